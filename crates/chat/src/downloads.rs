//! The model library's online half: recommended models, search, memory-fit estimates, and
//! downloads into the shared Hugging Face cache through [`hub::pull`].
//!
//! Offline first: nothing here opens a connection unless the user searches, asks for a
//! model's details or starts a download, and the `network_enabled` setting turns even those
//! off. Downloads run one at a time (the rest wait, queued); each is a row in the store, so
//! one a quit or crash interrupted is listed as paused at the next start and resumes from the
//! bytes on disk.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::view::{
    CatalogEntry, DownloadState, DownloadView, Fit, FitVerdict, ModelEntry, ModelSource,
    NetworkSettings,
};
use crate::{Chat, Error, Result, library, lock};

/// The app setting that allows network access (`true`/`false`; default true).
pub const NETWORK_ENABLED: &str = "network_enabled";
/// The app setting holding the hub endpoint (default: `HF_ENDPOINT`, else huggingface.co).
pub const HF_ENDPOINT: &str = "hf_endpoint";
/// The context the fit estimate sizes the KV cache for.
pub const FIT_CONTEXT: u32 = 8192;

/// Downloads in this process.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    /// One transfer at a time: the others wait for this (the queue).
    turn: tokio::sync::Mutex<()>,
    /// Pause flags of the downloads queued or running, by repo.
    active: Mutex<HashMap<String, Arc<AtomicBool>>>,
    /// Downloads whose files are to be deleted when they stop (cancelled, not paused).
    discard: Mutex<HashSet<String>>,
    /// The latest view of each download of this session (rate and ETA are not stored).
    latest: Mutex<HashMap<String, DownloadView>>,
}

/// Seconds to wait before each retry after a lost connection (then the download fails, to be
/// resumed by hand).
const RETRY_SECONDS: [u64; 6] = [1, 2, 5, 10, 30, 60];

