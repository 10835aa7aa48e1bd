//! The app's own settings: the KV cache new chats start with, and the memory guard's share
//! (each chat's own settings live with the chat, see [`Chat::set_settings`]).

use engine::cache::KvOptions;

use crate::view::AppSettings;
use crate::{Chat, Error, Result};

/// The app setting holding the KV cache new chats start with (JSON of [`KvOptions`]).
const DEFAULT_KV: &str = "default_kv";
/// The app setting holding the memory guard's share.
const MEMORY_SHARE: &str = "memory_share";

impl Chat {
    /// The app's settings (defaults where none were saved).
    pub async fn app_settings(&self) -> Result<AppSettings> {
        let mut settings = AppSettings::default();
        if let Some(kv) = self.store.setting(DEFAULT_KV).await? {
            settings.default_kv = serde_json::from_str(&kv).unwrap_or_default();
        }
        if let Some(share) = self.store.setting(MEMORY_SHARE).await? {
            settings.memory_share = share.parse().unwrap_or(settings.memory_share);
        }
        settings.recommended_memory = engine::memory::recommended_bytes()?.unwrap_or(0);
        Ok(settings)
    }

    /// Saves the app's settings (the recommended memory is the device's, not a setting).
    pub async fn set_app_settings(&self, settings: &AppSettings) -> Result<()> {
        check_kv(&settings.default_kv)?;
        if !(settings.memory_share > 0.0 && settings.memory_share <= 1.0) {
            return Err(Error::Invalid(
                "the memory limit is a share of the recommended memory, above 0% and at most 100%"
                    .into(),
            ));
        }
        let kv = serde_json::to_string(&settings.default_kv).unwrap_or_default();
        self.store.set_setting(DEFAULT_KV, &kv).await?;
        self.store.set_setting(MEMORY_SHARE, &settings.memory_share.to_string()).await?;
        Ok(())
    }
}

/// Refuses a KV choice no model takes (bits, group sizes); whether a model's head widths take
/// it is checked when it answers.
pub(crate) fn check_kv(kv: &KvOptions) -> Result<()> {
    kv.format.validate(&[]).map_err(|e| Error::Invalid(e.to_string()))
}
