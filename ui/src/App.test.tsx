// @vitest-environment jsdom
// A smoke test of the whole UI over a fake backend (the Tauri IPC is mocked).
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { act, cleanup, configure, fireEvent, render, screen, waitFor, within } from "@testing-library/react";
import type {
  CatalogEntry,
  ConversationDetail,
  DownloadView,
  ModelEntry,
  ModelsState,
  NetworkSettings,
  StreamEvent,
  ThreadMessage,
} from "./ipc/bindings";
import { emptyView } from "./state/downloads";
import { detail as makeDetail, msg } from "./state/testdata";

type Handler = (args: unknown) => unknown;
const handlers = new Map<string, Handler>();

vi.mock("@tauri-apps/api/core", () => {
  class Channel<T> {
    onmessage: (m: T) => void = () => {};
  }
  return {
    Channel,
    convertFileSrc: (file: string, protocol: string) => `${protocol}://localhost/${file}`,
    invoke: async (cmd: string, args?: unknown) => {
      const h = handlers.get(cmd);
      if (!h) throw { kind: "internal", message: `no handler for ${cmd}` };
      return h(args);
    },
  };
});
vi.mock("@tauri-apps/plugin-dialog", () => ({ open: async () => null }));

const { App } = await import("./App");

// The waits usually pass in milliseconds; the default second was once too short on a busy
// 2-core runner.
configure({ asyncUtilTimeout: 5000 });

let conv: ConversationDetail;

beforeEach(() => {
  handlers.clear();
  conv = makeDetail(1, []);
  handlers.set("list_models", () => ({
    models: [
      { path: "demo", name: "Demo (untrained)", source: "demo", vision: false, bytes: 0, problem: null, drafter: false },
      { path: "/m/assistant", name: "assistant", source: "folder", vision: false, bytes: 9, problem: null, drafter: true },
    ],
    loaded: null,
    default_model: "demo",
  }));
  handlers.set("load_model", (a) => {
    const { onProgress } = a as { onProgress: { onmessage: (e: unknown) => void } };
    onProgress.onmessage({ kind: "progress", stage: "weights", done: 1, total: 2 });
    return { path: "demo", name: "Demo (untrained)", vision: false, max_context: 2048, kv_costs: { full: 2048, affine8: 1088, affine4: 576, turbo3: 400 }, thinking: false };
  });
  handlers.set("list_conversations", () => [
    { id: 1, title: conv.title, model_id: null, updated_at: 0 },
  ]);
  handlers.set("get_conversation", () => conv);
  handlers.set("send_message", async (a) => {
    const { text, onEvent } = a as { text: string; onEvent: { onmessage: (e: StreamEvent) => void } };
    const user = msg({ id: 10, role: "user", content: text });
    const reply = msg({ id: 11, parent_id: 10, role: "assistant", state: "streaming" });
    onEvent.onmessage({ kind: "started", user, reply });
    onEvent.onmessage({ kind: "text", text: "Hello " });
    onEvent.onmessage({ kind: "text", text: "**world**" });
    const final: ThreadMessage = {
      ...reply,
      state: "complete",
      content: "Hello **world**",
      stats: { stop_reason: "stop", prompt_tokens: 12, reused_tokens: 0, generated_tokens: 34, ttft_ms: 123, prefill_tok_s: 0, restore_ms: 0, decode_tok_s: 45.6, peak_mem_bytes: 0, kv_bytes: 0, kv_storage: "", spec: null },
    };
    onEvent.onmessage({ kind: "done", reply: final });
    conv = { ...conv, title: text, messages: [user, final] };
    return final;
  });
});

afterEach(() => cleanup());

