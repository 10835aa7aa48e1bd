import { useEffect, useState } from "react";
import type { LocalServer } from "../ipc/bindings";
import * as api from "../ipc/commands";

/** The Local server disclosure: a switch (off by default) that serves the loaded model to other
 * apps on this computer through OpenAI- and Anthropic-compatible routes, with its URL and key. */
export function LocalServerSettings() {
  const [server, setServer] = useState<LocalServer | null>(null);
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState<string | null>(null);

  useEffect(() => {
    api.localServer().then(setServer, (e) => setError(api.errorMessage(e)));
  }, []);

  const toggle = async (enabled: boolean) => {
    setBusy(true);
    setError(null);
    try {
      setServer(await api.setLocalServer(enabled, server?.port ?? null));
    } catch (e) {
      setError(api.errorMessage(e));
    } finally {
      setBusy(false);
    }
  };

  return (
    <details className="network-settings" data-testid="local-server">
      <summary>
        Local server
        {server ? <span className="network-summary">{server.running ? "on" : "off"}</span> : null}
      </summary>
      <div className="network-body">
        <label className="check">
          <input
            type="checkbox"
            data-testid="local-server-enabled"
            checked={server?.running ?? false}
            disabled={server === null || busy}
            onChange={(e) => void toggle(e.target.checked)}
          />
          <span>Serve the loaded model to apps on this computer (OpenAI- and Anthropic-compatible)</span>
        </label>
        {server?.running ? (
          <dl className="server-details">
            <dt>Base URL</dt>
            <dd>
              <code data-testid="local-server-url">{server.url}</code>
            </dd>
            <dt>API key</dt>
            <dd>
              <code data-testid="local-server-key">{server.api_key}</code>
            </dd>
          </dl>
        ) : null}
        {error ? (
          <div className="form-problem" role="alert" data-testid="local-server-error">
            {error}
          </div>
        ) : null}
      </div>
    </details>
  );
}
