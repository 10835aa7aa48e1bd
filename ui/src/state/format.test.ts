import { describe, expect, it } from "vitest";
import { statsLine } from "./format";

describe("statsLine", () => {
  it("formats the reply statistics", () => {
    expect(
      statsLine({
        stop_reason: "eos",
        prompt_tokens: 12,
        generated_tokens: 34,
        ttft_ms: 123.4,
        decode_tok_s: 45.63,
        peak_mem_bytes: 0,
      }),
    ).toBe("TTFT 123 ms · 45.6 tok/s · 12 prompt + 34 generated tokens");
  });
});
