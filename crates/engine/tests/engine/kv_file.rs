//! KV checkpoint files: a restored cache stack is bit-identical to the saved one and continues
//! exactly as a cold run does; damaged or foreign files are refused.

use std::path::{Path, PathBuf};

use engine::batch::generate;
use engine::cache::Cache;
use engine::generate::{Flow, GenerateRequest};
use engine::kv_file::{self, Identity};
use engine::models::Model;

fn golden_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden/gemma4").join(name)
}

fn identity() -> Identity {
    Identity { model_id: "dense".into(), config_hash: "c0ffee".into() }
}

fn greedy(
    model: &dyn Model,
    caches: &mut Vec<Box<dyn Cache>>,
    prompt: &[u32],
    n: usize,
) -> Vec<u32> {
    generate(model, caches, &GenerateRequest::new(prompt.to_vec(), n), |_| Flow::Continue)
        .unwrap()
        .tokens
}

/// A conversation's first turn on the `dense` checkpoint (sliding window 6, so its rotating
/// caches have wrapped): the caches and the tokens they hold.
fn first_turn(model: &dyn Model) -> (Vec<Box<dyn Cache>>, Vec<u32>) {
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 % 250) as u32 + 2).collect();
    let mut caches = model.fresh_caches().unwrap();
    let reply = greedy(model, &mut caches, &prompt, 12);
    let held: Vec<u32> = prompt.iter().chain(&reply).copied().take(caches[0].offset()).collect();
    (caches, held)
}

fn write(model: &dyn Model, dir: &Path) -> (kv_file::Written, Vec<u32>, Vec<Box<dyn Cache>>) {
    let (caches, held) = first_turn(model);
    let written =
        kv_file::write(&dir.join("turn1.safetensors"), &caches, &held, &identity(), &[]).unwrap();
    (written, held, caches)
}

#[test]
fn a_restored_stack_is_bit_identical_and_continues_like_a_cold_run() {
    let model =
        engine::registry::load_model(golden_dir("dense"), &engine::LoadOptions::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (written, held, mut saved) = write(model.as_ref(), dir.path());
    assert!(written.signature.contains("rotating(window=6)"), "{}", written.signature);
    assert_eq!(written.bytes, std::fs::metadata(&written.path).unwrap().len());
    let leftovers: Vec<_> =
        std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(leftovers.len(), 1, "no temporary file left: {leftovers:?}");
    // Left to the page cache (the server's prompt cache), the same file.
    let cached_dir = tempfile::tempdir().unwrap();
    let cached = kv_file::write_with(
        &cached_dir.path().join("turn1.safetensors"),
        &saved,
        &held,
        &identity(),
        &[],
        kv_file::Durability::Cached,
    )
    .unwrap();
    assert_eq!((&cached.sha256, cached.bytes), (&written.sha256, written.bytes));
    assert_eq!(std::fs::read(&cached.path).unwrap(), std::fs::read(&written.path).unwrap());

    let mut restored = model.fresh_caches().unwrap();
    let read = kv_file::read(&written.path, &written.sha256, &identity(), &mut restored).unwrap();
    let tokens = read.tokens;
    assert!(read.attachments.is_empty());
    assert_eq!(tokens, held);
    for (a, b) in saved.iter().zip(&restored) {
        let (a, b) = (a.state().unwrap(), b.state().unwrap());
        assert_eq!(a.metadata, b.metadata);
        for (name, x) in &a.tensors {
            let y = &b.tensors[name];
            assert_eq!(x.shape(), y.shape());
            assert!(x.array_equal(y, false).unwrap().item::<bool>().unwrap(), "{name} differs");
        }
    }
    // The next turn: from the restored stack, from the saved one, and cold from nothing.
    let turn2: Vec<u32> = vec![3, 141, 59, 26, 53];
    let warm = greedy(model.as_ref(), &mut restored, &turn2, 16);
    assert_eq!(warm, greedy(model.as_ref(), &mut saved, &turn2, 16));
    let whole: Vec<u32> = held.iter().chain(&turn2).copied().collect();
    let mut cold = model.fresh_caches().unwrap();
    assert_eq!(warm, greedy(model.as_ref(), &mut cold, &whole, 16), "restored = cold re-prefill");
}

#[test]
fn damaged_or_foreign_checkpoints_are_refused() {
    let model =
        engine::registry::load_model(golden_dir("dense"), &engine::LoadOptions::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (written, _, _) = write(model.as_ref(), dir.path());
    let bytes = std::fs::read(&written.path).unwrap();
    let refused = |path: &Path, sha: &str, identity: &Identity| {
        let mut caches = model.fresh_caches().unwrap();
        kv_file::read(path, sha, identity, &mut caches).unwrap_err().to_string()
    };
    // Truncated, and one flipped bit: the recorded hash no longer matches.
    let truncated = dir.path().join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    assert!(refused(&truncated, &written.sha256, &identity()).contains("SHA-256 tree"));
    let mut flipped = bytes.clone();
    let middle = flipped.len() / 2;
    flipped[middle] ^= 0x10;
    let flipped_path = dir.path().join("flipped.safetensors");
    std::fs::write(&flipped_path, &flipped).unwrap();
    assert!(refused(&flipped_path, &written.sha256, &identity()).contains("SHA-256 tree"));
    // Gone.
    assert!(
        refused(&dir.path().join("gone.safetensors"), &written.sha256, &identity())
            .contains("cannot read")
    );
    // Another model or config.
    let other = Identity { model_id: "dense".into(), config_hash: "another".into() };
    assert!(refused(&written.path, &written.sha256, &other).contains("written for dense"));
    // Another cache geometry: the text-only checkpoint's stack (window 8).
    let text =
        engine::registry::load_model(golden_dir("text_only"), &engine::LoadOptions::default())
            .unwrap();
    let mut caches = text.fresh_caches().unwrap();
    assert!(kv_file::read(&written.path, &written.sha256, &identity(), &mut caches).is_err());
    // Caches are written only with exactly the tokens they hold.
    let (caches, held) = first_turn(model.as_ref());
    assert!(
        kv_file::write(&dir.path().join("x.safetensors"), &caches, &held[1..], &identity(), &[])
            .is_err()
    );
}

#[test]
fn a_file_hashes_as_its_bytes_do() {
    // Reading the pieces on several threads gives the digest of the bytes in memory, for empty
    // files, files of whole pieces and files with a short last piece; any change moves it.
    let dir = tempfile::tempdir().unwrap();
    let piece = 8 << 20;
    for len in [0usize, 1, piece, 2 * piece + 3] {
        let bytes: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        let path = dir.path().join(format!("{len}.bin"));
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(kv_file::digest_file(&path).unwrap(), kv_file::file_digest(&bytes), "{len}");
        if len > 0 {
            let mut flipped = bytes.clone();
            flipped[len - 1] ^= 1;
            assert_ne!(kv_file::file_digest(&flipped), kv_file::file_digest(&bytes), "{len}");
        }
    }
    assert_ne!(kv_file::file_digest(&[]), kv_file::file_digest(&[0]));
}