describe("App", () => {
  it("reopens the most recent conversation at startup, even when the backend answers at once", async () => {
    // The answer to get_conversation arrives before React re-renders with the selected id;
    // the conversation must still be shown (a relaunch once showed an empty chat this way).
    const user = msg({ id: 10, role: "user", content: "Saved question" });
    const reply = msg({ id: 11, parent_id: 10, role: "assistant", content: "Saved answer" });
    conv = makeDetail(1, [user, reply]);
    render(<App />);
    await waitFor(() => expect(screen.getAllByTestId("message")).toHaveLength(2));
    expect(screen.getAllByTestId("message-content")[0].textContent).toBe("Saved question");
  });

  it("loads the default model and sends a message with a streamed reply", async () => {
    render(<App />);
    await waitFor(() => expect(screen.getByTestId("model-status").textContent).toBe("Demo (untrained)"));
    await waitFor(() => expect(screen.getByTestId("empty-state")).toBeTruthy());
    expect((screen.getByTestId("attach-button") as HTMLButtonElement).disabled).toBe(true);
    expect(screen.getByTestId("attach-button").getAttribute("title")).toBe("This model does not take images");

    const input = screen.getByTestId("composer-input");
    fireEvent.change(input, { target: { value: "Say hi" } });
    await act(async () => {
      fireEvent.keyDown(input, { key: "Enter" });
    });

    await waitFor(() => expect(screen.getAllByTestId("message")).toHaveLength(2));
    const [u, r] = screen.getAllByTestId("message");
    expect(u.getAttribute("data-role")).toBe("user");
    expect(within(u).getByTestId("message-content").textContent).toBe("Say hi");
    expect(r.getAttribute("data-state")).toBe("complete");
    expect(within(r).getByTestId("message-content").textContent).toBe("Hello world");
    expect(within(r).getByTestId("reply-stats").textContent).toBe(
      "TTFT 123 ms · 45.6 tok/s · 12 prompt + 34 generated tokens",
    );
    expect(screen.getByTestId("chat").getAttribute("data-streaming")).toBe("false");
    await waitFor(() => expect(screen.getByTestId("conversation-title").textContent).toBe("Say hi"));
  });

  it("lets another conversation send while one is still replying, says while it waits in line, and marks each that replies", async () => {
    const convs: Record<number, ConversationDetail> = { 1: makeDetail(1, []), 2: makeDetail(2, []) };
    convs[1] = { ...convs[1], title: "First" };
    convs[2] = { ...convs[2], title: "Second" };
    handlers.set("list_conversations", () =>
      [2, 1].map((id) => ({ id, title: convs[id].title, model_id: null, updated_at: id })),
    );
    handlers.set("get_conversation", (a) => convs[(a as { id: number }).id]);
    let finishFirst: () => void = () => {};
    let startSecond: () => void = () => {};
    handlers.set("send_message", async (a) => {
      const { conversationId, text, onEvent } = a as {
        conversationId: number;
        text: string;
        onEvent: { onmessage: (e: StreamEvent) => void };
      };
      const user = msg({ id: 10 * conversationId, role: "user", content: text });
      const reply = msg({ id: 10 * conversationId + 1, parent_id: user.id, role: "assistant", state: "streaming" });
      onEvent.onmessage({ kind: "started", user, reply });
      if (conversationId === 2) {
        // It waits in line for the first reply, then streams.
        onEvent.onmessage({ kind: "queued", reason: "it starts when the replies running now have finished" });
        await new Promise<void>((resolve) => (startSecond = resolve));
      }
      onEvent.onmessage({ kind: "text", text: `reply ${conversationId}` });
      if (conversationId === 1) await new Promise<void>((resolve) => (finishFirst = resolve));
      const final: ThreadMessage = { ...reply, state: "complete", content: `reply ${conversationId}` };
      convs[conversationId] = { ...convs[conversationId], messages: [user, final] };
      return final;
    });
    const sendText = async (text: string) => {
      const input = screen.getByTestId("composer-input");
      fireEvent.change(input, { target: { value: text } });
      await act(async () => {
        fireEvent.keyDown(input, { key: "Enter" });
      });
    };
    render(<App />);
    await waitFor(() => expect(screen.getByTestId("model-status").textContent).toBe("Demo (untrained)"));
    const item = (id: number) =>
      screen.getAllByTestId("conversation-item").find((e) => e.getAttribute("data-id") === String(id))!;
    await act(async () => {
      fireEvent.click(item(1));
    });
    await waitFor(() => expect(screen.getByTestId("chat").getAttribute("data-streaming")).toBe("false"));
    await sendText("Write a long story.");
    await waitFor(() => expect(screen.getByTestId("chat").getAttribute("data-streaming")).toBe("true"));
    expect(item(1).getAttribute("data-replying")).toBe("true");

    // The other conversation is free to send while the first still replies.
    await act(async () => {
      fireEvent.click(item(2));
    });
    await waitFor(() => expect(screen.getByTestId("chat").getAttribute("data-streaming")).toBe("false"));
    await sendText("A short question.");
    await waitFor(() => expect(screen.getByTestId("queued").textContent).toContain("another chat's reply"));
    expect(screen.getByTestId("chat").getAttribute("data-streaming")).toBe("true");
    await act(async () => startSecond());
    await waitFor(() => expect(screen.queryByTestId("queued")).toBeNull());
    await waitFor(() => expect(screen.getAllByTestId("message")).toHaveLength(2));
    expect(screen.getAllByTestId("message-content")[1].textContent).toBe("reply 2");
    expect(item(1).getAttribute("data-replying")).toBe("true");
    expect(item(2).getAttribute("data-replying")).toBeNull();

    // Back in the first, its reply is still streaming, then ends.
    await act(async () => {
      fireEvent.click(item(1));
    });
    await waitFor(() => expect(screen.getByTestId("chat").getAttribute("data-streaming")).toBe("true"));
    await act(async () => finishFirst());
    await waitFor(() => expect(screen.getByTestId("chat").getAttribute("data-streaming")).toBe("false"));
    expect(item(1).getAttribute("data-replying")).toBeNull();
  });

  it("shows command errors in a dismissible banner", async () => {
    handlers.set("send_message", () => {
      throw { kind: "prompt_too_long", message: "The prompt is too long for this model" };
    });
    render(<App />);
    await waitFor(() => expect(screen.getByTestId("model-status").textContent).toBe("Demo (untrained)"));
    const input = screen.getByTestId("composer-input");
    fireEvent.change(input, { target: { value: "x" } });
    await act(async () => {
      fireEvent.click(screen.getByTestId("send-button"));
    });
    const banner = await screen.findByTestId("error-banner");
    expect(banner.textContent).toContain("The prompt is too long for this model");
    fireEvent.click(within(banner).getByRole("button"));
    expect(screen.queryByTestId("error-banner")).toBeNull();
  });

  it("gives the message back to the composer when no model is chosen at all", async () => {
    handlers.set("list_models", () => ({ models: [], loaded: null, default_model: null }));
    handlers.set("send_message", () => {
      throw { kind: "model_missing", message: "No model is loaded. Pick one in the model library." };
    });
    render(<App />);
    await waitFor(() => expect(screen.getByTestId("model-status").textContent).toBe("No model"));
    const input = screen.getByTestId("composer-input") as HTMLTextAreaElement;
    fireEvent.change(input, { target: { value: "Hello, who are you?" } });
    await act(async () => {
      fireEvent.keyDown(input, { key: "Enter" });
    });
    const banner = await screen.findByTestId("error-banner");
    expect(banner.textContent).toContain("No model is loaded");
    expect((screen.getByTestId("composer-input") as HTMLTextAreaElement).value).toBe("Hello, who are you?");
    expect(screen.queryByTestId("message")).toBeNull();
  });

  it("shows a message sent during a load as waiting, keeps it when the load fails, and Retry answers it", async () => {
    let fail: (e: unknown) => void = () => {};
    const user = msg({ id: 10, role: "user", content: "Hello, who are you?" });
    handlers.set("send_message", (a) => {
      const { onEvent } = a as { onEvent: { onmessage: (e: StreamEvent) => void } };
      onEvent.onmessage({ kind: "waiting", user, model: "Demo (untrained)", stage: "Warming up", done: 2, total: 3 });
      conv = { ...conv, messages: [user] };
      return new Promise((_, reject) => (fail = reject));
    });
    render(<App />);
    await waitFor(() => expect(screen.getByTestId("model-status").textContent).toBe("Demo (untrained)"));
    const input = screen.getByTestId("composer-input");
    fireEvent.change(input, { target: { value: "Hello, who are you?" } });
    await act(async () => {
      fireEvent.keyDown(input, { key: "Enter" });
    });
    const row = await screen.findByTestId("waiting-for-model");
    expect(row.textContent).toBe("Waiting for Demo (untrained) to load… Warming up 67%");
    expect(screen.getAllByTestId("message")).toHaveLength(1);
    expect(screen.getByTestId("stop-button")).toBeTruthy();
    expect(screen.queryByTestId("retry-button")).toBeNull();

    await act(async () => {
      fail({ kind: "model_load", message: "Demo (untrained) did not load (bad weights). The message is kept: load a model, then press Retry." });
    });
    expect((await screen.findByTestId("error-banner")).textContent).toContain("did not load");
    await waitFor(() => expect(screen.queryByTestId("waiting-for-model")).toBeNull());
    expect(screen.getAllByTestId("message")).toHaveLength(1);
    expect((screen.getByTestId("composer-input") as HTMLTextAreaElement).value).toBe("");

    const answered: unknown[] = [];
    handlers.set("answer_message", (a) => {
      const { messageId, onEvent } = a as { messageId: number; onEvent: { onmessage: (e: StreamEvent) => void } };
      answered.push(messageId);
      const reply = msg({ id: 11, parent_id: 10, role: "assistant", content: "I am Quince.", state: "complete" });
      onEvent.onmessage({ kind: "started", user: null, reply: { ...reply, content: "", state: "streaming" } });
      conv = { ...conv, messages: [user, reply] };
      return reply;
    });
    await act(async () => {
      fireEvent.click(screen.getByTestId("retry-button"));
    });
    await waitFor(() => expect(screen.getAllByTestId("message")).toHaveLength(2));
    expect(answered).toEqual([10]);
    expect(screen.queryByTestId("unanswered")).toBeNull();
  });

  it("saves a conversation's speculative decoding choice with its settings", async () => {
    const saved: unknown[] = [];
    handlers.set("set_system_prompt", () => null);
    handlers.set("set_settings", (a) => {
      saved.push((a as { settings: unknown }).settings);
      return null;
    });
    render(<App />);
    await waitFor(() => expect(screen.getByTestId("model-status").textContent).toBe("Demo (untrained)"));
    for (const [choice, want] of [
      ["lookup", { method: "lookup" }],
      ["draft:demo", { method: "draft", model: "demo" }],
      ["assistant:/m/assistant", { method: "assistant", model: "/m/assistant" }],
      ["off", { method: "off" }],
    ] as const) {
      fireEvent.click(screen.getByTestId("settings-button"));
      const select = (await screen.findByTestId("speculation")) as HTMLSelectElement;
      // Chat models draft; the assistant drafter is offered as one, not as a draft model.
      expect(Array.from(select.options).map((o) => o.value)).toEqual(["off", "lookup", "draft:demo", "assistant:/m/assistant"]);
      fireEvent.change(select, { target: { value: choice } });
      await act(async () => {
        fireEvent.click(screen.getByTestId("settings-save"));
      });
      await waitFor(() => expect(screen.queryByTestId("settings-panel")).toBeNull());
      expect(saved.at(-1)).toMatchObject({ temperature: 0.7, speculation: want });
    }
  });
});

