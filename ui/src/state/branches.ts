// Branch navigation helpers over BranchInfo (index is 0-based among siblings).
import type { BranchInfo } from "../ipc/bindings";

/** "2/3" for the second of three siblings. */
export function branchLabel(info: BranchInfo): string {
  const count = Math.max(info.count, info.siblings.length, 1);
  const index = Math.min(Math.max(info.index, 0), count - 1);
  return `${index + 1}/${count}`;
}

/** Whether there is more than one sibling to navigate between. */
export function hasBranches(info: BranchInfo): boolean {
  return info.count > 1;
}

/** The previous sibling's id, or null at the first. */
export function prevSibling(info: BranchInfo): number | null {
  const i = info.index - 1;
  return i >= 0 && i < info.siblings.length ? info.siblings[i] : null;
}

/** The next sibling's id, or null at the last. */
export function nextSibling(info: BranchInfo): number | null {
  const i = info.index + 1;
  return i >= 0 && i < info.siblings.length ? info.siblings[i] : null;
}
