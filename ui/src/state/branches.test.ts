import { describe, expect, it } from "vitest";
import { branchLabel, hasBranches, nextSibling, prevSibling } from "./branches";

describe("branches", () => {
  const mid = { index: 1, count: 3, siblings: [7, 8, 9] };
  const first = { index: 0, count: 3, siblings: [7, 8, 9] };
  const last = { index: 2, count: 3, siblings: [7, 8, 9] };

  it("labels 1-based position over count", () => {
    expect(branchLabel(mid)).toBe("2/3");
    expect(branchLabel(first)).toBe("1/3");
    expect(branchLabel({ index: 0, count: 1, siblings: [5] })).toBe("1/1");
  });

  it("prev/next give the neighbouring sibling ids", () => {
    expect(prevSibling(mid)).toBe(7);
    expect(nextSibling(mid)).toBe(9);
  });

  it("returns null at the ends", () => {
    expect(prevSibling(first)).toBeNull();
    expect(nextSibling(last)).toBeNull();
    expect(nextSibling({ index: 0, count: 1, siblings: [5] })).toBeNull();
    expect(prevSibling({ index: 0, count: 1, siblings: [5] })).toBeNull();
  });

  it("hasBranches only when there are siblings", () => {
    expect(hasBranches(mid)).toBe(true);
    expect(hasBranches({ index: 0, count: 1, siblings: [5] })).toBe(false);
  });
});
