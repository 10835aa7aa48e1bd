// The chat view's state: the conversation shown (detail) plus the reply that
// is streaming into it. Pure; the components only dispatch.
import type { ConversationDetail, StreamEvent, ThreadMessage } from "../ipc/bindings";

/** A reply that waits for its model to finish loading. */
export type Waiting = { model: string; stage: string; done: number; total: number };

export type InFlight = {
  conversationId: number;
  /** The placeholder reply's id, known once `started` arrives. */
  replyId: number | null;
  /** Set while the reply waits for the model (`waiting` events), until `started`. */
  waiting: Waiting | null;
  /** Whether the user message is stored (a `waiting` or `started` event carried it). */
  userStored: boolean;
  /**
   * Set while the reply waits in line for replies of other conversations to finish
   * (`queued`), until its first text: why, in words.
   */
  queued: string | null;
};

export type ChatState = {
  detail: ConversationDetail | null;
  /**
   * The replies in flight, one per conversation at most, by conversation id: several
   * conversations stream at once (the engine decodes their replies together).
   */
  inFlight: Record<number, InFlight>;
  /** The last stream failure's message (for the error banner). */
  error: string | null;
};

export type ChatAction =
  | { type: "loaded"; detail: ConversationDetail | null }
  | { type: "sending"; conversationId: number }
  | { type: "waiting"; conversationId: number; user: ThreadMessage | null; waiting: Waiting }
  | { type: "started"; conversationId: number; user: ThreadMessage | null; reply: ThreadMessage }
  | { type: "queued"; conversationId: number; reason: string }
  | { type: "text"; conversationId: number; text: string }
  | { type: "done"; conversationId: number; reply: ThreadMessage }
  | { type: "failed"; conversationId: number; message: string; reply: ThreadMessage | null }
  | { type: "stopped"; conversationId: number }
  | { type: "clearError" };

export const initialChatState: ChatState = { detail: null, inFlight: {}, error: null };

/** Turns a channel event into the reducer action for conversation `conversationId`. */
export function actionFromEvent(conversationId: number, ev: StreamEvent): ChatAction {
  switch (ev.kind) {
    case "started":
      return { type: "started", conversationId, user: ev.user, reply: ev.reply };
    case "waiting":
      return {
        type: "waiting",
        conversationId,
        user: ev.user,
        waiting: { model: ev.model, stage: ev.stage, done: ev.done, total: ev.total },
      };
    case "queued":
      return { type: "queued", conversationId, reason: ev.reason };
    case "text":
      return { type: "text", conversationId, text: ev.text };
    case "done":
      return { type: "done", conversationId, reply: ev.reply };
    case "failed":
      return { type: "failed", conversationId, message: ev.message, reply: ev.reply };
  }
}

/** The reply in flight in the conversation currently shown, if any. */
export function inFlightHere(state: ChatState): InFlight | null {
  return state.detail === null ? null : (state.inFlight[state.detail.id] ?? null);
}

/** Is a reply streaming into the conversation currently shown? */
export function isStreamingHere(state: ChatState): boolean {
  return inFlightHere(state) !== null;
}

/** The ids of the conversations with a reply in flight. */
export function streamingConversations(state: ChatState): number[] {
  return Object.keys(state.inFlight).map(Number);
}

/** `inFlight` with conversation `id`'s entry set to `entry`, or removed for `null`. */
function withInFlight(inFlight: Record<number, InFlight>, id: number, entry: InFlight | null): Record<number, InFlight> {
  const next = { ...inFlight };
  if (entry === null) delete next[id];
  else next[id] = entry;
  return next;
}

function mapMessages(
  detail: ConversationDetail,
  fn: (m: ThreadMessage) => ThreadMessage,
): ConversationDetail {
  return { ...detail, messages: detail.messages.map(fn) };
}

/**
 * The new path once `fresh` (the new messages, in order) is stored: everything up to the
 * first one's parent, then them (a send appends; regenerate/edit start a branch).
 */
function insertNew(messages: ThreadMessage[], fresh: ThreadMessage[]): ThreadMessage[] {
  const first = fresh[0];
  const newIds = new Set(fresh.map((m) => m.id));
  const kept = messages.filter((m) => !newIds.has(m.id));
  let cut: ThreadMessage[];
  if (first.parent_id === null) {
    cut = [];
  } else {
    const idx = kept.findIndex((m) => m.id === first.parent_id);
    cut = idx >= 0 ? kept.slice(0, idx + 1) : kept;
  }
  return [...cut, ...fresh];
}

