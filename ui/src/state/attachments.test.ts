import { describe, expect, it } from "vitest";
import type { PendingAttachment } from "../ipc/bindings";
import {
  MAX_ATTACHMENT_BYTES,
  NO_VISION_MESSAGE,
  addAttachment,
  formatBytes,
  mimeOf,
  partitionFiles,
  rejectReason,
  removeAttachment,
  visionRefusal,
} from "./attachments";

const png = { name: "cat.png", type: "image/png", size: 1000 };

function pending(file: string): PendingAttachment {
  return { file, mime: "image/png", bytes: 10, width: 1, height: 1, name: file };
}

describe("attachments", () => {
  it("accepts the supported image types", () => {
    for (const type of ["image/png", "image/jpeg", "image/webp", "image/gif", "image/bmp"]) {
      expect(rejectReason({ name: "x", type, size: 10 })).toBeNull();
    }
  });

  it("rejects other types with a readable reason", () => {
    const r = rejectReason({ name: "notes.pdf", type: "application/pdf", size: 10 });
    expect(r).toContain("notes.pdf");
    expect(r).toContain("not a supported image type");
    expect(rejectReason({ name: "pic.svg", type: "image/svg+xml", size: 10 })).not.toBeNull();
  });

  it("falls back on the extension when the type is missing", () => {
    expect(mimeOf({ name: "a.JPG", type: "", size: 1 })).toBe("image/jpeg");
    expect(rejectReason({ name: "a.webp", type: "", size: 1 })).toBeNull();
    expect(rejectReason({ name: "a.txt", type: "", size: 1 })).toContain("not a supported image type");
  });

  it("rejects files over the size limit and empty files", () => {
    const big = { ...png, size: MAX_ATTACHMENT_BYTES + 1 };
    expect(rejectReason(big)).toMatch(/over the 20 MB limit/);
    expect(rejectReason({ ...png, size: MAX_ATTACHMENT_BYTES })).toBeNull();
    expect(rejectReason({ ...png, size: 0 })).toMatch(/empty/);
  });

  it("partitions files into accepted and rejected", () => {
    const bad = { name: "a.txt", type: "text/plain", size: 3 };
    const { accepted, rejected } = partitionFiles([png, bad]);
    expect(accepted).toEqual([png]);
    expect(rejected).toHaveLength(1);
    expect(rejected[0].name).toBe("a.txt");
  });

  it("de-duplicates by stored file and removes", () => {
    let list = addAttachment([], pending("a"));
    list = addAttachment(list, pending("b"));
    list = addAttachment(list, pending("a"));
    expect(list.map((a) => a.file)).toEqual(["a", "b"]);
    expect(removeAttachment(list, "a").map((a) => a.file)).toEqual(["b"]);
    expect(removeAttachment(list, "zzz")).toHaveLength(2);
  });

  it("refuses images when the model has no vision or none is loaded", () => {
    const base = { path: "/m", name: "M", max_context: 2048, kv_costs: { full: 0, affine8: 0, affine4: 0, turbo3: 0 }, thinking: false };
    expect(visionRefusal({ ...base, vision: false })).toBe(NO_VISION_MESSAGE);
    expect(visionRefusal(null)).toBe(NO_VISION_MESSAGE);
    expect(visionRefusal({ ...base, vision: true })).toBeNull();
  });

  it("formats sizes", () => {
    expect(formatBytes(512)).toBe("512 B");
    expect(formatBytes(1536)).toBe("1.5 KB");
    expect(formatBytes(20 * 1024 * 1024)).toBe("20 MB");
  });
});
