//! The Hugging Face cache layout, as `huggingface_hub` writes it:
//!
//! ```text
//! <cache>/models--org--name/
//!     blobs/<sha256 or git blob id>          file contents
//!     blobs/<id>.incomplete                  a transfer in progress (resumed from its length)
//!     refs/<revision>                        the commit a branch or tag resolved to
//!     snapshots/<commit>/<path>              relative symlinks into ../blobs
//! ```

use std::path::{Path, PathBuf};

use crate::{Error, RemoteFile, Result, io};

/// Where the Hugging Face cache is: `HF_HUB_CACHE`, else `HF_HOME/hub`, else
/// `~/.cache/huggingface/hub`.
pub fn default_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("HF_HUB_CACHE") {
        return Some(PathBuf::from(dir));
    }
    if let Some(home) = std::env::var_os("HF_HOME") {
        return Some(PathBuf::from(home).join("hub"));
    }
    std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache/huggingface/hub"))
}

/// One repo's folder in a cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoDir {
    root: PathBuf,
}

impl RepoDir {
    /// `repo`'s folder under `cache` (`org/name` → `models--org--name`).
    pub fn new(cache: &Path, repo: &str) -> RepoDir {
        RepoDir { root: cache.join(format!("models--{}", repo.replace('/', "--"))) }
    }

    /// The folder.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// A complete blob.
    pub fn blob(&self, file: &RemoteFile) -> PathBuf {
        self.root.join("blobs").join(file.blob_name())
    }

    /// A blob being transferred.
    pub fn incomplete(&self, file: &RemoteFile) -> PathBuf {
        self.root.join("blobs").join(format!("{}.incomplete", file.blob_name()))
    }

    /// The snapshot folder of `commit`.
    pub fn snapshot(&self, commit: &str) -> PathBuf {
        self.root.join("snapshots").join(commit)
    }

    /// The commit `revision` resolved to when it was last downloaded (a commit is itself).
    pub fn resolve(&self, revision: &str) -> Option<String> {
        let recorded = std::fs::read_to_string(self.root.join("refs").join(revision)).ok();
        let commit = recorded.map(|c| c.trim().to_string()).unwrap_or_else(|| revision.into());
        self.snapshot(&commit).is_dir().then_some(commit)
    }

    /// Records that `revision` is `commit` (nothing for a commit itself).
    pub fn write_ref(&self, revision: &str, commit: &str) -> Result<()> {
        if revision == commit {
            return Ok(());
        }
        let refs = self.root.join("refs");
        let path = refs.join(revision);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(io(parent))?;
        }
        std::fs::write(&path, commit).map_err(io(&path))
    }

    /// Links `file` of the snapshot of `commit` to its blob (relatively, as the Python library
    /// does, so the cache can move).
    pub fn link(&self, commit: &str, file: &RemoteFile) -> Result<()> {
        let link = self.snapshot(commit).join(&file.path);
        let parent = link.parent().ok_or_else(|| Error::Protocol("no parent".into()))?;
        std::fs::create_dir_all(parent).map_err(io(parent))?;
        let depth = file.path.matches('/').count() + 2;
        let mut target = PathBuf::new();
        for _ in 0..depth {
            target.push("..");
        }
        target.push("blobs");
        target.push(file.blob_name());
        if std::fs::symlink_metadata(&link).is_ok() {
            std::fs::remove_file(&link).map_err(io(&link))?;
        }
        symlink(&target, &link).map_err(io(&link))
    }
}

#[cfg(unix)]
fn symlink(target: &Path, link: &Path) -> std::io::Result<()> {
    std::os::unix::fs::symlink(target, link)
}

#[cfg(not(unix))]
fn symlink(target: &Path, link: &Path) -> std::io::Result<()> {
    // Without symlinks, the snapshot holds a copy.
    let blob = link.parent().map(|p| p.join(target)).unwrap_or_default();
    std::fs::copy(blob, link).map(|_| ())
}
