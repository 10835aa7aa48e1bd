// Display formatting for reply statistics.
import type { ReplyStats } from "../ipc/bindings";

function fmtNumber(n: number, digits: number): string {
  return Number.isFinite(n) ? n.toFixed(digits) : "–";
}

/** "TTFT 123 ms · 45.6 tok/s · 12 prompt + 34 generated tokens" */
export function statsLine(s: ReplyStats): string {
  return [
    `TTFT ${fmtNumber(s.ttft_ms, 0)} ms`,
    `${fmtNumber(s.decode_tok_s, 1)} tok/s`,
    `${s.prompt_tokens} prompt + ${s.generated_tokens} generated tokens`,
  ].join(" · ");
}
