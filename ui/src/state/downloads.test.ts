import { describe, expect, it } from "vitest";
import type { CatalogEntry, DownloadView, Fit } from "../ipc/bindings";
import {
  type DownloadMap,
  downloadStatusLine,
  downloadsReducer,
  emptyView,
  fitLabel,
  fitTitle,
  formatEta,
  libraryErrorText,
  mergeDownload,
  OFFLINE_MESSAGE,
  sizeLabel,
  tokenStoreLabel,
} from "./downloads";

const MB = 1024 * 1024;
const GB = 1024 * MB;

function view(p: Partial<DownloadView> = {}): DownloadView {
  return { ...emptyView("org/model"), state: "downloading", ...p };
}

function fit(p: Partial<Fit> = {}): Fit {
  return { verdict: "fits", needed_bytes: 5 * GB, memory_bytes: 16 * GB, context_tokens: 8192, ...p };
}

function entry(p: Partial<CatalogEntry> = {}): CatalogEntry {
  return {
    repo: "org/model",
    name: "Model",
    description: "",
    recommended: true,
    drafter: false,
    vision: false,
    weight_bytes: 2.5 * GB,
    fit: fit(),
    local_path: null,
    download: null,
    ...p,
  };
}

describe("formatEta", () => {
  it("reads in seconds, minutes and hours", () => {
    expect(formatEta(8)).toBe("8 s");
    expect(formatEta(0.2)).toBe("1 s");
    expect(formatEta(59)).toBe("59 s");
    expect(formatEta(90)).toBe("2 min");
    expect(formatEta(45 * 60)).toBe("45 min");
    expect(formatEta(3600)).toBe("1 h");
    expect(formatEta(80 * 60)).toBe("1 h 20 min");
  });

  it("is empty without an estimate", () => {
    expect(formatEta(null)).toBe("");
    expect(formatEta(Number.NaN)).toBe("");
    expect(formatEta(-1)).toBe("");
  });
});

describe("downloadStatusLine", () => {
  it("gives bytes, speed, time left and file while downloading", () => {
    const v = view({ done_bytes: 12 * MB, total_bytes: 44 * MB, rate: 5.1 * MB, eta_s: 8, files_done: 1, files: 9 });
    expect(downloadStatusLine(v)).toBe("12 MB of 44 MB · 5.1 MB/s · 8 s left · file 2/9");
  });

  it("names the file being fetched with its own progress", () => {
    const v = view({
      done_bytes: 12 * MB, total_bytes: 44 * MB, files_done: 1, files: 4,
      file: "model.safetensors", file_done: 3 * MB, file_size: 9 * MB,
    });
    expect(downloadStatusLine(v)).toBe("12 MB of 44 MB · file 2/4: model.safetensors 3.0 MB of 9.0 MB");
  });

  it("says when a lost connection is tried again", () => {
    const v = view({ done_bytes: 3 * MB, total_bytes: 44 * MB, error: "Connection lost (reset). Trying again in 2 s." });
    expect(downloadStatusLine(v)).toBe("3.0 MB of 44 MB · Connection lost (reset). Trying again in 2 s.");
  });

  it("leaves out what is not known yet", () => {
    expect(downloadStatusLine(view({ done_bytes: 2048 }))).toBe("2.0 KB");
    // The file count never passes the number of files.
    expect(downloadStatusLine(view({ done_bytes: 44 * MB, total_bytes: 44 * MB, files_done: 9, files: 9 }))).toBe(
      "44 MB of 44 MB · file 9/9",
    );
  });

  it("names the other states", () => {
    expect(downloadStatusLine(view({ state: "queued" }))).toBe("Waiting to start");
    expect(downloadStatusLine(view({ state: "paused", done_bytes: 12 * MB, total_bytes: 44 * MB }))).toBe("Paused · 12 MB of 44 MB");
    expect(downloadStatusLine(view({ state: "failed" }))).toBe("Stopped");
    expect(downloadStatusLine(view({ state: "done", done_bytes: 44 * MB, total_bytes: 44 * MB }))).toBe("Downloaded 44 MB");
  });
});

