import { describe, expect, it } from "vitest";
import {
  actionFromEvent,
  chatReducer,
  initialChatState,
  isStreamingHere,
  streamingConversations,
  type ChatState,
} from "./stream";
import { detail, msg } from "./testdata";

function loaded(d = detail(1)): ChatState {
  return chatReducer(initialChatState, { type: "loaded", detail: d });
}

const user = msg({ id: 10, role: "user", content: "hi" });
const placeholder = msg({ id: 11, parent_id: 10, role: "assistant", content: "", state: "streaming" });

function started(s: ChatState = loaded()): ChatState {
  s = chatReducer(s, { type: "sending", conversationId: 1 });
  return chatReducer(s, { type: "started", conversationId: 1, user, reply: placeholder });
}

describe("chatReducer", () => {
  it("loaded replaces the detail", () => {
    const s = loaded(detail(3, [user]));
    expect(s.detail?.id).toBe(3);
    expect(s.detail?.messages).toHaveLength(1);
  });

  it("sending marks a reply in flight before started arrives", () => {
    const s = chatReducer(loaded(), { type: "sending", conversationId: 1 });
    expect(s.inFlight[1]).toEqual({ conversationId: 1, replyId: null, waiting: null, userStored: false, queued: null });
    expect(isStreamingHere(s)).toBe(true);
  });

  it("waiting shows the stored user message and the load's progress until started", () => {
    let s = chatReducer(loaded(), { type: "sending", conversationId: 1 });
    const progress = { model: "Demo", stage: "Warming up", done: 2, total: 3 };
    s = chatReducer(s, actionFromEvent(1, { kind: "waiting", user, ...progress }));
    expect(s.detail?.messages.map((m) => m.id)).toEqual([10]);
    expect(s.inFlight[1]).toEqual({ conversationId: 1, replyId: null, waiting: progress, userStored: true, queued: null });
    // Later stages repeat the user message: it is shown once.
    s = chatReducer(s, { type: "waiting", conversationId: 1, user, waiting: { ...progress, done: 3 } });
    expect(s.detail?.messages.map((m) => m.id)).toEqual([10]);
    expect(s.inFlight[1]?.waiting?.done).toBe(3);
    s = chatReducer(s, { type: "started", conversationId: 1, user, reply: placeholder });
    expect(s.detail?.messages.map((m) => m.id)).toEqual([10, 11]);
    expect(s.inFlight[1]).toEqual({ conversationId: 1, replyId: 11, waiting: null, userStored: true, queued: null });
  });

  it("a failed wait keeps the stored user message and clears the reply in flight", () => {
    let s = chatReducer(loaded(), { type: "sending", conversationId: 1 });
    s = chatReducer(s, { type: "waiting", conversationId: 1, user, waiting: { model: "M", stage: "", done: 0, total: 3 } });
    s = chatReducer(s, { type: "failed", conversationId: 1, message: "M did not load", reply: null });
    expect(s.detail?.messages.map((m) => m.id)).toEqual([10]);
    expect(s.inFlight).toEqual({});
    expect(s.error).toBe("M did not load");
  });

  it("started inserts the user message and the reply placeholder", () => {
    const s = started();
    expect(s.detail?.messages.map((m) => m.id)).toEqual([10, 11]);
    expect(s.detail?.messages[1].state).toBe("streaming");
    expect(s.inFlight[1]).toEqual({ conversationId: 1, replyId: 11, waiting: null, userStored: true, queued: null });
  });

  it("started with a null user (regenerate) branches off the reply's parent", () => {
    const old = msg({ id: 11, parent_id: 10, role: "assistant", content: "old" });
    const s0 = loaded(detail(1, [user, old]));
    const fresh = msg({ id: 12, parent_id: 10, role: "assistant", state: "streaming" });
    const s = chatReducer(s0, { type: "started", conversationId: 1, user: null, reply: fresh });
    expect(s.detail?.messages.map((m) => m.id)).toEqual([10, 12]);
  });

  it("started for an edit replaces the tail from the edited message on", () => {
    const a = msg({ id: 1, role: "user", content: "a" });
    const b = msg({ id: 2, parent_id: 1, role: "assistant", content: "b" });
    const c = msg({ id: 3, parent_id: 2, role: "user", content: "c" });
    const d = msg({ id: 4, parent_id: 3, role: "assistant", content: "d" });
    const s0 = loaded(detail(1, [a, b, c, d]));
    const edited = msg({ id: 5, parent_id: 2, role: "user", content: "c2" });
    const reply = msg({ id: 6, parent_id: 5, role: "assistant", state: "streaming" });
    const s = chatReducer(s0, { type: "started", conversationId: 1, user: edited, reply });
    expect(s.detail?.messages.map((m) => m.id)).toEqual([1, 2, 5, 6]);
  });

  it("text accumulates in order into the placeholder", () => {
    let s = started();
    for (const t of ["Hel", "lo", ", ", "world"]) {
      s = chatReducer(s, { type: "text", conversationId: 1, text: t });
    }
    expect(s.detail?.messages[1].content).toBe("Hello, world");
    expect(s.detail?.messages[0].content).toBe("hi");
  });

  it("done replaces the placeholder with the final reply and ends the stream", () => {
    let s = started();
    s = chatReducer(s, { type: "text", conversationId: 1, text: "partial" });
    const final = msg({
      id: 11,
      parent_id: 10,
      role: "assistant",
      content: "final text",
      stats: {
        stop_reason: "stop",
        prompt_tokens: 3,
        reused_tokens: 0,
        generated_tokens: 2,
        ttft_ms: 10,
        prefill_tok_s: 0,
        restore_ms: 0,
        decode_tok_s: 50,
        peak_mem_bytes: 0,
        kv_bytes: 0,
        kv_storage: "",
        spec: null,
      },
    });
    s = chatReducer(s, { type: "done", conversationId: 1, reply: final });
    expect(s.detail?.messages[1]).toEqual(final);
    expect(s.inFlight).toEqual({});
    expect(isStreamingHere(s)).toBe(false);
  });

  it("failed keeps the partial text and sets the error", () => {
    let s = started();
    s = chatReducer(s, { type: "text", conversationId: 1, text: "half an ans" });
    s = chatReducer(s, { type: "failed", conversationId: 1, message: "out of memory", reply: null });
    const r = s.detail!.messages[1];
    expect(r.content).toBe("half an ans");
    expect(r.state).toBe("error");
    expect(r.error).toBe("out of memory");
    expect(s.error).toBe("out of memory");
    expect(s.inFlight).toEqual({});
  });

  it("failed with a stored reply takes its error state", () => {
    let s = started();
    s = chatReducer(s, { type: "text", conversationId: 1, text: "abc" });
    const stored = msg({ id: 11, parent_id: 10, role: "assistant", content: "abc", state: "error", error: "boom" });
    s = chatReducer(s, { type: "failed", conversationId: 1, message: "boom", reply: stored });
    expect(s.detail!.messages[1]).toMatchObject({ content: "abc", state: "error", error: "boom" });
  });

  it("failed before started clears the in-flight marker", () => {
    let s = chatReducer(loaded(), { type: "sending", conversationId: 1 });
    s = chatReducer(s, { type: "failed", conversationId: 1, message: "busy", reply: null });
    expect(s.inFlight).toEqual({});
    expect(s.error).toBe("busy");
    expect(s.detail?.messages).toEqual([]);
  });

  it("stopped marks the reply stopped and ends the stream", () => {
    let s = started();
    s = chatReducer(s, { type: "text", conversationId: 1, text: "so far" });
    s = chatReducer(s, { type: "stopped", conversationId: 1 });
    expect(s.detail!.messages[1]).toMatchObject({ content: "so far", state: "stopped" });
    expect(s.inFlight).toEqual({});
  });

  it("events for another conversation are ignored", () => {
    const s0 = started();
    const other = 2;
    let s = chatReducer(s0, { type: "text", conversationId: other, text: "nope" });
    s = chatReducer(s, {
      type: "started",
      conversationId: other,
      user: msg({ id: 50 }),
      reply: msg({ id: 51, parent_id: 50, role: "assistant" }),
    });
    s = chatReducer(s, { type: "done", conversationId: other, reply: msg({ id: 11, content: "x" }) });
    s = chatReducer(s, { type: "failed", conversationId: other, message: "x", reply: null });
    s = chatReducer(s, { type: "stopped", conversationId: other });
    expect(s).toEqual(s0);
  });

  it("a stream into a conversation no longer shown does not touch the one shown", () => {
    let s = started();
    s = chatReducer(s, { type: "loaded", detail: detail(2, [msg({ id: 99, content: "other" })]) });
    expect(isStreamingHere(s)).toBe(false);
    const shown = s.detail;
    s = chatReducer(s, { type: "text", conversationId: 1, text: "more" });
    expect(s.detail).toBe(shown);
    s = chatReducer(s, { type: "done", conversationId: 1, reply: msg({ id: 11, role: "assistant" }) });
    expect(s.detail).toBe(shown);
    expect(s.inFlight).toEqual({});
  });

  it("replies in two conversations are in flight at once, each ending on its own", () => {
    let s = started();
    s = chatReducer(s, { type: "sending", conversationId: 2 });
    s = chatReducer(s, {
      type: "started",
      conversationId: 2,
      user: msg({ id: 50 }),
      reply: msg({ id: 51, parent_id: 50, role: "assistant" }),
    });
    expect(streamingConversations(s).sort()).toEqual([1, 2]);
    expect(s.inFlight[2]).toEqual({ conversationId: 2, replyId: 51, waiting: null, userStored: true, queued: null });
    // The one shown streams into its detail; the other's text is not its business.
    s = chatReducer(s, { type: "text", conversationId: 1, text: "one" });
    s = chatReducer(s, { type: "text", conversationId: 2, text: "two" });
    expect(s.detail!.messages[1].content).toBe("one");
    s = chatReducer(s, { type: "done", conversationId: 2, reply: msg({ id: 51, role: "assistant", content: "two" }) });
    expect(streamingConversations(s)).toEqual([1]);
    expect(isStreamingHere(s)).toBe(true);
    s = chatReducer(s, { type: "stopped", conversationId: 1 });
    expect(s.inFlight).toEqual({});
    expect(s.detail!.messages[1]).toMatchObject({ content: "one", state: "stopped" });
  });

  it("queued marks a reply waiting in line until its first text, also one not shown", () => {
    let s = started();
    s = chatReducer(s, actionFromEvent(1, { kind: "queued", reason: "it waits" }));
    expect(s.inFlight[1].queued).toBe("it waits");
    expect(isStreamingHere(s)).toBe(true);
    s = chatReducer(s, { type: "text", conversationId: 1, text: "at last" });
    expect(s.inFlight[1].queued).toBeNull();
    expect(s.detail!.messages[1].content).toBe("at last");
    // A conversation not shown: its marker changes, the detail shown does not.
    s = chatReducer(s, { type: "sending", conversationId: 2 });
    s = chatReducer(s, { type: "queued", conversationId: 2, reason: "behind 1" });
    const shown = s.detail;
    s = chatReducer(s, { type: "text", conversationId: 2, text: "x" });
    expect(s.inFlight[2].queued).toBeNull();
    expect(s.detail).toBe(shown);
    // Stopped while it waits: it leaves the in-flight replies.
    s = chatReducer(s, { type: "queued", conversationId: 1, reason: "again" });
    s = chatReducer(s, { type: "done", conversationId: 1, reply: msg({ id: 11, role: "assistant", state: "stopped" }) });
    expect(s.inFlight[1]).toBeUndefined();
  });

  it("actionFromEvent maps every channel event", () => {
    expect(actionFromEvent(4, { kind: "queued", reason: "r" })).toEqual({
      type: "queued",
      conversationId: 4,
      reason: "r",
    });
    expect(actionFromEvent(4, { kind: "text", text: "a" })).toEqual({ type: "text", conversationId: 4, text: "a" });
    expect(actionFromEvent(4, { kind: "started", user: null, reply: placeholder })).toMatchObject({
      type: "started",
      user: null,
    });
    expect(actionFromEvent(4, { kind: "done", reply: placeholder }).type).toBe("done");
    expect(actionFromEvent(4, { kind: "failed", message: "m", reply: null })).toMatchObject({
      type: "failed",
      message: "m",
    });
  });
});
