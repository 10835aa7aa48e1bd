//! Downloads against the fake hub (`hub::fake`, an axum server on 127.0.0.1: nothing outside
//! this machine is reachable from the tests): complete, cut and resumed, damaged and fetched
//! again, gated, missing, too big for the disk, paused.
#![allow(clippy::unwrap_used)] // test code: a failing unwrap is a failing test

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use hub::fake::{FakeHub, FakeRepo};
use hub::{Client, Error, Progress, pull};

const REPO: &str = "quince-test/tiny-model";

/// A small model-shaped repo: two small files (git blob ids) and a 1.5 MB LFS file (SHA-256).
fn files() -> BTreeMap<String, Vec<u8>> {
    let weights: Vec<u8> =
        (0..1_500_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    BTreeMap::from([
        ("config.json".to_string(), br#"{"model_type": "gemma3_text"}"#.to_vec()),
        ("tokenizer.json".to_string(), b"{}".to_vec()),
        ("model.safetensors".to_string(), weights),
    ])
}

async fn hub_with_repo() -> FakeHub {
    let hub = FakeHub::start(0).await.unwrap();
    hub.shared.add(REPO, FakeRepo::new(files()));
    hub
}

fn total() -> u64 {
    files().values().map(|f| f.len() as u64).sum()
}

async fn download(
    hub: &FakeHub,
    cache: &Path,
    token: Option<&str>,
    cancel: &AtomicBool,
) -> (hub::Result<std::path::PathBuf>, Vec<Progress>) {
    let client = Client::new(&hub.url, token.map(String::from)).unwrap();
    let mut seen = Vec::new();
    let result = pull(&client, REPO, "main", cache, cancel, |p| seen.push(p.clone())).await;
    (result, seen)
}

fn assert_snapshot(snapshot: &Path) {
    for (path, bytes) in files() {
        let file = snapshot.join(&path);
        assert!(file.symlink_metadata().unwrap().file_type().is_symlink(), "{path} is a link");
        assert_eq!(std::fs::read(&file).unwrap(), bytes, "{path}");
    }
}

#[tokio::test]
async fn a_download_fills_the_hf_cache_layout_and_a_second_one_fetches_nothing() {
    let hub = hub_with_repo().await;
    let cache = tempfile::tempdir().unwrap();
    let (result, progress) = download(&hub, cache.path(), None, &AtomicBool::new(false)).await;
    let snapshot = result.unwrap();
    assert_snapshot(&snapshot);
    let repo_dir = cache.path().join("models--quince-test--tiny-model");
    let commit = std::fs::read_to_string(repo_dir.join("refs/main")).unwrap();
    assert_eq!(snapshot, repo_dir.join("snapshots").join(&commit));
    assert_eq!(hub.served(), total());
    // Progress counts up to the total, file by file.
    let last = progress.last().unwrap();
    assert_eq!((last.done, last.total, last.files_done, last.files), (total(), total(), 3, 3));
    assert!(progress.windows(2).all(|w| w[0].done <= w[1].done));
    // Everything is on disk: nothing is fetched again.
    let (again, _) = download(&hub, cache.path(), None, &AtomicBool::new(false)).await;
    assert_eq!(again.unwrap(), snapshot);
    assert_eq!(hub.served(), total());
    // Search finds it by part of its id.
    let hits = Client::new(&hub.url, None).unwrap().search("tiny", 10).await.unwrap();
    assert_eq!(hits.iter().map(|h| h.id.as_str()).collect::<Vec<_>>(), [REPO]);
}

#[tokio::test]
async fn a_transfer_cut_mid_file_resumes_from_the_bytes_on_disk() {
    let hub = hub_with_repo().await;
    let cache = tempfile::tempdir().unwrap();
    hub.shared.cut_after.store(600_000, Ordering::SeqCst);
    let (result, _) = download(&hub, cache.path(), None, &AtomicBool::new(false)).await;
    let err = result.unwrap_err();
    assert!(matches!(err, Error::Network { .. }), "{err}");
    assert!(err.to_string().contains("resumes"), "{err}");
    let blobs = cache.path().join("models--quince-test--tiny-model/blobs");
    let partial: Vec<_> = std::fs::read_dir(&blobs)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".incomplete"))
        .collect();
    assert_eq!(partial.len(), 1, "one partial file");
    let kept = partial[0].metadata().unwrap().len();
    assert!(kept > 0 && kept <= 600_000, "{kept} bytes kept");
    assert!(
        !cache.path().join("models--quince-test--tiny-model/snapshots").exists(),
        "no snapshot before every file is complete"
    );
    let on_disk_before: u64 =
        std::fs::read_dir(&blobs).unwrap().flatten().map(|e| e.metadata().unwrap().len()).sum();
    let first_session = hub.served();
    let (result, progress) = download(&hub, cache.path(), None, &AtomicBool::new(false)).await;
    assert_snapshot(&result.unwrap());
    // The second session fetched exactly what was missing: nothing on disk came again.
    assert_eq!(hub.served() - first_session, total() - on_disk_before);
    assert_eq!(progress[0].done, on_disk_before, "progress starts from what is on disk");
}