/// Sleeps `seconds`, or less when `pause` is set (then false).
async fn wait_unless_paused(pause: &AtomicBool, seconds: u64) -> bool {
    let until = Instant::now() + std::time::Duration::from_secs(seconds);
    while Instant::now() < until {
        if pause.load(Ordering::SeqCst) {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    !pause.load(Ordering::SeqCst)
}

/// A recommended model (mlx-community 4-bit conversions; sizes are estimates until the hub
/// lists the files).
struct Recommended {
    repo: &'static str,
    name: &'static str,
    description: &'static str,
    /// Its `config.json`'s `model_type`: the entry is offered once the registry loads it.
    model_type: &'static str,
    weight_bytes: u64,
    kv_bytes: u64,
    vision: bool,
}

impl Recommended {
    fn drafter(&self) -> bool {
        engine::registry::family(self.model_type).is_some_and(|f| f.is_drafter())
    }
}

/// The recommended models the engine loads (the list also names families still to come).
fn recommended() -> impl Iterator<Item = &'static Recommended> {
    RECOMMENDED.iter().filter(|r| engine::registry::family(r.model_type).is_some())
}

const MB: u64 = 1_000_000;

const RECOMMENDED: &[Recommended] = &[
    Recommended {
        repo: "mlx-community/gemma-4-e2b-it-4bit",
        name: "Gemma 4 E2B",
        model_type: "gemma4",
        description: "Small and quick; text and images. Good on any Apple Silicon Mac.",
        weight_bytes: 3_200 * MB,
        kv_bytes: 60 * MB,
        vision: true,
    },
    Recommended {
        repo: "mlx-community/gemma-4-e4b-it-4bit",
        name: "Gemma 4 E4B",
        model_type: "gemma4",
        description: "The balanced choice; text and images.",
        weight_bytes: 5_200 * MB,
        kv_bytes: 150 * MB,
        vision: true,
    },
    Recommended {
        repo: "mlx-community/gemma-4-26b-a4b-it-4bit",
        name: "Gemma 4 26B-A4B",
        model_type: "gemma4",
        description: "Mixture of experts: large-model quality at 4B-active speed.",
        weight_bytes: 15_600 * MB,
        kv_bytes: 700 * MB,
        vision: true,
    },
    Recommended {
        repo: "mlx-community/gemma-3-1b-it-4bit",
        name: "Gemma 3 1B",
        model_type: "gemma3_text",
        description: "Gemma 3, tiny and fast; text only.",
        weight_bytes: 730 * MB,
        kv_bytes: 60 * MB,
        vision: false,
    },
    Recommended {
        repo: "mlx-community/gemma-3-4b-it-4bit",
        name: "Gemma 3 4B",
        model_type: "gemma3",
        description: "Gemma 3, small; text and images.",
        weight_bytes: 3_000 * MB,
        kv_bytes: 320 * MB,
        vision: true,
    },
    Recommended {
        repo: "mlx-community/gemma-3-12b-it-4bit",
        name: "Gemma 3 12B",
        model_type: "gemma3",
        description: "Gemma 3, larger; text and images. 16 GB Macs and up.",
        weight_bytes: 8_100 * MB,
        kv_bytes: 870 * MB,
        vision: true,
    },
    Recommended {
        repo: "mlx-community/Qwen3.5-4B-OptiQ-4bit",
        name: "Qwen3.5 4B",
        model_type: "qwen3_5",
        description: "Qwen3.5, small and sharp; thinks before it answers (switch it off in a \
                      chat's settings).",
        weight_bytes: 2_800 * MB,
        kv_bytes: 330 * MB,
        vision: false,
    },
    Recommended {
        repo: "mlx-community/Qwen3.5-9B-OptiQ-4bit",
        name: "Qwen3.5 9B",
        model_type: "qwen3_5",
        description: "Qwen3.5, the everyday size; thinks before it answers. 16 GB Macs and up.",
        weight_bytes: 5_600 * MB,
        kv_bytes: 330 * MB,
        vision: false,
    },
    Recommended {
        repo: "mlx-community/Qwen3.5-35B-A3B-OptiQ-4bit",
        name: "Qwen3.5 35B-A3B",
        model_type: "qwen3_5_moe",
        description: "Qwen3.5 mixture of experts: large-model quality at 3B-active speed. 32 GB \
                      Macs and up.",
        weight_bytes: 20_100 * MB,
        kv_bytes: 280 * MB,
        vision: false,
    },
    Recommended {
        repo: "mlx-community/gemma-4-e2b-it-assistant-bf16",
        name: "Gemma 4 E2B assistant",
        model_type: "gemma4_assistant",
        description: "Drafter for speculative decoding with Gemma 4 E2B.",
        weight_bytes: 300 * MB,
        kv_bytes: 0,
        vision: false,
    },
    Recommended {
        repo: "mlx-community/gemma-4-e4b-it-assistant-bf16",
        name: "Gemma 4 E4B assistant",
        model_type: "gemma4_assistant",
        description: "Drafter for speculative decoding with Gemma 4 E4B.",
        weight_bytes: 400 * MB,
        kv_bytes: 0,
        vision: false,
    },
    Recommended {
        repo: "mlx-community/gemma-4-26b-a4b-it-assistant-bf16",
        name: "Gemma 4 26B-A4B assistant",
        model_type: "gemma4_assistant",
        description: "Drafter for speculative decoding with Gemma 4 26B-A4B.",
        weight_bytes: 800 * MB,
        kv_bytes: 0,
        vision: false,
    },
];

/// The memory the model would use against what the machine has.
pub fn fit(weight_bytes: Option<u64>, kv_bytes: u64, memory_bytes: u64) -> Fit {
    let needed = weight_bytes.map_or(0, |w| w + kv_bytes);
    let verdict = match weight_bytes {
        None => FitVerdict::Unknown,
        Some(_) if memory_bytes == 0 => FitVerdict::Unknown,
        Some(_) if needed * 10 <= memory_bytes * 7 => FitVerdict::Fits,
        Some(_) if needed * 10 <= memory_bytes * 9 => FitVerdict::Tight,
        Some(_) => FitVerdict::TooBig,
    };
    Fit { verdict, needed_bytes: needed, memory_bytes, context_tokens: FIT_CONTEXT }
}

/// The memory the accelerator can use (unified memory on Apple Silicon, RAM on the CPU).
fn machine_memory() -> u64 {
    mlx::Device::default_device().and_then(|d| d.memory_size()).ok().flatten().unwrap_or(0)
}

/// KV-cache bytes at `context` tokens (bf16 keys and values) from a model's `config.json`:
/// sliding-window layers hold at most their window, layers that share another's cache hold
/// nothing.
pub fn kv_bytes_from_config(config: &serde_json::Value, context: u64) -> Option<u64> {
    let text = config.get("text_config").filter(|t| t.is_object()).unwrap_or(config);
    let number = |key: &str| text.get(key).and_then(serde_json::Value::as_u64);
    let layers = number("num_hidden_layers")?;
    let heads = number("num_attention_heads")?;
    let kv_heads = number("num_key_value_heads").unwrap_or(heads);
    let head_dim = match number("head_dim") {
        Some(dim) => dim,
        None => number("hidden_size")? / heads.max(1),
    };
    let global_head_dim = number("global_head_dim").unwrap_or(head_dim);
    let window = number("sliding_window").unwrap_or(context).min(context);
    let shared = number("num_kv_shared_layers").unwrap_or(0);
    let types: Vec<String> = text
        .get("layer_types")
        .and_then(|t| t.as_array())
        .map(|t| t.iter().filter_map(|v| v.as_str().map(String::from)).collect())
        .unwrap_or_default();
    let mut bytes = 0;
    for layer in 0..layers.saturating_sub(shared) {
        let sliding = types.get(layer as usize).is_some_and(|t| t.contains("sliding"));
        let (positions, dim) =
            if sliding { (window, head_dim) } else { (context, global_head_dim) };
        bytes += 2 * kv_heads * dim * 2 * positions;
    }
    Some(bytes)
}

/// The token the hub client presents: `HF_TOKEN`, else the one stored in Settings, else the
/// one `huggingface-cli login` saved.
fn read_token(data_dir: &Path) -> Option<String> {
    let env = std::env::var("HF_TOKEN").ok().filter(|t| !t.trim().is_empty());
    env.or_else(|| secrets::load(data_dir)).or_else(|| {
        let home = std::env::var_os("HF_HOME").map(PathBuf::from).or_else(|| {
            directories::BaseDirs::new().map(|b| b.home_dir().join(".cache/huggingface"))
        })?;
        let token = std::fs::read_to_string(home.join("token")).ok()?;
        Some(token.trim().to_string()).filter(|t| !t.is_empty())
    })
}

/// Where Settings keeps a Hugging Face token: the macOS Keychain, else a file only the user
/// can read (0600) in the app's data folder.
mod secrets {
    use std::path::Path;

    #[cfg(target_os = "macos")]
    const SERVICE: &str = "app.quince.huggingface";

    /// `keychain` or `file`.
    pub(super) fn store_name() -> &'static str {
        if cfg!(target_os = "macos") { "keychain" } else { "file" }
    }

    #[cfg(target_os = "macos")]
    pub(super) fn load(_data_dir: &Path) -> Option<String> {
        keyring::Entry::new(SERVICE, "token").ok()?.get_password().ok()
    }

    #[cfg(target_os = "macos")]
    pub(super) fn save(_data_dir: &Path, token: Option<&str>) -> std::io::Result<()> {
        let entry = keyring::Entry::new(SERVICE, "token").map_err(std::io::Error::other)?;
        match token {
            Some(token) => entry.set_password(token).map_err(std::io::Error::other),
            None => match entry.delete_credential() {
                Ok(()) | Err(keyring::Error::NoEntry) => Ok(()),
                Err(e) => Err(std::io::Error::other(e)),
            },
        }
    }

    #[cfg(not(target_os = "macos"))]
    pub(super) fn load(data_dir: &Path) -> Option<String> {
        let token = std::fs::read_to_string(data_dir.join("hf_token")).ok()?;
        Some(token.trim().to_string()).filter(|t| !t.is_empty())
    }

    #[cfg(not(target_os = "macos"))]
    pub(super) fn save(data_dir: &Path, token: Option<&str>) -> std::io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let path = data_dir.join("hf_token");
        let Some(token) = token else {
            return match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            };
        };
        // Written to a new 0600 file, then renamed over the old one.
        let partial = data_dir.join(".hf_token.partial");
        let _ = std::fs::remove_file(&partial);
        let mut file =
            std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&partial)?;
        file.write_all(token.as_bytes())?;
        file.sync_all()?;
        std::fs::rename(&partial, &path)
    }
}

