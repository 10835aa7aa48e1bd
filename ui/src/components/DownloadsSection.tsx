import { useCallback, useEffect, useState, type FormEvent } from "react";
import type { CatalogEntry, DownloadView, NetworkSettings as Network } from "../ipc/bindings";
import * as api from "../ipc/commands";
import { errorKind, errorMessage } from "../ipc/commands";
import {
  downloadStatusLine,
  fitLabel,
  fitTitle,
  isActive,
  libraryErrorText,
  sizeLabel,
} from "../state/downloads";
import type { Downloads } from "../state/useDownloads";
import { NetworkSettings } from "./NetworkSettings";

/** How often a download this window does not stream is polled, ms. */
const POLL_MS = 1000;

function DownloadProgress({ view }: { view: DownloadView }) {
  const known = view.total_bytes > 0;
  return (
    <div className="download-progress">
      <progress
        data-testid="download-progress"
        className={view.state === "paused" ? "paused" : undefined}
        max={known ? view.total_bytes : undefined}
        value={known ? view.done_bytes : undefined}
        data-done={view.done_bytes}
        data-total={view.total_bytes}
      />
      <div className="download-status" data-testid="download-status" title={view.file || undefined}>
        {downloadStatusLine(view)}
      </div>
    </div>
  );
}

/** The token field shown when a download was refused for want of one. */
function TokenPrompt({ onSave }: { onSave: (token: string) => Promise<void> }) {
  const [token, setToken] = useState("");
  const [saving, setSaving] = useState(false);
  const submit = async (e: FormEvent) => {
    e.preventDefault();
    const t = token.trim();
    if (!t) return;
    setSaving(true);
    try {
      await onSave(t);
      setToken("");
    } finally {
      setSaving(false);
    }
  };
  return (
    <form className="token-prompt" onSubmit={(e) => void submit(e)}>
      <input
        type="password"
        data-testid="hf-token-input"
        autoComplete="off"
        placeholder="Hugging Face token (hf_…)"
        aria-label="Hugging Face token"
        value={token}
        onChange={(e) => setToken(e.target.value)}
      />
      <button type="submit" className="button small" data-testid="hf-token-save" disabled={saving || !token.trim()}>
        Save token
      </button>
    </form>
  );
}

function CatalogRow({
  entry,
  exact,
  view,
  onDownload,
  onPause,
  onCancel,
  onDetails,
  onSaveToken,
}: {
  entry: CatalogEntry;
  /** Whether `entry` came from the model's details (exact size) rather than a list. */
  exact: boolean;
  view: DownloadView | null;
  onDownload: () => void;
  onPause: () => void;
  onCancel: () => void;
  onDetails: () => void;
  onSaveToken: (token: string) => Promise<void>;
}) {
  const state = view?.state;
  const downloaded = entry.local_path !== null || state === "done";
  const active = state !== undefined && isActive(state);
  const resumable = state === "paused" || state === "failed";
  const size = sizeLabel(entry, exact);
  const fit = fitLabel(entry.fit);
  return (
    <li className={`catalog-item${downloaded ? " downloaded" : ""}`} data-testid="catalog-item" data-repo={entry.repo} data-state={state}>
      <div className="catalog-main">
        <div className="catalog-head">
          <span className="model-name">{entry.name}</span>
          {entry.name !== entry.repo ? <span className="catalog-repo">{entry.repo}</span> : null}
        </div>
        {entry.description ? <div className="catalog-desc">{entry.description}</div> : null}
        <div className="model-meta">
          {size ? (
            <span className="model-size" data-testid="catalog-size" title={exact ? "Size of its weights" : "Estimated size of its weights"}>
              {size}
            </span>
          ) : null}
          {fit ? (
            <span className={`badge fit-${entry.fit.verdict}`} data-testid="fit-badge" data-fit={entry.fit.verdict} title={fitTitle(entry.fit) ?? undefined}>
              {fit}
            </span>
          ) : null}
          {entry.vision ? <span className="badge vision">vision</span> : null}
          {entry.drafter ? <span className="badge">assistant drafter</span> : null}
          {downloaded ? <span className="badge ok">downloaded</span> : null}
          {!exact && !downloaded && !active ? (
            <button type="button" className="link-button" data-testid="details-button" title="Ask Hugging Face for its exact size" onClick={onDetails}>
              exact size
            </button>
          ) : null}
        </div>
        {view && (active || state === "paused") ? <DownloadProgress view={view} /> : null}
        {view && state === "failed" ? (
          <div className="download-error" data-testid="download-error">
            {libraryErrorText(view.error_kind, view.error ?? "The download failed")}
          </div>
        ) : null}
        {view && state === "failed" && view.error_kind === "unauthorized" ? <TokenPrompt onSave={onSaveToken} /> : null}
      </div>
      <div className="catalog-actions">
        {!downloaded && !active ? (
          <button type="button" className="button small" data-testid="download-button" onClick={onDownload}>
            {resumable ? "Resume" : "Download"}
          </button>
        ) : null}
        {active ? (
          <button type="button" className="button small" data-testid="pause-download" onClick={onPause}>
            Pause
          </button>
        ) : null}
        {active || state === "paused" ? (
          <button type="button" className="button small" data-testid="cancel-download" title="Stop and delete what was downloaded" onClick={onCancel}>
            Cancel
          </button>
        ) : null}
      </div>
    </li>
  );
}

