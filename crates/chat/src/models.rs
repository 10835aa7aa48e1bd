//! The model library (the demo model, added folders, the Hugging Face cache) and the model in
//! the engine.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::watch;

use crate::view::{self, ErrorKind, LoadEvent, LoadedModel, ModelEntry, ModelSource, ModelsState};
use crate::{Chat, Error, LAST_MODEL, Result, actor, library, lock, model_type};

/// The model load in flight.
#[derive(Debug, Clone)]
pub(crate) struct Loading {
    /// Set to stop it between stages.
    pub cancel: Arc<AtomicBool>,
    /// The model's display name.
    pub name: String,
    /// Whether the model takes images (from its files).
    pub vision: bool,
    /// Where it stands; the last value says how it ended.
    pub status: watch::Receiver<LoadStatus>,
}

/// Where a model load stands.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum LoadStatus {
    /// A stage began: (stage, stages done, stages in all).
    Stage { stage: String, done: u32, total: u32 },
    /// The model is loaded.
    Loaded,
    /// The load failed.
    Failed { kind: ErrorKind, message: String },
    /// The user cancelled it.
    Cancelled,
}

impl Chat {
    /// The library (demo model, added folders, the Hugging Face cache) and what is loaded.
    pub async fn models(&self) -> Result<ModelsState> {
        let mut models = Vec::new();
        if let Some(demo) = &self.demo_model {
            models.push(library::describe(demo, ModelSource::Demo, library::demo_name(demo)));
        }
        for folder in self.store.model_folders().await? {
            let path = PathBuf::from(&folder);
            let name = library::display_name(&path);
            models.push(library::describe(&path, ModelSource::Folder, name));
        }
        if let Some(cache) = &self.hf_cache {
            for entry in library::scan_hf_cache(cache) {
                if !models.iter().any(|m| m.path == entry.path) {
                    models.push(entry);
                }
            }
        }
        let last = self.store.setting(LAST_MODEL).await?;
        let usable = |path: &str| models.iter().any(|m| m.path == path && m.problem.is_none());
        let default_model = last
            .filter(|p| usable(p))
            .or_else(|| models.iter().find(|m| m.problem.is_none()).map(|m| m.path.clone()));
        Ok(ModelsState { loaded: lock(&self.loaded).clone(), models, default_model })
    }

    /// Adds a model folder to the library; refused (and not added) when it cannot be loaded.
    pub async fn add_model_folder(&self, path: &Path) -> Result<ModelEntry> {
        let entry = library::describe(path, ModelSource::Folder, library::display_name(path));
        if let Some(problem) = &entry.problem {
            return Err(Error::Reported {
                kind: view::ErrorKind::ModelLoad,
                message: format!("{} cannot be added: {problem}", path.display()),
            });
        }
        self.store.add_model_folder(&entry.path).await?;
        Ok(entry)
    }

    /// Removes a folder from the library (its files stay).
    pub async fn remove_model_folder(&self, path: &str) -> Result<()> {
        Ok(self.store.remove_model_folder(path).await?)
    }

    /// The model in the engine.
    pub fn loaded(&self) -> Option<LoadedModel> {
        lock(&self.loaded).clone()
    }

    /// Who the loaded model's checkpoints belong to.
    pub(crate) fn identity(&self) -> Option<engine::kv_file::Identity> {
        lock(&self.engine_info).as_ref().map(|info| info.identity.clone())
    }

    /// The display name of the model being loaded, if one is.
    pub fn loading(&self) -> Option<String> {
        lock(&self.loading).as_ref().map(|l| l.name.clone())
    }

    /// Loads the model at `path` into the engine, reporting stages; [`Chat::cancel_load`]
    /// stops it (the previous model stays). One load at a time. Replies asked for meanwhile
    /// wait for it (see [`Chat::send`]).
    pub async fn load_model(
        &self,
        path: &Path,
        mut on_event: impl FnMut(LoadEvent),
    ) -> Result<LoadedModel> {
        if model_type(path)
            .and_then(|t| engine::registry::family(&t))
            .is_some_and(|f| f.is_drafter())
        {
            return Err(Error::Invalid(format!(
                "{} is a drafter, not a chat model: load the model it was made for, then choose \
                 it under Speculative decoding in the chat's settings",
                path.display()
            )));
        }
        let name = if self.demo_model.as_deref() == Some(path) {
            library::demo_name(path)
        } else {
            library::display_name(path)
        };
        let cancel = Arc::new(AtomicBool::new(false));
        let (status, _) = watch::channel(LoadStatus::Stage {
            stage: "Starting".into(),
            done: 0,
            total: actor::LOAD_STAGES.len() as u32,
        });
        {
            let mut loading = lock(&self.loading);
            if loading.is_some() {
                return Err(Error::Busy("a model is already loading".into()));
            }
            *loading = Some(Loading {
                cancel: cancel.clone(),
                name: name.clone(),
                vision: library::describe(path, ModelSource::Folder, name.clone()).vision,
                status: status.subscribe(),
            });
        }
        let (progress, mut stages) = tokio::sync::mpsc::unbounded_channel();
        let load = self.engine.load(path.to_path_buf(), progress, cancel);
        tokio::pin!(load);
        let result = loop {
            tokio::select! {
                result = &mut load => break result,
                Some((stage, done, total)) = stages.recv() => {
                    status.send_replace(LoadStatus::Stage { stage: stage.clone(), done, total });
                    on_event(LoadEvent::Progress { stage, done, total });
                }
            }
        };
        let info = match result {
            Ok(info) => info,
            Err(error) => {
                status.send_replace(match error.kind() {
                    ErrorKind::Cancelled => LoadStatus::Cancelled,
                    kind => LoadStatus::Failed { kind, message: error.to_string() },
                });
                *lock(&self.loading) = None;
                return Err(error);
            }
        };
        let model = LoadedModel {
            path: info.path.to_string_lossy().into_owned(),
            name,
            vision: info.vision,
            max_context: info.max_context as u32,
            kv_costs: info.kv_costs,
            thinking: info.thinking,
        };
        // The model is in place before the waiting replies hear that the load ended.
        *lock(&self.loaded) = Some(model.clone());
        *lock(&self.engine_info) = Some(info.clone());
        status.send_replace(LoadStatus::Loaded);
        *lock(&self.loading) = None;
        tracing::info!(model = %model.name, "model loaded");
        self.store.set_setting(LAST_MODEL, &model.path).await?;
        on_event(LoadEvent::Done { model: model.clone() });
        Ok(model)
    }

    /// Cancels the model load in progress; false when none is.
    pub fn cancel_load(&self) -> bool {
        match lock(&self.loading).as_ref() {
            Some(loading) => {
                loading.cancel.store(true, Ordering::SeqCst);
                true
            }
            None => false,
        }
    }
}
