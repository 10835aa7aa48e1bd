//! A local stand-in for the Hugging Face endpoint, for tests: an axum server on 127.0.0.1
//! implementing the paths [`crate::Client`] uses (repo info with blobs, search, `resolve` with
//! `Range`), counting the bytes it serves, with faults to order: gated repos, a transfer cut
//! after some bytes, a file served damaged once, a size that no disk holds, a slow link.
//!
//! It stands in for the real hub because nothing outside this machine can be reached from the
//! tests; the client code it exercises is the one the app and `quince pull` run.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use sha2::Digest;

/// A repo the fake hub serves.
#[derive(Debug, Clone, Default)]
pub struct FakeRepo {
    /// Its commit id.
    pub commit: String,
    /// Files by path.
    pub files: BTreeMap<String, Vec<u8>>,
    /// Refuse it (401) without the hub's token.
    pub gated: bool,
    /// Sizes to claim instead of the real ones.
    pub claimed_sizes: BTreeMap<String, u64>,
}

impl FakeRepo {
    /// A repo of every file in `dir` (not recursive), at a commit derived from the contents.
    pub fn from_dir(dir: &Path) -> std::io::Result<FakeRepo> {
        let mut files = BTreeMap::new();
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            if entry.file_type()?.is_file() {
                files.insert(
                    entry.file_name().to_string_lossy().into_owned(),
                    std::fs::read(entry.path())?,
                );
            }
        }
        Ok(FakeRepo::new(files))
    }

    /// A repo of these files.
    pub fn new(files: BTreeMap<String, Vec<u8>>) -> FakeRepo {
        let mut commit = sha1_smol::Sha1::new();
        for (path, bytes) in &files {
            commit.update(path.as_bytes());
            commit.update(bytes);
        }
        FakeRepo { commit: commit.digest().to_string(), files, ..FakeRepo::default() }
    }
}

/// Faults and counters shared with the running server.
#[derive(Debug, Default)]
pub struct Shared {
    repos: Mutex<BTreeMap<String, FakeRepo>>,
    /// Body bytes served so far.
    pub served: AtomicU64,
    /// Requests answered so far.
    pub requests: AtomicU64,
    /// Cut the next transfer longer than this many bytes after them (0: never), once.
    pub cut_after: AtomicU64,
    /// Files (by path) to serve with a flipped byte, once each.
    pub damage_once: Mutex<HashSet<String>>,
    /// Milliseconds to wait between 64 KiB chunks (a slow link).
    pub chunk_delay_ms: AtomicU64,
    /// The token gated repos need.
    pub token: Mutex<Option<String>>,
}

