//! The model library (the demo model, added folders, the Hugging Face cache) and the model in
//! the engine.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::view::{self, LoadEvent, LoadedModel, ModelEntry, ModelSource, ModelsState};
use crate::{Chat, Error, LAST_MODEL, Result, library, lock, model_type};

impl Chat {
    /// The library (demo model, added folders, the Hugging Face cache) and what is loaded.
    pub async fn models(&self) -> Result<ModelsState> {
        let mut models = Vec::new();
        if let Some(demo) = &self.demo_model {
            models.push(library::describe(demo, ModelSource::Demo, library::DEMO_NAME.into()));
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

    /// Loads the model at `path` into the engine, reporting stages; [`Chat::cancel_load`]
    /// stops it (the previous model stays). One load at a time.
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
        let cancel = Arc::new(AtomicBool::new(false));
        {
            let mut loading = lock(&self.loading);
            if loading.is_some() {
                return Err(Error::Busy("a model is already loading".into()));
            }
            *loading = Some(cancel.clone());
        }
        let (progress, mut stages) = tokio::sync::mpsc::unbounded_channel();
        let load = self.engine.load(path.to_path_buf(), progress, cancel);
        tokio::pin!(load);
        let result = loop {
            tokio::select! {
                result = &mut load => break result,
                Some((stage, done, total)) = stages.recv() => {
                    on_event(LoadEvent::Progress { stage, done, total });
                }
            }
        };
        *lock(&self.loading) = None;
        let info = result?;
        let model = LoadedModel {
            path: info.path.to_string_lossy().into_owned(),
            name: if self.demo_model.as_deref() == Some(path) {
                library::DEMO_NAME.into()
            } else {
                library::display_name(path)
            },
            vision: info.vision,
            max_context: info.max_context as u32,
        };
        *lock(&self.loaded) = Some(model.clone());
        *lock(&self.identity) = Some(info.identity.clone());
        self.store.set_setting(LAST_MODEL, &model.path).await?;
        on_event(LoadEvent::Done { model: model.clone() });
        Ok(model)
    }

    /// Cancels the model load in progress; false when none is.
    pub fn cancel_load(&self) -> bool {
        match lock(&self.loading).as_ref() {
            Some(flag) => {
                flag.store(true, Ordering::SeqCst);
                true
            }
            None => false,
        }
    }
}
