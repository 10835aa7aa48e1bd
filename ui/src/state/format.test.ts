import { describe, expect, it } from "vitest";
import { statsLine } from "./format";

describe("statsLine", () => {
  it("formats the reply statistics", () => {
    expect(
      statsLine({
        stop_reason: "stop",
        prompt_tokens: 12,
        reused_tokens: 0,
        generated_tokens: 34,
        ttft_ms: 123.4,
        prefill_tok_s: 0,
        restore_ms: 0,
        decode_tok_s: 45.63,
        peak_mem_bytes: 0,
        spec: null,
      }),
    ).toBe("TTFT 123 ms · 45.6 tok/s · 12 prompt + 34 generated tokens");
  });

  it("splits the prompt into reused and prefilled tokens for a resumed reply", () => {
    expect(
      statsLine({
        stop_reason: "stop",
        prompt_tokens: 1212,
        reused_tokens: 1200,
        generated_tokens: 34,
        ttft_ms: 9.2,
        prefill_tok_s: 0,
        restore_ms: 0,
        decode_tok_s: 45.63,
        peak_mem_bytes: 0,
        spec: null,
      }),
    ).toBe("TTFT 9 ms · 45.6 tok/s · 1,200 reused + 12 prefilled + 34 generated tokens");
  });

  it("adds speculative decoding's acceptance", () => {
    expect(
      statsLine({
        stop_reason: "length",
        prompt_tokens: 40,
        reused_tokens: 0,
        generated_tokens: 128,
        ttft_ms: 20,
        prefill_tok_s: 0,
        restore_ms: 0,
        decode_tok_s: 143.2,
        peak_mem_bytes: 0,
        spec: { method: "draft", rounds: 41, proposed: 131, accepted: 86, context_computed: 12 },
      }),
    ).toBe("TTFT 20 ms · 143.2 tok/s · 40 prompt + 128 generated tokens · draft: 66% accepted (86/131), 2.1 per round");
  });
});
