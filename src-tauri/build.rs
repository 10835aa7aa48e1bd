//! Tauri's build step (embeds the UI, generates the command permissions) and where the app
//! finds libmlx at run time.

/// The commands the UI calls: each gets an `allow-…` permission, and only these are granted
/// (capabilities/default.json).
const COMMANDS: &[&str] = &[
    "list_conversations",
    "create_conversation",
    "get_conversation",
    "rename_conversation",
    "delete_conversation",
    "send_message",
    "answer_message",
    "regenerate",
    "edit_message",
    "stop_reply",
    "stop_conversation",
    "switch_branch",
    "set_system_prompt",
    "set_settings",
    "import_attachment",
    "list_models",
    "add_model_folder",
    "remove_model_folder",
    "load_model",
    "cancel_load",
    "catalog",
    "search_models",
    "model_details",
    "list_downloads",
    "download_model",
    "pause_download",
    "cancel_download",
    "network_settings",
    "set_network",
    "set_hf_token",
    "app_info",
    "local_server",
    "set_local_server",
    "app_settings",
    "set_app_settings",
];

fn main() {
    // The development build runs against the venv's libmlx; installed packages carry their
    // own copy (the .deb in /usr/lib/quince/mlx/lib, the .app in Contents/Frameworks).
    mlx_build::emit_rpath();
    #[cfg(target_os = "linux")]
    println!("cargo:rustc-link-arg-bins=-Wl,-rpath,$ORIGIN/../lib/quince/mlx/lib");
    #[cfg(target_os = "macos")]
    println!("cargo:rustc-link-arg-bins=-Wl,-rpath,@executable_path/../Frameworks");
    let demo = std::path::Path::new("../target/demo-model/model.safetensors");
    if !demo.exists() {
        panic!(
            "\n\nthe demo model the app ships is missing ({}): run `make demo-model` (or `make run`)\n",
            demo.display()
        );
    }
    if !std::path::Path::new("../ui/dist/index.html").exists() {
        panic!("\n\nthe web UI is not built (ui/dist): run `make ui` (or `make run`)\n");
    }
    tauri_build::try_build(
        tauri_build::Attributes::new()
            .app_manifest(tauri_build::AppManifest::new().commands(COMMANDS)),
    )
    .unwrap_or_else(|e| panic!("tauri build step failed: {e:#}"));
}
