import { describe, expect, it } from "vitest";
import { splitThinking } from "./thinking";

describe("splitThinking", () => {
  it("separates a closed thinking block from the answer", () => {
    expect(splitThinking("<think>\nAdd them.\n</think>\n\n4")).toEqual({ thinking: "Add them.", answer: "4", open: false });
  });

  it("reads a block the prompt opened (only the closing tag in the reply)", () => {
    expect(splitThinking("Add them.\n</think>\n\n4")).toEqual({ thinking: "Add them.", answer: "4", open: false });
  });

  it("reports a block still open while the model thinks", () => {
    expect(splitThinking("<think>\nLet me see")).toEqual({ thinking: "Let me see", answer: "", open: true });
  });

  it("keeps an empty block (thinking turned off) apart from the answer", () => {
    expect(splitThinking("<think>\n\n</think>\n\nHello")).toEqual({ thinking: "", answer: "Hello", open: false });
  });

  it("leaves a reply without thinking as it is", () => {
    expect(splitThinking("Plain answer with <think> in the middle")).toEqual({
      thinking: null,
      answer: "Plain answer with <think> in the middle",
      open: false,
    });
  });
});
