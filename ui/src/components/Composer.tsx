import { forwardRef, useEffect, useImperativeHandle, useRef } from "react";
import type { PendingAttachment } from "../ipc/bindings";
import { ACCEPTED_MIME_TYPES, imageFilesFrom } from "../state/attachments";
import { attachmentSrc } from "./Message";

export type ComposerHandle = { focus: () => void };

export const Composer = forwardRef<
  ComposerHandle,
  {
    text: string;
    onTextChange: (t: string) => void;
    attachments: PendingAttachment[];
    importing: number;
    attachError: string | null;
    onDismissAttachError: () => void;
    /** Why images are refused now (no vision), or null. */
    visionRefusal: string | null;
    streaming: boolean;
    onSend: () => void;
    onStop: () => void;
    onFiles: (files: File[]) => void;
    onRemoveAttachment: (file: string) => void;
  }
>(function Composer(props, ref) {
  const {
    text,
    onTextChange,
    attachments,
    importing,
    attachError,
    onDismissAttachError,
    visionRefusal,
    streaming,
    onSend,
    onStop,
    onFiles,
    onRemoveAttachment,
  } = props;
  const taRef = useRef<HTMLTextAreaElement>(null);
  const fileRef = useRef<HTMLInputElement>(null);

  useImperativeHandle(ref, () => ({ focus: () => taRef.current?.focus() }), []);

  useEffect(() => {
    const el = taRef.current;
    if (!el) return;
    el.style.height = "auto";
    el.style.height = `${Math.min(el.scrollHeight, 240)}px`;
  }, [text]);

  const canSend = !streaming && importing === 0 && (text.trim().length > 0 || attachments.length > 0);

  return (
    <div className="composer-wrap">
      {attachError ? (
        <div className="attach-error" role="alert" data-testid="attach-error">
          <span>{attachError}</span>
          <button type="button" className="icon-button small" aria-label="Dismiss" onClick={onDismissAttachError}>
            ×
          </button>
        </div>
      ) : null}
      <div className="composer">
        {attachments.length > 0 || importing > 0 ? (
          <div className="composer-thumbs">
            {attachments.map((a) => (
              <div className="composer-thumb" data-testid="composer-thumb" data-file={a.file} key={a.file} title={a.name}>
                <img src={attachmentSrc(a.file)} alt={a.name} />
                <button
                  type="button"
                  className="thumb-remove"
                  aria-label={`Remove ${a.name}`}
                  title="Remove"
                  onClick={() => onRemoveAttachment(a.file)}
                >
                  ×
                </button>
              </div>
            ))}
            {importing > 0 ? <div className="composer-thumb importing" aria-label="Importing image" /> : null}
          </div>
        ) : null}
        <div className="composer-row">
          <button
            type="button"
            className="icon-button attach"
            data-testid="attach-button"
            aria-label="Attach images"
            title={visionRefusal ?? "Attach images"}
            disabled={visionRefusal !== null}
            onClick={() => fileRef.current?.click()}
          >
            📎
          </button>
          <input
            ref={fileRef}
            type="file"
            accept={["image/*", ...ACCEPTED_MIME_TYPES].join(",")}
            multiple
            hidden
            data-testid="attach-input"
            onChange={(e) => {
              const files = e.target.files ? Array.from(e.target.files) : [];
              e.target.value = "";
              if (files.length) onFiles(files);
            }}
          />
          <textarea
            ref={taRef}
            className="composer-input"
            data-testid="composer-input"
            placeholder="Send a message…  (Shift+Enter for a new line)"
            aria-label="Message"
            rows={1}
            value={text}
            onChange={(e) => onTextChange(e.target.value)}
            onKeyDown={(e) => {
              if (e.key === "Enter" && !e.shiftKey && !e.nativeEvent.isComposing) {
                e.preventDefault();
                if (canSend) onSend();
              }
            }}
            onPaste={(e) => {
              const files = imageFilesFrom(e.clipboardData.items);
              if (files.length > 0) {
                e.preventDefault();
                onFiles(files);
              }
            }}
          />
          {streaming ? (
            <button type="button" className="button stop" data-testid="stop-button" onClick={onStop} title="Stop (Esc)">
              ■ Stop
            </button>
          ) : (
            <button
              type="button"
              className="button primary send"
              data-testid="send-button"
              disabled={!canSend}
              onClick={onSend}
              title="Send (Enter)"
            >
              Send
            </button>
          )}
        </div>
      </div>
    </div>
  );
});
