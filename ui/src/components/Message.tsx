import { memo, useEffect, useRef, useState } from "react";
import { convertFileSrc } from "@tauri-apps/api/core";
import type { ThreadMessage } from "../ipc/bindings";
import { branchLabel, hasBranches, nextSibling, prevSibling } from "../state/branches";
import { resumed, statsLine } from "../state/format";
import { Markdown } from "./Markdown";
import { splitThinking } from "../state/thinking";

export function attachmentSrc(file: string): string {
  return convertFileSrc(file, "quince-attachment");
}

function BranchNav({
  msg,
  disabled,
  onSwitch,
}: {
  msg: ThreadMessage;
  disabled: boolean;
  onSwitch: (siblingId: number) => void;
}) {
  if (!hasBranches(msg.branch)) return null;
  const prev = prevSibling(msg.branch);
  const next = nextSibling(msg.branch);
  return (
    <span className="branch-nav">
      <button
        type="button"
        className="icon-button small"
        data-testid="branch-prev"
        aria-label="Previous version"
        title="Previous version"
        disabled={disabled || prev === null}
        onClick={() => prev !== null && onSwitch(prev)}
      >
        ‹
      </button>
      <span className="branch-label" data-testid="branch-label">
        {branchLabel(msg.branch)}
      </span>
      <button
        type="button"
        className="icon-button small"
        data-testid="branch-next"
        aria-label="Next version"
        title="Next version"
        disabled={disabled || next === null}
        onClick={() => next !== null && onSwitch(next)}
      >
        ›
      </button>
    </span>
  );
}

function EditBox({
  initial,
  onSave,
  onCancel,
}: {
  initial: string;
  onSave: (text: string) => void;
  onCancel: () => void;
}) {
  const [text, setText] = useState(initial);
  const ref = useRef<HTMLTextAreaElement>(null);
  useEffect(() => {
    const el = ref.current;
    if (!el) return;
    el.focus();
    el.setSelectionRange(el.value.length, el.value.length);
  }, []);
  useEffect(() => {
    const el = ref.current;
    if (!el) return;
    el.style.height = "auto";
    el.style.height = `${Math.min(el.scrollHeight, 320)}px`;
  }, [text]);
  const save = () => {
    if (text.trim()) onSave(text);
  };
  return (
    <div className="edit-box">
      <textarea
        ref={ref}
        data-testid="edit-input"
        aria-label="Edit message"
        value={text}
        onChange={(e) => setText(e.target.value)}
        onKeyDown={(e) => {
          if (e.key === "Enter" && !e.shiftKey && !e.nativeEvent.isComposing) {
            e.preventDefault();
            save();
          } else if (e.key === "Escape") {
            e.preventDefault();
            e.stopPropagation();
            onCancel();
          }
        }}
      />
      <div className="edit-actions">
        <button type="button" className="button" onClick={onCancel}>
          Cancel
        </button>
        <button type="button" className="button primary" data-testid="edit-save" disabled={!text.trim()} onClick={save}>
          Save &amp; submit
        </button>
      </div>
    </div>
  );
}

