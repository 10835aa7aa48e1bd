//! Hugging Face downloads for Quince: repo metadata from the hub API, and transfers that
//! survive anything — a quit, a crash, a lost network — because they resume from the bytes on
//! disk (HTTP `Range`) and are verified at the end (size, and the SHA-256 of LFS files or the
//! git blob id of small ones).
//!
//! Files land in the shared Hugging Face cache layout (`models--org--name/blobs`,
//! `snapshots/<commit>/`, `refs/<revision>`), so Python tools and other apps reuse them and
//! models they downloaded show up here without a transfer. A partial file is
//! `blobs/<id>.incomplete`, as `huggingface_hub` names it.
//!
//! Metadata and transfers are ours, on `reqwest`, rather than the `hf-hub` crate's: hf-hub 1.0
//! writes a plain download's `.incomplete` file with create/truncate, so it does not resume
//! across restarts, and it brings hf-xet and a second TLS stack (aws-lc); 0.4/0.5 resume only
//! into their own `.sync.part` format, not the Python layout, and 0.5 broke `Range` through the
//! CDN (hf-hub#141). The hub API's `?blobs=true` listing gives every file's size and LFS
//! SHA-256 in one call (the free-space check and the verification need both). Nothing here
//! touches the network unless called: the app calls it only when the user searches, asks for
//! a model's details or downloads.
//!
//! With the `fake` feature, the `fake` module serves a folder as a repo on 127.0.0.1 for tests.

pub mod cache;
mod download;
#[cfg(feature = "fake")]
pub mod fake;

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use download::{Progress, pull};

/// The public hub.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// What can go wrong talking to the hub or writing its files.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// 401/403: gated or private.
    #[error(
        "{repo} needs a Hugging Face token with access (HTTP {status}): the model is gated or \
         private. Accept its terms on the model's page, then add a token in Settings."
    )]
    Unauthorized {
        /// The repo.
        repo: String,
        /// 401 or 403.
        status: u16,
    },
    /// 404.
    #[error("{what} was not found on {endpoint} (HTTP 404): check the repo id and revision.")]
    NotFound {
        /// The repo, revision or file.
        what: String,
        /// Where it was looked for.
        endpoint: String,
    },
    /// Not enough free disk space for what is left to download.
    #[error(
        "Not enough disk space in {}: the download needs {} more, {} is free.",
        dir.display(), human_bytes(*needed), human_bytes(*available)
    )]
    NoSpace {
        /// The cache folder.
        dir: PathBuf,
        /// Bytes still to download.
        needed: u64,
        /// Bytes free.
        available: u64,
    },
    /// The disk filled up during the transfer.
    #[error(
        "The disk is full ({}): free some space, then resume the download; what was fetched \
         is kept.",
        dir.display()
    )]
    DiskFull {
        /// The folder being written.
        dir: PathBuf,
    },
    /// The network failed (no connection, a dropped transfer, a timeout).
    #[error(
        "The download from {endpoint} was interrupted: {message}. It resumes where it stopped."
    )]
    Network {
        /// The endpoint.
        endpoint: String,
        /// What happened.
        message: String,
    },
    /// Another status.
    #[error("{url} answered HTTP {status}.")]
    Http {
        /// The URL.
        url: String,
        /// The status.
        status: u16,
    },
    /// A file that stayed different from what the hub says after fetching it again.
    #[error("{file} does not match the hub's record ({message}) even after fetching it again.")]
    Corrupt {
        /// The file in the repo.
        file: String,
        /// How.
        message: String,
    },
    /// The hub said something this client does not understand.
    #[error("Unexpected answer from the hub: {0}")]
    Protocol(String),
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Stopped by the caller; what is on disk stays for a resume.
    #[error("The download was paused.")]
    Cancelled,
}

/// The crate's result.
pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.into();
    move |source| Error::Io { path, source }
}

