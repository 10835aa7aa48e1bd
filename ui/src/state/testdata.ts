// Builders shared by the unit tests.
import type { ConversationDetail, ThreadMessage } from "../ipc/bindings";

export function msg(p: Partial<ThreadMessage> & Pick<ThreadMessage, "id">): ThreadMessage {
  return {
    parent_id: null,
    role: "user",
    content: "",
    state: "complete",
    stats: null,
    error: null,
    attachments: [],
    branch: { index: 0, count: 1, siblings: [p.id] },
    created_at: 0,
    ...p,
  };
}

export function detail(id: number, messages: ThreadMessage[] = []): ConversationDetail {
  return {
    id,
    title: "New chat",
    model_id: null,
    system_prompt: "",
    settings: { temperature: 0.7, top_p: 0.9, top_k: 40, max_tokens: 512, seed: 0, max_soft_tokens: 280, speculation: { method: "off" }, kv: { format: { scheme: "full" }, quantized_start: 0, layers: "all" }, thinking: true },
    messages,
  };
}
