//! The commands the UI invokes (`ui/src/ipc/commands.ts`). Each is a thin call into
//! [`chat::Chat`]; failures reach the UI as [`CommandError`] (a kind and a readable message).

use std::path::PathBuf;

use chat::view::{
    AppInfo, AppSettings, CatalogEntry, CommandError, ConversationDetail, ConversationSummary,
    DownloadView, ErrorKind, LoadEvent, LoadedModel, LocalServer, ModelEntry, ModelsState,
    NetworkSettings, PendingAttachment, Settings, StreamEvent, ThreadMessage,
};
use tauri::State;
use tauri::ipc::{Channel, InvokeBody, Request};

use crate::AppState;

/// What every command returns.
pub type CommandResult<T> = Result<T, CommandError>;

fn fail(error: chat::Error) -> CommandError {
    if error.kind() == ErrorKind::Internal {
        tracing::error!("{error}");
    } else {
        tracing::info!(kind = ?error.kind(), "{error}");
    }
    error.to_command_error()
}

/// Forwards stream events to the UI; a closed window just stops receiving.
fn forward<T: serde::Serialize + Clone + tauri::ipc::IpcResponse>(
    channel: &Channel<T>,
) -> impl FnMut(T) + '_ {
    move |event| {
        if let Err(e) = channel.send(event) {
            tracing::debug!("the UI stopped listening: {e}");
        }
    }
}

/// Conversations, most recent first; with a query, those whose title or messages match.
#[tauri::command]
pub async fn list_conversations(
    state: State<'_, AppState>,
    query: Option<String>,
) -> CommandResult<Vec<ConversationSummary>> {
    state.chat.conversations(query.as_deref()).await.map_err(fail)
}

/// A new conversation.
#[tauri::command]
pub async fn create_conversation(state: State<'_, AppState>) -> CommandResult<ConversationDetail> {
    state.chat.create_conversation().await.map_err(fail)
}

/// A conversation with its current branch.
#[tauri::command]
pub async fn get_conversation(
    state: State<'_, AppState>,
    id: i64,
) -> CommandResult<ConversationDetail> {
    state.chat.conversation(id).await.map_err(fail)
}

/// Renames a conversation.
#[tauri::command]
pub async fn rename_conversation(
    state: State<'_, AppState>,
    id: i64,
    title: String,
) -> CommandResult<()> {
    state.chat.rename(id, &title).await.map_err(fail)
}

/// Deletes a conversation.
#[tauri::command]
pub async fn delete_conversation(state: State<'_, AppState>, id: i64) -> CommandResult<()> {
    state.chat.delete(id).await.map_err(fail)
}

/// Sends a message and streams the reply.
#[tauri::command]
pub async fn send_message(
    state: State<'_, AppState>,
    conversation_id: i64,
    text: String,
    attachments: Vec<String>,
    on_event: Channel<StreamEvent>,
) -> CommandResult<ThreadMessage> {
    state.chat.send(conversation_id, &text, &attachments, forward(&on_event)).await.map_err(fail)
}

/// A new reply to the message an assistant message answered.
#[tauri::command]
pub async fn regenerate(
    state: State<'_, AppState>,
    message_id: i64,
    on_event: Channel<StreamEvent>,
) -> CommandResult<ThreadMessage> {
    state.chat.regenerate(message_id, forward(&on_event)).await.map_err(fail)
}

/// A reply to a stored user message (one left unanswered, or another reply to it).
#[tauri::command]
pub async fn answer_message(
    state: State<'_, AppState>,
    message_id: i64,
    on_event: Channel<StreamEvent>,
) -> CommandResult<ThreadMessage> {
    state.chat.answer(message_id, forward(&on_event)).await.map_err(fail)
}

/// A new version of a user message (a branch) and its reply.
#[tauri::command]
pub async fn edit_message(
    state: State<'_, AppState>,
    message_id: i64,
    text: String,
    on_event: Channel<StreamEvent>,
) -> CommandResult<ThreadMessage> {
    state.chat.edit(message_id, &text, forward(&on_event)).await.map_err(fail)
}

/// Stops a generation, named by the id of the reply it writes (from the `started` event);
/// false when it is not running.
#[tauri::command]
pub fn stop_reply(state: State<'_, AppState>, reply_id: i64) -> bool {
    state.chat.stop_generation(reply_id)
}

