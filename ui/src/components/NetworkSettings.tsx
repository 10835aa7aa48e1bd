import { useState, type FormEvent } from "react";
import type { NetworkSettings as Network } from "../ipc/bindings";
import * as api from "../ipc/commands";
import { tokenStoreLabel } from "../state/downloads";

/** The Network disclosure: whether Quince may reach the hub, which hub, and the token. */
export function NetworkSettings({
  settings,
  open,
  onToggle,
  onSaved,
  onError,
}: {
  /** Null until loaded (or when loading failed). */
  settings: Network | null;
  open: boolean;
  onToggle: (open: boolean) => void;
  onSaved: (settings: Network) => void;
  onError: (e: unknown) => void;
}) {
  const [endpoint, setEndpoint] = useState<string | null>(null);
  const [token, setToken] = useState("");
  const [saving, setSaving] = useState(false);
  // The field shows the saved endpoint until the user types.
  const endpointValue = endpoint ?? settings?.endpoint ?? "";
  const disabled = settings === null || saving;

  const run = async (action: () => Promise<Network>, after?: () => void) => {
    setSaving(true);
    try {
      onSaved(await action());
      after?.();
    } catch (e) {
      onError(e);
    } finally {
      setSaving(false);
    }
  };

  const saveNetwork = (enabled: boolean) =>
    run(() => api.setNetwork(enabled, endpointValue.trim()), () => setEndpoint(null));

  const saveToken = (e: FormEvent) => {
    e.preventDefault();
    const t = token.trim();
    if (!t) return;
    void run(() => api.setHfToken(t), () => setToken(""));
  };

  return (
    <details
      className="network-settings"
      data-testid="network-settings"
      open={open}
      onToggle={(e) => onToggle(e.currentTarget.open)}
    >
      <summary>
        Network
        {settings ? <span className="network-summary">{settings.enabled ? "on" : "off"}</span> : null}
      </summary>
      <div className="network-body">
        <label className="check">
          <input
            type="checkbox"
            data-testid="network-enabled"
            checked={settings?.enabled ?? false}
            disabled={disabled}
            onChange={(e) => void saveNetwork(e.target.checked)}
          />
          <span>Allow Quince to connect to Hugging Face (only when you search or download)</span>
        </label>
        <form
          className="network-row"
          onSubmit={(e) => {
            e.preventDefault();
            if (settings) void saveNetwork(settings.enabled);
          }}
        >
          <label className="field">
            <span>Hub address</span>
            <input
              data-testid="hf-endpoint-input"
              placeholder="https://huggingface.co"
              spellCheck={false}
              value={endpointValue}
              disabled={settings === null}
              onChange={(e) => setEndpoint(e.target.value)}
            />
          </label>
          <button
            type="submit"
            className="button"
            data-testid="hf-endpoint-save"
            disabled={disabled || endpoint === null || endpoint.trim() === settings?.endpoint}
          >
            Save
          </button>
        </form>
        <form className="network-row" onSubmit={saveToken}>
          <label className="field">
            <span>Hugging Face token (for gated or private models)</span>
            <input
              type="password"
              data-testid="network-token-input"
              autoComplete="off"
              placeholder={settings?.has_token ? "A token is saved" : "hf_…"}
              value={token}
              disabled={settings === null}
              onChange={(e) => setToken(e.target.value)}
            />
          </label>
          <button type="submit" className="button" data-testid="network-token-save" disabled={disabled || !token.trim()}>
            Save
          </button>
          {settings?.has_token ? (
            <button
              type="button"
              className="button"
              data-testid="network-token-forget"
              disabled={disabled}
              onClick={() => void run(() => api.setHfToken(null))}
            >
              Forget
            </button>
          ) : null}
        </form>
        {settings ? (
          <p className="network-note" data-testid="token-store">
            {settings.has_token ? "Your token is kept in " : "A token is kept in "}
            {tokenStoreLabel(settings.token_store)}.
            {settings.cache_dir ? ` Models download to ${settings.cache_dir}.` : ""}
          </p>
        ) : null}
      </div>
    </details>
  );
}
