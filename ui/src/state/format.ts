// Display formatting for reply statistics.
import type { ReplyStats } from "../ipc/bindings";

function fmtNumber(n: number, digits: number): string {
  return Number.isFinite(n) ? n.toFixed(digits) : "–";
}

/**
 * "TTFT 123 ms · 45.6 tok/s · 12 prompt + 34 generated tokens", and for a reply resumed from a
 * KV checkpoint "… · 1,200 reused + 12 prefilled + 34 generated tokens".
 */
export function statsLine(s: ReplyStats): string {
  const tokens =
    s.resumed && s.reused_tokens > 0
      ? `${s.reused_tokens.toLocaleString("en-US")} reused + ${s.prompt_tokens - s.reused_tokens} prefilled + ${s.generated_tokens} generated tokens`
      : `${s.prompt_tokens} prompt + ${s.generated_tokens} generated tokens`;
  const parts = [`TTFT ${fmtNumber(s.ttft_ms, 0)} ms`, `${fmtNumber(s.decode_tok_s, 1)} tok/s`, tokens];
  if (s.spec) {
    const method = s.spec.method;
    parts.push(
      `${method}: ${fmtNumber(s.spec.acceptance_rate * 100, 0)}% accepted (${s.spec.accepted}/${s.spec.proposed}), ${fmtNumber(s.spec.mean_accepted_length, 1)} per round`,
    );
  }
  return parts.join(" · ");
}