/// Bytes as people read them: `1.5 GB`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KB", "MB", "GB", "TB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1000.0 && unit + 1 < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    if unit == 0 { format!("{bytes} B") } else { format!("{value:.1} {}", UNITS[unit]) }
}

/// A file of a repo at a commit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteFile {
    /// Its path in the repo.
    pub path: String,
    /// Its size in bytes.
    pub size: u64,
    /// The SHA-256 of an LFS file (its LFS oid).
    pub sha256: Option<String>,
    /// The git blob id (SHA-1 of `blob <len>\0<bytes>`).
    pub blob_id: String,
}

impl RemoteFile {
    /// Its name under `blobs/`: the LFS SHA-256 or the git blob id, as `huggingface_hub`
    /// names them (the ETag the hub serves).
    pub fn blob_name(&self) -> &str {
        self.sha256.as_deref().unwrap_or(&self.blob_id)
    }
}

/// A repo at a commit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RepoInfo {
    /// `org/name`.
    pub repo: String,
    /// The commit the revision resolved to.
    pub commit: String,
    /// Its files.
    pub files: Vec<RemoteFile>,
}

impl RepoInfo {
    /// Bytes of every file.
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

/// A search hit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SearchHit {
    /// `org/name`.
    pub id: String,
    /// Downloads last month, where the hub says.
    pub downloads: Option<u64>,
    /// Likes, where the hub says.
    pub likes: Option<u64>,
}

/// A hub endpoint and the token to present.
#[derive(Debug, Clone)]
pub struct Client {
    endpoint: String,
    token: Option<String>,
    http: reqwest::Client,
}

/// The endpoint `HF_ENDPOINT` names, else the public hub.
pub fn endpoint_from_env() -> String {
    std::env::var("HF_ENDPOINT")
        .ok()
        .filter(|e| !e.trim().is_empty())
        .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string())
}

#[derive(Deserialize)]
struct ApiLfs {
    sha256: String,
}

#[derive(Deserialize)]
struct ApiSibling {
    rfilename: String,
    size: Option<u64>,
    #[serde(rename = "blobId")]
    blob_id: Option<String>,
    lfs: Option<ApiLfs>,
}

#[derive(Deserialize)]
struct ApiInfo {
    sha: String,
    siblings: Vec<ApiSibling>,
}

