// Generated from the Rust types in crates/chat/src/view.rs by
// `cargo test -p chat --test bindings` with UPDATE_BINDINGS=1. Do not edit.

export type Role = "system" | "user" | "assistant";

export type MessageState = "complete" | "streaming" | "stopped" | "error";

export type StopReason = "stop" | "length" | "stopped";

export type TurnStats = { 
/**
 * Why the reply ended.
 */
stop_reason: StopReason, 
/**
 * Tokens in the prompt, images included.
 */
prompt_tokens: number, 
/**
 * Prompt tokens restored from a checkpoint (the rest were prefilled).
 */
reused_tokens: number, 
/**
 * Tokens generated.
 */
generated_tokens: number, 
/**
 * From the start of the turn (images, template, checkpoint, prefill) to the first token,
 * in ms.
 */
ttft_ms: number, 
/**
 * Prefill speed over the tokens actually prefilled, tokens per second.
 */
prefill_tok_s: number, 
/**
 * Decode speed after the first token, tokens per second.
 */
decode_tok_s: number, 
/**
 * Time spent finding, verifying and restoring the checkpoint, in ms (part of the TTFT).
 */
restore_ms: number, 
/**
 * MLX's peak memory during the turn, in bytes.
 */
peak_mem_bytes: number, 
/**
 * Bytes the KV cache held at the end of the reply.
 */
kv_bytes: number, 
/**
 * The KV cache's storage, layer by layer (`;`-joined signatures, as checkpoints record
 * it).
 */
kv_storage: string, 
/**
 * Speculative decoding's counts, when it ran.
 */
spec: SpecStats | null, };

export type SpecStats = { 
/**
 * The method's name (`lookup`, `draft`, `assistant`).
 */
method: string, 
/**
 * Verify rounds run (steps with no proposal are plain decode steps, not rounds).
 */
rounds: number, 
/**
 * Draft tokens proposed.
 */
proposed: number, 
/**
 * Draft tokens accepted.
 */
accepted: number, 
/**
 * Conversation tokens the method computed before its first round (a draft model's
 * prefill of what its caches did not hold).
 */
context_computed: number, };

export type Speculation = { "method": "off" } | { "method": "lookup" } | { "method": "draft", 
/**
 * The draft model's folder.
 */
model: string, } | { "method": "assistant", 
/**
 * The drafter's folder.
 */
model: string, };

export type KvFormat = { "scheme": "full" } | { "scheme": "affine", 
/**
 * 4 or 8.
 */
bits: number, 
/**
 * 32, 64 or 128 (dividing the head dimension).
 */
group_size: number, } | { "scheme": "turbo", 
/**
 * Bits per key coordinate, 2 to 4.
 */
key_bits: number, 
/**
 * Bits per value coordinate, 2 to 4.
 */
value_bits: number, };

export type KvLayers = "all" | "full";

export type KvOptions = { 
/**
 * How keys and values are stored.
 */
format: KvFormat, 
/**
 * Positions kept in full precision before the conversion (mlx-lm's `quantized_kv_start`).
 */
quantized_start: number, 
/**
 * The layers it applies to.
 */
layers: KvLayers, };

export type KvCosts = { 
/**
 * Full precision.
 */
full: number, 
/**
 * Affine 8-bit.
 */
affine8: number, 
/**
 * Affine 4-bit.
 */
affine4: number, 
/**
 * TurboQuant 3-bit.
 */
turbo3: number, };

export type AppSettings = { 
/**
 * The KV cache new chats start with.
 */
default_kv: KvOptions, 
/**
 * The share of the memory MLX recommends for this device that the model and a reply's
 * KV cache may fill; a reply that would need more is refused before it starts.
 */
memory_share: number, 
/**
 * That memory, in bytes (0 where MLX reports none).
 */
recommended_memory: number, };

export type AttachmentView = { 
/**
 * File name inside the app's attachment folder (served as `quince-attachment://`).
 */
file: string, 
/**
 * MIME type.
 */
mime: string, 
/**
 * Size in bytes.
 */
bytes: number, };

export type PendingAttachment = { 
/**
 * File name inside the attachment folder (content-addressed: `<sha256>.<ext>`).
 */
file: string, 
/**
 * MIME type.
 */
mime: string, 
/**
 * Size in bytes.
 */
bytes: number, 
/**
 * Pixel width.
 */
width: number, 
/**
 * Pixel height.
 */
height: number, 
/**
 * The name the user's file had.
 */
name: string, };

