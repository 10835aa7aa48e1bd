//! KV checkpoint files: a model's whole cache stack at one point of a conversation, as one
//! safetensors file.
//!
//! Tensors: `layer.{i}.{name}` for each cache's state (only valid positions, never padded
//! capacity) and `tokens` (u32 `[N]`, the ids the caches hold, in order). Metadata:
//! `format`, `model_id`, `config_hash`, `token_count`, `tokens_sha256`, `layers`, and each
//! cache's own entries as `layer.{i}.{key}` (its signature, offset, window, ...).
//!
//! A checkpoint may carry [`Attachment`]s: a generation method's own state at that point (a
//! draft model's caches, say), stored in the same file under `attachment.{schema}.` and covered
//! by the same digest. Their schemas are listed in the metadata's `attachments`.
//!
//! Writes are atomic (a temporary file, fsync, rename) and return the file's SHA-256, which the
//! index keeps; [`read`] verifies that hash before parsing anything, then the model identity,
//! then each cache's signature, and fails closed on any mismatch.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mlx::Array;
use sha2::Digest;

use crate::error::{Error, Result};
use crate::{Cache, CacheState};

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
    /// What the index records of each attachment written.
    pub attachments: Vec<AttachmentIndex>,
}

/// An attachment as the index records it: its schema, metadata and the names of its tensors
/// in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachmentIndex {
    /// [`Attachment::schema`].
    pub schema: String,
    /// [`Attachment::metadata`].
    pub metadata: BTreeMap<String, String>,
    /// The file's names of [`Attachment::tensors`].
    pub tensors: Vec<String>,
}

/// A generation method's state kept with a checkpoint (the seed's `CheckpointAttachment`): a
/// schema naming its layout, string metadata and named tensors.
#[derive(Debug, Clone, Default)]
pub struct Attachment {
    /// What the entries mean, with a version, e.g. `quince-draft-kv/1`.
    pub schema: String,
    /// String entries.
    pub metadata: BTreeMap<String, String>,
    /// Named tensors.
    pub tensors: BTreeMap<String, Array>,
}

/// What [`read`] found besides the caches it restored.
#[derive(Debug, Clone, Default)]
pub struct Contents {
    /// The token ids the caches hold.
    pub tokens: Vec<u32>,
    /// The attachments written with them.
    pub attachments: Vec<Attachment>,
}

/// Adds each cache's state under `{prefix}{i}.` to `tensors` and `metadata`.
pub fn save_stack(
    caches: &[Box<dyn Cache>],
    prefix: &str,
    tensors: &mut BTreeMap<String, Array>,
    metadata: &mut BTreeMap<String, String>,
) -> Result<()> {
    for (i, cache) in caches.iter().enumerate() {
        let state = cache.state()?;
        for (name, array) in state.tensors {
            tensors.insert(format!("{prefix}{i}.{name}"), array);
        }
        for (key, value) in state.metadata {
            metadata.insert(format!("{prefix}{i}.{key}"), value);
        }
    }
    Ok(())
}

/// Restores each of `caches` from the entries [`save_stack`] wrote under `{prefix}{i}.`
/// (`tensors` and `metadata`: maps by reference, of any kind).
pub fn restore_stack<'a, T, M>(
    caches: &mut [Box<dyn Cache>],
    prefix: &str,
    tensors: T,
    metadata: M,
) -> Result<()>
where
    T: IntoIterator<Item = (&'a String, &'a Array)> + Copy,
    M: IntoIterator<Item = (&'a String, &'a String)> + Copy,
{
    for (i, cache) in caches.iter_mut().enumerate() {
        let prefix = format!("{prefix}{i}.");
        let mut state = CacheState::default();
        for (name, array) in tensors {
            if let Some(rest) = name.strip_prefix(&prefix) {
                state.tensors.insert(rest.to_string(), array.clone());
            }
        }
        for (key, value) in metadata {
            if let Some(rest) = key.strip_prefix(&prefix) {
                state.metadata.insert(rest.to_string(), value.clone());
            }
        }
        cache.restore(&state)?;
    }
    Ok(())
}

