// Rules for image attachments: which files are accepted (with readable
// reasons), the pending list (deduplicated by stored file), and the refusal
// when the loaded model cannot take images.
import type { LoadedModel, PendingAttachment } from "../ipc/bindings";

export const ACCEPTED_MIME_TYPES: readonly string[] = [
  "image/png",
  "image/jpeg",
  "image/webp",
  "image/gif",
  "image/bmp",
];

export const MAX_ATTACHMENT_BYTES = 20 * 1024 * 1024;

export const NO_VISION_MESSAGE = "This model does not take images";

const EXTENSION_MIME: Record<string, string> = {
  png: "image/png",
  jpg: "image/jpeg",
  jpeg: "image/jpeg",
  jfif: "image/jpeg",
  webp: "image/webp",
  gif: "image/gif",
  bmp: "image/bmp",
};

/** The part of a File these rules look at (so tests need no DOM). */
export type FileLike = { name: string; type: string; size: number };

export type Rejection = { name: string; reason: string };

/** The file's MIME type, falling back on its extension when the browser gives none. */
export function mimeOf(file: FileLike): string {
  const t = file.type.trim().toLowerCase();
  if (t) return t === "image/jpg" ? "image/jpeg" : t;
  const dot = file.name.lastIndexOf(".");
  const ext = dot >= 0 ? file.name.slice(dot + 1).toLowerCase() : "";
  return EXTENSION_MIME[ext] ?? "";
}

export function formatBytes(n: number): string {
  if (n < 1024) return `${n} B`;
  const units = ["KB", "MB", "GB", "TB"];
  let v = n / 1024;
  let u = 0;
  while (v >= 1024 && u < units.length - 1) {
    v /= 1024;
    u++;
  }
  return `${v >= 10 ? v.toFixed(0) : v.toFixed(1)} ${units[u]}`;
}

/** Null when the file may be imported, else why not. */
export function rejectReason(file: FileLike, maxBytes: number = MAX_ATTACHMENT_BYTES): string | null {
  const mime = mimeOf(file);
  if (!ACCEPTED_MIME_TYPES.includes(mime)) {
    return mime
      ? `${file.name}: ${mime} is not a supported image type (PNG, JPEG, WebP, GIF or BMP)`
      : `${file.name}: not a supported image type (PNG, JPEG, WebP, GIF or BMP)`;
  }
  if (file.size === 0) return `${file.name}: the file is empty`;
  if (file.size > maxBytes) {
    return `${file.name}: ${formatBytes(file.size)} is over the ${formatBytes(maxBytes)} limit`;
  }
  return null;
}

/** Splits files into those to import and those refused, with reasons. */
export function partitionFiles<F extends FileLike>(
  files: readonly F[],
  maxBytes: number = MAX_ATTACHMENT_BYTES,
): { accepted: F[]; rejected: Rejection[] } {
  const accepted: F[] = [];
  const rejected: Rejection[] = [];
  for (const f of files) {
    const reason = rejectReason(f, maxBytes);
    if (reason) rejected.push({ name: f.name, reason });
    else accepted.push(f);
  }
  return { accepted, rejected };
}

/** Why images are refused for this model (or no model), or null when it takes them. */
export function visionRefusal(model: LoadedModel | null): string | null {
  return model?.vision ? null : NO_VISION_MESSAGE;
}

/** Adds an imported attachment unless the same stored file is already pending. */
export function addAttachment(list: readonly PendingAttachment[], att: PendingAttachment): PendingAttachment[] {
  return list.some((a) => a.file === att.file) ? [...list] : [...list, att];
}

export function removeAttachment(list: readonly PendingAttachment[], file: string): PendingAttachment[] {
  return list.filter((a) => a.file !== file);
}

/** Image files out of a clipboard / drop DataTransfer item list. */
export function imageFilesFrom(items: ArrayLike<{ kind: string; type: string; getAsFile(): File | null }>): File[] {
  const out: File[] = [];
  for (let i = 0; i < items.length; i++) {
    const it = items[i];
    if (it.kind === "file") {
      const f = it.getAsFile();
      if (f) out.push(f);
    }
  }
  return out;
}