export type BranchInfo = { 
/**
 * Its index among the siblings, from 0.
 */
index: number, 
/**
 * How many siblings there are (itself included).
 */
count: number, 
/**
 * The siblings' ids in creation order.
 */
siblings: Array<number>, };

export type ThreadMessage = { 
/**
 * Row id.
 */
id: number, 
/**
 * The message it follows.
 */
parent_id: number | null, 
/**
 * Who wrote it.
 */
role: Role, 
/**
 * Its text.
 */
content: string, 
/**
 * Complete, streaming, stopped or error.
 */
state: MessageState, 
/**
 * Statistics of a finished reply.
 */
stats: TurnStats | null, 
/**
 * Why a reply failed.
 */
error: string | null, 
/**
 * Its images.
 */
attachments: Array<AttachmentView>, 
/**
 * Its siblings.
 */
branch: BranchInfo, 
/**
 * Unix ms.
 */
created_at: number, };

export type Settings = { 
/**
 * 0 is greedy.
 */
temperature: number, 
/**
 * Nucleus sampling mass (1 disables it).
 */
top_p: number, 
/**
 * Keep the k most likely tokens (0 disables it).
 */
top_k: number, 
/**
 * Most tokens per reply.
 */
max_tokens: number, 
/**
 * Seed of the sampler.
 */
seed: number, 
/**
 * Soft tokens per image (Gemma 4: 70, 140, 280, 560 or 1120).
 */
max_soft_tokens: number, 
/**
 * Speculative decoding.
 */
speculation: Speculation, 
/**
 * How the KV cache is stored (and from which token it is quantized).
 */
kv: KvOptions, 
/**
 * Let a model that can think first do so (its template's `enable_thinking`).
 */
thinking: boolean, };

export type ConversationSummary = { 
/**
 * Row id.
 */
id: number, 
/**
 * Its title.
 */
title: string, 
/**
 * The model it last talked to.
 */
model_id: string | null, 
/**
 * Unix ms of the last change.
 */
updated_at: number, };

export type ConversationDetail = { 
/**
 * Row id.
 */
id: number, 
/**
 * Its title.
 */
title: string, 
/**
 * The model it last talked to.
 */
model_id: string | null, 
/**
 * Its system prompt ("" for none).
 */
system_prompt: string, 
/**
 * Its sampling settings.
 */
settings: Settings, 
/**
 * The current branch, first message first.
 */
messages: Array<ThreadMessage>, };

export type StreamEvent = { "kind": "waiting", 
/**
 * The user message just stored (absent when regenerating or answering).
 */
user: ThreadMessage | null, 
/**
 * The model being loaded.
 */
model: string, 
/**
 * The load's current stage, in words.
 */
stage: string, 
/**
 * Stages done.
 */
done: number, 
/**
 * Stages in all.
 */
total: number, } | { "kind": "started", 
/**
 * The user message just stored.
 */
user: ThreadMessage | null, 
/**
 * The reply being written.
 */
reply: ThreadMessage, } | { "kind": "queued", 
/**
 * Why it waits, in words.
 */
reason: string, } | { "kind": "text", 
/**
 * The piece to append.
 */
text: string, } | { "kind": "done", 
/**
 * The stored reply.
 */
reply: ThreadMessage, } | { "kind": "failed", 
/**
 * Readable message.
 */
message: string, 
/**
 * The stored reply, when it got that far.
 */
reply: ThreadMessage | null, };

export type ModelSource = "demo" | "folder" | "hf_cache";

export type ModelEntry = { 
/**
 * The model folder (its id).
 */
path: string, 
/**
 * Display name.
 */
name: string, 
/**
 * Where it comes from.
 */
source: ModelSource, 
/**
 * Whether it takes images.
 */
vision: boolean, 
/**
 * Size of its weights.
 */
bytes: number, 
/**
 * Why it cannot be loaded, if it cannot.
 */
problem: string | null, 
/**
 * A drafter made for one model (a Gemma 4 assistant, a Qwen3.5 MTP head): chosen for
 * speculative decoding in a chat's settings, never loaded to chat with.
 */
drafter: boolean, };

export type LoadedModel = { 
/**
 * Its folder.
 */
path: string, 
/**
 * Display name.
 */
name: string, 
/**
 * Whether it takes images.
 */
vision: boolean, 
/**
 * Its context length in tokens.
 */
max_context: number, 
/**
 * What its KV cache takes per token under each choice the settings offer.
 */
kv_costs: KvCosts, 
/**
 * Whether its chat template turns thinking on and off (the settings offer the switch).
 */
thinking: boolean, };