fn view_of(row: &store::Download) -> DownloadView {
    let state = match row.state.as_str() {
        "queued" => DownloadState::Queued,
        "downloading" => DownloadState::Downloading,
        "failed" => DownloadState::Failed,
        "done" => DownloadState::Done,
        _ => DownloadState::Paused,
    };
    DownloadView {
        repo: row.repo.clone(),
        revision: row.revision.clone(),
        state,
        done_bytes: row.done_bytes.max(0) as u64,
        total_bytes: row.total_bytes.max(0) as u64,
        file: String::new(),
        file_done: 0,
        file_size: 0,
        files_done: 0,
        files: 0,
        rate: 0.0,
        eta_s: None,
        error: row.error.clone(),
        error_kind: None,
        path: row.path.clone(),
    }
}

fn state_name(state: DownloadState) -> &'static str {
    match state {
        DownloadState::Queued => "queued",
        DownloadState::Downloading => "downloading",
        DownloadState::Paused => "paused",
        DownloadState::Failed => "failed",
        DownloadState::Done => "done",
    }
}

impl Chat {
    /// The network settings.
    pub async fn network_settings(&self) -> Result<NetworkSettings> {
        Ok(NetworkSettings {
            enabled: self.network_enabled().await?,
            endpoint: self.endpoint().await?,
            has_token: read_token(&self.data_dir).is_some(),
            token_store: secrets::store_name().into(),
            cache_dir: self.hf_cache.as_ref().map(|p| p.to_string_lossy().into_owned()),
        })
    }