#[tokio::test]
async fn damaged_files_are_detected_and_fetched_again() {
    let hub = hub_with_repo().await;
    let cache = tempfile::tempdir().unwrap();
    // Served damaged once: the hash check catches it and the file comes again.
    hub.shared.damage_once("model.safetensors");
    let (result, _) = download(&hub, cache.path(), None, &AtomicBool::new(false)).await;
    assert_snapshot(&result.unwrap());
    let weights = files()["model.safetensors"].len() as u64;
    assert_eq!(hub.served(), total() + weights);

    // A partial file of the right length with the wrong bytes (a disk that lied).
    let other = tempfile::tempdir().unwrap();
    let client = Client::new(&hub.url, None).unwrap();
    let info = client.repo_info(REPO, "main").await.unwrap();
    let lfs = info.files.iter().find(|f| f.sha256.is_some()).unwrap();
    let blobs = other.path().join("models--quince-test--tiny-model/blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::write(
        blobs.join(format!("{}.incomplete", lfs.blob_name())),
        vec![7u8; weights as usize],
    )
    .unwrap();
    let served = hub.served();
    let (result, _) = download(&hub, other.path(), None, &AtomicBool::new(false)).await;
    assert_snapshot(&result.unwrap());
    assert_eq!(hub.served() - served, total(), "the bad bytes were replaced");
}

#[tokio::test]
async fn gated_missing_and_too_big_say_what_to_do_and_write_nothing() {
    let hub = hub_with_repo().await;
    let cache = tempfile::tempdir().unwrap();
    let never = AtomicBool::new(false);
    // Gated: 401 without the token, fine with it.
    hub.shared.add(REPO, FakeRepo { gated: true, ..FakeRepo::new(files()) });
    hub.shared.set_token("hf_secret");
    let (result, _) = download(&hub, cache.path(), None, &never).await;
    let err = result.unwrap_err();
    assert!(matches!(err, Error::Unauthorized { status: 401, .. }), "{err}");
    assert!(err.to_string().contains("token"), "{err}");
    let (result, _) = download(&hub, cache.path(), Some("hf_wrong"), &never).await;
    assert!(matches!(result.unwrap_err(), Error::Unauthorized { .. }));
    let (result, _) = download(&hub, cache.path(), Some("hf_secret"), &never).await;
    assert_snapshot(&result.unwrap());

    // Missing repo and revision: 404, named.
    let client = Client::new(&hub.url, None).unwrap();
    let err = pull(&client, "quince-test/nothing", "main", cache.path(), &never, |_| {}).await;
    let err = err.unwrap_err();
    assert!(matches!(err, Error::NotFound { .. }), "{err}");
    assert!(err.to_string().contains("quince-test/nothing"), "{err}");
    let client = Client::new(&hub.url, Some("hf_secret".into())).unwrap();
    let err = pull(&client, REPO, "v9", cache.path(), &never, |_| {}).await.unwrap_err();
    assert!(err.to_string().contains("v9"), "{err}");

    // Bigger than the disk: refused before a byte is fetched.
    let mut big = FakeRepo::new(files());
    big.claimed_sizes.insert("model.safetensors".into(), 1 << 60);
    hub.shared.add("quince-test/huge", big);
    let served = hub.served();
    let empty = tempfile::tempdir().unwrap();
    let err = pull(&client, "quince-test/huge", "main", empty.path(), &never, |_| {}).await;
    let err = err.unwrap_err();
    assert!(matches!(err, Error::NoSpace { .. }), "{err}");
    assert!(err.to_string().contains("disk space"), "{err}");
    assert_eq!(hub.served(), served);
    let blobs = empty.path().join("models--quince-test--huge/blobs");
    assert_eq!(std::fs::read_dir(blobs).unwrap().count(), 0);
}

#[tokio::test]
async fn a_paused_download_keeps_its_bytes_and_continues() {
    let hub = hub_with_repo().await;
    hub.shared.chunk_delay_ms.store(5, Ordering::SeqCst);
    let cache = tempfile::tempdir().unwrap();
    let cancel = AtomicBool::new(false);
    let client = Client::new(&hub.url, None).unwrap();
    let result = pull(&client, REPO, "main", cache.path(), &cancel, |p| {
        if p.file_done > 300_000 {
            cancel.store(true, Ordering::SeqCst);
        }
    })
    .await;
    assert!(matches!(result, Err(Error::Cancelled)), "{result:?}");
    let first = hub.served();
    assert!(first < total());
    cancel.store(false, Ordering::SeqCst);
    let (result, _) = download(&hub, cache.path(), None, &cancel).await;
    assert_snapshot(&result.unwrap());
    // At most the chunks in flight when it paused came twice.
    assert!(hub.served() - total() <= 2 * (64 << 10), "{} served", hub.served());
}

#[tokio::test]
async fn a_disk_that_fills_up_mid_transfer_says_so_and_keeps_what_it_has() {
    let hub = hub_with_repo().await;
    let cache = tempfile::tempdir().unwrap();
    let client = Client::new(&hub.url, None).unwrap();
    let info = client.repo_info(REPO, "main").await.unwrap();
    let lfs = info.files.iter().find(|f| f.sha256.is_some()).unwrap();
    // The weights' partial file is /dev/full: every write fails with ENOSPC.
    let blobs = cache.path().join("models--quince-test--tiny-model/blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    std::os::unix::fs::symlink("/dev/full", blobs.join(format!("{}.incomplete", lfs.blob_name())))
        .unwrap();
    let (result, _) = download(&hub, cache.path(), None, &AtomicBool::new(false)).await;
    let err = result.unwrap_err();
    assert!(matches!(err, Error::DiskFull { .. }), "{err}");
    assert!(err.to_string().contains("disk is full"), "{err}");
    // The small file fetched before it stays complete.
    let config = info.files.iter().find(|f| f.path == "config.json").unwrap();
    assert!(blobs.join(config.blob_name()).is_file());
}