/// Stops the reply in flight in a conversation (also one still waiting for its model);
/// false when none is.
#[tauri::command]
pub fn stop_conversation(state: State<'_, AppState>, conversation_id: i64) -> bool {
    state.chat.stop(conversation_id)
}

/// Shows the branch through a message.
#[tauri::command]
pub async fn switch_branch(
    state: State<'_, AppState>,
    message_id: i64,
) -> CommandResult<ConversationDetail> {
    state.chat.switch_branch(message_id).await.map_err(fail)
}

/// Sets a conversation's system prompt.
#[tauri::command]
pub async fn set_system_prompt(
    state: State<'_, AppState>,
    id: i64,
    prompt: String,
) -> CommandResult<()> {
    state.chat.set_system_prompt(id, &prompt).await.map_err(fail)
}

/// Sets a conversation's sampling settings.
#[tauri::command]
pub async fn set_settings(
    state: State<'_, AppState>,
    id: i64,
    settings: Settings,
) -> CommandResult<()> {
    state.chat.set_settings(id, &settings).await.map_err(fail)
}

/// Imports an image: the raw bytes are the request body, the file name the `x-file-name`
/// header (percent-encoded).
#[tauri::command]
pub async fn import_attachment(
    state: State<'_, AppState>,
    request: Request<'_>,
) -> CommandResult<PendingAttachment> {
    let InvokeBody::Raw(bytes) = request.body() else {
        return Err(CommandError {
            kind: ErrorKind::Invalid,
            message: "send the image as raw bytes".into(),
        });
    };
    let name = request
        .headers()
        .get("x-file-name")
        .and_then(|v| v.to_str().ok())
        .map(|v| percent_encoding::percent_decode_str(v).decode_utf8_lossy().into_owned())
        .unwrap_or_else(|| "image".into());
    state.chat.import_attachment(bytes, &name).await.map_err(fail)
}

/// The model library and what is loaded.
#[tauri::command]
pub async fn list_models(state: State<'_, AppState>) -> CommandResult<ModelsState> {
    state.chat.models().await.map_err(fail)
}

/// Adds a model folder to the library.
#[tauri::command]
pub async fn add_model_folder(
    state: State<'_, AppState>,
    path: PathBuf,
) -> CommandResult<ModelEntry> {
    state.chat.add_model_folder(&path).await.map_err(fail)
}

/// Removes a folder from the library.
#[tauri::command]
pub async fn remove_model_folder(state: State<'_, AppState>, path: String) -> CommandResult<()> {
    state.chat.remove_model_folder(&path).await.map_err(fail)
}

/// Loads a model, streaming its stages.
#[tauri::command]
pub async fn load_model(
    state: State<'_, AppState>,
    path: PathBuf,
    on_progress: Channel<LoadEvent>,
) -> CommandResult<LoadedModel> {
    tracing::info!(path = %path.display(), "loading a model");
    state.chat.load_model(&path, forward(&on_progress)).await.map_err(fail)
}

/// Cancels the model load in progress.
#[tauri::command]
pub fn cancel_load(state: State<'_, AppState>) -> bool {
    state.chat.cancel_load()
}

/// The recommended models with fit estimates (no network).
#[tauri::command]
pub async fn catalog(state: State<'_, AppState>) -> CommandResult<Vec<CatalogEntry>> {
    state.chat.catalog().await.map_err(fail)
}

/// Searches the hub by repo id (network).
#[tauri::command]
pub async fn search_models(
    state: State<'_, AppState>,
    query: String,
) -> CommandResult<Vec<CatalogEntry>> {
    state.chat.search_models(&query).await.map_err(fail)
}

/// One model's exact size and fit (network).
#[tauri::command]
pub async fn model_details(
    state: State<'_, AppState>,
    repo: String,
) -> CommandResult<CatalogEntry> {
    state.chat.model_details(&repo).await.map_err(fail)
}

/// Every download, running ones with their live rate.
#[tauri::command]
pub async fn list_downloads(state: State<'_, AppState>) -> CommandResult<Vec<DownloadView>> {
    state.chat.downloads().await.map_err(fail)
}

/// Downloads (or resumes) a model, streaming its progress; returns its library entry.
#[tauri::command]
pub async fn download_model(
    state: State<'_, AppState>,
    repo: String,
    on_progress: Channel<DownloadView>,
) -> CommandResult<ModelEntry> {
    tracing::info!(repo, "downloading a model");
    state.chat.download(&repo, forward(&on_progress)).await.map_err(fail)
}

