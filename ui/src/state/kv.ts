// The KV cache choices the settings offer, and what each costs for the loaded model.
import type { KvCosts, KvOptions } from "../ipc/bindings";

export type KvChoice = keyof KvCosts;

export const KV_CHOICES: { value: KvChoice; label: string; hint: string }[] = [
  { value: "full", label: "Full precision", hint: "Keys and values as the model computes them: the most memory, exact." },
  { value: "affine8", label: "8-bit", hint: "About half the memory of full precision; replies barely change." },
  { value: "affine4", label: "4-bit", hint: "About a quarter of the memory; replies may change a little." },
  {
    value: "turbo3",
    label: "TurboQuant 3-bit (long context)",
    hint: "About a fifth of the memory, for very long chats; replies change more.",
  },
];

/** The choice a stored KV setting is (another format reads as the nearest offered). */
export function kvChoice(kv: KvOptions): KvChoice {
  switch (kv.format.scheme) {
    case "full":
      return "full";
    case "affine":
      return kv.format.bits >= 8 ? "affine8" : "affine4";
    case "turbo":
      return "turbo3";
  }
}

/** The KV setting of a choice, keeping the rest of `base` (start, layers). */
export function kvOptions(choice: KvChoice, start: number, base?: KvOptions): KvOptions {
  const layers = base?.layers ?? "all";
  const format: KvOptions["format"] =
    choice === "full"
      ? { scheme: "full" }
      : choice === "turbo3"
        ? { scheme: "turbo", key_bits: 3, value_bits: 3 }
        : { scheme: "affine", bits: choice === "affine8" ? 8 : 4, group_size: 64 };
  // A kept format of the same choice keeps its parameters (a 3.5-bit TurboQuant, groups of 32).
  const same = base && kvChoice(base) === choice ? base.format : format;
  return { format: same, quantized_start: start, layers };
}

/** Bytes as people read them: `812 KB`, `3.4 MB`, `21.3 GB`. */
export function bytesText(bytes: number): string {
  if (bytes < 1e6) return `${Math.max(1, Math.ceil(bytes / 1e3))} KB`;
  if (bytes < 1e9) return `${(bytes / 1e6).toFixed(1)} MB`;
  return `${(bytes / 1e9).toFixed(1)} GB`;
}

/** What `choice` costs per 1,000 tokens for a model with these costs ("" when unknown, and
 * a note when the model's heads do not take it). */
export function kvCostText(costs: KvCosts | null, choice: KvChoice): string {
  if (!costs) return "";
  const bytes = costs[choice];
  if (bytes === 0) return "not for this model";
  return `${bytesText(bytes * 1000)} per 1,000 tokens`;
}
