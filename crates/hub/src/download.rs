//! A repo download: resumable per file, verified per file, linked into a snapshot only when
//! every file is complete (so a half-downloaded model never shows up as one).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde::Serialize;
use sha2::Digest;
use tokio::io::AsyncWriteExt;

use crate::cache::RepoDir;
use crate::{Client, Error, RemoteFile, RepoInfo, Result, io};

/// Where a download stands. Sent when it starts, as bytes arrive (at most ten times a second)
/// and when each file is verified.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Progress {
    /// The repo.
    pub repo: String,
    /// The file being transferred (empty before the first).
    pub file: String,
    /// Its bytes on disk.
    pub file_done: u64,
    /// Its size.
    pub file_size: u64,
    /// Bytes on disk over all files (what earlier sessions fetched included).
    pub done: u64,
    /// Bytes of all files.
    pub total: u64,
    /// Files complete and verified.
    pub files_done: usize,
    /// Files in the repo.
    pub files: usize,
    /// Bytes per second fetched in this session.
    pub rate: f64,
    /// Seconds left at that rate.
    pub eta_s: Option<f64>,
}

/// Downloads `repo` at `revision` into the Hugging Face cache at `cache` and returns the
/// snapshot folder. What is already there is kept: complete files are not fetched again,
/// partial ones resume from their length. Stops with [`Error::Cancelled`] (keeping what it
/// has) when `cancel` is set.
pub async fn pull(
    client: &Client,
    repo: &str,
    revision: &str,
    cache: &Path,
    cancel: &AtomicBool,
    mut on_progress: impl FnMut(&Progress),
) -> Result<PathBuf> {
    let info = client.repo_info(repo, revision).await?;
    let dir = RepoDir::new(cache, repo);
    std::fs::create_dir_all(dir.root().join("blobs")).map_err(io(dir.root()))?;
    dir.write_ref(revision, &info.commit)?;

    // What is on disk already, and the space the rest needs.
    let mut state = Progress {
        repo: repo.to_string(),
        file: String::new(),
        file_done: 0,
        file_size: 0,
        done: 0,
        total: info.total_bytes(),
        files_done: 0,
        files: info.files.len(),
        rate: 0.0,
        eta_s: None,
    };
    let mut needed = 0;
    for file in &info.files {
        let on_disk = on_disk(&dir, file);
        state.done += on_disk;
        if on_disk == file.size && dir.blob(file).is_file() {
            state.files_done += 1;
        }
        needed += file.size - on_disk;
    }
    let available = fs4::available_space(dir.root()).map_err(io(dir.root()))?;
    // Some room to spare: the file system needs a little for itself.
    if needed + (needed / 100).min(64 << 20) > available {
        return Err(Error::NoSpace { dir: cache.to_path_buf(), needed, available });
    }
    on_progress(&state);

    let mut transfer = Transfer { started: Instant::now(), fetched: 0, last_report: None };
    for file in &info.files {
        if dir.blob(file).is_file() && on_disk(&dir, file) == file.size {
            continue;
        }
        fetch(client, &info, &dir, file, cancel, &mut state, &mut transfer, &mut on_progress)
            .await?;
        state.files_done += 1;
        transfer.report(&mut state, true, &mut on_progress);
    }
    for file in &info.files {
        dir.link(&info.commit, file)?;
    }
    Ok(dir.snapshot(&info.commit))
}

/// Bytes of `file` on disk: its blob's, else its partial file's.
fn on_disk(dir: &RepoDir, file: &RemoteFile) -> u64 {
    let len = |p: PathBuf| std::fs::metadata(p).map(|m| m.len()).ok();
    len(dir.blob(file)).or_else(|| len(dir.incomplete(file))).unwrap_or(0).min(file.size)
}

struct Transfer {
    started: Instant,
    /// Bytes fetched in this session.
    fetched: u64,
    last_report: Option<Instant>,
}

impl Transfer {
    fn report(
        &mut self,
        state: &mut Progress,
        force: bool,
        on_progress: &mut impl FnMut(&Progress),
    ) {
        let now = Instant::now();
        if !force && self.last_report.is_some_and(|t| now - t < Duration::from_millis(100)) {
            return;
        }
        self.last_report = Some(now);
        let seconds = (now - self.started).as_secs_f64();
        state.rate = if seconds > 0.0 { self.fetched as f64 / seconds } else { 0.0 };
        state.eta_s =
            (state.rate > 0.0).then(|| state.total.saturating_sub(state.done) as f64 / state.rate);
        on_progress(state);
    }
}

