//! The model library: the demo model, folders the user added, and compatible models found in
//! the Hugging Face cache. Entries are described from their files without loading anything.

use std::path::{Path, PathBuf};

use crate::view::{ModelEntry, ModelSource};

/// The demo model's display name: "Demo (…)" with what its weights say about themselves
/// (the `quince_demo` entry of its safetensors metadata, e.g. "small, trained on fortunes").
pub fn demo_name(path: &Path) -> String {
    match safetensors_metadata(&path.join("model.safetensors"), "quince_demo") {
        Some(about) => format!("Demo ({about})"),
        None => "Demo".to_string(),
    }
}

/// One entry of a safetensors file's `__metadata__`, read from its header alone.
fn safetensors_metadata(file: &Path, key: &str) -> Option<String> {
    use std::io::Read;
    let mut file = std::fs::File::open(file).ok()?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).ok()?;
    let len = u64::from_le_bytes(len);
    if len > 100 << 20 {
        return None;
    }
    let mut header = vec![0u8; len as usize];
    file.read_exact(&mut header).ok()?;
    let header: serde_json::Value = serde_json::from_slice(&header).ok()?;
    Some(header.get("__metadata__")?.get(key)?.as_str()?.to_string())
}

/// Describes the model folder at `path`; `problem` says why it cannot be loaded, if it cannot.
pub fn describe(path: &Path, source: ModelSource, name: String) -> ModelEntry {
    let mut entry = ModelEntry {
        path: path.to_string_lossy().into_owned(),
        name,
        source,
        vision: false,
        bytes: 0,
        problem: None,
        drafter: false,
    };
    match inspect(path) {
        Ok((vision, bytes, drafter)) => {
            entry.vision = vision;
            entry.bytes = bytes;
            entry.drafter = drafter;
        }
        Err(problem) => entry.problem = Some(problem),
    }
    entry
}

/// Whether the folder holds a model the engine can load: (vision, weight bytes, drafter) or
/// why not.
fn inspect(path: &Path) -> Result<(bool, u64, bool), String> {
    if !path.is_dir() {
        return Err(format!("the folder {} does not exist", path.display()));
    }
    let config = std::fs::read_to_string(path.join("config.json"))
        .map_err(|_| "no config.json: not a model folder".to_string())?;
    let config: serde_json::Value =
        serde_json::from_str(&config).map_err(|e| format!("config.json is not valid JSON: {e}"))?;
    let model_type = engine::registry::model_type_of(&config);
    let Some(family) = engine::registry::family(model_type) else {
        return Err(format!(
            "model type {model_type:?} is not supported yet (supported: {})",
            engine::registry::model_types().join(", ")
        ));
    };
    let drafter = family.is_drafter();
    let mut bytes = 0;
    let entries = std::fs::read_dir(path).map_err(|e| format!("cannot list the folder: {e}"))?;
    for entry in entries.flatten() {
        let name = entry.file_name();
        if name.to_string_lossy().ends_with(".safetensors") {
            // `metadata` follows symlinks: the Hugging Face cache links into its blobs.
            bytes += std::fs::metadata(entry.path()).map(|m| m.len()).unwrap_or(0);
        }
    }
    if bytes == 0 {
        return Err("no .safetensors weights in the folder".into());
    }
    // A drafter reads its target's tokens: it ships no tokenizer.
    if !drafter && !path.join("tokenizer.json").is_file() {
        return Err("no tokenizer.json in the folder".into());
    }
    Ok(((family.takes_images)(&config), bytes, drafter))
}

/// Where the Hugging Face cache is: `HF_HUB_CACHE`, else `HF_HOME/hub`, else
/// `~/.cache/huggingface/hub`.
pub fn hf_cache_dir() -> Option<PathBuf> {
    hub::cache::default_dir()
}

/// Compatible models in a Hugging Face cache folder: for each `models--org--name`, the snapshot
/// `refs/main` names (else the newest), when the engine can load it.
pub fn scan_hf_cache(root: &Path) -> Vec<ModelEntry> {
    let Ok(repos) = std::fs::read_dir(root) else { return Vec::new() };
    let mut found = Vec::new();
    for repo in repos.flatten() {
        let dir_name = repo.file_name().to_string_lossy().into_owned();
        let Some(id) = dir_name.strip_prefix("models--") else { continue };
        let Some(snapshot) = snapshot(&repo.path()) else { continue };
        let entry = describe(&snapshot, ModelSource::HfCache, id.replace("--", "/"));
        if entry.problem.is_none() {
            found.push(entry);
        }
    }
    found.sort_by(|a, b| a.name.cmp(&b.name));
    found
}

