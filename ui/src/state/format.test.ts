import { describe, expect, it } from "vitest";
import type { TurnStats } from "../ipc/bindings";
import { statsLine } from "./format";

/** A reply's statistics, every field set, for the cases below to vary. */
const base: TurnStats = {
  stop_reason: "stop",
  prompt_tokens: 12,
  reused_tokens: 0,
  generated_tokens: 34,
  ttft_ms: 123.4,
  prefill_tok_s: 0,
  restore_ms: 0,
  decode_tok_s: 45.63,
  peak_mem_bytes: 0,
  kv_bytes: 0,
  kv_storage: "",
  spec: null,
};

describe("statsLine", () => {
  it("formats the reply statistics", () => {
    expect(statsLine(base)).toBe("TTFT 123 ms · 45.6 tok/s · 12 prompt + 34 generated tokens");
  });

  it("splits the prompt into reused and prefilled tokens for a resumed reply", () => {
    expect(statsLine({ ...base, prompt_tokens: 1212, reused_tokens: 1200, ttft_ms: 9.2 })).toBe(
      "TTFT 9 ms · 45.6 tok/s · 1,200 reused + 12 prefilled + 34 generated tokens",
    );
  });

  it("names the KV cache's size and format", () => {
    expect(
      statsLine({ ...base, kv_bytes: 1_234_567, kv_storage: "rotating(window=512)+affine(bits=4,group=64,start=0);plain" }),
    ).toBe("TTFT 123 ms · 45.6 tok/s · 12 prompt + 34 generated tokens · KV 1.2 MB 4-bit");
    expect(statsLine({ ...base, kv_bytes: 5000, kv_storage: "plain+turbo(k=3,v=4,seed=0,start=0)" })).toContain(
      "KV 5 KB TurboQuant 3.5-bit",
    );
    expect(statsLine({ ...base, kv_bytes: 5000, kv_storage: "plain;rotating(window=4)" })).toContain("· KV 5 KB");
  });

  it("adds speculative decoding's acceptance", () => {
    expect(
      statsLine({
        ...base,
        stop_reason: "length",
        prompt_tokens: 40,
        generated_tokens: 128,
        ttft_ms: 20,
        decode_tok_s: 143.2,
        spec: { method: "draft", rounds: 41, proposed: 131, accepted: 86, context_computed: 12 },
      }),
    ).toBe("TTFT 20 ms · 143.2 tok/s · 40 prompt + 128 generated tokens · draft: 66% accepted (86/131), 2.1 per round");
  });
});
