// Display formatting for reply statistics.
import type { SpecStats, TurnStats } from "../ipc/bindings";
import { bytesText } from "./kv";

function fmtNumber(n: number, digits: number): string {
  return Number.isFinite(n) ? n.toFixed(digits) : "–";
}

/**
 * "TTFT 123 ms · 45.6 tok/s · 12 prompt + 34 generated tokens", and for a reply resumed from a
 * KV checkpoint "… · 1,200 reused + 12 prefilled + 34 generated tokens".
 */
export function statsLine(s: TurnStats): string {
  const tokens =
    resumed(s)
      ? `${s.reused_tokens.toLocaleString("en-US")} reused + ${s.prompt_tokens - s.reused_tokens} prefilled + ${s.generated_tokens} generated tokens`
      : `${s.prompt_tokens} prompt + ${s.generated_tokens} generated tokens`;
  const parts = [`TTFT ${fmtNumber(s.ttft_ms, 0)} ms`, `${fmtNumber(s.decode_tok_s, 1)} tok/s`, tokens];
  if (s.kv_bytes > 0) {
    const storage = kvLabel(s.kv_storage);
    parts.push(`KV ${bytesText(s.kv_bytes)}${storage ? ` ${storage}` : ""}`);
  }
  if (s.spec) {
    const method = s.spec.method;
    parts.push(
      `${method}: ${fmtNumber(acceptanceRate(s.spec) * 100, 0)}% accepted (${s.spec.accepted}/${s.spec.proposed}), ${fmtNumber(meanAcceptedLength(s.spec), 1)} per round`,
    );
  }
  return parts.join(" · ");
}

/** The quantized format a KV storage signature names ("4-bit", "TurboQuant 3-bit"), or "" for
 * full precision. */
export function kvLabel(storage: string): string {
  const affine = /\+affine\(bits=(\d+)/.exec(storage);
  if (affine) return `${affine[1]}-bit`;
  const turbo = /\+turbo\(k=(\d+),v=(\d+)/.exec(storage);
  if (turbo) {
    const bits = (Number(turbo[1]) + Number(turbo[2])) / 2;
    return `TurboQuant ${bits}-bit`;
  }
  return "";
}

/** Whether the reply resumed from a KV checkpoint (some of its prompt was restored, not read). */
export function resumed(s: TurnStats): boolean {
  return s.reused_tokens > 0;
}

/** Drafts accepted / proposed (0 when nothing was proposed). */
export function acceptanceRate(spec: SpecStats): number {
  return spec.proposed === 0 ? 0 : spec.accepted / spec.proposed;
}

/** Drafts accepted per verify round. */
export function meanAcceptedLength(spec: SpecStats): number {
  return spec.rounds === 0 ? 0 : spec.accepted / spec.rounds;
}