impl Shared {
    fn repos(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, FakeRepo>> {
        self.repos.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds or replaces a repo.
    pub fn add(&self, id: &str, repo: FakeRepo) {
        self.repos().insert(id.to_string(), repo);
    }

    /// Sets the token gated repos need.
    pub fn set_token(&self, token: &str) {
        *self.token.lock().unwrap_or_else(PoisonError::into_inner) = Some(token.to_string());
    }

    /// Serves `path` damaged on its next transfer.
    pub fn damage_once(&self, path: &str) {
        self.damage_once.lock().unwrap_or_else(PoisonError::into_inner).insert(path.to_string());
    }
}

/// A running fake hub.
#[derive(Debug)]
pub struct FakeHub {
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    /// Its state.
    pub shared: Arc<Shared>,
}

impl FakeHub {
    /// Starts a fake hub on `port` of 127.0.0.1 (0: any free port) on the current runtime.
    pub async fn start(port: u16) -> std::io::Result<FakeHub> {
        let shared = Arc::new(Shared::default());
        let app = Router::new()
            .route("/api/models", get(search))
            .route("/api/models/{*rest}", get(info))
            .route("/_stats", get(stats))
            .route("/{org}/{name}/resolve/{revision}/{*path}", get(resolve))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
        let url = format!("http://{}", listener.local_addr()?);
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(FakeHub { url, shared })
    }

    /// Requests answered so far.
    pub fn requests(&self) -> u64 {
        self.shared.requests.load(Ordering::SeqCst)
    }

    /// Body bytes served so far.
    pub fn served(&self) -> u64 {
        self.shared.served.load(Ordering::SeqCst)
    }
}

fn authorized(shared: &Shared, repo: &FakeRepo, headers: &HeaderMap) -> bool {
    if !repo.gated {
        return true;
    }
    let token = shared.token.lock().unwrap_or_else(PoisonError::into_inner).clone();
    let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    matches!((token, given), (Some(t), Some(g)) if g == format!("Bearer {t}"))
}

fn git_blob_id(bytes: &[u8]) -> String {
    let mut sha1 = sha1_smol::Sha1::new();
    sha1.update(format!("blob {}\0", bytes.len()).as_bytes());
    sha1.update(bytes);
    sha1.digest().to_string()
}

async fn info(
    State(shared): State<Arc<Shared>>,
    UrlPath(rest): UrlPath<String>,
    headers: HeaderMap,
) -> Response {
    shared.requests.fetch_add(1, Ordering::SeqCst);
    // org/name/revision/<rev>
    let parts: Vec<&str> = rest.splitn(4, '/').collect();
    let [org, name, "revision", revision] = parts[..] else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let repos = shared.repos();
    let Some(repo) = repos.get(&format!("{org}/{name}")) else {
        return (StatusCode::NOT_FOUND, "Repository not found").into_response();
    };
    if !authorized(&shared, repo, &headers) {
        return (StatusCode::UNAUTHORIZED, "Access to model is restricted").into_response();
    }
    if revision != "main" && revision != repo.commit {
        return (StatusCode::NOT_FOUND, "Revision not found").into_response();
    }
    let siblings: Vec<serde_json::Value> = repo
        .files
        .iter()
        .map(|(path, bytes)| {
            let size = repo.claimed_sizes.get(path).copied().unwrap_or(bytes.len() as u64);
            let mut sibling = serde_json::json!({
                "rfilename": path, "size": size, "blobId": git_blob_id(bytes),
            });
            if path.ends_with(".safetensors") {
                let sha: String =
                    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect();
                sibling["lfs"] =
                    serde_json::json!({"sha256": sha, "size": size, "pointerSize": 134});
            }
            sibling
        })
        .collect();
    axum::Json(serde_json::json!({
        "id": format!("{org}/{name}"), "sha": repo.commit, "siblings": siblings,
    }))
    .into_response()
}

async fn search(
    State(shared): State<Arc<Shared>>,
    Query(query): Query<BTreeMap<String, String>>,
) -> Response {
    shared.requests.fetch_add(1, Ordering::SeqCst);
    let needle = query.get("search").cloned().unwrap_or_default().to_lowercase();
    let hits: Vec<serde_json::Value> = shared
        .repos()
        .keys()
        .filter(|id| id.to_lowercase().contains(&needle))
        .map(|id| serde_json::json!({"id": id, "downloads": 7, "likes": 1}))
        .collect();
    axum::Json(hits).into_response()
}

async fn stats(State(shared): State<Arc<Shared>>) -> Response {
    axum::Json(serde_json::json!({"served_bytes": shared.served.load(Ordering::SeqCst)}))
        .into_response()
}

async fn resolve(
    State(shared): State<Arc<Shared>>,
    UrlPath((org, name, revision, path)): UrlPath<(String, String, String, String)>,
    headers: HeaderMap,
) -> Response {
    shared.requests.fetch_add(1, Ordering::SeqCst);
    let repo = shared.repos().get(&format!("{org}/{name}")).cloned();
    let Some(repo) = repo else { return StatusCode::NOT_FOUND.into_response() };
    if !authorized(&shared, &repo, &headers) {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    if revision != "main" && revision != repo.commit {
        return StatusCode::NOT_FOUND.into_response();
    }
    let Some(bytes) = repo.files.get(&path) else { return StatusCode::NOT_FOUND.into_response() };
    let mut bytes = bytes.clone();
    let damaged = shared.damage_once.lock().unwrap_or_else(PoisonError::into_inner).remove(&path);
    if damaged && let Some(first) = bytes.last_mut() {
        *first ^= 0xff;
    }
    let start = headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("bytes="))
        .and_then(|v| v.strip_suffix('-'))
        .and_then(|v| v.parse::<usize>().ok());
    let total = bytes.len();
    let (status, from) = match start {
        Some(s) if s < total => (StatusCode::PARTIAL_CONTENT, s),
        Some(_) => return StatusCode::RANGE_NOT_SATISFIABLE.into_response(),
        None => (StatusCode::OK, 0),
    };
    let body = bytes[from..].to_vec();
    let length = body.len();
    // The cut falls on the first transfer long enough to be cut.
    let cut = shared.cut_after.load(Ordering::SeqCst);
    let cut = if cut > 0 && (length as u64) > cut {
        shared.cut_after.swap(0, Ordering::SeqCst)
    } else {
        0
    };
    let delay = shared.chunk_delay_ms.load(Ordering::SeqCst);
    let counter = shared.clone();
    let stream = async_stream(body, cut, delay, counter);
    let mut response = Response::builder()
        .status(status)
        .header(header::CONTENT_LENGTH, length)
        .header(header::ACCEPT_RANGES, "bytes");
    if status == StatusCode::PARTIAL_CONTENT {
        response =
            response.header(header::CONTENT_RANGE, format!("bytes {from}-{}/{total}", total - 1));
    }
    response
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// The body in 64 KiB chunks, counted as they go out; cut (an error: the connection drops)
/// after `cut` bytes when nonzero.
fn async_stream(
    body: Vec<u8>,
    cut: u64,
    delay_ms: u64,
    shared: Arc<Shared>,
) -> impl futures_util::Stream<Item = std::io::Result<Vec<u8>>> + Send {
    let limit = if cut > 0 { (cut as usize).min(body.len()) } else { body.len() };
    let chunks: Vec<Vec<u8>> = body[..limit].chunks(64 << 10).map(<[u8]>::to_vec).collect();
    let cut_short = limit < body.len();
    futures_util::stream::unfold(
        (chunks.into_iter(), cut_short, shared),
        move |(mut chunks, cut_short, shared)| async move {
            match chunks.next() {
                Some(chunk) => {
                    if delay_ms > 0 {
                        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                    }
                    shared.served.fetch_add(chunk.len() as u64, Ordering::SeqCst);
                    Some((Ok(chunk), (chunks, cut_short, shared)))
                }
                None if cut_short => Some((
                    Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "cut")),
                    (chunks, false, shared),
                )),
                None => None,
            }
        },
    )
}