/// Hex SHA-256 of bytes.
pub fn sha256_hex(bytes: &[u8]) -> String {
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Checks that a safetensors file is as long as its header says: 8 bytes of header length, the
/// JSON header, then exactly the data its tensors' offsets cover.
fn check_length(path: &Path) -> std::result::Result<(), String> {
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let len = file.metadata().map_err(|e| e.to_string())?.len();
    let mut prefix = [0u8; 8];
    file.read_exact_at(&mut prefix, 0).map_err(|_| "shorter than a safetensors header")?;
    let header_len = u64::from_le_bytes(prefix);
    if header_len > len.saturating_sub(8) || header_len > 100 << 20 {
        return Err(format!("a header of {header_len} bytes does not fit the file of {len}"));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact_at(&mut header, 8).map_err(|e| e.to_string())?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| format!("header: {e}"))?;
    let data_end = header
        .iter()
        .filter(|(name, _)| *name != "__metadata__")
        .filter_map(|(_, entry)| entry["data_offsets"].get(1).and_then(|end| end.as_u64()))
        .max()
        .unwrap_or(0);
    if 8 + header_len + data_end != len {
        return Err(format!(
            "{len} bytes, where the header describes {}",
            8 + header_len + data_end
        ));
    }
    Ok(())
}

/// Leaves of [`file_digest`].
const LEAF: usize = 8 << 20;

/// The digest a checkpoint file is verified by: SHA-256 over the file's length and the SHA-256s
/// of its 8 MiB pieces, hashed in parallel (a 150 MB file is verified in tens of milliseconds,
/// where one SHA-256 stream takes several hundred). Any flipped or missing byte changes it.
pub fn file_digest(bytes: &[u8]) -> String {
    let pieces: Vec<&[u8]> = bytes.chunks(LEAF).collect();
    tree_digest(bytes.len() as u64, pieces.len(), |i, _| Ok(sha2::Sha256::digest(pieces[i]).into()))
        .unwrap_or_else(|e: std::io::Error| unreachable!("hashing memory cannot fail: {e}"))
}

/// [`file_digest`] of the file at `path`, each worker reading its own pieces.
pub fn digest_file(path: &Path) -> std::io::Result<String> {
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::open(path)?;
    let len = file.metadata()?.len();
    let pieces = len.div_ceil(LEAF as u64) as usize;
    tree_digest(len, pieces, |i, buffer| {
        let start = i as u64 * LEAF as u64;
        let size = (len - start).min(LEAF as u64) as usize;
        buffer.resize(size, 0);
        file.read_exact_at(buffer, start)?;
        Ok(sha2::Sha256::digest(&buffer[..]).into())
    })
}

/// The root over `pieces` leaves, leaf `i` hashed by `leaf(i, scratch)` on one of the machine's
/// cores (interleaved, so the workers finish together).
fn tree_digest(
    len: u64,
    pieces: usize,
    leaf: impl Fn(usize, &mut Vec<u8>) -> std::io::Result<[u8; 32]> + Sync,
) -> std::io::Result<String> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(pieces).max(1);
    let mut leaves = vec![[0u8; 32]; pieces];
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let leaf = &leaf;
                scope.spawn(move || {
                    let mut scratch = Vec::new();
                    (t..pieces)
                        .step_by(threads)
                        .map(|i| Ok((i, leaf(i, &mut scratch)?)))
                        .collect::<std::io::Result<Vec<_>>>()
                })
            })
            .collect();
        for worker in workers {
            let done =
                worker.join().map_err(|_| std::io::Error::other("a hashing thread panicked"))?;
            for (i, digest) in done? {
                leaves[i] = digest;
            }
        }
        Ok::<_, std::io::Error>(())
    })?;
    let mut root = sha2::Sha256::new();
    root.update(len.to_le_bytes());
    for leaf in &leaves {
        root.update(leaf);
    }
    let hex: String = root.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("sha256-tree:{hex}"))
}

/// Hex SHA-256 of token ids (little-endian u32s): the prefix hash the index matches on.
pub fn tokens_hash(tokens: &[u32]) -> String {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    sha256_hex(&bytes)
}

/// The signatures of a cache stack, joined with `;`.
pub fn stack_signature(caches: &[Box<dyn Cache>]) -> String {
    caches.iter().map(|c| c.signature()).collect::<Vec<_>>().join(";")
}

/// Whether a checkpoint write waits for the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// The file is synced before it is renamed into place and the rename synced after: it
    /// survives a power cut (a conversation's checkpoints).
    #[default]
    Synced,
    /// Left to the page cache: for files that only ever serve the process that wrote them
    /// (the local server's prompt cache, which clears its folder at start). A sync of a large
    /// checkpoint costs tens to hundreds of milliseconds that every row of a batch would wait.
    Cached,
}

/// Writes `caches` (holding exactly `tokens`) and `attachments` to `path` atomically, synced
/// ([`Durability::Synced`]).
pub fn write(
    path: &Path,
    caches: &[Box<dyn Cache>],
    tokens: &[u32],
    identity: &Identity,
    attachments: &[Attachment],
) -> Result<Written> {
    write_with(path, caches, tokens, identity, attachments, Durability::Synced)
}

