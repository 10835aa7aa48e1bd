//! KV checkpoint files: a model's whole cache stack at one point of a conversation, as one
//! safetensors file.
//!
//! Tensors: `layer.{i}.{name}` for each cache's state (only valid positions, never padded
//! capacity) and `tokens` (u32 `[N]`, the ids the caches hold, in order). Metadata:
//! `format`, `model_id`, `config_hash`, `token_count`, `tokens_sha256`, `layers`, and each
//! cache's own entries as `layer.{i}.{key}` (its signature, offset, window, ...).
//!
//! Writes are atomic (a temporary file, fsync, rename) and return the file's SHA-256, which the
//! index keeps; [`read`] verifies that hash before parsing anything, then the model identity,
//! then each cache's signature, and fails closed on any mismatch.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mlx::Array;
use sha2::Digest;

use crate::cache::{AttentionCache, CacheState};
use crate::error::{Error, Result};

/// The format tag written into every file.
pub const FORMAT: &str = "quince-kv/1";

/// Who a checkpoint belongs to: a restore needs the same model, config and cache geometry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The model (its folder or hub id).
    pub model_id: String,
    /// SHA-256 of the model's `config.json`.
    pub config_hash: String,
}

/// A written checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// Final path.
    pub path: PathBuf,
    /// File size.
    pub bytes: u64,
    /// The file's digest ([`file_digest`]).
    pub sha256: String,
    /// The caches' signatures joined with `;` (the stack's geometry).
    pub signature: String,
}

/// Hex SHA-256 of bytes.
pub fn sha256_hex(bytes: &[u8]) -> String {
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// A safetensors file's tensors and metadata, from its bytes.
fn parse_safetensors(bytes: &[u8]) -> std::result::Result<mlx::io::Safetensors, String> {
    let header_len = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as usize)
        .ok_or("shorter than a safetensors header")?;
    let data_start = 8usize.checked_add(header_len).filter(|&e| e <= bytes.len());
    let data_start = data_start.ok_or("the header runs past the end")?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..data_start]).map_err(|e| format!("header: {e}"))?;
    let data = &bytes[data_start..];
    let mut file = mlx::io::Safetensors::default();
    for (name, entry) in header {
        if name == "__metadata__" {
            for (key, value) in entry.as_object().into_iter().flatten() {
                file.metadata.insert(key.clone(), value.as_str().unwrap_or_default().to_string());
            }
            continue;
        }
        let dtype = match entry["dtype"].as_str() {
            Some("F32") => mlx::Dtype::Float32,
            Some("F16") => mlx::Dtype::Float16,
            Some("BF16") => mlx::Dtype::Bfloat16,
            Some("U32") => mlx::Dtype::Uint32,
            Some("I32") => mlx::Dtype::Int32,
            Some("U8") => mlx::Dtype::Uint8,
            other => return Err(format!("{name}: dtype {other:?} is not one a cache writes")),
        };
        let shape: Vec<i32> = entry["shape"]
            .as_array()
            .ok_or(format!("{name}: no shape"))?
            .iter()
            .map(|d| d.as_i64().map(|d| d as i32).ok_or(format!("{name}: bad shape")))
            .collect::<std::result::Result<_, _>>()?;
        let range = entry["data_offsets"].as_array().ok_or(format!("{name}: no offsets"))?;
        let (start, end) = match range.as_slice() {
            [a, b] => (a.as_u64().unwrap_or(u64::MAX) as usize, b.as_u64().unwrap_or(0) as usize),
            _ => return Err(format!("{name}: bad offsets")),
        };
        let elements: usize = shape.iter().map(|&d| d.max(0) as usize).product();
        if start > end || end > data.len() || end - start != elements * dtype.size() {
            return Err(format!("{name}: offsets {start}..{end} do not fit its shape {shape:?}"));
        }
        let array = Array::from_bytes(&data[start..end], &shape, dtype)
            .map_err(|e| format!("{name}: {}", e.message()))?;
        file.tensors.insert(name, array);
    }
    Ok(file)
}

/// Leaves of [`file_digest`].
const LEAF: usize = 8 << 20;

