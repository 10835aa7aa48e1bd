import { describe, expect, it } from "vitest";
import { bytesText, kvChoice, kvCostText, kvOptions } from "./kv";

describe("KV cache choices", () => {
  it("round-trip between settings and choices", () => {
    for (const choice of ["full", "affine8", "affine4", "turbo3"] as const) {
      expect(kvChoice(kvOptions(choice, 0))).toBe(choice);
    }
    expect(kvOptions("affine4", 256)).toEqual({
      format: { scheme: "affine", bits: 4, group_size: 64 },
      quantized_start: 256,
      layers: "all",
    });
    // A stored format of the same choice keeps its parameters; another choice replaces it.
    const custom = kvOptions("affine4", 0, {
      format: { scheme: "affine", bits: 4, group_size: 32 },
      quantized_start: 0,
      layers: "full",
    });
    expect(custom.format).toEqual({ scheme: "affine", bits: 4, group_size: 32 });
    expect(custom.layers).toBe("full");
    expect(kvOptions("turbo3", 0, custom).format).toEqual({ scheme: "turbo", key_bits: 3, value_bits: 3 });
  });

  it("say what each choice costs for the loaded model", () => {
    const costs = { full: 2048, affine8: 1088, affine4: 576, turbo3: 0 };
    expect(kvCostText(costs, "full")).toBe("2.0 MB per 1,000 tokens");
    expect(kvCostText(costs, "affine4")).toBe("576 KB per 1,000 tokens");
    expect(kvCostText(costs, "turbo3")).toBe("not for this model");
    expect(kvCostText(null, "full")).toBe("");
    expect(bytesText(21.3e9)).toBe("21.3 GB");
  });
});