/// [`write()`], as durable as `durability` says. Either way the file appears whole or not at
/// all (written under a temporary name, then renamed).
pub fn write_with(
    path: &Path,
    caches: &[Box<dyn Cache>],
    tokens: &[u32],
    identity: &Identity,
    attachments: &[Attachment],
    durability: Durability,
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
    save_stack(caches, "layer.", &mut tensors, &mut metadata)?;
    let mut schemas = Vec::new();
    for attachment in attachments {
        let schema = &attachment.schema;
        if schema.is_empty() || schema.contains(',') || schemas.contains(&schema.as_str()) {
            return Err(Error::InvalidRequest(format!("attachment schema {schema:?}")));
        }
        schemas.push(schema);
        for (name, array) in &attachment.tensors {
            tensors.insert(format!("attachment.{schema}.{name}"), array.clone());
        }
        for (key, value) in &attachment.metadata {
            metadata.insert(format!("attachment.{schema}.{key}"), value.clone());
        }
    }
    metadata.insert("attachments".into(), schemas.join(","));
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
    let sha256 = digest_file(&partial).map_err(io(&partial))?;
    let bytes = std::fs::metadata(&partial).map_err(io(&partial))?.len();
    let synced = durability == Durability::Synced;
    if synced {
        std::fs::File::options()
            .write(true)
            .open(&partial)
            .and_then(|f| f.sync_all())
            .map_err(io(&partial))?;
    }
    std::fs::rename(&partial, path).map_err(io(path))?;
    // The rename is durable once the folder is synced.
    if synced && let Ok(folder) = std::fs::File::open(dir) {
        let _ = folder.sync_all();
    }
    let attachments = attachments
        .iter()
        .map(|a| AttachmentIndex {
            schema: a.schema.clone(),
            metadata: a.metadata.clone(),
            tensors: a
                .tensors
                .keys()
                .map(|name| format!("attachment.{}.{name}", a.schema))
                .collect(),
        })
        .collect();
    Ok(Written {
        path: path.to_path_buf(),
        bytes,
        sha256,
        signature: stack_signature(caches),
        attachments,
    })
}

/// Reads the checkpoint at `path` into `caches` (fresh ones from `Model::new_caches`) and
/// returns the tokens they now hold, with the file's attachments. Refused, leaving `caches` unusable, when the file's
/// digest is not `sha256`, or it belongs to another model, config or cache geometry.
pub fn read(
    path: &Path,
    sha256: &str,
    identity: &Identity,
    caches: &mut [Box<dyn Cache>],
) -> Result<Contents> {
    let bad = |message: String| Error::CorruptWeights { path: path.to_path_buf(), message };
    let started = std::time::Instant::now();
    // A file shorter or longer than its header says is not given to MLX at all.
    let length = check_length(path);
    // MLX reads the tensors into its own memory (straight to the device where there is one)
    // while the other cores hash the file; nothing is restored until both are done and the
    // digest is the recorded one.
    let (digest, loaded) = std::thread::scope(|scope| {
        let hashing = scope.spawn(|| digest_file(path));
        let loaded = length.clone().and_then(|()| {
            let file = mlx::io::load_safetensors(path).map_err(|e| e.message().to_string())?;
            mlx::eval(&file.tensors.values().collect::<Vec<_>>())
                .map_err(|e| e.message().to_string())?;
            Ok(file)
        });
        let digest =
            hashing.join().unwrap_or_else(|_| Err(std::io::Error::other("hashing panicked")));
        (digest, loaded)
    });
    let actual = digest.map_err(|e| Error::Io { path: path.to_path_buf(), source: e })?;
    if actual != sha256 {
        return Err(bad(format!("digest {actual} is not the recorded {sha256} (SHA-256 tree)")));
    }
    let file = loaded.map_err(bad)?;
    let load_ms = started.elapsed().as_secs_f64() * 1e3;
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
    restore_stack(caches, "layer.", &file.tensors, &file.metadata)?;
    for (i, cache) in caches.iter().enumerate() {
        if cache.offset() != tokens.len() {
            return Err(bad(format!(
                "cache {i} holds {} positions, the file {} tokens",
                cache.offset(),
                tokens.len()
            )));
        }
    }
    tracing::debug!(
        load_ms,
        restore_ms = started.elapsed().as_secs_f64() * 1e3 - load_ms,
        "read a KV checkpoint"
    );
    // Files written before attachments existed have no `attachments` entry: none.
    let schemas = file.metadata.get("attachments").cloned().unwrap_or_default();
    let attachments = schemas
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|schema| {
            let prefix = format!("attachment.{schema}.");
            let pick = |name: &String| name.strip_prefix(&prefix).map(str::to_string);
            Attachment {
                schema: schema.to_string(),
                metadata: file
                    .metadata
                    .iter()
                    .filter_map(|(k, v)| Some((pick(k)?, v.clone())))
                    .collect(),
                tensors: file
                    .tensors
                    .iter()
                    .filter_map(|(k, v)| Some((pick(k)?, v.clone())))
                    .collect(),
            }
        })
        .collect();
    Ok(Contents { tokens, attachments })
}
