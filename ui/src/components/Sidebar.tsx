import { useEffect, useRef, useState } from "react";
import type { ConversationSummary } from "../ipc/bindings";

function ConversationItem({
  conv,
  selected,
  streaming,
  onSelect,
  onRename,
  onDelete,
}: {
  conv: ConversationSummary;
  selected: boolean;
  /** A reply is being written in this conversation. */
  streaming: boolean;
  onSelect: () => void;
  onRename: (title: string) => void;
  onDelete: () => void;
}) {
  const [editing, setEditing] = useState(false);
  const [draft, setDraft] = useState(conv.title);
  const inputRef = useRef<HTMLInputElement>(null);

  useEffect(() => {
    if (editing) {
      inputRef.current?.focus();
      inputRef.current?.select();
    }
  }, [editing]);

  const commit = () => {
    if (!editing) return;
    setEditing(false);
    const t = draft.trim();
    if (t && t !== conv.title) onRename(t);
  };

  return (
    <li
      className={`conv-item${selected ? " selected" : ""}`}
      data-testid="conversation-item"
      data-id={conv.id}
      data-replying={streaming ? "true" : undefined}
      aria-current={selected ? "true" : undefined}
      onClick={() => !editing && onSelect()}
    >
      {editing ? (
        <input
          ref={inputRef}
          className="rename-input"
          data-testid="rename-input"
          value={draft}
          aria-label="Conversation title"
          onChange={(e) => setDraft(e.target.value)}
          onClick={(e) => e.stopPropagation()}
          onBlur={commit}
          onKeyDown={(e) => {
            if (e.key === "Enter") {
              e.preventDefault();
              commit();
            } else if (e.key === "Escape") {
              e.preventDefault();
              e.stopPropagation();
              setEditing(false);
              setDraft(conv.title);
            }
          }}
        />
      ) : (
        <>
          <div className="conv-text">
            <span className="conv-title" data-testid="conversation-title" title={conv.title}>
              {streaming ? (
                <span className="conv-streaming" data-testid="conversation-streaming" title="Replying…" aria-label="Replying" />
              ) : null}
              {conv.title || "Untitled"}
            </span>
          </div>
          <div className="conv-actions">
            <button
              type="button"
              className="icon-button small"
              data-testid="rename-conversation"
              title="Rename"
              aria-label="Rename conversation"
              onClick={(e) => {
                e.stopPropagation();
                setDraft(conv.title);
                setEditing(true);
              }}
            >
              ✎
            </button>
            <button
              type="button"
              className="icon-button small"
              data-testid="delete-conversation"
              title="Delete"
              aria-label="Delete conversation"
              onClick={(e) => {
                e.stopPropagation();
                onDelete();
              }}
            >
              🗑
            </button>
          </div>
        </>
      )}
    </li>
  );
}

export function Sidebar({
  conversations,
  streaming,
  selectedId,
  query,
  onQueryChange,
  onNewChat,
  onSelect,
  onRename,
  onDelete,
}: {
  conversations: ConversationSummary[];
  /** Conversations with a reply being written (several stream at once). */
  streaming: number[];
  selectedId: number | null;
  query: string;
  onQueryChange: (q: string) => void;
  onNewChat: () => void;
  onSelect: (id: number) => void;
  onRename: (id: number, title: string) => void;
  onDelete: (conv: ConversationSummary) => void;
}) {
  return (
    <aside className="sidebar">
      <div className="brand">
        <span className="brand-mark" aria-hidden="true">
          ◆
        </span>
        Quince
      </div>
      <button type="button" className="button primary new-chat" data-testid="new-chat" onClick={onNewChat} title="New chat (Ctrl+N)">
        + New chat
      </button>
      <input
        type="search"
        className="search"
        placeholder="Search chats"
        aria-label="Search chats"
        data-testid="conversation-search"
        value={query}
        onChange={(e) => onQueryChange(e.target.value)}
      />
      {conversations.length === 0 ? (
        <div className="sidebar-empty" data-testid="conversations-empty">
          {query.trim() ? "No matching chats" : "No conversations yet"}
        </div>
      ) : (
        <ul className="conv-list">
          {conversations.map((c) => (
            <ConversationItem
              key={c.id}
              conv={c}
              selected={c.id === selectedId}
              streaming={streaming.includes(c.id)}
              onSelect={() => onSelect(c.id)}
              onRename={(t) => onRename(c.id, t)}
              onDelete={() => onDelete(c)}
            />
          ))}
        </ul>
      )}
    </aside>
  );
}