describe("Thinking", () => {
  it("folds a reply's thinking above its answer, and offers the switch for a model that thinks", async () => {
    handlers.set("load_model", () => ({
      path: "qwen", name: "Qwen", vision: false, max_context: 4096,
      kv_costs: { full: 2048, affine8: 1088, affine4: 576, turbo3: 400 }, thinking: true,
    }));
    handlers.set("send_message", async (a) => {
      const { text, onEvent } = a as { text: string; onEvent: { onmessage: (e: StreamEvent) => void } };
      const user = msg({ id: 10, role: "user", content: text });
      const reply = msg({ id: 11, parent_id: 10, role: "assistant", state: "streaming" });
      onEvent.onmessage({ kind: "started", user, reply });
      onEvent.onmessage({ kind: "text", text: "<think>\nTwo and two " });
      onEvent.onmessage({ kind: "text", text: "make four.\n</think>\n\nIt is **4**." });
      const final: ThreadMessage = { ...reply, state: "complete", content: "<think>\nTwo and two make four.\n</think>\n\nIt is **4**." };
      onEvent.onmessage({ kind: "done", reply: final });
      conv = { ...conv, title: text, messages: [user, final] };
      return final;
    });
    const saved: unknown[] = [];
    handlers.set("set_system_prompt", () => null);
    handlers.set("set_settings", (a) => {
      saved.push((a as { settings: unknown }).settings);
      return null;
    });
    render(<App />);
    await waitFor(() => expect(screen.getByTestId("model-status").textContent).toBe("Qwen"));
    const input = screen.getByTestId("composer-input") as HTMLTextAreaElement;
    fireEvent.change(input, { target: { value: "2+2?" } });
    await act(async () => {
      fireEvent.keyDown(input, { key: "Enter" });
    });
    const thinking = (await screen.findByTestId("thinking")) as HTMLDetailsElement;
    expect(thinking.open).toBe(false);
    expect(thinking.querySelector("summary")?.textContent).toBe("Thought");
    expect(thinking.textContent).toContain("Two and two make four.");
    const replies = screen.getAllByTestId("message-content");
    const answer = replies[replies.length - 1];
    expect(answer.querySelector("strong")?.textContent).toBe("4");
    expect(answer.textContent).not.toContain("</think>");

    fireEvent.click(screen.getByTestId("settings-button"));
    const box = (await screen.findByTestId("thinking-switch")) as HTMLInputElement;
    expect(box.checked).toBe(true);
    fireEvent.click(box);
    await act(async () => {
      fireEvent.click(screen.getByTestId("settings-save"));
    });
    await waitFor(() => expect(saved.at(-1)).toMatchObject({ thinking: false }));
  });
});

