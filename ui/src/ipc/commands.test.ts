import { describe, expect, it } from "vitest";
import { errorKind, errorMessage, isCommandError } from "./commands";

describe("errorMessage", () => {
  it("shows a command error's message", () => {
    expect(errorMessage({ kind: "bad_image", message: "That file is not an image" })).toBe(
      "That file is not an image",
    );
  });
  it("handles strings and Errors without stacks", () => {
    expect(errorMessage("plain")).toBe("plain");
    const e = new Error("broke");
    expect(errorMessage(e)).toBe("broke");
    expect(errorMessage(e)).not.toContain("at ");
  });
  it("has a fallback for odd values", () => {
    expect(errorMessage(null)).toBe("Unknown error");
    expect(errorMessage({ kind: "busy" })).toBe("busy");
    expect(errorMessage(42)).toBe("42");
  });
  it("recognises command errors", () => {
    expect(isCommandError({ kind: "cancelled", message: "x" })).toBe(true);
    expect(isCommandError({ kind: "nope", message: "x" })).toBe(false);
    expect(errorKind({ kind: "busy", message: "x" })).toBe("busy");
    expect(errorKind(new Error("x"))).toBeNull();
  });
});