describe("fit", () => {
  it("labels each verdict", () => {
    expect(fitLabel(fit({ verdict: "fits" }))).toBe("fits");
    expect(fitLabel(fit({ verdict: "tight" }))).toBe("tight fit");
    expect(fitLabel(fit({ verdict: "too_big" }))).toBe("too big for this Mac");
    expect(fitLabel(fit({ verdict: "unknown" }))).toBeNull();
  });

  it("explains the estimate", () => {
    expect(fitTitle(fit())).toBe("weights + KV cache at 8,192 tokens ≈ 5.0 GB of 16 GB memory");
    expect(fitTitle(fit({ verdict: "unknown" }))).toBeNull();
  });
});

describe("sizeLabel", () => {
  it("marks the catalog's estimate", () => {
    expect(sizeLabel(entry(), false)).toBe("≈ 2.5 GB");
    expect(sizeLabel(entry(), true)).toBe("2.5 GB");
    expect(sizeLabel(entry({ weight_bytes: null }), false)).toBeNull();
  });
});

describe("words", () => {
  it("says where the token is kept", () => {
    expect(tokenStoreLabel("keychain")).toBe("macOS Keychain");
    expect(tokenStoreLabel("file")).toBe("a file only you can read");
  });

  it("explains that networking is off", () => {
    expect(libraryErrorText("offline", "offline")).toBe(OFFLINE_MESSAGE);
    expect(libraryErrorText("network", "Could not reach huggingface.co")).toBe("Could not reach huggingface.co");
  });
});

describe("downloadsReducer", () => {
  it("merges views by repo", () => {
    let m: DownloadMap = {};
    m = mergeDownload(m, view({ repo: "a/x", done_bytes: 1 }));
    m = mergeDownload(m, view({ repo: "b/y", done_bytes: 2 }));
    m = mergeDownload(m, view({ repo: "a/x", done_bytes: 3 }));
    expect(Object.keys(m)).toEqual(["a/x", "b/y"]);
    expect(m["a/x"].done_bytes).toBe(3);
  });

  it("keeps a finished download finished when a late event arrives", () => {
    let m = downloadsReducer({}, { type: "progress", view: view({ done_bytes: 5, total_bytes: 10, files: 2 }) });
    m = downloadsReducer(m, { type: "finished", repo: "org/model", path: "/hf/snap" });
    expect(m["org/model"]).toMatchObject({ state: "done", done_bytes: 10, files_done: 2, path: "/hf/snap" });
    const late = downloadsReducer(m, { type: "progress", view: view({ done_bytes: 7, total_bytes: 10 }) });
    expect(late).toBe(m);
    expect(downloadsReducer(m, { type: "list", views: [view({ state: "paused" })] })).toBe(m);
    expect(downloadsReducer(m, { type: "failed", repo: "org/model", message: "x", kind: "network" })).toBe(m);
  });

  it("starts, pauses, fails and removes", () => {
    let m = downloadsReducer({}, { type: "started", repo: "org/model" });
    expect(m["org/model"]).toMatchObject({ state: "queued", done_bytes: 0 });
    m = downloadsReducer(m, { type: "progress", view: view({ done_bytes: 4, rate: 9, eta_s: 3 }) });
    m = downloadsReducer(m, { type: "paused", repo: "org/model" });
    expect(m["org/model"]).toMatchObject({ state: "paused", done_bytes: 4, rate: 0, eta_s: null });
    m = downloadsReducer(m, { type: "failed", repo: "org/model", message: "Token needed", kind: "unauthorized" });
    expect(m["org/model"]).toMatchObject({ state: "failed", done_bytes: 4, error: "Token needed", error_kind: "unauthorized" });
    // Resuming clears the failure and keeps the bytes.
    m = downloadsReducer(m, { type: "started", repo: "org/model" });
    expect(m["org/model"]).toMatchObject({ state: "queued", done_bytes: 4, error: null, error_kind: null });
    m = downloadsReducer(m, { type: "removed", repo: "org/model" });
    expect(m).toEqual({});
    expect(downloadsReducer(m, { type: "removed", repo: "org/model" })).toBe(m);
  });

  it("merges the backend's list", () => {
    const m = downloadsReducer(
      { "a/x": view({ repo: "a/x", done_bytes: 1 }) },
      { type: "list", views: [view({ repo: "a/x", done_bytes: 2 }), view({ repo: "b/y", state: "paused" })] },
    );
    expect(m["a/x"].done_bytes).toBe(2);
    expect(m["b/y"].state).toBe("paused");
  });
});
