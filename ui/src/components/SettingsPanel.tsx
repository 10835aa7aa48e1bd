import { useState } from "react";
import type { AppSettings, ConversationDetail, LoadedModel, ModelEntry, Settings, Speculation } from "../ipc/bindings";
import { bytesText, KV_CHOICES, type KvChoice, kvChoice, kvCostText, kvOptions } from "../state/kv";
import { Modal } from "./Modal";

/** The settings typed into number fields. */
type NumberKey = Exclude<keyof Settings, "speculation" | "kv" | "thinking">;
type NumberSettings = Omit<Settings, "speculation" | "kv" | "thinking">;

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

/** A KV cache select: each choice with what it costs for the loaded model. */
function KvSelect({
  value,
  onChange,
  loaded,
  testId,
}: {
  value: KvChoice;
  onChange: (choice: KvChoice) => void;
  loaded: LoadedModel | null;
  testId: string;
}) {
  const costs = loaded?.kv_costs ?? null;
  return (
    <select data-testid={testId} value={value} onChange={(e) => onChange(e.target.value as KvChoice)}>
      {KV_CHOICES.map((c) => {
        const cost = kvCostText(costs, c.value);
        return (
          <option key={c.value} value={c.value} disabled={costs !== null && costs[c.value] === 0}>
            {cost ? `${c.label} — ${cost}` : c.label}
          </option>
        );
      })}
    </select>
  );
}

export function SettingsPanel({
  detail,
  models,
  loaded,
  app,
  onSave,
  onClose,
}: {
  detail: ConversationDetail;
  /** The library: any model that loads can draft for one with the same tokenizer. */
  models: ModelEntry[];
  /** The model loaded, whose KV cache costs the choices show. */
  loaded: LoadedModel | null;
  /** The app's settings (null until read). */
  app: AppSettings | null;
  onSave: (prompt: string, settings: Settings, app: AppSettings | null) => Promise<void>;
  onClose: () => void;
}) {
  const [prompt, setPrompt] = useState(detail.system_prompt);
  const [kv, setKv] = useState<KvChoice>(() => kvChoice(detail.settings.kv));
  const [kvStart, setKvStart] = useState(String(detail.settings.kv.quantized_start));
  const [defaultKv, setDefaultKv] = useState<KvChoice>(() => (app ? kvChoice(app.default_kv) : "full"));
  const [memoryPercent, setMemoryPercent] = useState(() => String(Math.round((app?.memory_share ?? 0.9) * 100)));
  const [speculation, setSpeculation] = useState(() => speculationValue(detail.settings.speculation));
  const [thinking, setThinking] = useState(detail.settings.thinking);
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
    const start = Number(kvStart.trim());
    if (kvStart.trim() === "" || !Number.isInteger(start) || start < 0) {
      setProblem("Quantize after must be a whole number of tokens, 0 or more");
      return;
    }
    const percent = Number(memoryPercent.trim());
    if (!Number.isFinite(percent) || percent < 10 || percent > 100) {
      setProblem("The memory limit must be between 10% and 100%");
      return;
    }
    setProblem(null);
    setSaving(true);
    try {
      const settings = {
        ...parsed,
        speculation: parseSpeculation(speculation),
        kv: kvOptions(kv, start, detail.settings.kv),
        thinking,
      };
      const appSettings = app
        ? {
            ...app,
            default_kv: kvOptions(defaultKv, app.default_kv.quantized_start, app.default_kv),
            memory_share: percent / 100,
          }
        : null;
      await onSave(prompt, settings, appSettings);
    } finally {
      setSaving(false);
    }
  };
  const kvHint = KV_CHOICES.find((c) => c.value === kv)?.hint ?? "";

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
                Drafter made for the model: {m.name}
              </option>
            ))}
            {speculation.includes(":") && !listed.includes(speculation) ? (
              <option value={speculation}>{speculation}</option>
            ) : null}
          </select>
        </label>
        {loaded?.thinking ? (
          <label className="field wide check" title="The model reasons first; its thinking shows folded above the reply">
            <input
              type="checkbox"
              data-testid="thinking-switch"
              checked={thinking}
              onChange={(e) => setThinking(e.target.checked)}
            />
            <span>Let the model think before it answers</span>
          </label>
        ) : null}
        <label className="field wide" title="Where the conversation's keys and values are kept: less memory lets longer chats fit">
          <span>KV cache</span>
          <KvSelect value={kv} onChange={setKv} loaded={loaded} testId="kv-cache" />
          <small className="field-hint" data-testid="kv-hint">
            {kvHint}
          </small>
        </label>
        <label className="field" title="The first tokens stay in full precision; the cache is quantized once the chat is longer">
          <span>Quantize after (tokens)</span>
          <input
            type="number"
            inputMode="numeric"
            min={0}
            step="1"
            data-testid="kv-start"
            value={kvStart}
            disabled={kv === "full"}
            onChange={(e) => setKvStart(e.target.value)}
          />
        </label>
        {app ? (
          <fieldset className="app-settings" data-testid="app-settings">
            <legend>All chats</legend>
            <label className="field wide">
              <span>KV cache of new chats</span>
              <KvSelect value={defaultKv} onChange={setDefaultKv} loaded={loaded} testId="default-kv-cache" />
            </label>
            <label
              className="field"
              title="A reply whose KV cache would not fit beside the model is refused before it starts, instead of running the machine out of memory"
            >
              <span>Memory limit (%)</span>
              <input
                type="number"
                inputMode="numeric"
                min={10}
                max={100}
                step="1"
                data-testid="memory-limit"
                value={memoryPercent}
                onChange={(e) => setMemoryPercent(e.target.value)}
              />
              {app.recommended_memory > 0 ? (
                <small className="field-hint">of the {bytesText(app.recommended_memory)} MLX recommends for this device</small>
              ) : null}
            </label>
          </fieldset>
        ) : null}
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