describe("KV cache settings", () => {
  it("saves a chat's KV cache and the app's defaults, each choice priced for the loaded model", async () => {
    const saved: unknown[] = [];
    const savedApp: unknown[] = [];
    let app = {
      default_kv: { format: { scheme: "full" }, quantized_start: 0, layers: "all" },
      memory_share: 0.9,
      recommended_memory: 25.3e9,
    };
    handlers.set("set_system_prompt", () => null);
    handlers.set("set_settings", (a) => {
      saved.push((a as { settings: unknown }).settings);
      return null;
    });
    handlers.set("app_settings", () => app);
    handlers.set("set_app_settings", (a) => {
      app = (a as { settings: typeof app }).settings;
      savedApp.push(app);
      return app;
    });
    render(<App />);
    await waitFor(() => expect(screen.getByTestId("model-status").textContent).toBe("Demo (untrained)"));
    fireEvent.click(screen.getByTestId("settings-button"));
    const select = (await screen.findByTestId("kv-cache")) as HTMLSelectElement;
    expect(Array.from(select.options).map((o) => o.textContent)).toEqual([
      "Full precision — 2.0 MB per 1,000 tokens",
      "8-bit — 1.1 MB per 1,000 tokens",
      "4-bit — 576 KB per 1,000 tokens",
      "TurboQuant 3-bit (long context) — 400 KB per 1,000 tokens",
    ]);
    expect((screen.getByTestId("kv-start") as HTMLInputElement).disabled).toBe(true);
    fireEvent.change(select, { target: { value: "affine4" } });
    expect(screen.getByTestId("kv-hint").textContent).toContain("a quarter");
    fireEvent.change(screen.getByTestId("kv-start"), { target: { value: "256" } });
    fireEvent.change(screen.getByTestId("default-kv-cache"), { target: { value: "turbo3" } });
    fireEvent.change(screen.getByTestId("memory-limit"), { target: { value: "75" } });
    expect(screen.getByTestId("app-settings").textContent).toContain("of the 25.3 GB MLX recommends");
    await act(async () => {
      fireEvent.click(screen.getByTestId("settings-save"));
    });
    await waitFor(() => expect(screen.queryByTestId("settings-panel")).toBeNull());
    expect(saved.at(-1)).toMatchObject({
      kv: { format: { scheme: "affine", bits: 4, group_size: 64 }, quantized_start: 256, layers: "all" },
    });
    expect(savedApp.at(-1)).toMatchObject({
      default_kv: { format: { scheme: "turbo", key_bits: 3, value_bits: 3 } },
      memory_share: 0.75,
    });
    // A start that is not a whole number is refused in the form.
    fireEvent.click(screen.getByTestId("settings-button"));
    fireEvent.change(await screen.findByTestId("kv-start"), { target: { value: "-3" } });
    await act(async () => {
      fireEvent.click(screen.getByTestId("settings-save"));
    });
    expect(screen.getByRole("alert").textContent).toContain("Quantize after");
  });

  it("gives the message back when its KV cache would not fit the memory limit", async () => {
    handlers.set("send_message", () => {
      throw { kind: "out_of_memory", message: "This reply could need 3.2 GB of KV cache (… tokens). Choose a smaller KV cache" };
    });
    render(<App />);
    await waitFor(() => expect(screen.getByTestId("model-status").textContent).toBe("Demo (untrained)"));
    const input = screen.getByTestId("composer-input") as HTMLTextAreaElement;
    fireEvent.change(input, { target: { value: "A very long story, please" } });
    await act(async () => {
      fireEvent.keyDown(input, { key: "Enter" });
    });
    const banner = await screen.findByTestId("error-banner");
    expect(banner.textContent).toContain("Choose a smaller KV cache");
    await waitFor(() => expect(input.value).toBe("A very long story, please"));
    expect(screen.queryAllByTestId("message")).toHaveLength(0);
  });
});

