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
};

export type ChatState = {
  detail: ConversationDetail | null;
  inFlight: InFlight | null;
  /** The last stream failure's message (for the error banner). */
  error: string | null;
};

export type ChatAction =
  | { type: "loaded"; detail: ConversationDetail | null }
  | { type: "sending"; conversationId: number }
  | { type: "waiting"; conversationId: number; user: ThreadMessage | null; waiting: Waiting }
  | { type: "started"; conversationId: number; user: ThreadMessage | null; reply: ThreadMessage }
  | { type: "text"; conversationId: number; text: string }
  | { type: "done"; conversationId: number; reply: ThreadMessage }
  | { type: "failed"; conversationId: number; message: string; reply: ThreadMessage | null }
  | { type: "stopped"; conversationId: number }
  | { type: "clearError" };

export const initialChatState: ChatState = { detail: null, inFlight: null, error: null };

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
    case "text":
      return { type: "text", conversationId, text: ev.text };
    case "done":
      return { type: "done", conversationId, reply: ev.reply };
    case "failed":
      return { type: "failed", conversationId, message: ev.message, reply: ev.reply };
  }
}

/** Is a reply streaming into the conversation currently shown? */
export function isStreamingHere(state: ChatState): boolean {
  return state.inFlight !== null && state.detail !== null && state.inFlight.conversationId === state.detail.id;
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
        inFlight: { conversationId: action.conversationId, replyId: null, waiting: null, userStored: false },
        error: null,
      };
    default:
      break;
  }

  // Stream events: only for the conversation shown.
  const detail = state.detail;
  const here = detail !== null && detail.id === action.conversationId;
  const inFlightHere = state.inFlight !== null && state.inFlight.conversationId === action.conversationId;

  switch (action.type) {
    case "waiting": {
      if (!inFlightHere || state.inFlight === null) return state;
      const inFlight: InFlight = {
        ...state.inFlight,
        waiting: action.waiting,
        userStored: state.inFlight.userStored || action.user !== null,
      };
      if (!here || action.user === null) return { ...state, inFlight };
      return { ...state, inFlight, detail: { ...detail, messages: insertNew(detail.messages, [action.user]) } };
    }
    case "started": {
      const inFlight: InFlight = {
        conversationId: action.conversationId,
        replyId: action.reply.id,
        waiting: null,
        userStored: (state.inFlight?.userStored ?? false) || action.user !== null,
      };
      if (!here) return inFlightHere ? { ...state, inFlight } : state;
      return {
        ...state,
        inFlight,
        detail: { ...detail, messages: insertStarted(detail.messages, action.user, action.reply) },
      };
    }
    case "text": {
      if (!here || !inFlightHere || state.inFlight?.replyId == null || action.text === "") return state;
      const replyId = state.inFlight.replyId;
      return {
        ...state,
        detail: mapMessages(detail, (m) => (m.id === replyId ? { ...m, content: m.content + action.text } : m)),
      };
    }
    case "done": {
      const next: ChatState = { ...state, inFlight: inFlightHere ? null : state.inFlight };
      if (!here) return inFlightHere ? next : state;
      const target = state.inFlight?.replyId ?? action.reply.id;
      const has = detail.messages.some((m) => m.id === target);
      return {
        ...next,
        detail: has
          ? mapMessages(detail, (m) => (m.id === target ? action.reply : m))
          : { ...detail, messages: [...detail.messages, action.reply] },
      };
    }
    case "failed": {
      if (!here && !inFlightHere) return state;
      const next: ChatState = {
        ...state,
        inFlight: inFlightHere ? null : state.inFlight,
        error: action.message,
      };
      if (!here) return next;
      const target = state.inFlight?.replyId ?? action.reply?.id ?? null;
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
      if (!inFlightHere) return state;
      const replyId = state.inFlight?.replyId ?? null;
      const next: ChatState = { ...state, inFlight: null };
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