export const Message = memo(function Message({
  msg,
  busy,
  onRegenerate,
  onEdit,
  onSwitchBranch,
}: {
  msg: ThreadMessage;
  /** A reply is streaming somewhere: actions that start one are disabled. */
  busy: boolean;
  onRegenerate: (id: number) => void;
  /** Resolves to true when the edit was refused before anything was stored. */
  onEdit: (id: number, text: string) => Promise<boolean>;
  onSwitchBranch: (siblingId: number) => void;
}) {
  const [editing, setEditing] = useState(false);
  // An edit refused before it was stored (no model at all) comes back into the box.
  const [draft, setDraft] = useState<string | null>(null);
  const isUser = msg.role === "user";
  const streaming = msg.state === "streaming";

  return (
    <div
      className={`message ${msg.role}`}
      data-testid="message"
      data-role={msg.role}
      data-state={msg.state}
      data-id={msg.id}
    >
      <div className="message-inner">
        <div className="avatar" aria-hidden="true">
          {isUser ? "You" : "Q"}
        </div>
        <div className="message-body">
          {isUser && editing ? (
            <EditBox
              initial={draft ?? msg.content}
              onCancel={() => {
                setEditing(false);
                setDraft(null);
              }}
              onSave={(text) => {
                setEditing(false);
                setDraft(null);
                void onEdit(msg.id, text).then((refused) => {
                  if (refused) {
                    setDraft(text);
                    setEditing(true);
                  }
                });
              }}
            />
          ) : isUser ? (
            <>
              {msg.attachments.length > 0 ? (
                <div className="message-thumbs">
                  {msg.attachments.map((a) => (
                    <img
                      key={a.file}
                      className="message-thumb"
                      data-testid="message-thumb"
                      src={attachmentSrc(a.file)}
                      alt="Attached image"
                      loading="lazy"
                    />
                  ))}
                </div>
              ) : null}
              <div className="message-content user-text" data-testid="message-content">
                {msg.content}
              </div>
            </>
          ) : (
            <div className="message-content" data-testid="message-content">
              <Reply text={msg.content} streaming={streaming} />
              {streaming ? <span className="cursor" aria-label="Generating" /> : null}
            </div>
          )}

          {!editing ? (
            <div className="message-footer">
              <BranchNav msg={msg} disabled={busy} onSwitch={onSwitchBranch} />
              {!isUser && !streaming ? (
                <span className="reply-stats" data-testid="reply-stats">
                  {msg.stats ? statsLine(msg.stats) : null}
                  {msg.stats && resumed(msg.stats) ? (
                    <span
                      className="tag resumed"
                      data-testid="resumed-tag"
                      title="The conversation so far came from its saved KV checkpoint instead of being read again"
                    >
                      resumed
                    </span>
                  ) : null}
                  {msg.state === "stopped" ? <span className="tag">stopped</span> : null}
                  {msg.state === "error" ? (
                    <span className="tag error" title={msg.error ?? undefined}>
                      {msg.error ?? "error"}
                    </span>
                  ) : null}
                </span>
              ) : null}
              <span className="message-actions">
                {isUser ? (
                  <button
                    type="button"
                    className="icon-button small"
                    data-testid="edit-button"
                    title="Edit"
                    aria-label="Edit message"
                    disabled={busy}
                    onClick={() => setEditing(true)}
                  >
                    ✎
                  </button>
                ) : !streaming ? (
                  <>
                    <CopyButton text={msg.content} />
                    <button
                      type="button"
                      className="icon-button small"
                      data-testid="regenerate-button"
                      title="Regenerate"
                      aria-label="Regenerate reply"
                      disabled={busy}
                      onClick={() => onRegenerate(msg.id)}
                    >
                      ↻
                    </button>
                  </>
                ) : null}
              </span>
            </div>
          ) : null}
        </div>
      </div>
    </div>
  );
});

function CopyButton({ text }: { text: string }) {
  const [copied, setCopied] = useState(false);
  return (
    <button
      type="button"
      className="icon-button small"
      title={copied ? "Copied" : "Copy reply"}
      aria-label="Copy reply"
      onClick={async () => {
        try {
          await navigator.clipboard.writeText(text);
          setCopied(true);
          window.setTimeout(() => setCopied(false), 1500);
        } catch {
          /* clipboard unavailable */
        }
      }}
    >
      {copied ? "✓" : "⧉"}
    </button>
  );
}

/** A reply: its thinking folded (open it to read), then the answer. */
function Reply({ text, streaming }: { text: string; streaming: boolean }) {
  const parts = splitThinking(text);
  return (
    <>
      {parts.thinking !== null && (parts.thinking !== "" || parts.open) ? (
        <details className="thinking" data-testid="thinking">
          <summary>{parts.open && streaming ? "Thinking…" : "Thought"}</summary>
          <div className="thinking-text">{parts.thinking}</div>
        </details>
      ) : null}
      {parts.answer ? <Markdown text={parts.answer} /> : null}
    </>
  );
}