/// Pauses a download (its bytes stay).
#[tauri::command]
pub fn pause_download(state: State<'_, AppState>, repo: String) -> bool {
    state.chat.pause_download(&repo)
}

/// Cancels a download and deletes what it fetched.
#[tauri::command]
pub async fn cancel_download(state: State<'_, AppState>, repo: String) -> CommandResult<()> {
    state.chat.cancel_download(&repo).await.map_err(fail)
}

/// The app's settings: the KV cache new chats start with, the memory limit.
#[tauri::command]
pub async fn app_settings(state: State<'_, AppState>) -> CommandResult<AppSettings> {
    state.chat.app_settings().await.map_err(fail)
}

/// Saves the app's settings.
#[tauri::command]
pub async fn set_app_settings(
    state: State<'_, AppState>,
    settings: AppSettings,
) -> CommandResult<AppSettings> {
    state.chat.set_app_settings(&settings).await.map_err(fail)?;
    state.chat.app_settings().await.map_err(fail)
}

/// The network settings.
#[tauri::command]
pub async fn network_settings(state: State<'_, AppState>) -> CommandResult<NetworkSettings> {
    state.chat.network_settings().await.map_err(fail)
}

/// Turns networking on or off and sets the hub endpoint.
#[tauri::command]
pub async fn set_network(
    state: State<'_, AppState>,
    enabled: bool,
    endpoint: String,
) -> CommandResult<NetworkSettings> {
    state.chat.set_network(enabled, &endpoint).await.map_err(fail)
}

/// Stores (or, empty, forgets) the Hugging Face token.
#[tauri::command]
pub async fn set_hf_token(
    state: State<'_, AppState>,
    token: Option<String>,
) -> CommandResult<NetworkSettings> {
    state.chat.set_hf_token(token.as_deref()).await.map_err(fail)
}

/// Versions and folders, for the settings screen.
#[tauri::command]
pub fn app_info(state: State<'_, AppState>) -> AppInfo {
    AppInfo {
        version: env!("CARGO_PKG_VERSION").into(),
        data_dir: state.paths.data_dir.display().to_string(),
        log_dir: state.paths.log_dir.display().to_string(),
        device: format!(
            "MLX {} ({})",
            mlx::device::version(),
            mlx::device::Backend::current().name()
        ),
    }
}

/// The app setting holding the local server's key.
const SERVER_KEY: &str = "server_api_key";

/// The local server's key: the stored one, else a new one, stored.
async fn server_key(state: &AppState) -> CommandResult<String> {
    let store = state.chat.store();
    if let Some(key) = store.setting(SERVER_KEY).await.map_err(|e| fail(e.into()))? {
        return Ok(key);
    }
    let key = server::new_api_key();
    store.set_setting(SERVER_KEY, &key).await.map_err(|e| fail(e.into()))?;
    Ok(key)
}

/// What the settings screen shows of the local server.
async fn server_view(
    state: &AppState,
    running: Option<&server::Server>,
) -> CommandResult<LocalServer> {
    Ok(LocalServer {
        running: running.is_some(),
        url: running.map(server::Server::base_url),
        api_key: server_key(state).await?,
        port: running.map_or(server::DEFAULT_PORT, |s| s.addr().port()),
    })
}

/// The local server's state.
#[tauri::command]
pub async fn local_server(state: State<'_, AppState>) -> CommandResult<LocalServer> {
    let running = state.server.lock().await;
    server_view(&state, running.as_ref()).await
}

/// Starts (on `port`, default 8741, loopback only) or stops the local server, which answers
/// with the loaded model through the same engine as the chats.
#[tauri::command]
pub async fn set_local_server(
    state: State<'_, AppState>,
    enabled: bool,
    port: Option<u16>,
) -> CommandResult<LocalServer> {
    let mut running = state.server.lock().await;
    if let Some(server) = running.take() {
        server.stop().await;
        tracing::info!("local server stopped");
    }
    if enabled {
        let options = server::ServeOptions {
            port: port.unwrap_or(server::DEFAULT_PORT),
            ..server::ServeOptions::new(server_key(&state).await?)
        };
        let started = server::Server::start(state.chat.clone(), options)
            .await
            .map_err(|e| fail(chat::Error::Invalid(e.to_string())))?;
        tracing::info!(url = %started.base_url(), "local server started");
        *running = Some(started);
    }
    server_view(&state, running.as_ref()).await
}