// ---- the model library's downloads ----

const MB = 1024 * 1024;
const GB = 1024 * MB;

function catalogEntry(p: Partial<CatalogEntry> & Pick<CatalogEntry, "repo" | "name">): CatalogEntry {
  return {
    description: "",
    recommended: true,
    drafter: false,
    vision: false,
    weight_bytes: 2 * GB,
    fit: { verdict: "fits", needed_bytes: 3 * GB, memory_bytes: 16 * GB, context_tokens: 8192 },
    local_path: null,
    download: null,
    ...p,
  };
}

const CATALOG: CatalogEntry[] = [
  catalogEntry({ repo: "mlx-community/small", name: "Small", description: "A small chat model", vision: true }),
  catalogEntry({
    repo: "mlx-community/big",
    name: "Big",
    weight_bytes: 14 * GB,
    fit: { verdict: "tight", needed_bytes: 15 * GB, memory_bytes: 16 * GB, context_tokens: 8192 },
  }),
  catalogEntry({
    repo: "mlx-community/huge",
    name: "Huge",
    weight_bytes: 60 * GB,
    fit: { verdict: "too_big", needed_bytes: 64 * GB, memory_bytes: 16 * GB, context_tokens: 8192 },
  }),
  catalogEntry({
    repo: "google/gemma-assistant",
    name: "Gemma assistant",
    drafter: true,
    weight_bytes: null,
    fit: { verdict: "unknown", needed_bytes: 0, memory_bytes: 16 * GB, context_tokens: 8192 },
    local_path: "/hf/models--google--gemma-assistant/snapshots/abc",
  }),
];