impl Client {
    /// A client of `endpoint` (e.g. [`DEFAULT_ENDPOINT`]), presenting `token` when given.
    pub fn new(endpoint: &str, token: Option<String>) -> Result<Client> {
        let http = reqwest::Client::builder()
            .user_agent(concat!("quince/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(Duration::from_secs(20))
            // A transfer that goes silent this long is dropped (and resumes on retry).
            .read_timeout(Duration::from_secs(60))
            .build()
            .map_err(|e| Error::Protocol(format!("HTTP client: {e}")))?;
        Ok(Client {
            endpoint: endpoint.trim_end_matches('/').to_string(),
            token: token.filter(|t| !t.trim().is_empty()),
            http,
        })
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    pub(crate) fn get(&self, url: &str) -> reqwest::RequestBuilder {
        let request = self.http.get(url);
        match &self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }

    pub(crate) fn network(&self, e: impl std::fmt::Display) -> Error {
        Error::Network { endpoint: self.endpoint.clone(), message: e.to_string() }
    }

    /// Maps an error status to its [`Error`].
    pub(crate) fn status_error(&self, repo: &str, what: &str, url: &str, status: u16) -> Error {
        match status {
            401 | 403 => Error::Unauthorized { repo: repo.to_string(), status },
            404 => Error::NotFound { what: what.to_string(), endpoint: self.endpoint.clone() },
            _ => Error::Http { url: url.to_string(), status },
        }
    }

    /// The files of `repo` at `revision` (a branch, tag or commit), with sizes and hashes.
    pub async fn repo_info(&self, repo: &str, revision: &str) -> Result<RepoInfo> {
        check_repo_id(repo)?;
        let url = format!("{}/api/models/{repo}/revision/{revision}?blobs=true", self.endpoint);
        let response = self.get(&url).send().await.map_err(|e| self.network(e))?;
        let status = response.status().as_u16();
        if !response.status().is_success() {
            let what = format!("{repo} at revision {revision}");
            return Err(self.status_error(repo, &what, &url, status));
        }
        let info: ApiInfo = response
            .json()
            .await
            .map_err(|e| Error::Protocol(format!("repo info of {repo}: {e}")))?;
        let mut files = Vec::new();
        for s in info.siblings {
            check_repo_path(&s.rfilename)?;
            let (Some(size), Some(blob_id)) = (s.size, s.blob_id) else {
                return Err(Error::Protocol(format!("{} has no size or blob id", s.rfilename)));
            };
            files.push(RemoteFile {
                path: s.rfilename,
                size,
                sha256: s.lfs.map(|l| l.sha256.to_ascii_lowercase()),
                blob_id,
            });
        }
        if !is_hex(&info.sha) {
            return Err(Error::Protocol(format!("commit {:?}", info.sha)));
        }
        Ok(RepoInfo { repo: repo.to_string(), commit: info.sha, files })
    }

    /// A small JSON file of `repo` at `commit` (a `config.json`), read into memory.
    pub async fn small_file(
        &self,
        repo: &str,
        commit: &str,
        path: &str,
    ) -> Result<serde_json::Value> {
        check_repo_id(repo)?;
        check_repo_path(path)?;
        let url = format!("{}/{repo}/resolve/{commit}/{path}", self.endpoint);
        let response = self.get(&url).send().await.map_err(|e| self.network(e))?;
        let status = response.status().as_u16();
        if !response.status().is_success() {
            return Err(self.status_error(repo, &format!("{path} in {repo}"), &url, status));
        }
        let bytes = response.bytes().await.map_err(|e| self.network(e))?;
        serde_json::from_slice(&bytes).map_err(|e| Error::Protocol(format!("{path}: {e}")))
    }

    /// Models whose id contains `query`, most downloaded first.
    pub async fn search(&self, query: &str, limit: usize) -> Result<Vec<SearchHit>> {
        let url = format!("{}/api/models", self.endpoint);
        let response = self
            .get(&url)
            .query(&[("search", query), ("limit", &limit.to_string()), ("sort", "downloads")])
            .send()
            .await
            .map_err(|e| self.network(e))?;
        if !response.status().is_success() {
            return Err(Error::Http { url, status: response.status().as_u16() });
        }
        response.json().await.map_err(|e| Error::Protocol(format!("search: {e}")))
    }
}

fn is_hex(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// `org/name` with safe characters only.
pub fn check_repo_id(repo: &str) -> Result<()> {
    let ok = |part: &str| {
        !part.is_empty()
            && part != "."
            && part != ".."
            && part.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    match repo.split_once('/') {
        Some((org, name)) if ok(org) && ok(name) => Ok(()),
        _ => Err(Error::Protocol(format!("{repo:?} is not a repo id of the form org/name"))),
    }
}

/// A relative path that stays inside its folder.
fn check_repo_path(path: &str) -> Result<()> {
    let bad = path.is_empty()
        || path.starts_with('/')
        || path.contains('\\')
        || path.split('/').any(|p| p.is_empty() || p == "." || p == "..");
    if bad { Err(Error::Protocol(format!("unsafe file path {path:?}"))) } else { Ok(()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_and_paths_that_could_escape_the_cache_are_refused() {
        assert!(check_repo_id("mlx-community/gemma-3-4b-it-4bit").is_ok());
        for bad in ["gemma", "a/b/c", "../x", "a/..", "a/b c", "/x"] {
            assert!(check_repo_id(bad).is_err(), "{bad}");
        }
        assert!(check_repo_path("sub/model.safetensors").is_ok());
        for bad in ["../x", "a/../../x", "/etc/passwd", "a//b", ""] {
            assert!(check_repo_path(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bytes_read_as_people_write_them() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1_500_000_000), "1.5 GB");
    }
}
