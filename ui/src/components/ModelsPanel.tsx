import type { LoadedModel, ModelEntry, ModelSource } from "../ipc/bindings";
import { formatBytes } from "../state/attachments";
import type { Downloads } from "../state/useDownloads";
import { DownloadsSection } from "./DownloadsSection";
import { LocalServerSettings } from "./LocalServerSettings";
import { Modal } from "./Modal";

const SOURCE_LABEL: Record<ModelSource, string> = {
  demo: "demo",
  folder: "folder",
  hf_cache: "HF cache",
};

export function ModelsPanel({
  models,
  loaded,
  loadingPath,
  onLoad,
  onAddFolder,
  onRemoveFolder,
  downloads,
  onClose,
}: {
  models: ModelEntry[];
  loaded: LoadedModel | null;
  loadingPath: string | null;
  onLoad: (m: ModelEntry) => void;
  onAddFolder: () => void;
  onRemoveFolder: (m: ModelEntry) => void;
  /** Hugging Face downloads (kept by the app, so they outlive the panel). */
  downloads: Downloads;
  onClose: () => void;
}) {
  return (
    <Modal title="Models" onClose={onClose} className="models-panel" testId="models-panel">
      <div className="models-scroll">
        {models.length === 0 ? (
          <div className="panel-empty">No models found. Add a folder that holds a model.</div>
        ) : (
          <ul className="model-list">
            {models.map((m) => {
              const isLoaded = loaded?.path === m.path;
              const isLoading = loadingPath === m.path;
              // An assistant drafter is chosen in a chat's settings, never loaded to chat with.
              const disabled = m.problem !== null || m.drafter || isLoading;
              return (
                <li
                  key={m.path}
                  className={`model-item${isLoaded ? " loaded" : ""}${m.problem ? " problem" : ""}`}
                  data-testid="model-item"
                  data-path={m.path}
                  aria-disabled={disabled ? "true" : undefined}
                >
                  <button
                    type="button"
                    className="model-main"
                    disabled={disabled}
                    title={m.problem ?? (m.drafter ? "A drafter made for one model (Gemma 4 assistant, Qwen3.5 MTP): choose it under Speculative decoding in a chat's settings" : m.path)}
                    onClick={() => onLoad(m)}
                  >
                    <span className="model-name">{m.name}</span>
                    <span className="model-meta">
                      <span className={`badge source-${m.source}`}>{SOURCE_LABEL[m.source]}</span>
                      {m.vision ? <span className="badge vision">vision</span> : null}
                      {m.drafter ? <span className="badge">assistant drafter</span> : null}
                      {m.bytes > 0 ? <span className="model-size">{formatBytes(m.bytes)}</span> : null}
                      {isLoaded ? <span className="badge ok">loaded</span> : null}
                      {isLoading ? <span className="badge">loading…</span> : null}
                    </span>
                    {m.problem ? <span className="model-problem">{m.problem}</span> : null}
                  </button>
                  {m.source === "folder" ? (
                    <button
                      type="button"
                      className="icon-button small"
                      data-testid="remove-model-folder"
                      title="Remove this folder from the library"
                      aria-label={`Remove ${m.name}`}
                      onClick={() => onRemoveFolder(m)}
                    >
                      ×
                    </button>
                  ) : null}
                </li>
              );
            })}
          </ul>
        )}
        <div className="modal-actions">
          <button type="button" className="button" data-testid="add-model-folder" onClick={onAddFolder}>
            Add folder…
          </button>
        </div>
        <DownloadsSection downloads={downloads} />
        <LocalServerSettings />
      </div>
    </Modal>
  );
}