fn snapshot(repo: &Path) -> Option<PathBuf> {
    let snapshots = repo.join("snapshots");
    if let Ok(main) = std::fs::read_to_string(repo.join("refs/main")) {
        let dir = snapshots.join(main.trim());
        if dir.is_dir() {
            return Some(dir);
        }
    }
    std::fs::read_dir(&snapshots)
        .ok()?
        .flatten()
        .filter(|e| e.path().is_dir())
        .max_by_key(|e| e.metadata().and_then(|m| m.modified()).ok())
        .map(|e| e.path())
}

/// A display name for a model folder: the Hugging Face id for cache snapshots, else its name.
pub fn display_name(path: &Path) -> String {
    let parts: Vec<String> =
        path.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
    if let Some(i) = parts.iter().rposition(|p| p == "snapshots")
        && i >= 1
        && let Some(id) = parts[i - 1].strip_prefix("models--")
    {
        return id.replace("--", "/");
    }
    path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| parts.join("/"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn model(dir: &Path, model_type: &str, vision: bool) {
        std::fs::create_dir_all(dir).unwrap();
        let vision =
            if vision { serde_json::json!({"hidden_size": 8}) } else { serde_json::Value::Null };
        let config = serde_json::json!({"model_type": model_type, "vision_config": vision});
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        std::fs::write(dir.join("model.safetensors"), [0u8; 100]).unwrap();
        std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
    }

    #[test]
    fn folders_are_described_with_the_reason_they_cannot_load() {
        let dir = tempfile::tempdir().unwrap();
        model(&dir.path().join("good"), "gemma4", true);
        let good = describe(&dir.path().join("good"), ModelSource::Folder, "good".into());
        assert_eq!((good.problem.clone(), good.vision, good.bytes), (None, true, 100));

        model(&dir.path().join("llama"), "llama", false);
        let llama = describe(&dir.path().join("llama"), ModelSource::Folder, "llama".into());
        assert!(llama.problem.unwrap().contains("\"llama\" is not supported"));

        let gone = describe(&dir.path().join("gone"), ModelSource::Folder, "gone".into());
        assert!(gone.problem.unwrap().contains("does not exist"));

        std::fs::create_dir_all(dir.path().join("empty")).unwrap();
        let empty = describe(&dir.path().join("empty"), ModelSource::Folder, "e".into());
        assert!(empty.problem.unwrap().contains("config.json"));

        // An assistant drafter ships no tokenizer (it reads its target's tokens).
        let assistant = dir.path().join("assistant");
        model(&assistant, "gemma4_assistant", false);
        std::fs::remove_file(assistant.join("tokenizer.json")).unwrap();
        let entry = describe(&assistant, ModelSource::Folder, "a".into());
        assert_eq!((entry.problem, entry.drafter), (None, true));
        assert!(!good.drafter);
        std::fs::remove_file(dir.path().join("good/tokenizer.json")).unwrap();
        let untokenized = describe(&dir.path().join("good"), ModelSource::Folder, "g".into());
        assert!(untokenized.problem.unwrap().contains("tokenizer.json"));
    }

    #[test]
    fn the_hf_cache_scan_finds_compatible_snapshots_only() {
        let root = tempfile::tempdir().unwrap();
        let repo = root.path().join("models--mlx-community--gemma-4-e2b-it-4bit");
        model(&repo.join("snapshots/abc123"), "gemma4", true);
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), "abc123\n").unwrap();
        model(&root.path().join("models--org--llama/snapshots/def"), "llama", false);
        std::fs::create_dir_all(root.path().join("datasets--org--data/snapshots/x")).unwrap();
        // Gemma 3, as other tools download it: the vision model and the 1B text one.
        model(
            &root.path().join("models--mlx-community--gemma-3-4b-it-4bit/snapshots/g3"),
            "gemma3",
            true,
        );
        model(
            &root.path().join("models--google--gemma-3-1b-it/snapshots/g1"),
            "gemma3_text",
            false,
        );

        let mut found = scan_hf_cache(root.path());
        found.sort_by(|a, b| a.name.cmp(&b.name));
        let seen: Vec<(&str, bool)> = found.iter().map(|m| (m.name.as_str(), m.vision)).collect();
        assert_eq!(
            seen,
            [
                ("google/gemma-3-1b-it", false),
                ("mlx-community/gemma-3-4b-it-4bit", true),
                ("mlx-community/gemma-4-e2b-it-4bit", true)
            ]
        );
        let found: Vec<_> = found.into_iter().filter(|m| m.name.contains("gemma-4")).collect();
        assert_eq!(found[0].name, "mlx-community/gemma-4-e2b-it-4bit");
        assert_eq!(found[0].source, ModelSource::HfCache);
        assert!(found[0].path.ends_with("snapshots/abc123"));
        assert_eq!(display_name(Path::new(&found[0].path)), "mlx-community/gemma-4-e2b-it-4bit");
        assert!(scan_hf_cache(&root.path().join("missing")).is_empty());
    }
}
