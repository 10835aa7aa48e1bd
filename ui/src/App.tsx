import { useCallback, useEffect, useReducer, useRef, useState } from "react";
import { open } from "@tauri-apps/plugin-dialog";
import type {
  AppSettings,
  ConversationSummary,
  LoadEvent,
  ModelEntry,
  ModelsState,
  PendingAttachment,
  Settings,
  StreamEvent,
  ThreadMessage,
} from "./ipc/bindings";
import * as api from "./ipc/commands";
import { Channel, errorKind, errorMessage } from "./ipc/commands";
import { actionFromEvent, chatReducer, inFlightHere, initialChatState, streamingConversations } from "./state/stream";
import { addAttachment, partitionFiles, removeAttachment, visionRefusal } from "./state/attachments";
import { useDownloads } from "./state/useDownloads";
import { Sidebar } from "./components/Sidebar";
import { ChatView } from "./components/ChatView";
import { Composer, type ComposerHandle } from "./components/Composer";
import { ModelBar, type LoadProgress } from "./components/ModelBar";
import { ModelsPanel } from "./components/ModelsPanel";
import { SettingsPanel } from "./components/SettingsPanel";
import { ConfirmDialog } from "./components/ConfirmDialog";
import { ErrorBanner } from "./components/ErrorBanner";

const SEARCH_DEBOUNCE_MS = 250;