    /// Turns networking on or off and sets the hub endpoint (empty: the default).
    pub async fn set_network(&self, enabled: bool, endpoint: &str) -> Result<NetworkSettings> {
        let endpoint = endpoint.trim().trim_end_matches('/');
        if !endpoint.is_empty()
            && !endpoint.starts_with("http://")
            && !endpoint.starts_with("https://")
        {
            return Err(Error::Invalid(format!("{endpoint:?} is not an http(s) URL")));
        }
        self.store.set_setting(NETWORK_ENABLED, if enabled { "true" } else { "false" }).await?;
        self.store.set_setting(HF_ENDPOINT, endpoint).await?;
        if !enabled {
            // Off means off: running downloads pause now.
            for flag in lock(&self.downloads.active).values() {
                flag.store(true, Ordering::SeqCst);
            }
        }
        self.network_settings().await
    }

    /// Stores a Hugging Face token (for gated models), or forgets it (`None` or empty).
    pub async fn set_hf_token(&self, token: Option<&str>) -> Result<NetworkSettings> {
        let token = token.map(str::trim).filter(|t| !t.is_empty());
        if token.is_some_and(|t| t.chars().any(|c| c.is_whitespace() || c.is_control())) {
            return Err(Error::Invalid("a token is one word, without spaces".into()));
        }
        secrets::save(&self.data_dir, token)
            .map_err(|e| Error::Invalid(format!("the token could not be saved: {e}")))?;
        self.network_settings().await
    }

    async fn network_enabled(&self) -> Result<bool> {
        Ok(self.store.setting(NETWORK_ENABLED).await?.is_none_or(|v| v != "false"))
    }

    async fn endpoint(&self) -> Result<String> {
        let stored = self.store.setting(HF_ENDPOINT).await?.filter(|e| !e.is_empty());
        Ok(stored.unwrap_or_else(hub::endpoint_from_env))
    }

    /// A hub client, refused while networking is off.
    async fn hub_client(&self) -> Result<hub::Client> {
        if !self.network_enabled().await? {
            return Err(Error::Offline);
        }
        Ok(hub::Client::new(&self.endpoint().await?, read_token(&self.data_dir))?)
    }

    fn cache_dir(&self) -> Result<&PathBuf> {
        self.hf_cache.as_ref().ok_or_else(|| {
            Error::Invalid("there is no Hugging Face cache folder to download to".into())
        })
    }

    /// The snapshot of `repo` in the cache, when a download completed.
    fn local_snapshot(&self, repo: &str) -> Option<String> {
        let dir = hub::cache::RepoDir::new(self.hf_cache.as_ref()?, repo);
        let commit = dir.resolve("main")?;
        let snapshot = dir.snapshot(&commit);
        let entry = library::describe(&snapshot, ModelSource::HfCache, repo.to_string());
        (entry.problem.is_none()).then(|| snapshot.to_string_lossy().into_owned())
    }

    async fn entry_download(&self, repo: &str) -> Result<Option<DownloadView>> {
        Ok(self.downloads().await?.into_iter().find(|d| d.repo == repo))
    }