const NETWORK: NetworkSettings = {
  enabled: true,
  endpoint: "https://huggingface.co",
  has_token: false,
  token_store: "keychain",
  cache_dir: "/hf",
};

type ChannelLike = { onmessage: (v: DownloadView) => void };

function row(repo: string): HTMLElement {
  const el = document.querySelector<HTMLElement>(`[data-testid="catalog-item"][data-repo="${repo}"]`);
  if (!el) throw new Error(`no catalog row for ${repo}`);
  return el;
}

function downloading(repo: string, p: Partial<DownloadView>): DownloadView {
  return { ...emptyView(repo), state: "downloading", ...p };
}

async function openModels() {
  render(<App />);
  await waitFor(() => expect(screen.getByTestId("model-status").textContent).toBe("Demo (untrained)"));
  fireEvent.click(screen.getByTestId("models-button"));
  await waitFor(() => expect(screen.getAllByTestId("catalog-item").length).toBeGreaterThan(0));
}

describe("Model library downloads", () => {
  beforeEach(() => {
    handlers.set("catalog", () => CATALOG);
    handlers.set("list_downloads", () => []);
    handlers.set("network_settings", () => NETWORK);
    handlers.set("local_server", () => ({ running: false, url: null, api_key: "qk-1", port: 8741 }));
  });

  it("shows the recommended models with their size and fit", async () => {
    await openModels();
    expect(screen.getAllByTestId("catalog-item").map((r) => r.getAttribute("data-repo"))).toEqual(CATALOG.map((e) => e.repo));

    const small = row("mlx-community/small");
    expect(within(small).getByTestId("catalog-size").textContent).toBe("≈ 2.0 GB");
    const badge = within(small).getByTestId("fit-badge");
    expect(badge.getAttribute("data-fit")).toBe("fits");
    expect(badge.textContent).toBe("fits");
    expect(badge.getAttribute("title")).toBe("weights + KV cache at 8,192 tokens ≈ 3.0 GB of 16 GB memory");
    expect(within(small).getByTestId("download-button").textContent).toBe("Download");

    expect(within(row("mlx-community/big")).getByTestId("fit-badge").textContent).toBe("tight fit");
    expect(within(row("mlx-community/huge")).getByTestId("fit-badge").textContent).toBe("too big for this Mac");

    // Already in the cache: no download; a drafter says so; an unknown fit has no badge.
    const assistant = row("google/gemma-assistant");
    expect(within(assistant).queryByTestId("fit-badge")).toBeNull();
    expect(within(assistant).getByText("assistant drafter")).toBeTruthy();
    expect(within(assistant).getByText("downloaded")).toBeTruthy();
    expect(within(assistant).queryByTestId("download-button")).toBeNull();

    // The network settings: on, and where a token would be kept.
    expect((screen.getByTestId("network-enabled") as HTMLInputElement).checked).toBe(true);
    expect(screen.getByTestId("token-store").textContent).toContain("macOS Keychain");
  });

  it("turns the local server on and off and shows its URL and key", async () => {
    const calls: unknown[] = [];
    let running = false;
    const state = () => ({
      running,
      url: running ? "http://127.0.0.1:8741/v1" : null,
      api_key: "qk-0123456789abcdef",
      port: 8741,
    });
    handlers.set("local_server", state);
    handlers.set("set_local_server", (a) => {
      calls.push(a);
      running = (a as { enabled: boolean }).enabled;
      return state();
    });
    await openModels();
    const toggle = screen.getByTestId("local-server-enabled") as HTMLInputElement;
    await waitFor(() => expect(toggle.disabled).toBe(false));
    expect(toggle.checked).toBe(false);
    expect(screen.queryByTestId("local-server-url")).toBeNull();
    await act(async () => {
      fireEvent.click(toggle);
    });
    await waitFor(() => expect(screen.getByTestId("local-server-url").textContent).toBe("http://127.0.0.1:8741/v1"));
    expect(screen.getByTestId("local-server-key").textContent).toBe("qk-0123456789abcdef");
    await act(async () => {
      fireEvent.click(screen.getByTestId("local-server-enabled"));
    });
    await waitFor(() => expect(screen.queryByTestId("local-server-url")).toBeNull());
    expect(calls).toEqual([
      { enabled: true, port: 8741 },
      { enabled: false, port: 8741 },
    ]);
  });

  it("says why the local server did not start", async () => {
    handlers.set("local_server", () => ({ running: false, url: null, api_key: "qk-1", port: 8741 }));
    handlers.set("set_local_server", () => {
      throw { kind: "invalid", message: "cannot listen on 127.0.0.1:8741: address in use" };
    });
    await openModels();
    const toggle = screen.getByTestId("local-server-enabled") as HTMLInputElement;
    await waitFor(() => expect(toggle.disabled).toBe(false));
    await act(async () => {
      fireEvent.click(toggle);
    });
    await waitFor(() => expect(screen.getByTestId("local-server-error").textContent).toContain("address in use"));
    expect((screen.getByTestId("local-server-enabled") as HTMLInputElement).checked).toBe(false);
  });

  it("searches the hub and goes back to the recommended list", async () => {
    const queries: string[] = [];
    handlers.set("search_models", (a) => {
      queries.push((a as { query: string }).query);
      return [catalogEntry({ repo: "someone/gemma-mlx", name: "someone/gemma-mlx", recommended: false, weight_bytes: null })];
    });
    await openModels();
    const input = screen.getByTestId("library-search-input");
    expect(input.getAttribute("placeholder")).toBe("Search Hugging Face, e.g. mlx-community/gemma");
    fireEvent.change(input, { target: { value: " gemma " } });
    await act(async () => {
      fireEvent.click(screen.getByTestId("library-search-button"));
    });
    await waitFor(() => expect(screen.getAllByTestId("catalog-item")).toHaveLength(1));
    expect(queries).toEqual(["gemma"]);
    expect(row("someone/gemma-mlx")).toBeTruthy();
    fireEvent.click(screen.getByTestId("library-recommended"));
    expect(screen.getAllByTestId("catalog-item")).toHaveLength(CATALOG.length);
  });

  it("explains a search refused because networking is off", async () => {
    handlers.set("network_settings", () => ({ ...NETWORK, enabled: false }));
    handlers.set("search_models", () => {
      throw { kind: "offline", message: "offline" };
    });
    await openModels();
    fireEvent.change(screen.getByTestId("library-search-input"), { target: { value: "gemma" } });
    await act(async () => {
      fireEvent.click(screen.getByTestId("library-search-button"));
    });
    const err = await screen.findByTestId("library-error");
    expect(err.textContent).toContain("Networking is off");
    expect(screen.getByTestId("network-settings").hasAttribute("open")).toBe(true);

    const saved: unknown[] = [];
    handlers.set("set_network", (a) => {
      saved.push(a);
      return { ...NETWORK, enabled: true };
    });
    await act(async () => {
      fireEvent.click(screen.getByTestId("network-enabled"));
    });
    expect(saved).toEqual([{ enabled: true, endpoint: "https://huggingface.co" }]);
    await waitFor(() => expect((screen.getByTestId("network-enabled") as HTMLInputElement).checked).toBe(true));
  });

  it("streams a download's progress, then adds the model to the library", async () => {
    const repo = "mlx-community/small";
    const dl: { ch?: ChannelLike; finish?: (e: ModelEntry) => void } = {};
    handlers.set("download_model", (a) => {
      const args = a as { repo: string; onProgress: ChannelLike };
      expect(args.repo).toBe(repo);
      dl.ch = args.onProgress;
      return new Promise<ModelEntry>((resolve) => {
        dl.finish = resolve;
      });
    });
    const newModel: ModelEntry = {
      path: "/hf/models--mlx-community--small/snapshots/abc",
      name: "small",
      source: "hf_cache",
      vision: true,
      bytes: 40 * MB,
      problem: null,
      drafter: false,
    };
    const listModels = handlers.get("list_models") as () => ModelsState;
    let listCalls = 0;
    let done = false;
    handlers.set("list_models", () => {
      listCalls++;
      const st = listModels();
      return done ? { ...st, models: [...st.models, newModel] } : st;
    });

    await openModels();
    fireEvent.click(within(row(repo)).getByTestId("download-button"));
    await waitFor(() => expect(dl.ch).toBeDefined());
    expect(row(repo).getAttribute("data-state")).toBe("queued");

    act(() => dl.ch?.onmessage(downloading(repo, { done_bytes: 10 * MB, total_bytes: 40 * MB, rate: 5 * MB, eta_s: 6, files: 9, files_done: 1 })));
    const bar = within(row(repo)).getByTestId("download-progress");
    expect(bar.getAttribute("data-done")).toBe(String(10 * MB));
    expect(bar.getAttribute("data-total")).toBe(String(40 * MB));
    expect(row(repo).getAttribute("data-state")).toBe("downloading");
    expect(within(row(repo)).getByTestId("download-status").textContent).toBe("10 MB of 40 MB · 5.0 MB/s · 6 s left · file 2/9");
    expect(within(row(repo)).queryByTestId("download-button")).toBeNull();
    expect(within(row(repo)).getByTestId("pause-download")).toBeTruthy();
    expect(within(row(repo)).getByTestId("cancel-download")).toBeTruthy();

    // Closing the panel leaves the download running; reopening shows its progress.
    fireEvent.click(screen.getByRole("button", { name: "Close" }));
    expect(screen.queryByTestId("models-panel")).toBeNull();
    act(() => dl.ch?.onmessage(downloading(repo, { done_bytes: 30 * MB, total_bytes: 40 * MB, rate: 5 * MB, eta_s: 2, files: 9, files_done: 7 })));
    fireEvent.click(screen.getByTestId("models-button"));
    await waitFor(() => expect(screen.getAllByTestId("catalog-item").length).toBeGreaterThan(0));
    expect(within(row(repo)).getByTestId("download-progress").getAttribute("data-done")).toBe(String(30 * MB));

    const before = listCalls;
    done = true;
    await act(async () => {
      dl.finish?.(newModel);
    });
    await waitFor(() =>
      expect(document.querySelector(`[data-testid="model-item"][data-path="${newModel.path}"]`)).not.toBeNull(),
    );
    expect(listCalls).toBeGreaterThan(before);
    expect(row(repo).getAttribute("data-state")).toBe("done");
    expect(within(row(repo)).getByText("downloaded")).toBeTruthy();
    expect(within(row(repo)).queryByTestId("download-progress")).toBeNull();
    expect(within(row(repo)).queryByTestId("download-button")).toBeNull();
    // A late progress event does not take the finished download back.
    act(() => dl.ch?.onmessage(downloading(repo, { done_bytes: 39 * MB, total_bytes: 40 * MB })));
    expect(row(repo).getAttribute("data-state")).toBe("done");
  });

  it("pauses a download and offers to resume it", async () => {
    const repo = "mlx-community/big";
    const dl: { ch?: ChannelLike; reject?: (e: unknown) => void } = {};
    handlers.set("download_model", (a) => {
      dl.ch = (a as { onProgress: ChannelLike }).onProgress;
      return new Promise((_, reject) => {
        dl.reject = reject;
      });
    });
    const paused: unknown[] = [];
    handlers.set("pause_download", (a) => {
      paused.push(a);
      dl.reject?.({ kind: "cancelled", message: "Paused" });
      return true;
    });
    await openModels();
    fireEvent.click(within(row(repo)).getByTestId("download-button"));
    await waitFor(() => expect(dl.ch).toBeDefined());
    act(() => dl.ch?.onmessage(downloading(repo, { done_bytes: 2 * GB, total_bytes: 14 * GB })));
    await act(async () => {
      fireEvent.click(within(row(repo)).getByTestId("pause-download"));
    });
    expect(paused).toEqual([{ repo }]);
    await waitFor(() => expect(row(repo).getAttribute("data-state")).toBe("paused"));
    expect(within(row(repo)).getByTestId("download-button").textContent).toBe("Resume");
    expect(within(row(repo)).getByTestId("download-status").textContent).toBe("Paused · 2.0 GB of 14 GB");
    expect(screen.queryByTestId("library-error")).toBeNull();
  });

  it("asks for a token when the hub refuses, then retries", async () => {
    const repo = "mlx-community/small";
    let attempts = 0;
    handlers.set("download_model", () => {
      attempts++;
      if (attempts === 1) throw { kind: "unauthorized", message: "This model is gated: a Hugging Face token is needed" };
      return new Promise(() => {});
    });
    const tokens: unknown[] = [];
    handlers.set("set_hf_token", (a) => {
      tokens.push((a as { token: string | null }).token);
      return { ...NETWORK, has_token: true };
    });
    await openModels();
    await act(async () => {
      fireEvent.click(within(row(repo)).getByTestId("download-button"));
    });
    await waitFor(() => expect(row(repo).getAttribute("data-state")).toBe("failed"));
    expect(within(row(repo)).getByTestId("download-error").textContent).toBe(
      "This model is gated: a Hugging Face token is needed",
    );
    const field = within(row(repo)).getByTestId("hf-token-input") as HTMLInputElement;
    expect(field.type).toBe("password");
    fireEvent.change(field, { target: { value: "hf_secret" } });
    await act(async () => {
      fireEvent.click(within(row(repo)).getByText("Save token"));
    });
    expect(tokens).toEqual(["hf_secret"]);
    await waitFor(() => expect(attempts).toBe(2));
    await waitFor(() => expect(row(repo).getAttribute("data-state")).toBe("queued"));
    expect(within(row(repo)).queryByTestId("hf-token-input")).toBeNull();
    // The network settings now know a token is saved.
    expect(screen.getByTestId("network-token-forget")).toBeTruthy();
  });
});