/** The Models panel's "Download models": the recommended list, hub search and downloads. */
export function DownloadsSection({ downloads }: { downloads: Downloads }) {
  const [recommended, setRecommended] = useState<CatalogEntry[] | null>(null);
  const [results, setResults] = useState<{ query: string; entries: CatalogEntry[] } | null>(null);
  const [query, setQuery] = useState("");
  const [searching, setSearching] = useState(false);
  // Entries refreshed from their details (exact sizes), by repo.
  const [details, setDetails] = useState<Readonly<Record<string, CatalogEntry>>>({});
  const [error, setError] = useState<string | null>(null);
  const [network, setNetwork] = useState<Network | null>(null);
  const [networkOpen, setNetworkOpen] = useState(false);
  const { map, untrackedActive, start, pause, cancel, refresh } = downloads;

  const showError = useCallback((e: unknown) => {
    const kind = errorKind(e);
    setError(libraryErrorText(kind, errorMessage(e)));
    if (kind === "offline") setNetworkOpen(true);
  }, []);

  useEffect(() => {
    let live = true;
    api.catalog().then(
      (list) => live && setRecommended(list),
      (e: unknown) => live && showError(e),
    );
    api.networkSettings().then(
      (n) => live && setNetwork(n),
      (e: unknown) => live && showError(e),
    );
    refresh().catch((e: unknown) => live && showError(e));
    return () => {
      live = false;
    };
  }, [refresh, showError]);

  // A download started before a reload streams nowhere: follow it from the backend's list.
  useEffect(() => {
    if (!untrackedActive) return;
    const t = window.setInterval(() => void refresh().catch(() => {}), POLL_MS);
    return () => window.clearInterval(t);
  }, [untrackedActive, refresh]);

  const search = async (e: FormEvent) => {
    e.preventDefault();
    const q = query.trim();
    if (!q) {
      setResults(null);
      return;
    }
    setSearching(true);
    setError(null);
    try {
      setResults({ query: q, entries: await api.searchModels(q) });
    } catch (err) {
      showError(err);
    } finally {
      setSearching(false);
    }
  };

  const loadDetails = async (repo: string) => {
    try {
      const entry = await api.modelDetails(repo);
      setDetails((d) => ({ ...d, [repo]: entry }));
    } catch (e) {
      showError(e);
    }
  };

  const download = (repo: string) => {
    setError(null);
    void start(repo);
  };

  const saveToken = async (repo: string, token: string) => {
    try {
      setNetwork(await api.setHfToken(token));
    } catch (e) {
      showError(e);
      return;
    }
    download(repo);
  };

  const shown = results ? results.entries : recommended;

  return (
    <section className="downloads-section" data-testid="downloads-section">
      <h3 className="section-title">Download models</h3>
      <form className="library-search" onSubmit={(e) => void search(e)}>
        <input
          className="search"
          data-testid="library-search-input"
          placeholder="Search Hugging Face, e.g. mlx-community/gemma"
          aria-label="Search Hugging Face"
          spellCheck={false}
          value={query}
          onChange={(e) => setQuery(e.target.value)}
        />
        <button type="submit" className="button" data-testid="library-search-button" disabled={searching}>
          Search
        </button>
      </form>
      {error ? (
        <div className="library-error" role="alert">
          <span data-testid="library-error">{error}</span>
          <button type="button" className="icon-button small" aria-label="Dismiss error" title="Dismiss" onClick={() => setError(null)}>
            ×
          </button>
        </div>
      ) : null}
      <div className="library-subhead">
        {results ? (
          <>
            <span data-testid="library-results-title">
              {searching ? "Searching…" : `Results for “${results.query}”`}
            </span>
            <button type="button" className="link-button" data-testid="library-recommended" onClick={() => setResults(null)}>
              Recommended
            </button>
          </>
        ) : (
          <span>{searching ? "Searching…" : "Recommended"}</span>
        )}
      </div>
      {shown === null ? (
        <div className="panel-empty">{error ? "" : "Loading…"}</div>
      ) : shown.length === 0 ? (
        <div className="panel-empty" data-testid="library-empty">
          {results ? `No models found for “${results.query}”.` : "No recommended models."}
        </div>
      ) : (
        <ul className="catalog-list">
          {shown.map((listed) => {
            const entry = details[listed.repo] ?? listed;
            return (
              <CatalogRow
                key={entry.repo}
                entry={entry}
                exact={details[listed.repo] !== undefined}
                view={map[entry.repo] ?? entry.download}
                onDownload={() => download(entry.repo)}
                onPause={() => void pause(entry.repo).catch(showError)}
                onCancel={() => void cancel(entry.repo).catch(showError)}
                onDetails={() => void loadDetails(entry.repo)}
                onSaveToken={(token) => saveToken(entry.repo, token)}
              />
            );
          })}
        </ul>
      )}
      <NetworkSettings
        settings={network}
        open={networkOpen}
        onToggle={setNetworkOpen}
        onSaved={(n) => {
          setNetwork(n);
          setError(null);
        }}
        onError={showError}
      />
    </section>
  );
}