    /// The recommended models, with fit estimates and what is downloaded already (no
    /// network).
    pub async fn catalog(&self) -> Result<Vec<CatalogEntry>> {
        let memory = machine_memory();
        let downloads = self.downloads().await?;
        Ok(recommended()
            .map(|r| CatalogEntry {
                repo: r.repo.into(),
                name: r.name.into(),
                description: r.description.into(),
                recommended: true,
                drafter: r.drafter(),
                vision: r.vision,
                weight_bytes: Some(r.weight_bytes),
                fit: fit(Some(r.weight_bytes), r.kv_bytes, memory),
                local_path: self.local_snapshot(r.repo),
                download: downloads.iter().find(|d| d.repo == r.repo).cloned(),
            })
            .collect())
    }

    /// Models on the hub whose id contains `query` (network).
    pub async fn search_models(&self, query: &str) -> Result<Vec<CatalogEntry>> {
        let query = query.trim();
        if query.is_empty() {
            return Ok(Vec::new());
        }
        let client = self.hub_client().await?;
        let hits = client.search(query, 30).await?;
        let memory = machine_memory();
        let mut entries = Vec::new();
        for hit in hits {
            let recommended = recommended().find(|r| r.repo == hit.id);
            entries.push(CatalogEntry {
                name: hit.id.rsplit('/').next().unwrap_or(&hit.id).to_string(),
                description: hit
                    .downloads
                    .map(|d| format!("{d} downloads last month"))
                    .unwrap_or_default(),
                recommended: recommended.is_some(),
                drafter: recommended.is_some_and(Recommended::drafter),
                vision: recommended.is_some_and(|r| r.vision),
                weight_bytes: recommended.map(|r| r.weight_bytes),
                fit: fit(
                    recommended.map(|r| r.weight_bytes),
                    recommended.map_or(0, |r| r.kv_bytes),
                    memory,
                ),
                local_path: self.local_snapshot(&hit.id),
                download: self.entry_download(&hit.id).await?,
                repo: hit.id,
            });
        }
        Ok(entries)
    }

    /// One model's exact size (its files as the hub lists them) and fit, from its config's
    /// KV geometry (network: the file list and `config.json`).
    pub async fn model_details(&self, repo: &str) -> Result<CatalogEntry> {
        hub::check_repo_id(repo)?;
        let client = self.hub_client().await?;
        let info = client.repo_info(repo, "main").await?;
        let weights: u64 =
            info.files.iter().filter(|f| f.path.ends_with(".safetensors")).map(|f| f.size).sum();
        let config: serde_json::Value = match info.files.iter().any(|f| f.path == "config.json") {
            true => client.small_file(repo, &info.commit, "config.json").await?,
            false => serde_json::Value::Null,
        };
        let kv = kv_bytes_from_config(&config, FIT_CONTEXT as u64).unwrap_or(0);
        let model_type = config.get("model_type").and_then(|t| t.as_str()).unwrap_or_default();
        let recommended = recommended().find(|r| r.repo == repo);
        Ok(CatalogEntry {
            repo: repo.into(),
            name: recommended.map_or_else(
                || repo.rsplit('/').next().unwrap_or(repo).to_string(),
                |r| r.name.to_string(),
            ),
            description: format!(
                "{} files, {}",
                info.files.len(),
                hub::human_bytes(info.total_bytes())
            ),
            recommended: recommended.is_some(),
            drafter: engine::registry::family(model_type).is_some_and(|f| f.is_drafter()),
            vision: engine::registry::family(model_type).is_some_and(|f| (f.takes_images)(&config)),
            weight_bytes: Some(weights),
            fit: fit(Some(weights), kv, machine_memory()),
            local_path: self.local_snapshot(repo),
            download: self.entry_download(repo).await?,
        })
    }

    /// Every download the store knows, the running ones with their live rate.
    pub async fn downloads(&self) -> Result<Vec<DownloadView>> {
        let latest = lock(&self.downloads.latest).clone();
        Ok(self
            .store
            .downloads()
            .await?
            .iter()
            .map(|row| match latest.get(&row.repo) {
                Some(live) if live.state == view_of(row).state => live.clone(),
                _ => view_of(row),
            })
            .collect())
    }

