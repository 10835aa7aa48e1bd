//! The app's folders, from the platform conventions (`directories`), and its log file.
//!
//! On macOS the data folder is `~/Library/Application Support/app.quince.Quince`, the same
//! folder Tauri names from the bundle identifier (a test pins the two together); logs go to
//! `~/Library/Logs/app.quince.Quince`. On Linux: `~/.local/share/quince` and its `logs/`.
//! `QUINCE_DATA_DIR` overrides both (fresh profiles for tests, portable installs).

use std::path::PathBuf;

/// The reverse-DNS parts of the app's identifier: `ProjectDirs` takes them apart, Tauri's
/// `identifier` (tauri.conf.json) joins them with dots.
pub const QUALIFIER: &str = "app";
/// Organization part of the identifier.
pub const ORGANIZATION: &str = "quince";
/// Application part of the identifier.
pub const APPLICATION: &str = "Quince";

/// Where the app keeps its data and logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppPaths {
    /// Database and attachments.
    pub data_dir: PathBuf,
    /// Rotating log files.
    pub log_dir: PathBuf,
}

impl AppPaths {
    /// `QUINCE_DATA_DIR` when set, else the platform folders.
    pub fn discover() -> Result<AppPaths, String> {
        if let Some(dir) = std::env::var_os("QUINCE_DATA_DIR") {
            let data_dir = PathBuf::from(dir);
            return Ok(AppPaths { log_dir: data_dir.join("logs"), data_dir });
        }
        let dirs = directories::ProjectDirs::from(QUALIFIER, ORGANIZATION, APPLICATION)
            .ok_or("no home folder: cannot place the app's data")?;
        let data_dir = dirs.data_dir().to_path_buf();
        let log_dir = if cfg!(target_os = "macos") {
            directories::BaseDirs::new()
                .map(|b| b.home_dir().join("Library/Logs").join(identifier()))
                .unwrap_or_else(|| data_dir.join("logs"))
        } else {
            dirs.data_local_dir().join("logs")
        };
        Ok(AppPaths { data_dir, log_dir })
    }
}

/// The bundle identifier these folders agree with.
pub fn identifier() -> String {
    format!("{QUALIFIER}.{ORGANIZATION}.{APPLICATION}")
}

/// Sends `tracing` output to a daily-rotated file in `log_dir` (a week kept) and to stderr.
/// `RUST_LOG` sets the filter (default `info`). Keep the guard alive to flush on exit.
pub fn init_logging(
    log_dir: &std::path::Path,
) -> Result<tracing_appender::non_blocking::WorkerGuard, Box<dyn std::error::Error>> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    std::fs::create_dir_all(log_dir)?;
    let appender = tracing_appender::rolling::Builder::new()
        .rotation(tracing_appender::rolling::Rotation::DAILY)
        .filename_prefix("quince")
        .filename_suffix("log")
        .max_log_files(7)
        .build(log_dir)?;
    let (file, guard) = tracing_appender::non_blocking(appender);
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::registry()
        .with(filter)
        .with(tracing_subscriber::fmt::layer().with_writer(file).with_ansi(false))
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
        .try_init()?;
    Ok(guard)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_tauri_identifier_and_the_data_folders_agree() {
        let config: serde_json::Value =
            serde_json::from_str(include_str!("../tauri.conf.json")).unwrap();
        assert_eq!(config["identifier"], identifier());
        // On macOS, ProjectDirs names the folder after the same identifier Tauri uses.
        #[cfg(target_os = "macos")]
        {
            let dirs =
                directories::ProjectDirs::from(QUALIFIER, ORGANIZATION, APPLICATION).unwrap();
            assert!(dirs.data_dir().ends_with(identifier()));
        }
    }
}