export type ModelsState = { 
/**
 * Every model found.
 */
models: Array<ModelEntry>, 
/**
 * The model in the engine.
 */
loaded: LoadedModel | null, 
/**
 * What to load when nothing is: the last model used, else the demo model.
 */
default_model: string | null, };

export type LoadEvent = { "kind": "progress", 
/**
 * What is happening, in words.
 */
stage: string, 
/**
 * Stages done.
 */
done: number, 
/**
 * Stages in all.
 */
total: number, } | { "kind": "done", 
/**
 * The loaded model.
 */
model: LoadedModel, };

export type ErrorKind = "model_missing" | "model_load" | "prompt_too_long" | "out_of_memory" | "bad_image" | "busy" | "not_found" | "invalid" | "cancelled" | "offline" | "network" | "unauthorized" | "disk_full" | "internal";

export type FitVerdict = "fits" | "tight" | "too_big" | "unknown";

export type Fit = { 
/**
 * The verdict.
 */
verdict: FitVerdict, 
/**
 * Weights plus KV cache at `context_tokens`.
 */
needed_bytes: number, 
/**
 * This machine's memory.
 */
memory_bytes: number, 
/**
 * The context the KV estimate is for.
 */
context_tokens: number, };

export type DownloadState = "queued" | "downloading" | "paused" | "failed" | "done";

export type DownloadView = { 
/**
 * `org/name`.
 */
repo: string, 
/**
 * Branch, tag or commit.
 */
revision: string, 
/**
 * Its state.
 */
state: DownloadState, 
/**
 * Bytes on disk.
 */
done_bytes: number, 
/**
 * Bytes of all files (0 until known).
 */
total_bytes: number, 
/**
 * The file being transferred.
 */
file: string, 
/**
 * Its bytes on disk.
 */
file_done: number, 
/**
 * Its size.
 */
file_size: number, 
/**
 * Files complete.
 */
files_done: number, 
/**
 * Files in all.
 */
files: number, 
/**
 * Bytes per second.
 */
rate: number, 
/**
 * Seconds left.
 */
eta_s: number | null, 
/**
 * Why it failed.
 */
error: string | null, 
/**
 * The kind of that failure (`unauthorized`: ask for a token).
 */
error_kind: ErrorKind | null, 
/**
 * The snapshot folder once done.
 */
path: string | null, };

export type CatalogEntry = { 
/**
 * `org/name`.
 */
repo: string, 
/**
 * Display name.
 */
name: string, 
/**
 * One line about it.
 */
description: string, 
/**
 * In the recommended list.
 */
recommended: boolean, 
/**
 * A drafter made for one model (for speculative decoding).
 */
drafter: boolean, 
/**
 * Takes images.
 */
vision: boolean, 
/**
 * Bytes of its weights: exact once its files were listed, else the catalog's estimate.
 */
weight_bytes: number | null, 
/**
 * Whether it fits this machine.
 */
fit: Fit, 
/**
 * Its snapshot folder when it is in the Hugging Face cache already.
 */
local_path: string | null, 
/**
 * Its download, when one was started.
 */
download: DownloadView | null, };

export type NetworkSettings = { 
/**
 * Search and downloads may use the network (only when the user starts one).
 */
enabled: boolean, 
/**
 * The hub (`HF_ENDPOINT` convention; default `https://huggingface.co`).
 */
endpoint: string, 
/**
 * A Hugging Face token is stored.
 */
has_token: boolean, 
/**
 * Where tokens are kept: `keychain` or `file` (0600, in the app's data folder).
 */
token_store: string, 
/**
 * The Hugging Face cache downloads go to.
 */
cache_dir: string | null, };

export type CommandError = { 
/**
 * The kind of failure.
 */
kind: ErrorKind, 
/**
 * A readable message.
 */
message: string, };

export type AppInfo = { 
/**
 * App version.
 */
version: string, 
/**
 * Where conversations and attachments live.
 */
data_dir: string, 
/**
 * Where the logs are.
 */
log_dir: string, 
/**
 * The MLX device.
 */
device: string, };

export type LocalServer = { 
/**
 * Whether it is serving.
 */
running: boolean, 
/**
 * Its base URL while it runs (`http://127.0.0.1:8741/v1`).
 */
url: string | null, 
/**
 * The key clients send (`Authorization: Bearer KEY`), kept across launches.
 */
api_key: string, 
/**
 * The port it listens on, or would.
 */
port: number, };
