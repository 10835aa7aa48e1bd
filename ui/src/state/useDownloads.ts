// The app's downloads: kept above the Models panel, so that a download started there keeps
// its progress channel (and its row its live progress) when the panel is closed and reopened.
import { useCallback, useEffect, useMemo, useReducer, useRef } from "react";
import type { DownloadView, ModelEntry } from "../ipc/bindings";
import * as api from "../ipc/commands";
import { Channel, errorKind, errorMessage } from "../ipc/commands";
import { type DownloadMap, downloadsReducer, isActive } from "./downloads";

export type Downloads = {
  /** The downloads known, by repo. */
  map: DownloadMap;
  /** Whether an active download is not streaming to this window (started before a reload):
   * its progress is then polled from `list_downloads` while the panel is open. */
  untrackedActive: boolean;
  /** Downloads or resumes `repo`; failures land in its view. */
  start: (repo: string) => Promise<void>;
  /** Pauses `repo` (its partial files are kept). Rejects with the command's error. */
  pause: (repo: string) => Promise<void>;
  /** Cancels `repo` and drops its partial files. Rejects with the command's error. */
  cancel: (repo: string) => Promise<void>;
  /** Refreshes the map from the backend. Rejects with the command's error. */
  refresh: () => Promise<void>;
};

/**
 * `onDownloaded` runs when a download finished: with its library entry, or null when the
 * finish was seen in the backend's list (a download this window does not stream).
 */
export function useDownloads(onDownloaded: (entry: ModelEntry | null) => void): Downloads {
  const [map, dispatch] = useReducer(downloadsReducer, {});
  const mapRef = useRef(map);
  mapRef.current = map;
  // Downloads whose channel this window holds.
  const streaming = useRef(new Set<string>());
  const cancelling = useRef(new Set<string>());
  const onDownloadedRef = useRef(onDownloaded);
  useEffect(() => {
    onDownloadedRef.current = onDownloaded;
  }, [onDownloaded]);

  const start = useCallback(async (repo: string) => {
    if (streaming.current.has(repo)) return;
    streaming.current.add(repo);
    cancelling.current.delete(repo);
    dispatch({ type: "started", repo });
    const ch = new Channel<DownloadView>();
    // Events still on the way once the command answered are stale: the answer is final.
    let settled = false;
    ch.onmessage = (view) => {
      if (!settled) dispatch({ type: "progress", view });
    };
    try {
      const entry = await api.downloadModel(repo, ch);
      settled = true;
      dispatch({ type: "finished", repo, path: entry.path });
      onDownloadedRef.current(entry);
    } catch (e) {
      settled = true;
      if (errorKind(e) === "cancelled") {
        dispatch(cancelling.current.has(repo) ? { type: "removed", repo } : { type: "paused", repo });
      } else {
        dispatch({ type: "failed", repo, message: errorMessage(e), kind: errorKind(e) });
      }
    } finally {
      streaming.current.delete(repo);
      cancelling.current.delete(repo);
    }
  }, []);

  const pause = useCallback(async (repo: string) => {
    const paused = await api.pauseDownload(repo);
    // A streamed download's rejection says so too; one started before a reload only here.
    if (paused) dispatch({ type: "paused", repo });
  }, []);

  const cancel = useCallback(async (repo: string) => {
    cancelling.current.add(repo);
    try {
      await api.cancelDownload(repo);
    } catch (e) {
      cancelling.current.delete(repo);
      throw e;
    }
    dispatch({ type: "removed", repo });
  }, []);

  const refresh = useCallback(async () => {
    const before = mapRef.current;
    const views = await api.listDownloads();
    dispatch({ type: "list", views });
    const finished = views.some(
      (v) => v.state === "done" && !streaming.current.has(v.repo) && before[v.repo] !== undefined && before[v.repo].state !== "done",
    );
    if (finished) onDownloadedRef.current(null);
  }, []);

  const untrackedActive = Object.values(map).some((v) => isActive(v.state) && !streaming.current.has(v.repo));

  return useMemo(
    () => ({ map, untrackedActive, start, pause, cancel, refresh }),
    [map, untrackedActive, start, pause, cancel, refresh],
  );
}