    async fn record(&self, view: &DownloadView) -> Result<()> {
        lock(&self.downloads.latest).insert(view.repo.clone(), view.clone());
        self.store
            .put_download(&store::Download {
                repo: view.repo.clone(),
                revision: view.revision.clone(),
                state: state_name(view.state).into(),
                total_bytes: view.total_bytes as i64,
                done_bytes: view.done_bytes as i64,
                error: view.error.clone(),
                path: view.path.clone(),
                updated_at: 0,
            })
            .await?;
        Ok(())
    }

    /// Downloads `repo` (at `main`) into the Hugging Face cache, or resumes it: queued behind
    /// the running download, then transferred with progress sent to `on_event`. Returns the
    /// library entry of the snapshot. [`Chat::pause_download`] stops it keeping its bytes;
    /// [`Chat::cancel_download`] stops it and deletes them.
    pub async fn download(
        &self,
        repo: &str,
        mut on_event: impl FnMut(DownloadView),
    ) -> Result<ModelEntry> {
        hub::check_repo_id(repo)?;
        let client = self.hub_client().await?;
        let cache = self.cache_dir()?.clone();
        let pause = Arc::new(AtomicBool::new(false));
        {
            let mut active = lock(&self.downloads.active);
            if active.contains_key(repo) {
                return Err(Error::Busy(format!("{repo} is already downloading")));
            }
            active.insert(repo.to_string(), pause.clone());
        }
        lock(&self.downloads.discard).remove(repo);
        let result = self.run_download(&client, repo, &cache, &pause, &mut on_event).await;
        lock(&self.downloads.active).remove(repo);
        result
    }

    async fn run_download(
        &self,
        client: &hub::Client,
        repo: &str,
        cache: &Path,
        pause: &AtomicBool,
        on_event: &mut impl FnMut(DownloadView),
    ) -> Result<ModelEntry> {
        // Queued, with the bytes an earlier session left on disk.
        let mut view = match self.entry_download(repo).await? {
            Some(before) => DownloadView {
                state: DownloadState::Queued,
                rate: 0.0,
                eta_s: None,
                error: None,
                error_kind: None,
                path: None,
                ..before
            },
            None => view_of(&store::Download {
                repo: repo.into(),
                revision: "main".into(),
                state: "queued".into(),
                total_bytes: 0,
                done_bytes: 0,
                error: None,
                path: None,
                updated_at: 0,
            }),
        };
        view.revision = "main".into();
        self.record(&view).await?;
        on_event(view.clone());
        let turn = self.downloads.turn.lock().await;
        let result = if pause.load(Ordering::SeqCst) {
            Err(hub::Error::Cancelled)
        } else {
            view.state = DownloadState::Downloading;
            self.record(&view).await?;
            on_event(view.clone());
            // A lost connection is retried after a pause, with the bytes on disk kept; the
            // count starts over whenever a try made progress.
            let mut failures = 0;
            loop {
                let before = view.done_bytes;
                let result = self.transfer(client, cache, pause, &mut view, on_event).await?;
                if view.done_bytes > before {
                    failures = 0;
                }
                match result {
                    Err(hub::Error::Network { message, .. }) if failures < RETRY_SECONDS.len() => {
                        let wait = RETRY_SECONDS[failures];
                        failures += 1;
                        tracing::info!(repo, wait, "download interrupted ({message}); retrying");
                        view.rate = 0.0;
                        view.eta_s = None;
                        view.error = Some(format!(
                            "Connection lost ({message}). Trying again in {wait} s; nothing \
                             fetched is lost."
                        ));
                        on_event(view.clone());
                        if !wait_unless_paused(pause, wait).await {
                            break Err(hub::Error::Cancelled);
                        }
                        view.error = None;
                    }
                    other => break other,
                }
            }
        };
        drop(turn);
        view.rate = 0.0;
        view.eta_s = None;
        match result {
            Ok(snapshot) => {
                view.state = DownloadState::Done;
                view.done_bytes = view.total_bytes;
                view.path = Some(snapshot.to_string_lossy().into_owned());
                self.record(&view).await?;
                on_event(view.clone());
                Ok(library::describe(&snapshot, ModelSource::HfCache, repo.to_string()))
            }
            Err(hub::Error::Cancelled) => {
                if lock(&self.downloads.discard).remove(repo) {
                    self.discard_files(repo).await?;
                } else {
                    view.state = DownloadState::Paused;
                    self.record(&view).await?;
                    on_event(view.clone());
                }
                Err(Error::Cancelled)
            }
            Err(e) => {
                let error = Error::from(e);
                view.state = DownloadState::Failed;
                view.error = Some(error.to_string());
                view.error_kind = Some(error.kind());
                self.record(&view).await?;
                on_event(view.clone());
                Err(error)
            }
        }
    }