/// Fetches one file into its blob, resuming its partial file, and verifies it; a file that
/// fails verification is fetched once more from its first byte.
#[allow(clippy::too_many_arguments)]
async fn fetch(
    client: &Client,
    info: &RepoInfo,
    dir: &RepoDir,
    file: &RemoteFile,
    cancel: &AtomicBool,
    state: &mut Progress,
    transfer: &mut Transfer,
    on_progress: &mut impl FnMut(&Progress),
) -> Result<()> {
    let partial = dir.incomplete(file);
    state.file = file.path.clone();
    state.file_size = file.size;
    for attempt in 0..2 {
        let mut have = std::fs::metadata(&partial).map(|m| m.len()).unwrap_or(0);
        if have > file.size {
            std::fs::remove_file(&partial).map_err(io(&partial))?;
            state.done -= have;
            have = 0;
        }
        state.file_done = have;
        if file.size == 0 {
            std::fs::write(&partial, b"").map_err(io(&partial))?;
        }
        if have < file.size {
            let url = format!(
                "{}/{}/resolve/{}/{}",
                client.endpoint(),
                info.repo,
                info.commit,
                file.path
            );
            let mut request = client.get(&url);
            if have > 0 {
                request = request.header(reqwest::header::RANGE, format!("bytes={have}-"));
            }
            let response = request.send().await.map_err(|e| client.network(e))?;
            let status = response.status().as_u16();
            let mut out = tokio::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&partial)
                .await
                .map_err(io(&partial))?;
            match status {
                206 => {}
                200 if have > 0 => {
                    // The server sent the whole file: start it over.
                    out.set_len(0).await.map_err(io(&partial))?;
                    state.done -= have;
                    state.file_done = 0;
                }
                200 => {}
                _ => {
                    let what = format!("{} in {}", file.path, info.repo);
                    return Err(client.status_error(&info.repo, &what, &url, status));
                }
            }
            let mut body = response.bytes_stream();
            loop {
                if cancel.load(Ordering::SeqCst) {
                    out.flush().await.map_err(io(&partial))?;
                    return Err(Error::Cancelled);
                }
                // Wake up now and then to notice a cancel while the network is silent.
                let next = tokio::time::timeout(Duration::from_millis(200), body.next()).await;
                let chunk = match next {
                    Err(_) => continue,
                    Ok(None) => break,
                    Ok(Some(chunk)) => chunk,
                };
                let chunk = match chunk {
                    Ok(chunk) => chunk,
                    Err(e) => {
                        let _ = out.flush().await;
                        return Err(client.network(e));
                    }
                };
                if state.file_done + chunk.len() as u64 > file.size {
                    return Err(Error::Protocol(format!("{} is longer than its size", file.path)));
                }
                out.write_all(&chunk).await.map_err(|e| write_error(&partial, e))?;
                state.file_done += chunk.len() as u64;
                state.done += chunk.len() as u64;
                transfer.fetched += chunk.len() as u64;
                transfer.report(state, false, on_progress);
            }
            out.flush().await.map_err(io(&partial))?;
            out.sync_all().await.map_err(io(&partial))?;
        }
        let verified = verify(&partial, file).await?;
        match verified {
            Ok(()) => {
                let blob = dir.blob(file);
                std::fs::rename(&partial, &blob).map_err(io(&blob))?;
                return Ok(());
            }
            Err(message) => {
                tracing::warn!(file = %file.path, attempt, "a downloaded file is damaged: {message}");
                std::fs::remove_file(&partial).map_err(io(&partial))?;
                state.done -= state.file_done;
                state.file_done = 0;
                if attempt == 1 {
                    return Err(Error::Corrupt { file: file.path.clone(), message });
                }
            }
        }
    }
    Ok(())
}

/// A full disk is said plainly; the partial file stays for a resume once there is room.
fn write_error(path: &Path, e: std::io::Error) -> Error {
    if e.kind() == std::io::ErrorKind::StorageFull {
        return Error::DiskFull { dir: path.parent().map(Path::to_path_buf).unwrap_or_default() };
    }
    Error::Io { path: path.to_path_buf(), source: e }
}

/// Checks a complete file's size and hash: the LFS SHA-256, else the git blob id.
async fn verify(path: &Path, file: &RemoteFile) -> Result<std::result::Result<(), String>> {
    let path = path.to_path_buf();
    let file = file.clone();
    let task = tokio::task::spawn_blocking(move || -> Result<std::result::Result<(), String>> {
        use std::io::Read;
        let mut f = std::fs::File::open(&path).map_err(io(&path))?;
        let len = f.metadata().map_err(io(&path))?.len();
        if len != file.size {
            return Ok(Err(format!("{len} bytes, not {}", file.size)));
        }
        let mut sha256 = sha2::Sha256::new();
        let mut sha1 = sha1_smol::Sha1::new();
        sha1.update(format!("blob {len}\0").as_bytes());
        let mut buffer = vec![0u8; 1 << 20];
        loop {
            let n = f.read(&mut buffer).map_err(io(&path))?;
            if n == 0 {
                break;
            }
            match file.sha256 {
                Some(_) => sha256.update(&buffer[..n]),
                None => sha1.update(&buffer[..n]),
            }
        }
        let (actual, expected) = match &file.sha256 {
            Some(expected) => {
                let hex: String = sha256.finalize().iter().map(|b| format!("{b:02x}")).collect();
                (hex, expected.clone())
            }
            None => (sha1.digest().to_string(), file.blob_id.clone()),
        };
        Ok(if actual == expected {
            Ok(())
        } else {
            Err(format!("its hash is {actual}, the hub's is {expected}"))
        })
    });
    task.await.map_err(|e| Error::Protocol(format!("verification: {e}")))?
}