export function App() {
  const [chat, dispatch] = useReducer(chatReducer, initialChatState);
  const [conversations, setConversations] = useState<ConversationSummary[]>([]);
  const [query, setQuery] = useState("");
  const [selectedId, setSelectedId] = useState<number | null>(null);
  const [error, setError] = useState<string | null>(null);
  const [models, setModels] = useState<ModelsState>({ models: [], loaded: null, default_model: null });
  const [loading, setLoading] = useState<LoadProgress | null>(null);
  const [modelsOpen, setModelsOpen] = useState(false);
  const [settingsOpen, setSettingsOpen] = useState(false);
  const [appSettings, setAppSettings] = useState<AppSettings | null>(null);
  const [toDelete, setToDelete] = useState<ConversationSummary | null>(null);
  const [text, setText] = useState("");
  const [pending, setPending] = useState<PendingAttachment[]>([]);
  const [importing, setImporting] = useState(0);
  const [attachError, setAttachError] = useState<string | null>(null);

  const composerRef = useRef<ComposerHandle>(null);
  const selectedRef = useRef<number | null>(null);
  selectedRef.current = selectedId;
  const queryRef = useRef(query);
  queryRef.current = query;

  // Each conversation has at most one reply in flight; others stream at the same time.
  const here = inFlightHere(chat);
  const streamingHere = here !== null;
  const refusal = visionRefusal(loading ? null : models.loaded);

  const showError = useCallback((e: unknown) => setError(errorMessage(e)), []);

  // The reducer's stream failures go to the banner too.
  useEffect(() => {
    if (chat.error) setError(chat.error);
  }, [chat.error]);

  // ---- conversations ----

  const refreshList = useCallback(async () => {
    try {
      setConversations(await api.listConversations(queryRef.current));
    } catch (e) {
      showError(e);
    }
  }, [showError]);

  const openConversation = useCallback(
    async (id: number | null) => {
      // The ref first: the answer below may arrive before React re-renders with the new id.
      selectedRef.current = id;
      setSelectedId(id);
      if (id === null) {
        dispatch({ type: "loaded", detail: null });
        return;
      }
      try {
        const d = await api.getConversation(id);
        if (selectedRef.current === id) dispatch({ type: "loaded", detail: d });
      } catch (e) {
        showError(e);
      }
    },
    [showError],
  );

  /** Refetch the shown conversation (the source of truth) if it is still `id`. */
  const refetch = useCallback(async (id: number) => {
    if (selectedRef.current !== id) return;
    try {
      const d = await api.getConversation(id);
      if (selectedRef.current === id) dispatch({ type: "loaded", detail: d });
    } catch (e) {
      showError(e);
    }
  }, [showError]);

  // Debounced search (also the initial load).
  const firstLoad = useRef(true);
  useEffect(() => {
    const delay = firstLoad.current ? 0 : SEARCH_DEBOUNCE_MS;
    const t = window.setTimeout(async () => {
      try {
        const list = await api.listConversations(query);
        setConversations(list);
        if (firstLoad.current) {
          firstLoad.current = false;
          if (list.length > 0 && selectedRef.current === null) void openConversation(list[0].id);
        }
      } catch (e) {
        showError(e);
      }
    }, delay);
    return () => window.clearTimeout(t);
  }, [query, openConversation, showError]);

  const newChat = useCallback(async () => {
    try {
      const d = await api.createConversation();
      setSelectedId(d.id);
      selectedRef.current = d.id;
      dispatch({ type: "loaded", detail: d });
      setText("");
      void refreshList();
      composerRef.current?.focus();
    } catch (e) {
      showError(e);
    }
  }, [refreshList, showError]);

  const rename = useCallback(
    async (id: number, title: string) => {
      try {
        await api.renameConversation(id, title);
        await refreshList();
        await refetch(id);
      } catch (e) {
        showError(e);
      }
    },
    [refreshList, refetch, showError],
  );

  const confirmDelete = useCallback(async () => {
    const conv = toDelete;
    setToDelete(null);
    if (!conv) return;
    try {
      await api.deleteConversation(conv.id);
      const list = await api.listConversations(queryRef.current);
      setConversations(list);
      if (selectedRef.current === conv.id) {
        await openConversation(list.length > 0 ? list[0].id : null);
      }
    } catch (e) {
      showError(e);
    }
  }, [toDelete, openConversation, showError]);

  // ---- streaming ----

  /**
   * Runs a reply command, streaming its events into the view. Resolves to whether it ended
   * before anything was stored (a refusal: the caller gives the user their input back).
   */
  const runStream = useCallback(
    async (conversationId: number, start: (ch: Channel<StreamEvent>) => Promise<ThreadMessage>) => {
      dispatch({ type: "sending", conversationId });
      let stored = false;
      const ch = new Channel<StreamEvent>();
      ch.onmessage = (ev) => {
        if (!stored && (ev.kind === "started" || (ev.kind === "waiting" && ev.user !== null))) {
          stored = true;
          // The sidebar shows the title the first message gave, also while the reply waits.
          void refreshList();
        }
        dispatch(actionFromEvent(conversationId, ev));
      };
      try {
        // The resolved reply is final even if its `done` event is still on the way.
        const reply = await start(ch);
        dispatch({ type: "done", conversationId, reply });
      } catch (e) {
        if (errorKind(e) === "cancelled") {
          dispatch({ type: "stopped", conversationId });
        } else {
          dispatch({ type: "failed", conversationId, message: errorMessage(e), reply: null });
        }
        return !stored;
      } finally {
        await refetch(conversationId);
        void refreshList();
      }
      return false;
    },
    [refetch, refreshList],
  );

  const send = useCallback(async () => {
    if (streamingHere) return;
    const body = text;
    const files = pending.map((a) => a.file);
    if (!body.trim() && files.length === 0) return;
    let id = selectedRef.current;
    if (id === null) {
      try {
        const d = await api.createConversation();
        id = d.id;
        setSelectedId(id);
        selectedRef.current = id;
        dispatch({ type: "loaded", detail: d });
      } catch (e) {
        showError(e);
        return;
      }
    }
    const attached = pending;
    setText("");
    setPending([]);
    setAttachError(null);
    const convId = id;
    const refused = await runStream(convId, (ch) => api.sendMessage(convId, body, files, ch));
    // Nothing was stored (no model at all, a missing image): the composer gets the message
    // back, unless the user has started another.
    if (refused) {
      setText((now) => (now === "" ? body : now));
      setPending((now) => (now.length === 0 ? attached : now));
    }
  }, [streamingHere, text, pending, runStream, showError]);

  const stop = useCallback(async () => {
    const inFlight = here;
    if (inFlight === null) return;
    try {
      // The generation is named once its reply is stored (`started`); a reply still waiting
      // for its model is stopped by its conversation.
      if (inFlight.replyId !== null) await api.stopReply(inFlight.replyId);
      else await api.stopConversation(inFlight.conversationId);
    } catch (e) {
      showError(e);
    }
  }, [here, showError]);

  const retry = useCallback(
    (messageId: number) => {
      const id = selectedRef.current;
      if (id === null || streamingHere) return;
      void runStream(id, (ch) => api.answerMessage(messageId, ch));
    },
    [streamingHere, runStream],
  );

  const regenerate = useCallback(
    (messageId: number) => {
      const id = selectedRef.current;
      if (id === null || streamingHere) return;
      void runStream(id, (ch) => api.regenerate(messageId, ch));
    },
    [streamingHere, runStream],
  );

  const edit = useCallback(
    async (messageId: number, newText: string) => {
      const id = selectedRef.current;
      if (id === null || streamingHere) return true;
      return runStream(id, (ch) => api.editMessage(messageId, newText, ch));
    },
    [streamingHere, runStream],
  );

  const switchBranch = useCallback(
    async (siblingId: number) => {
      try {
        const d = await api.switchBranch(siblingId);
        if (selectedRef.current === d.id) dispatch({ type: "loaded", detail: d });
      } catch (e) {
        showError(e);
      }
    },
    [showError],
  );

  // ---- attachments ----

  const addFiles = useCallback(
    async (files: File[]) => {
      if (refusal) {
        setAttachError(refusal);
        return;
      }
      const { accepted, rejected } = partitionFiles(files);
      const problems = rejected.map((r) => r.reason);
      setAttachError(problems.length ? problems.join("\n") : null);
      for (const f of accepted) {
        setImporting((n) => n + 1);
        try {
          const bytes = new Uint8Array(await f.arrayBuffer());
          const att = await api.importAttachment(bytes, f.name);
          setPending((list) => addAttachment(list, att));
        } catch (e) {
          problems.push(`${f.name}: ${errorMessage(e)}`);
          setAttachError(problems.join("\n"));
        } finally {
          setImporting((n) => n - 1);
        }
      }
    },
    [refusal],
  );

  // ---- models ----

  const startLoad = useCallback(
    async (path: string, name: string) => {
      setLoading({ path, name, stage: "", done: 0, total: 0 });
      const ch = new Channel<LoadEvent>();
      ch.onmessage = (ev) => {
        if (ev.kind === "progress") {
          setLoading((l) => (l && l.path === path ? { ...l, stage: ev.stage, done: ev.done, total: ev.total } : l));
        } else {
          setModels((m) => ({ ...m, loaded: ev.model }));
        }
      };
      try {
        const model = await api.loadModel(path, ch);
        setModels((m) => ({ ...m, loaded: model }));
      } catch (e) {
        if (errorKind(e) !== "cancelled") showError(e);
      } finally {
        setLoading((l) => (l && l.path === path ? null : l));
      }
    },
    [showError],
  );

  const refreshModels = useCallback(async () => {
    try {
      const st = await api.listModels();
      setModels(st);
      return st;
    } catch (e) {
      showError(e);
      return null;
    }
  }, [showError]);

  // A finished download joins the library (its entry is in the refreshed list).
  const onDownloaded = useCallback(() => {
    void refreshModels();
  }, [refreshModels]);
  const downloads = useDownloads(onDownloaded);

  // Startup: list models; load the default one when nothing is loaded.
  const booted = useRef(false);
  useEffect(() => {
    if (booted.current) return;
    booted.current = true;
    void (async () => {
      const st = await refreshModels();
      if (st && st.loaded === null && st.default_model) {
        const entry = st.models.find((m) => m.path === st.default_model);
        void startLoad(st.default_model, entry?.name ?? st.default_model);
      }
    })();
  }, [refreshModels, startLoad]);

  const loadEntry = useCallback(
    (m: ModelEntry) => {
      if (m.problem) return;
      setModelsOpen(false);
      if (models.loaded?.path === m.path) return;
      void startLoad(m.path, m.name);
    },
    [models.loaded, startLoad],
  );

  const cancelLoad = useCallback(async () => {
    try {
      await api.cancelLoad();
    } catch (e) {
      showError(e);
    }
  }, [showError]);

  const addFolder = useCallback(async () => {
    try {
      const picked = await open({ directory: true, multiple: false, title: "Choose a model folder" });
      if (typeof picked !== "string") return;
      await api.addModelFolder(picked);
      await refreshModels();
    } catch (e) {
      showError(e);
    }
  }, [refreshModels, showError]);

  const removeFolder = useCallback(
    async (m: ModelEntry) => {
      try {
        await api.removeModelFolder(m.path);
        await refreshModels();
      } catch (e) {
        showError(e);
      }
    },
    [refreshModels, showError],
  );

  const saveSettings = useCallback(
    async (prompt: string, settings: Settings, app: AppSettings | null) => {
      const id = selectedRef.current;
      if (id === null) return;
      try {
        await api.setSystemPrompt(id, prompt);
        await api.setSettings(id, settings);
        if (app) setAppSettings(await api.setAppSettings(app));
        setSettingsOpen(false);
        await refetch(id);
      } catch (e) {
        showError(e);
      }
    },
    [refetch, showError],
  );

  // ---- shortcuts ----

  const modalOpen = modelsOpen || settingsOpen || toDelete !== null;
  useEffect(() => {
    const onKey = (e: KeyboardEvent) => {
      if ((e.ctrlKey || e.metaKey) && !e.shiftKey && !e.altKey && e.key.toLowerCase() === "n") {
        e.preventDefault();
        void newChat();
      } else if (e.key === "Escape" && !modalOpen && !e.defaultPrevented && here) {
        e.preventDefault();
        void stop();
      }
    };
    window.addEventListener("keydown", onKey);
    return () => window.removeEventListener("keydown", onKey);
  }, [newChat, stop, modalOpen, here]);

  return (
    <div className="app">
      <Sidebar
        conversations={conversations}
        streaming={streamingConversations(chat)}
        selectedId={selectedId}
        query={query}
        onQueryChange={setQuery}
        onNewChat={() => void newChat()}
        onSelect={(id) => {
          if (id !== selectedId) void openConversation(id);
        }}
        onRename={(id, t) => void rename(id, t)}
        onDelete={setToDelete}
      />
      <main className="main">
        <ModelBar
          loaded={models.loaded}
          loading={loading}
          hasConversation={chat.detail !== null}
          title={chat.detail?.title ?? ""}
          onOpenModels={() => {
            setModelsOpen(true);
            void refreshModels();
          }}
          onCancelLoad={() => void cancelLoad()}
          onOpenSettings={() => {
            // The app's settings are read each time the panel opens; without them the panel
            // shows the chat's own alone.
            api.appSettings().then(
              (s) => {
                setAppSettings(s);
                setSettingsOpen(true);
              },
              () => {
                setAppSettings(null);
                setSettingsOpen(true);
              },
            );
          }}
        />
        <ErrorBanner
          message={error}
          onDismiss={() => {
            setError(null);
            dispatch({ type: "clearError" });
          }}
        />
        <ChatView
          detail={chat.detail}
          streaming={streamingHere}
          busy={streamingHere}
          visionRefusal={refusal}
          onFiles={(files) => void addFiles(files)}
          onRefused={setAttachError}
          onRegenerate={regenerate}
          onEdit={edit}
          onSwitchBranch={(id) => void switchBranch(id)}
          onRetry={retry}
          waiting={here?.waiting ?? null}
          queued={here?.queued ?? null}
          composer={
            <Composer
              ref={composerRef}
              text={text}
              onTextChange={setText}
              attachments={pending}
              importing={importing}
              attachError={attachError}
              onDismissAttachError={() => setAttachError(null)}
              visionRefusal={refusal}
              streaming={streamingHere}
              onSend={() => void send()}
              onStop={() => void stop()}
              onFiles={(files) => void addFiles(files)}
              onRemoveAttachment={(file) => setPending((l) => removeAttachment(l, file))}
            />
          }
        />
      </main>
      {modelsOpen ? (
        <ModelsPanel
          models={models.models}
          loaded={models.loaded}
          loadingPath={loading?.path ?? null}
          onLoad={loadEntry}
          onAddFolder={() => void addFolder()}
          onRemoveFolder={(m) => void removeFolder(m)}
          downloads={downloads}
          onClose={() => setModelsOpen(false)}
        />
      ) : null}
      {settingsOpen && chat.detail ? (
        <SettingsPanel
          detail={chat.detail}
          models={models.models}
          loaded={models.loaded}
          app={appSettings}
          onSave={saveSettings}
          onClose={() => setSettingsOpen(false)}
        />
      ) : null}
      {toDelete ? (
        <ConfirmDialog
          title="Delete chat?"
          message={`“${toDelete.title || "Untitled"}” and all its messages will be deleted. This cannot be undone.`}
          confirmLabel="Delete"
          onConfirm={() => void confirmDelete()}
          onCancel={() => setToDelete(null)}
        />
      ) : null}
    </div>
  );
}
