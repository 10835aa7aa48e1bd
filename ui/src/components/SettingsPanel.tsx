import { useState } from "react";
import type { ConversationDetail, ModelEntry, Settings, Speculation } from "../ipc/bindings";
import { Modal } from "./Modal";

/** The settings typed into number fields. */
type NumberKey = Exclude<keyof Settings, "speculation">;
type NumberSettings = Omit<Settings, "speculation">;

type Field = {
  key: NumberKey;
  label: string;
  testId?: string;
  step: string;
  min: number;
  max?: number;
  int: boolean;
  hint?: string;
};

const FIELDS: Field[] = [
  { key: "temperature", label: "Temperature", testId: "temperature", step: "0.05", min: 0, int: false },
  { key: "top_p", label: "Top P", testId: "top-p", step: "0.01", min: 0, max: 1, int: false },
  { key: "top_k", label: "Top K", testId: "top-k", step: "1", min: 0, int: true },
  { key: "max_tokens", label: "Max tokens", testId: "max-tokens", step: "1", min: 1, int: true },
  { key: "seed", label: "Seed", testId: "seed", step: "1", min: 0, int: true },
  { key: "max_soft_tokens", label: "Image tokens", testId: "max-soft-tokens", step: "1", min: 1, int: true, hint: "Soft tokens per image (e.g. 70, 140, 280, 560, 1120)" },
];

/** Parses the form; returns the settings or a readable problem. */
export function parseSettings(values: Record<NumberKey, string>): NumberSettings | string {
  const out = {} as NumberSettings;
  for (const f of FIELDS) {
    const raw = values[f.key].trim();
    const n = Number(raw);
    if (raw === "" || !Number.isFinite(n)) return `${f.label} must be a number`;
    if (f.int && !Number.isInteger(n)) return `${f.label} must be a whole number`;
    if (n < f.min) return `${f.label} must be at least ${f.min}`;
    if (f.max !== undefined && n > f.max) return `${f.label} must be at most ${f.max}`;
    out[f.key] = n;
  }
  return out;
}

/** The select's value for a speculation setting: "off", "lookup", "draft:<folder>" or
 * "assistant:<folder>". */
export function speculationValue(s: Speculation): string {
  return s.method === "draft" || s.method === "assistant" ? `${s.method}:${s.model}` : s.method;
}

export function parseSpeculation(value: string): Speculation {
  if (value.startsWith("draft:")) return { method: "draft", model: value.slice("draft:".length) };
  if (value.startsWith("assistant:")) return { method: "assistant", model: value.slice("assistant:".length) };
  return value === "lookup" ? { method: "lookup" } : { method: "off" };
}

export function SettingsPanel({
  detail,
  models,
  onSave,
  onClose,
}: {
  detail: ConversationDetail;
  /** The library: any model that loads can draft for one with the same tokenizer. */
  models: ModelEntry[];
  onSave: (prompt: string, settings: Settings) => Promise<void>;
  onClose: () => void;
}) {
  const [prompt, setPrompt] = useState(detail.system_prompt);
  const [speculation, setSpeculation] = useState(() => speculationValue(detail.settings.speculation));
  const drafts = models.filter((m) => m.problem === null && !m.drafter);
  const assistants = models.filter((m) => m.problem === null && m.drafter);
  const listed = [...drafts.map((m) => `draft:${m.path}`), ...assistants.map((m) => `assistant:${m.path}`)];
  const [values, setValues] = useState<Record<NumberKey, string>>(() => ({
    temperature: String(detail.settings.temperature),
    top_p: String(detail.settings.top_p),
    top_k: String(detail.settings.top_k),
    max_tokens: String(detail.settings.max_tokens),
    seed: String(detail.settings.seed),
    max_soft_tokens: String(detail.settings.max_soft_tokens),
  }));
  const [problem, setProblem] = useState<string | null>(null);
  const [saving, setSaving] = useState(false);

  const save = async () => {
    const parsed = parseSettings(values);
    if (typeof parsed === "string") {
      setProblem(parsed);
      return;
    }
    setProblem(null);
    setSaving(true);
    try {
      await onSave(prompt, { ...parsed, speculation: parseSpeculation(speculation) });
    } finally {
      setSaving(false);
    }
  };

  return (
    <Modal title="Chat settings" onClose={onClose} className="settings-panel" testId="settings-panel">
      <form
        className="settings-form"
        onSubmit={(e) => {
          e.preventDefault();
          void save();
        }}
      >
        <label className="field wide">
          <span>System prompt</span>
          <textarea
            data-testid="system-prompt"
            value={prompt}
            rows={5}
            placeholder="You are a helpful assistant."
            onChange={(e) => setPrompt(e.target.value)}
          />
        </label>
        <div className="field-grid">
          {FIELDS.map((f) => (
            <label className="field" key={f.key} title={f.hint}>
              <span>{f.label}</span>
              <input
                type="number"
                inputMode={f.int ? "numeric" : "decimal"}
                step={f.step}
                min={f.min}
                max={f.max}
                data-testid={f.testId}
                value={values[f.key]}
                onChange={(e) => setValues((v) => ({ ...v, [f.key]: e.target.value }))}
              />
            </label>
          ))}
        </div>
        <label className="field wide" title="Drafts are checked by the model itself: replies are the same, only faster when drafts are accepted">
          <span>Speculative decoding</span>
          <select data-testid="speculation" value={speculation} onChange={(e) => setSpeculation(e.target.value)}>
            <option value="off">Off</option>
            <option value="lookup">Prompt lookup (no model)</option>
            {drafts.map((m) => (
              <option key={m.path} value={`draft:${m.path}`}>
                Draft model: {m.name}
              </option>
            ))}
            {assistants.map((m) => (
              <option key={m.path} value={`assistant:${m.path}`}>
                Gemma 4 assistant: {m.name}
              </option>
            ))}
            {speculation.includes(":") && !listed.includes(speculation) ? (
              <option value={speculation}>{speculation}</option>
            ) : null}
          </select>
        </label>
        {problem ? (
          <div className="form-problem" role="alert">
            {problem}
          </div>
        ) : null}
        <div className="modal-actions">
          <button type="button" className="button" onClick={onClose}>
            Cancel
          </button>
          <button type="submit" className="button primary" data-testid="settings-save" disabled={saving}>
            Save
          </button>
        </div>
      </form>
    </Modal>
  );
}
