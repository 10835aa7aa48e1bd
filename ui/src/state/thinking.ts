// A reply's thinking (Qwen-style `<think>…</think>`) apart from its answer.

export interface ReplyParts {
  /** What the model thought, or null when the reply has no thinking block. */
  thinking: string | null;
  /** The answer after the thinking (all of the reply when there is none). */
  answer: string;
  /** The thinking block is still open: the model is thinking. */
  open: boolean;
}

const OPEN = "<think>";
const CLOSE = "</think>";

/**
 * Splits a reply into its thinking and its answer. A reply that closes a block it did not open
 * thinks too (a template may open the block in the prompt); one that opens a block and has not
 * closed it is still thinking.
 */
export function splitThinking(text: string): ReplyParts {
  const close = text.indexOf(CLOSE);
  if (close >= 0) {
    let thought = text.slice(0, close);
    const open = thought.indexOf(OPEN);
    if (open >= 0 && thought.slice(0, open).trim() === "") thought = thought.slice(open + OPEN.length);
    return { thinking: thought.trim(), answer: text.slice(close + CLOSE.length).replace(/^\s+/, ""), open: false };
  }
  const start = text.search(/\S/);
  if (start >= 0 && text.startsWith(OPEN, start)) {
    return { thinking: text.slice(start + OPEN.length).trim(), answer: "", open: true };
  }
  return { thinking: null, answer: text, open: false };
}
