// Model downloads from the Hugging Face hub: the downloads map (by repo) and how a
// download, a size and a fit estimate read.
import type { CatalogEntry, DownloadState, DownloadView, ErrorKind, Fit, FitVerdict } from "../ipc/bindings";
import { formatBytes } from "./attachments";

/** The downloads known to the UI, by repo (`org/name`). */
export type DownloadMap = Readonly<Record<string, DownloadView>>;

export type DownloadAction =
  /** A view from the download's channel. */
  | { type: "progress"; view: DownloadView }
  /** The backend's list (`list_downloads`). */
  | { type: "list"; views: readonly DownloadView[] }
  /** A download (or resume) was asked for. */
  | { type: "started"; repo: string }
  /** The download resolved: the model is in the library. */
  | { type: "finished"; repo: string; path: string }
  /** The download was paused (it rejected with `cancelled`, the user having paused it). */
  | { type: "paused"; repo: string }
  /** The download rejected. */
  | { type: "failed"; repo: string; message: string; kind: ErrorKind | null }
  /** The download was cancelled and its partial files dropped. */
  | { type: "removed"; repo: string };

/** The active states: a progress bar, Pause and Cancel. */
export function isActive(state: DownloadState): boolean {
  return state === "queued" || state === "downloading";
}

/** A view for a download not heard of yet. */
export function emptyView(repo: string): DownloadView {
  return {
    repo,
    revision: "main",
    state: "queued",
    done_bytes: 0,
    total_bytes: 0,
    file: "",
    file_done: 0,
    file_size: 0,
    files_done: 0,
    files: 0,
    rate: 0,
    eta_s: null,
    error: null,
    error_kind: null,
    path: null,
  };
}

/**
 * Merges a view into the map. A finished download stays finished: a progress event that
 * arrives after the download resolved does not take it back.
 */
export function mergeDownload(map: DownloadMap, view: DownloadView): DownloadMap {
  const prev = map[view.repo];
  if (prev?.state === "done" && view.state !== "done") return map;
  return { ...map, [view.repo]: view };
}

function patch(map: DownloadMap, repo: string, p: Partial<DownloadView>): DownloadMap {
  return { ...map, [repo]: { ...(map[repo] ?? emptyView(repo)), ...p } };
}

export function downloadsReducer(map: DownloadMap, action: DownloadAction): DownloadMap {
  switch (action.type) {
    case "progress":
      return mergeDownload(map, action.view);
    case "list":
      return action.views.reduce(mergeDownload, map);
    case "started":
      return patch(map, action.repo, { state: "queued", rate: 0, eta_s: null, error: null, error_kind: null });
    case "finished": {
      const prev = map[action.repo];
      const total = prev?.total_bytes ?? 0;
      return patch(map, action.repo, {
        state: "done",
        done_bytes: total > 0 ? total : (prev?.done_bytes ?? 0),
        files_done: prev?.files ?? 0,
        rate: 0,
        eta_s: null,
        error: null,
        error_kind: null,
        path: action.path,
      });
    }
    case "paused":
      if (map[action.repo]?.state === "done") return map;
      return patch(map, action.repo, { state: "paused", rate: 0, eta_s: null });
    case "failed":
      if (map[action.repo]?.state === "done") return map;
      return patch(map, action.repo, {
        state: "failed",
        rate: 0,
        eta_s: null,
        error: action.message,
        error_kind: action.kind,
      });
    case "removed": {
      if (!(action.repo in map)) return map;
      const next = { ...map };
      delete next[action.repo];
      return next;
    }
  }
}

/** "8 s", "5 min", "1 h 20 min"; "" for no estimate. */
export function formatEta(seconds: number | null): string {
  if (seconds === null || !Number.isFinite(seconds) || seconds < 0) return "";
  const secs = Math.max(1, Math.round(seconds));
  if (secs < 60) return `${secs} s`;
  const mins = Math.round(secs / 60);
  if (mins < 60) return `${mins} min`;
  const h = Math.floor(mins / 60);
  const m = mins % 60;
  return m > 0 ? `${h} h ${m} min` : `${h} h`;
}

function bytesLine(v: DownloadView): string {
  return v.total_bytes > 0
    ? `${formatBytes(v.done_bytes)} of ${formatBytes(v.total_bytes)}`
    : formatBytes(v.done_bytes);
}

/** "12 MB of 44 MB · 5.1 MB/s · 8 s left · file 2/9" while downloading; the state's word else. */
export function downloadStatusLine(v: DownloadView): string {
  switch (v.state) {
    case "queued":
      return v.done_bytes > 0 ? `Waiting to start · ${bytesLine(v)}` : "Waiting to start";
    case "downloading": {
      // A lost connection: the backend says when it tries again.
      if (v.error) return `${bytesLine(v)} · ${v.error}`;
      const parts = [bytesLine(v)];
      if (v.rate > 0) parts.push(`${formatBytes(Math.round(v.rate))}/s`);
      const eta = formatEta(v.eta_s);
      if (eta) parts.push(`${eta} left`);
      if (v.files > 0) {
        const which = `file ${Math.min(v.files_done + 1, v.files)}/${v.files}`;
        // The file being fetched and its own progress, when known.
        parts.push(
          v.file && v.file_size > 0
            ? `${which}: ${v.file} ${formatBytes(v.file_done)} of ${formatBytes(v.file_size)}`
            : which,
        );
      }
      return parts.join(" · ");
    }
    case "paused":
      return `Paused · ${bytesLine(v)}`;
    case "failed":
      return v.done_bytes > 0 ? `Stopped at ${bytesLine(v)}` : "Stopped";
    case "done":
      return v.total_bytes > 0 ? `Downloaded ${formatBytes(v.total_bytes)}` : "Downloaded";
  }
}

const FIT_LABEL: Record<FitVerdict, string | null> = {
  fits: "fits",
  tight: "tight fit",
  too_big: "too big for this Mac",
  unknown: null,
};

/** The fit badge's text; null when there is no estimate. */
export function fitLabel(fit: Fit): string | null {
  return FIT_LABEL[fit.verdict];
}

/** "weights + KV cache at 8,192 tokens ≈ 5.1 GB of 16 GB memory"; null when unknown. */
export function fitTitle(fit: Fit): string | null {
  if (fit.verdict === "unknown" || fit.needed_bytes <= 0 || fit.memory_bytes <= 0) return null;
  return `weights + KV cache at ${fit.context_tokens.toLocaleString("en-US")} tokens ≈ ${formatBytes(fit.needed_bytes)} of ${formatBytes(fit.memory_bytes)} memory`;
}

/** The weights' size: "≈ 5.1 GB" for the catalog's estimate, "5.1 GB" once exact; null if unknown. */
export function sizeLabel(entry: CatalogEntry, exact: boolean): string | null {
  if (entry.weight_bytes === null || entry.weight_bytes <= 0) return null;
  return `${exact ? "" : "≈ "}${formatBytes(entry.weight_bytes)}`;
}

/** Where the token is kept, in words. */
export function tokenStoreLabel(store: string): string {
  if (store === "keychain") return "macOS Keychain";
  if (store === "file") return "a file only you can read";
  return store;
}

export const OFFLINE_MESSAGE =
  "Networking is off. Turn on “Allow Quince to connect to Hugging Face” under Network to search and download.";

/** The text for a failed search, details or download; for `offline`, what to do about it. */
export function libraryErrorText(kind: ErrorKind | null, message: string): string {
  return kind === "offline" ? OFFLINE_MESSAGE : message;
}
