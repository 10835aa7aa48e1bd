//! Quince's desktop shell: Tauri commands and channels over [`chat::Chat`], nothing more.
//!
//! - Commands ([`commands`]) map one to one onto `Chat` methods and reject with a
//!   [`chat::view::CommandError`] the UI shows as is.
//! - Replies and model loads stream over their own `tauri::ipc::Channel`.
//! - Images are served to the web view from the attachment folder through the
//!   `quince-attachment:` scheme ([`attachment_response`]); nothing else on disk is reachable.
//! - App data lives in the platform folders ([`paths::AppPaths`]), logs in a daily-rotated file.

#![deny(missing_docs)]

pub mod commands;
pub mod paths;

use std::path::{Path, PathBuf};

use tauri::Manager;

/// Where the demo model sits among the app's resources.
pub const DEMO_RESOURCE: &str = "demo-model";

/// Everything the commands need.
#[derive(Debug)]
pub struct AppState {
    /// The command surface.
    pub chat: chat::Chat,
    /// The app's folders.
    pub paths: paths::AppPaths,
    /// The local server while the settings switch has it on.
    pub server: tokio::sync::Mutex<Option<server::Server>>,
}

/// Adds Quince's commands, plugins and the attachment scheme (serving `attachments`) to a
/// builder: the real runtime, or the mock runtime in tests. The [`AppState`] is managed
/// separately (in `setup`, once the resource folder is known).
pub fn builder<R: tauri::Runtime>(
    builder: tauri::Builder<R>,
    attachments: PathBuf,
) -> tauri::Builder<R> {
    builder
        .plugin(tauri_plugin_dialog::init())
        .register_uri_scheme_protocol("quince-attachment", move |_ctx, request| {
            attachment_response(&attachments, request.uri().path())
        })
        .invoke_handler(tauri::generate_handler![
            commands::list_conversations,
            commands::create_conversation,
            commands::get_conversation,
            commands::rename_conversation,
            commands::delete_conversation,
            commands::send_message,
            commands::regenerate,
            commands::answer_message,
            commands::edit_message,
            commands::stop_reply,
            commands::stop_conversation,
            commands::switch_branch,
            commands::set_system_prompt,
            commands::set_settings,
            commands::import_attachment,
            commands::list_models,
            commands::add_model_folder,
            commands::remove_model_folder,
            commands::load_model,
            commands::cancel_load,
            commands::catalog,
            commands::search_models,
            commands::model_details,
            commands::list_downloads,
            commands::download_model,
            commands::pause_download,
            commands::cancel_download,
            commands::network_settings,
            commands::app_settings,
            commands::set_app_settings,
            commands::set_network,
            commands::set_hf_token,
            commands::app_info,
            commands::local_server,
            commands::set_local_server,
        ])
}

/// Serves `/<file>` of the attachment folder: plain content-addressed names only, so no path
/// can leave the folder.
pub fn attachment_response(dir: &Path, uri_path: &str) -> tauri::http::Response<Vec<u8>> {
    let file = uri_path.trim_start_matches('/');
    let found =
        if chat::is_attachment_name(file) { std::fs::read(dir.join(file)).ok() } else { None };
    let response = tauri::http::Response::builder();
    match found {
        Some(bytes) => response
            .header(tauri::http::header::CONTENT_TYPE, chat::attachment_mime(file))
            .header(tauri::http::header::CACHE_CONTROL, "max-age=31536000, immutable")
            .body(bytes),
        None => response.status(404).body(Vec::new()),
    }
    .unwrap_or_else(|_| tauri::http::Response::new(Vec::new()))
}

/// Opens the app's data and starts the engine; the demo model comes from `resources`.
pub async fn open_state(
    paths: paths::AppPaths,
    resources: Option<PathBuf>,
) -> chat::Result<AppState> {
    let mut chat = chat::Chat::open(&paths.data_dir).await?;
    if let Some(demo) = resources.map(|r| r.join(DEMO_RESOURCE)).filter(|d| d.is_dir()) {
        chat = chat.with_demo_model(demo);
    }
    Ok(AppState { chat, paths, server: Default::default() })
}

/// Runs the desktop app until its window closes.
pub fn run() -> Result<(), Box<dyn std::error::Error>> {
    chat::configure_mlx()?;
    let paths = paths::AppPaths::discover()?;
    let _log_guard = paths::init_logging(&paths.log_dir)?;
    tracing::info!(
        data = %paths.data_dir.display(),
        "Quince {} starting",
        env!("CARGO_PKG_VERSION")
    );
    let attachments = paths.data_dir.join("attachments");
    builder(tauri::Builder::default(), attachments)
        .setup(move |app| {
            let resources = app.path().resource_dir().ok();
            let state = tauri::async_runtime::block_on(open_state(paths.clone(), resources))
                .inspect_err(|e| tracing::error!("cannot open the app data: {e}"))?;
            tracing::info!(loaded = ?state.chat.loaded(), "ready");
            app.manage(state);
            Ok(())
        })
        .build(tauri::generate_context!())
        .inspect_err(|e| tracing::error!("the app could not start: {e}"))?
        .run(|app, event| {
            // Free the model on its own thread before the process exits.
            if let tauri::RunEvent::Exit = event
                && let Some(state) = app.try_state::<AppState>()
            {
                state.chat.shutdown();
                tracing::info!("engine stopped; exiting");
            }
        });
    Ok(())
}
