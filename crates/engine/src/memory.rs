//! The memory guard: before a reply, the KV cache its prompt and longest reply could fill,
//! projected with the storage chosen, against a share of the memory MLX recommends for the
//! device, less what is in use already (the weights). A reply that would pass it is refused
//! before anything is computed, with the numbers and what to change.

use crate::cache::{CachePlan, KvOptions};
use crate::error::{Error, Result};

/// The share of the recommended memory a turn may fill when nothing else is said.
pub const DEFAULT_SHARE: f64 = 0.9;

/// The device's recommended memory, or `None` where MLX reports none.
pub fn recommended_bytes() -> Result<Option<u64>> {
    Ok(mlx::Device::default_device()?.recommended_memory()?)
}

/// Refuses a turn of `tokens` positions (prompt and longest reply) whose KV cache under
/// `plan` would not fit `share` of the recommended memory beside what is in use now.
pub fn check_kv(plan: &CachePlan, kv: &KvOptions, tokens: usize, share: f64) -> Result<()> {
    let Some(recommended) = recommended_bytes()? else {
        return Ok(());
    };
    let needed = plan.projected_bytes(tokens) as u64;
    let in_use = mlx::device::memory::active()? as u64;
    let limit = (share.clamp(0.0, 1.0) * recommended as f64) as u64;
    let available = limit.saturating_sub(in_use);
    if needed > available {
        return Err(Error::KvMemory {
            needed,
            available,
            share,
            recommended,
            in_use,
            tokens,
            storage: kv.describe(),
        });
    }
    Ok(())
}

/// Bytes for people: `812 KB`, `3.4 MB`, `21.3 GB`.
pub(crate) fn human(bytes: u64) -> String {
    let b = bytes as f64;
    match bytes {
        0..1_000_000 => format!("{:.0} KB", (b / 1e3).ceil()),
        1_000_000..1_000_000_000 => format!("{:.1} MB", b / 1e6),
        _ => format!("{:.1} GB", b / 1e9),
    }
}

/// A share as a percentage: `90%`, `0.5%`.
pub(crate) fn percent(share: f64) -> String {
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
