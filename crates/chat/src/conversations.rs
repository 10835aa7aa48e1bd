//! Conversations: the list, one conversation's branch on screen, titles, settings, branches.

use crate::view::{
    self, AttachmentView, BranchInfo, ConversationDetail, ConversationSummary, Settings,
    ThreadMessage,
};
use crate::{Chat, Error, NEW_TITLE, Result, extras, lock, merge, model_type, settings_of};

impl Chat {
    /// Conversations, most recent first; with a query, those whose title or messages hold it.
    pub async fn conversations(&self, query: Option<&str>) -> Result<Vec<ConversationSummary>> {
        let rows = match query.map(str::trim).filter(|q| !q.is_empty()) {
            Some(q) => self.store.search(q).await?,
            None => self.store.conversations().await?,
        };
        Ok(rows
            .into_iter()
            .map(|c| ConversationSummary {
                id: c.id,
                title: c.title,
                model_id: c.model_id,
                updated_at: c.updated_at,
            })
            .collect())
    }

    /// A new, empty conversation with default settings (the KV cache the app settings name).
    pub async fn create_conversation(&self) -> Result<ConversationDetail> {
        let model = lock(&self.loaded).as_ref().map(|m| m.name.clone());
        let c = self.store.create_conversation(NEW_TITLE, model.as_deref()).await?;
        let kv = self.app_settings().await?.default_kv;
        let settings =
            serde_json::to_value(Settings { kv, ..Settings::default() }).unwrap_or_default();
        self.store.set_settings(c.id, &settings).await?;
        self.conversation(c.id).await
    }

    /// A conversation with its current branch.
    pub async fn conversation(&self, id: i64) -> Result<ConversationDetail> {
        let c = self.store.conversation(id).await?;
        let mut messages = Vec::new();
        if let Some(leaf) = c.current_leaf_id {
            for m in self.store.path_to(leaf).await? {
                messages.push(self.thread_message(m).await?);
            }
        }
        Ok(ConversationDetail {
            id: c.id,
            title: c.title,
            model_id: c.model_id,
            system_prompt: c.system_prompt.unwrap_or_default(),
            settings: settings_of(&c.settings),
            messages,
        })
    }

    /// Renames a conversation.
    pub async fn rename(&self, id: i64, title: &str) -> Result<()> {
        let title = title.trim();
        if title.is_empty() {
            return Err(Error::Invalid("a title cannot be empty".into()));
        }
        Ok(self.store.rename_conversation(id, title).await?)
    }

    /// Deletes a conversation, its messages, and the image files no other message uses.
    pub async fn delete(&self, id: i64) -> Result<()> {
        if lock(&self.running).contains_key(&id) {
            return Err(Error::Busy("stop the reply before deleting the conversation".into()));
        }
        let files = self.store.conversation_attachment_paths(id).await?;
        let checkpoints = self.store.checkpoint_paths(id).await?;
        self.store.delete_conversation(id).await?;
        for file in checkpoints {
            let _ = std::fs::remove_file(self.checkpoints_dir().join(file));
        }
        let _ = std::fs::remove_dir(self.checkpoints_dir().join(id.to_string()));
        for file in files {
            if self.store.attachment_references(&file).await? == 0 {
                let _ = std::fs::remove_file(self.attachments_dir().join(&file));
            }
        }
        Ok(())
    }

    /// Sets the system prompt ("" clears it).
    pub async fn set_system_prompt(&self, id: i64, prompt: &str) -> Result<()> {
        let prompt = Some(prompt).filter(|p| !p.trim().is_empty());
        Ok(self.store.set_system_prompt(id, prompt).await?)
    }

    /// Sets the sampling settings.
    pub async fn set_settings(&self, id: i64, settings: &Settings) -> Result<()> {
        if !(0.0..=5.0).contains(&settings.temperature)
            || !(0.0..=1.0).contains(&settings.top_p)
            || settings.max_tokens == 0
        {
            return Err(Error::Invalid(
                "temperature must be 0–5, top-p 0–1, and max tokens at least 1".into(),
            ));
        }
        crate::settings::check_kv(&settings.kv)?;
        match &settings.speculation {
            view::Speculation::Draft { model } if !model.join("config.json").is_file() => {
                return Err(Error::Invalid(format!(
                    "no model at {}: a draft model is a model folder with a config.json",
                    model.display()
                )));
            }
            view::Speculation::Assistant { model }
                if !model_type(model)
                    .and_then(|t| engine::registry::family(&t))
                    .is_some_and(|f| f.is_drafter()) =>
            {
                return Err(Error::Invalid(format!(
                    "no drafter at {}: its config.json must name a drafter's model_type, such \
                     as gemma4_assistant",
                    model.display()
                )));
            }
            _ => {}
        }
        let mut value = self.store.conversation(id).await?.settings;
        merge(&mut value, serde_json::to_value(settings).unwrap_or_default());
        Ok(self.store.set_settings(id, &value).await?)
    }

    /// Sets the options the CLI uses: `raw_tokens` (turns are token ids, verbatim, no
    /// template) and `ignore_eos`. A conversation with text messages cannot become raw.
    pub async fn set_raw_options(&self, id: i64, raw_tokens: bool, ignore_eos: bool) -> Result<()> {
        let c = self.store.conversation(id).await?;
        let (was_raw, _) = extras(&c.settings);
        if raw_tokens != was_raw && c.current_leaf_id.is_some() {
            return Err(Error::Invalid(
                "a conversation's messages are either all text or all token ids".into(),
            ));
        }
        let mut value = c.settings;
        merge(
            &mut value,
            serde_json::json!({ "raw_tokens": raw_tokens, "ignore_eos": ignore_eos }),
        );
        Ok(self.store.set_settings(id, &value).await?)
    }

    /// Shows the branch through `message` (one of a `‹ 2/3 ›` set): its newest leaf becomes
    /// the conversation's tip.
    pub async fn switch_branch(&self, message: i64) -> Result<ConversationDetail> {
        let m = self.store.message(message).await?;
        let leaf = self.store.latest_leaf(message).await?;
        self.store.set_current_leaf(m.conversation_id, leaf).await?;
        self.conversation(m.conversation_id).await
    }

    pub(crate) async fn thread_message(&self, m: store::Message) -> Result<ThreadMessage> {
        let siblings: Vec<i64> = self
            .store
            .children(m.conversation_id, m.parent_id)
            .await?
            .into_iter()
            .map(|s| s.id)
            .collect();
        let index = siblings.iter().position(|&s| s == m.id).unwrap_or(0) as u32;
        let attachments = self
            .store
            .attachments(m.id)
            .await?
            .into_iter()
            .map(|a| AttachmentView { file: a.path, mime: a.mime, bytes: a.bytes as u64 })
            .collect();
        let error = m.stats.as_ref().and_then(|s| s.get("error")).map(|e| match e.as_str() {
            Some(text) => text.to_string(),
            None => e.to_string(),
        });
        let stats = m.stats.and_then(|s| serde_json::from_value::<view::TurnStats>(s).ok());
        Ok(ThreadMessage {
            id: m.id,
            parent_id: m.parent_id,
            role: m.role,
            content: m.content,
            state: m.state,
            stats,
            error,
            attachments,
            branch: BranchInfo { index, count: siblings.len() as u32, siblings },
            created_at: m.created_at,
        })
    }
}
