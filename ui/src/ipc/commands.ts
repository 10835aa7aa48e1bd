// Typed wrappers over the Tauri commands. Argument names are camelCase here;
// Tauri maps them to the Rust snake_case parameters.
import { Channel, invoke } from "@tauri-apps/api/core";
import type {
  AppInfo,
  AppSettings,
  CatalogEntry,
  CommandError,
  DownloadView,
  LocalServer,
  ConversationDetail,
  ConversationSummary,
  ErrorKind,
  LoadEvent,
  LoadedModel,
  ModelEntry,
  ModelsState,
  NetworkSettings,
  PendingAttachment,
  Settings,
  StreamEvent,
  ThreadMessage,
} from "./bindings";

export { Channel };

const ERROR_KINDS: readonly ErrorKind[] = [
  "model_missing",
  "model_load",
  "prompt_too_long",
  "out_of_memory",
  "bad_image",
  "busy",
  "not_found",
  "invalid",
  "cancelled",
  "offline",
  "network",
  "unauthorized",
  "disk_full",
  "internal",
];

/** True when `e` has the `{kind, message}` shape every command rejects with. */
export function isCommandError(e: unknown): e is CommandError {
  if (typeof e !== "object" || e === null) return false;
  const o = e as Record<string, unknown>;
  return (
    typeof o.message === "string" &&
    typeof o.kind === "string" &&
    (ERROR_KINDS as readonly string[]).includes(o.kind)
  );
}

/** The kind of a command error, or null for anything else. */
export function errorKind(e: unknown): ErrorKind | null {
  return isCommandError(e) ? e.kind : null;
}

/** A readable message for anything a command (or other code) threw. Never a stack. */
export function errorMessage(e: unknown): string {
  if (e === null || e === undefined) return "Unknown error";
  if (typeof e === "string") return e.trim() || "Unknown error";
  if (e instanceof Error) return e.message || e.name || "Unknown error";
  if (typeof e === "object") {
    const msg = (e as { message?: unknown }).message;
    if (typeof msg === "string" && msg.trim()) return msg;
    const kind = (e as { kind?: unknown }).kind;
    if (typeof kind === "string") return kind.replace(/_/g, " ");
  }
  try {
    return String(e);
  } catch {
    return "Unknown error";
  }
}

// ---- conversations ----

export function listConversations(query: string | null): Promise<ConversationSummary[]> {
  return invoke("list_conversations", { query: query && query.trim() ? query.trim() : null });
}

export function createConversation(): Promise<ConversationDetail> {
  return invoke("create_conversation");
}

export function getConversation(id: number): Promise<ConversationDetail> {
  return invoke("get_conversation", { id });
}

export function renameConversation(id: number, title: string): Promise<void> {
  return invoke("rename_conversation", { id, title });
}

export function deleteConversation(id: number): Promise<void> {
  return invoke("delete_conversation", { id });
}

// ---- messages / streaming ----

export function sendMessage(
  conversationId: number,
  text: string,
  attachments: string[],
  onEvent: Channel<StreamEvent>,
): Promise<ThreadMessage> {
  return invoke("send_message", { conversationId, text, attachments, onEvent });
}

export function regenerate(messageId: number, onEvent: Channel<StreamEvent>): Promise<ThreadMessage> {
  return invoke("regenerate", { messageId, onEvent });
}

/** A reply to a stored user message (one left unanswered by a failed load, or another reply). */
export function answerMessage(messageId: number, onEvent: Channel<StreamEvent>): Promise<ThreadMessage> {
  return invoke("answer_message", { messageId, onEvent });
}

export function editMessage(
  messageId: number,
  text: string,
  onEvent: Channel<StreamEvent>,
): Promise<ThreadMessage> {
  return invoke("edit_message", { messageId, text, onEvent });
}

/** Stops a generation, named by the reply it writes (the `started` event's reply id). */
export function stopReply(replyId: number): Promise<boolean> {
  return invoke("stop_reply", { replyId });
}

/** Stops the reply in flight in a conversation, also one still waiting for its model. */
export function stopConversation(conversationId: number): Promise<boolean> {
  return invoke("stop_conversation", { conversationId });
}

export function switchBranch(messageId: number): Promise<ConversationDetail> {
  return invoke("switch_branch", { messageId });
}

export function setSystemPrompt(id: number, prompt: string): Promise<void> {
  return invoke("set_system_prompt", { id, prompt });
}

export function setSettings(id: number, settings: Settings): Promise<void> {
  return invoke("set_settings", { id, settings });
}

// ---- attachments ----

/** Sends the raw bytes as the request body; the file name travels in a header. */
export function importAttachment(bytes: Uint8Array, name: string): Promise<PendingAttachment> {
  return invoke("import_attachment", bytes, {
    headers: { "x-file-name": encodeURIComponent(name) },
  });
}

// ---- models ----

export function listModels(): Promise<ModelsState> {
  return invoke("list_models");
}

export function addModelFolder(path: string): Promise<ModelEntry> {
  return invoke("add_model_folder", { path });
}

export function removeModelFolder(path: string): Promise<void> {
  return invoke("remove_model_folder", { path });
}

export function loadModel(path: string, onProgress: Channel<LoadEvent>): Promise<LoadedModel> {
  return invoke("load_model", { path, onProgress });
}

export function cancelLoad(): Promise<void> {
  return invoke("cancel_load");
}

// ---- downloads and the network ----

/** Recommended models with fit estimates (no network). */
export function catalog(): Promise<CatalogEntry[]> {
  return invoke("catalog");
}

/** Searches the hub by repo id (network). */
export function searchModels(query: string): Promise<CatalogEntry[]> {
  return invoke("search_models", { query });
}

/** One model's exact size and fit (network). */
export function modelDetails(repo: string): Promise<CatalogEntry> {
  return invoke("model_details", { repo });
}

export function listDownloads(): Promise<DownloadView[]> {
  return invoke("list_downloads");
}

/** Downloads or resumes `repo`, streaming progress; resolves with its library entry. */
export function downloadModel(repo: string, onProgress: Channel<DownloadView>): Promise<ModelEntry> {
  return invoke("download_model", { repo, onProgress });
}

export function pauseDownload(repo: string): Promise<boolean> {
  return invoke("pause_download", { repo });
}

export function cancelDownload(repo: string): Promise<void> {
  return invoke("cancel_download", { repo });
}

export function networkSettings(): Promise<NetworkSettings> {
  return invoke("network_settings");
}

export function setNetwork(enabled: boolean, endpoint: string): Promise<NetworkSettings> {
  return invoke("set_network", { enabled, endpoint });
}

/** Stores the Hugging Face token; null or empty forgets it. */
export function setHfToken(token: string | null): Promise<NetworkSettings> {
  return invoke("set_hf_token", { token });
}

/** The app's settings: the KV cache new chats start with, the memory limit. */
export function appSettings(): Promise<AppSettings> {
  return invoke("app_settings");
}

export function setAppSettings(settings: AppSettings): Promise<AppSettings> {
  return invoke("set_app_settings", { settings });
}

export function appInfo(): Promise<AppInfo> {
  return invoke("app_info");
}

/** The local server: whether it runs, its URL and key. */
export function localServer(): Promise<LocalServer> {
  return invoke("local_server");
}

/** Starts or stops the local server (loopback only). */
export function setLocalServer(enabled: boolean, port: number | null = null): Promise<LocalServer> {
  return invoke("set_local_server", { enabled, port });
}