    /// One try of a download's transfer, its progress reported through `view`.
    async fn transfer(
        &self,
        client: &hub::Client,
        cache: &Path,
        pause: &AtomicBool,
        view: &mut DownloadView,
        on_event: &mut impl FnMut(DownloadView),
    ) -> Result<hub::Result<PathBuf>> {
        let (sender, mut progress) = tokio::sync::mpsc::unbounded_channel::<hub::Progress>();
        let pull = hub::pull(client, &view.repo, &view.revision, cache, pause, move |p| {
            let _ = sender.send(p.clone());
        });
        tokio::pin!(pull);
        let mut saved = Instant::now();
        loop {
            tokio::select! {
                result = &mut pull => return Ok(result),
                Some(p) = progress.recv() => {
                    view.done_bytes = p.done;
                    view.total_bytes = p.total;
                    view.file = p.file;
                    view.file_done = p.file_done;
                    view.file_size = p.file_size;
                    view.files_done = p.files_done as u32;
                    view.files = p.files as u32;
                    view.rate = p.rate;
                    view.eta_s = p.eta_s;
                    on_event(view.clone());
                    // The store keeps the bytes about once a second, for the list after a
                    // restart (the files on disk are the truth).
                    if saved.elapsed().as_secs() >= 1 {
                        saved = Instant::now();
                        self.record(view).await?;
                    }
                }
            }
        }
    }

    /// Pauses a queued or running download (its bytes stay for a resume); false when none is.
    pub fn pause_download(&self, repo: &str) -> bool {
        match lock(&self.downloads.active).get(repo) {
            Some(flag) => {
                flag.store(true, Ordering::SeqCst);
                true
            }
            None => false,
        }
    }

    /// Cancels a download: stops it if it runs and deletes what it fetched (a model already
    /// complete in the cache stays).
    pub async fn cancel_download(&self, repo: &str) -> Result<()> {
        hub::check_repo_id(repo)?;
        let running = lock(&self.downloads.active).get(repo).cloned();
        match running {
            Some(flag) => {
                lock(&self.downloads.discard).insert(repo.to_string());
                flag.store(true, Ordering::SeqCst);
                Ok(())
            }
            None => self.discard_files(repo).await,
        }
    }

    async fn discard_files(&self, repo: &str) -> Result<()> {
        lock(&self.downloads.latest).remove(repo);
        self.store.delete_download(repo).await?;
        let Some(cache) = &self.hf_cache else { return Ok(()) };
        let dir = hub::cache::RepoDir::new(cache, repo);
        if self.local_snapshot(repo).is_some() {
            // A complete model stays: only the partial files go.
            for entry in std::fs::read_dir(dir.root().join("blobs")).into_iter().flatten().flatten()
            {
                if entry.file_name().to_string_lossy().ends_with(".incomplete") {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        } else if dir.root().is_dir() {
            std::fs::remove_dir_all(dir.root())
                .map_err(|e| Error::Invalid(format!("{}: {e}", dir.root().display())))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The catalog offers only what the registry loads (Gemma 4, Gemma 3 and Qwen3.5 today),
    /// each entry with its family's role.
    #[test]
    fn the_catalog_offers_only_what_the_registry_loads() {
        let offered: Vec<&str> = recommended().map(|r| r.repo).collect();
        for family in ["gemma-4", "gemma-3", "Qwen3.5"] {
            assert!(offered.iter().any(|r| r.contains(family)), "{family}: {offered:?}");
        }
        for r in RECOMMENDED {
            match engine::registry::family(r.model_type) {
                Some(family) => {
                    assert!(offered.contains(&r.repo), "{} loads, so it is offered", r.repo);
                    assert_eq!(family.is_drafter(), r.drafter(), "{}", r.repo);
                    assert_eq!(r.drafter(), r.repo.contains("assistant"), "{}", r.repo);
                }
                None => assert!(!offered.contains(&r.repo), "{} does not load yet", r.repo),
            }
        }
    }
}