/** The new path after `started`: the user message (when new) and the reply placeholder. */
function insertStarted(
  messages: ThreadMessage[],
  user: ThreadMessage | null,
  reply: ThreadMessage,
): ThreadMessage[] {
  const placeholder: ThreadMessage = { ...reply, state: "streaming", error: null };
  return insertNew(messages, user ? [user, placeholder] : [placeholder]);
}

export function chatReducer(state: ChatState, action: ChatAction): ChatState {
  switch (action.type) {
    case "loaded":
      return { ...state, detail: action.detail };
    case "clearError":
      return state.error === null ? state : { ...state, error: null };
    case "sending":
      return {
        ...state,
        inFlight: withInFlight(state.inFlight, action.conversationId, {
          conversationId: action.conversationId,
          replyId: null,
          waiting: null,
          userStored: false,
          queued: null,
        }),
        error: null,
      };
    default:
      break;
  }

  // Stream events: each for its conversation's reply; the detail changes only when shown.
  const detail = state.detail;
  const here = detail !== null && detail.id === action.conversationId;
  const mine = state.inFlight[action.conversationId] ?? null;

  switch (action.type) {
    case "waiting": {
      if (mine === null) return state;
      const entry: InFlight = {
        ...mine,
        waiting: action.waiting,
        userStored: mine.userStored || action.user !== null,
      };
      const inFlight = withInFlight(state.inFlight, action.conversationId, entry);
      if (!here || action.user === null) return { ...state, inFlight };
      return { ...state, inFlight, detail: { ...detail, messages: insertNew(detail.messages, [action.user]) } };
    }
    case "started": {
      const entry: InFlight = {
        conversationId: action.conversationId,
        replyId: action.reply.id,
        waiting: null,
        userStored: (mine?.userStored ?? false) || action.user !== null,
        queued: mine?.queued ?? null,
      };
      const inFlight = withInFlight(state.inFlight, action.conversationId, entry);
      if (!here) return mine !== null ? { ...state, inFlight } : state;
      return {
        ...state,
        inFlight,
        detail: { ...detail, messages: insertStarted(detail.messages, action.user, action.reply) },
      };
    }
    case "queued": {
      if (mine === null) return state;
      const inFlight = withInFlight(state.inFlight, action.conversationId, { ...mine, queued: action.reason });
      return { ...state, inFlight };
    }
    case "text": {
      // The first text ends the wait in line.
      const next: ChatState =
        mine !== null && mine.queued !== null
          ? { ...state, inFlight: withInFlight(state.inFlight, action.conversationId, { ...mine, queued: null }) }
          : state;
      if (!here || mine?.replyId == null || action.text === "") return next;
      const replyId = mine.replyId;
      return {
        ...next,
        detail: mapMessages(detail, (m) => (m.id === replyId ? { ...m, content: m.content + action.text } : m)),
      };
    }
    case "done": {
      const next: ChatState = { ...state, inFlight: withInFlight(state.inFlight, action.conversationId, null) };
      if (!here) return mine !== null ? next : state;
      const target = mine?.replyId ?? action.reply.id;
      const has = detail.messages.some((m) => m.id === target);
      return {
        ...next,
        detail: has
          ? mapMessages(detail, (m) => (m.id === target ? action.reply : m))
          : { ...detail, messages: [...detail.messages, action.reply] },
      };
    }
    case "failed": {
      if (!here && mine === null) return state;
      const next: ChatState = {
        ...state,
        inFlight: withInFlight(state.inFlight, action.conversationId, null),
        error: action.message,
      };
      if (!here) return next;
      const target = mine?.replyId ?? action.reply?.id ?? null;
      if (target === null) return next;
      return {
        ...next,
        detail: mapMessages(detail, (m) => {
          if (m.id !== target) return m;
          const stored = action.reply;
          return {
            ...m,
            ...(stored ?? {}),
            // Keep the partial text the user already saw if the stored reply has less.
            content: stored && stored.content.length >= m.content.length ? stored.content : m.content,
            state: "error",
            error: stored?.error ?? action.message,
          };
        }),
      };
    }
    case "stopped": {
      if (mine === null) return state;
      const replyId = mine.replyId;
      const next: ChatState = { ...state, inFlight: withInFlight(state.inFlight, action.conversationId, null) };
      if (!here || replyId === null) return next;
      return {
        ...next,
        detail: mapMessages(detail, (m) =>
          m.id === replyId && m.state === "streaming" ? { ...m, state: "stopped" } : m,
        ),
      };
    }
  }
}
