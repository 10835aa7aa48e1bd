import { useEffect, useLayoutEffect, useRef, useState, type ReactNode } from "react";
import type { ConversationDetail } from "../ipc/bindings";
import type { Waiting } from "../state/stream";
import { Message } from "./Message";

/** The row under a message that waits for the model to load. */
function WaitingRow({ waiting }: { waiting: Waiting }) {
  const pct = waiting.total > 0 ? Math.round((Math.min(waiting.done, waiting.total) / waiting.total) * 100) : null;
  return (
    <div className="reply-waiting" data-testid="waiting-for-model" role="status">
      <span className="spinner" aria-hidden="true" />
      Waiting for {waiting.model} to load…
      {waiting.stage ? ` ${waiting.stage}` : ""}
      {pct !== null ? ` ${pct}%` : ""}
    </div>
  );
}

/** The row under a reply that waits in line for replies of other conversations to finish. */
function QueuedRow({ reason }: { reason: string }) {
  return (
    <div className="reply-waiting" data-testid="queued" role="status" title={reason}>
      <span className="spinner" aria-hidden="true" />
      Waiting for another chat's reply to finish: {reason}.
    </div>
  );
}

export function ChatView({
  detail,
  streaming,
  busy,
  visionRefusal,
  onFiles,
  onRefused,
  onRegenerate,
  onEdit,
  onSwitchBranch,
  onRetry,
  waiting,
  queued,
  composer,
}: {
  detail: ConversationDetail | null;
  /** A reply streams into this conversation. */
  streaming: boolean;
  /** A reply streams anywhere. */
  busy: boolean;
  visionRefusal: string | null;
  onFiles: (files: File[]) => void;
  onRefused: (message: string) => void;
  onRegenerate: (id: number) => void;
  onEdit: (id: number, text: string) => Promise<boolean>;
  onSwitchBranch: (siblingId: number) => void;
  /** Answers a user message left without a reply. */
  onRetry: (id: number) => void;
  /** Set while the reply in this conversation waits for its model. */
  waiting: Waiting | null;
  /** Set while the reply in this conversation waits in line behind other chats' replies. */
  queued: string | null;
  composer: ReactNode;
}) {
  const scrollRef = useRef<HTMLDivElement>(null);
  const stickRef = useRef(true);
  const dragDepth = useRef(0);
  const [dragging, setDragging] = useState(false);
  const messages = detail?.messages ?? [];
  const last = messages[messages.length - 1];

  // Follow the stream while the view is scrolled to the bottom.
  useLayoutEffect(() => {
    const el = scrollRef.current;
    if (el && stickRef.current) el.scrollTop = el.scrollHeight;
  }, [messages.length, last?.content, last?.state, waiting?.done]);

  // A newly opened conversation starts at the bottom.
  useEffect(() => {
    stickRef.current = true;
    const el = scrollRef.current;
    if (el) el.scrollTop = el.scrollHeight;
  }, [detail?.id]);

  const hasFiles = (e: React.DragEvent) => Array.from(e.dataTransfer.types).includes("Files");

  return (
    <div
      className="chat"
      data-testid="chat"
      data-streaming={streaming ? "true" : "false"}
      onDragEnter={(e) => {
        if (!hasFiles(e)) return;
        e.preventDefault();
        dragDepth.current += 1;
        setDragging(true);
      }}
      onDragOver={(e) => {
        if (!hasFiles(e)) return;
        e.preventDefault();
        e.dataTransfer.dropEffect = visionRefusal ? "none" : "copy";
      }}
      onDragLeave={(e) => {
        if (!hasFiles(e)) return;
        dragDepth.current = Math.max(0, dragDepth.current - 1);
        if (dragDepth.current === 0) setDragging(false);
      }}
      onDrop={(e) => {
        if (!hasFiles(e)) return;
        e.preventDefault();
        dragDepth.current = 0;
        setDragging(false);
        const files = Array.from(e.dataTransfer.files);
        if (files.length === 0) return;
        if (visionRefusal) onRefused(visionRefusal);
        else onFiles(files);
      }}
    >
      <div
        className="messages"
        ref={scrollRef}
        onScroll={(e) => {
          const el = e.currentTarget;
          stickRef.current = el.scrollHeight - el.scrollTop - el.clientHeight < 48;
        }}
      >
        {messages.length === 0 ? (
          <div className="empty-state" data-testid="empty-state">
            <div className="empty-mark" aria-hidden="true">
              ◆
            </div>
            <h1>Quince</h1>
            <p>Send a message to start</p>
          </div>
        ) : (
          <div className="thread">
            {messages.map((m) => (
              <Message
                key={m.id}
                msg={m}
                busy={busy}
                onRegenerate={onRegenerate}
                onEdit={onEdit}
                onSwitchBranch={onSwitchBranch}
              />
            ))}
            {waiting && streaming ? <WaitingRow waiting={waiting} /> : null}
            {queued && streaming && !waiting ? <QueuedRow reason={queued} /> : null}
            {!streaming && last?.role === "user" ? (
              <div className="reply-missing" data-testid="unanswered">
                Not answered yet.
                <button
                  type="button"
                  className="button small"
                  data-testid="retry-button"
                  disabled={busy}
                  onClick={() => onRetry(last.id)}
                >
                  Retry
                </button>
              </div>
            ) : null}
          </div>
        )}
      </div>
      {composer}
      {dragging ? (
        <div className={`drop-overlay${visionRefusal ? " refused" : ""}`} data-testid="drop-overlay">
          <div className="drop-box">{visionRefusal ?? "Drop images to attach"}</div>
        </div>
      ) : null}
    </div>
  );
}
