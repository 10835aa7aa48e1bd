//! Quantities written for people, in messages and the app: bytes and shares.

/// Bytes for people: `812 KB`, `3.4 MB`, `21.3 GB`.
pub fn human(bytes: u64) -> String {
    let b = bytes as f64;
    match bytes {
        0..1_000_000 => format!("{:.0} KB", (b / 1e3).ceil()),
        1_000_000..1_000_000_000 => format!("{:.1} MB", b / 1e6),
        _ => format!("{:.1} GB", b / 1e9),
    }
}

/// A share as a percentage: `90%`, `0.5%`.
pub fn percent(share: f64) -> String {
    let p = share * 100.0;
    if p >= 1.0 { format!("{p:.0}%") } else { format!("{p:.2}%") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_people_write_them() {
        assert_eq!(human(812), "1 KB");
        assert_eq!(human(3_400_000), "3.4 MB");
        assert_eq!(human(21_300_000_000), "21.3 GB");
        assert_eq!(percent(0.9), "90%");
        assert_eq!(percent(0.005), "0.50%");
    }
}
