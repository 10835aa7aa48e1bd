import type { LoadedModel } from "../ipc/bindings";

export type LoadProgress = { path: string; name: string; stage: string; done: number; total: number };

export function ModelBar({
  loaded,
  loading,
  hasConversation,
  title,
  onOpenModels,
  onCancelLoad,
  onOpenSettings,
}: {
  loaded: LoadedModel | null;
  loading: LoadProgress | null;
  hasConversation: boolean;
  title: string;
  onOpenModels: () => void;
  onCancelLoad: () => void;
  onOpenSettings: () => void;
}) {
  const status = loading ? "Loading…" : loaded ? loaded.name : "No model";
  const frac = loading && loading.total > 0 ? Math.min(1, loading.done / loading.total) : null;
  return (
    <header className="topbar">
      <button
        type="button"
        className="model-picker"
        data-testid="models-button"
        onClick={onOpenModels}
        title="Choose a model"
      >
        <span className={`model-dot${loaded && !loading ? " on" : ""}`} aria-hidden="true" />
        <span className="model-status" data-testid="model-status">
          {status}
        </span>
        {loaded && !loading && loaded.vision ? <span className="badge">vision</span> : null}
        <span className="chevron" aria-hidden="true">
          ▾
        </span>
      </button>
      {loading ? (
        <div className="load-progress" data-testid="load-progress">
          <div className="load-text">
            {loading.name}
            {loading.stage ? ` — ${loading.stage}` : ""}
            {frac !== null ? ` ${Math.round(frac * 100)}%` : ""}
          </div>
          <div className="progress" role="progressbar" aria-valuemin={0} aria-valuemax={100} aria-valuenow={frac !== null ? Math.round(frac * 100) : undefined}>
            <div className={`progress-fill${frac === null ? " indeterminate" : ""}`} style={{ width: frac !== null ? `${frac * 100}%` : undefined }} />
          </div>
          <button type="button" className="button small" data-testid="cancel-load" onClick={onCancelLoad}>
            Cancel
          </button>
        </div>
      ) : (
        <div className="topbar-title" title={title}>
          {title}
        </div>
      )}
      <button
        type="button"
        className="icon-button"
        data-testid="settings-button"
        title={hasConversation ? "Chat settings" : "Open a chat to change its settings"}
        aria-label="Chat settings"
        disabled={!hasConversation}
        onClick={onOpenSettings}
      >
        ⚙
      </button>
    </header>
  );
}