/// The digest a checkpoint file is verified by: SHA-256 over the SHA-256s of its 8 MiB pieces,
/// hashed in parallel (a 150 MB file is read and verified in a few milliseconds per core, where
/// one SHA-256 stream takes a few hundred). Any flipped or missing byte changes it.
pub fn file_digest(bytes: &[u8]) -> String {
    let pieces: Vec<&[u8]> = bytes.chunks(LEAF).collect();
    let threads =
        std::thread::available_parallelism().map_or(1, |n| n.get()).min(pieces.len()).max(1);
    let per_thread = pieces.len().div_ceil(threads).max(1);
    let leaves: Vec<[u8; 32]> = std::thread::scope(|scope| {
        let workers: Vec<_> = pieces
            .chunks(per_thread)
            .map(|group| {
                scope.spawn(move || {
                    group
                        .iter()
                        .map(|p| <[u8; 32]>::from(sha2::Sha256::digest(p)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().unwrap_or_default()).collect()
    });
    let mut root = sha2::Sha256::new();
    root.update((bytes.len() as u64).to_le_bytes());
    for leaf in &leaves {
        root.update(leaf);
    }
    let hex: String = root.finalize().iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256-tree:{hex}")
}

/// Hex SHA-256 of token ids (little-endian u32s): the prefix hash the index matches on.
pub fn tokens_hash(tokens: &[u32]) -> String {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    sha256_hex(&bytes)
}

/// The signatures of a cache stack, joined with `;`.
pub fn stack_signature(caches: &[Box<dyn AttentionCache>]) -> String {
    caches.iter().map(|c| c.signature()).collect::<Vec<_>>().join(";")
}

/// Writes `caches` (holding exactly `tokens`) to `path` atomically.
pub fn write(
    path: &Path,
    caches: &[Box<dyn AttentionCache>],
    tokens: &[u32],
    identity: &Identity,
) -> Result<Written> {
    let offset = caches.first().map_or(0, |c| c.offset());
    if tokens.is_empty() || caches.iter().any(|c| c.offset() != offset) || offset != tokens.len() {
        return Err(Error::InvalidRequest(format!(
            "a checkpoint needs caches at one offset equal to its {} tokens",
            tokens.len()
        )));
    }
    let mut tensors = BTreeMap::new();
    let mut metadata = BTreeMap::new();
    for (i, cache) in caches.iter().enumerate() {
        let state = cache.state()?;
        for (name, array) in state.tensors {
            tensors.insert(format!("layer.{i}.{name}"), array);
        }
        for (key, value) in state.metadata {
            metadata.insert(format!("layer.{i}.{key}"), value);
        }
    }
    tensors.insert("tokens".into(), Array::from_slice(tokens, &[tokens.len() as i32])?);
    metadata.insert("format".into(), FORMAT.into());
    metadata.insert("model_id".into(), identity.model_id.clone());
    metadata.insert("config_hash".into(), identity.config_hash.clone());
    metadata.insert("token_count".into(), tokens.len().to_string());
    metadata.insert("tokens_sha256".into(), tokens_hash(tokens));
    metadata.insert("layers".into(), caches.len().to_string());

    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |e: std::io::Error| Error::Io { path: p, source: e }
    };
    let dir = path.parent().ok_or_else(|| Error::InvalidRequest("no parent folder".into()))?;
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    // MLX adds `.safetensors` to a name without it, so the temporary name keeps the suffix.
    let partial = dir.join(format!(".partial-{name}.safetensors"));
    mlx::io::save_safetensors(&partial, &tensors, &metadata)?;
    let bytes = std::fs::read(&partial).map_err(io(&partial))?;
    std::fs::File::options()
        .write(true)
        .open(&partial)
        .and_then(|f| f.sync_all())
        .map_err(io(&partial))?;
    std::fs::rename(&partial, path).map_err(io(path))?;
    // The rename is durable once the folder is synced.
    if let Ok(folder) = std::fs::File::open(dir) {
        let _ = folder.sync_all();
    }
    Ok(Written {
        path: path.to_path_buf(),
        bytes: bytes.len() as u64,
        sha256: file_digest(&bytes),
        signature: stack_signature(caches),
    })
}

/// Reads the checkpoint at `path` into `caches` (fresh ones from `Model::new_caches`) and
/// returns the tokens they now hold. Refused, leaving `caches` unusable, when the file's
/// digest is not `sha256`, or it belongs to another model, config or cache geometry.
pub fn read(
    path: &Path,
    sha256: &str,
    identity: &Identity,
    caches: &mut [Box<dyn AttentionCache>],
) -> Result<Vec<u32>> {
    let bad = |message: String| Error::CorruptWeights { path: path.to_path_buf(), message };
    let bytes =
        std::fs::read(path).map_err(|e| Error::Io { path: path.to_path_buf(), source: e })?;
    let actual = file_digest(&bytes);
    if actual != sha256 {
        return Err(bad(format!("digest {actual} is not the recorded {sha256} (SHA-256 tree)")));
    }
    // Parsed from the bytes already read and verified: the file is not read a second time.
    let file = parse_safetensors(&bytes).map_err(bad)?;
    let meta = |key: &str| {
        file.metadata.get(key).cloned().ok_or_else(|| bad(format!("no `{key}` in the metadata")))
    };
    if meta("format")? != FORMAT {
        return Err(bad(format!("format {:?} is not {FORMAT}", meta("format")?)));
    }
    if meta("model_id")? != identity.model_id || meta("config_hash")? != identity.config_hash {
        return Err(bad(format!(
            "written for {} (config {}), not {} (config {})",
            meta("model_id")?,
            meta("config_hash")?,
            identity.model_id,
            identity.config_hash
        )));
    }
    let layers: usize = meta("layers")?.parse().map_err(|_| bad("bad `layers`".into()))?;
    if layers != caches.len() {
        return Err(bad(format!("{layers} caches, the model has {}", caches.len())));
    }
    let tokens_array =
        file.tensors.get("tokens").ok_or_else(|| bad("no `tokens` tensor".into()))?;
    let tokens: Vec<u32> = tokens_array.to_vec()?;
    if tokens_hash(&tokens) != meta("tokens_sha256")?
        || tokens.len().to_string() != meta("token_count")?
    {
        return Err(bad("the token ids do not match their recorded hash".into()));
    }
    for (i, cache) in caches.iter_mut().enumerate() {
        let prefix = format!("layer.{i}.");
        let mut state = CacheState::default();
        for (name, array) in &file.tensors {
            if let Some(rest) = name.strip_prefix(&prefix) {
                state.tensors.insert(rest.to_string(), array.clone());
            }
        }
        for (key, value) in &file.metadata {
            if let Some(rest) = key.strip_prefix(&prefix) {
                state.metadata.insert(rest.to_string(), value.clone());
            }
        }
        cache.restore(&state)?;
        if cache.offset() != tokens.len() {
            return Err(bad(format!(
                "cache {i} holds {} positions, the file {} tokens",
                cache.offset(),
                tokens.len()
            )));
        }
    }
    Ok(tokens)
}
