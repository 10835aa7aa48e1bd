//! The model registry: every `model_type` Quince loads, with its family's loader and what a
//! library may know of a checkpoint without loading it. The app's library, the download
//! catalog and the CLI all ask it, so there is no second list.
//!
//! A family is one folder of this crate and one [`Family`] entry in [`FAMILIES`].

use std::path::Path;

use serde_json::Value;

use cache::{Error, Result};

use crate::checkpoint::{ModelDir, Unread, read_json};
use crate::options::LoadOptions;
use crate::{DraftMethod, Model, gemma3, gemma4, qwen3_5};

/// How a family's checkpoints load.
#[derive(Debug, Clone, Copy)]
pub enum Loader {
    /// A model to chat with (and to draft with, as a draft model for a larger one).
    Model(fn(&ModelDir, &LoadOptions) -> Result<Box<dyn Model>>),
    /// A drafter: it drafts for a target model and is never chatted with.
    Drafter(fn(&ModelDir, &LoadOptions) -> Result<Box<dyn DraftMethod>>),
}

/// One family of checkpoints.
#[derive(Debug, Clone, Copy)]
pub struct Family {
    /// Its name, for people.
    pub name: &'static str,
    /// The `model_type`s of `config.json` it loads.
    pub model_types: &'static [&'static str],
    /// Its loader.
    pub loader: Loader,
    /// Whether a checkpoint's config gives it a vision tower.
    pub takes_images: fn(&Value) -> bool,
    /// The tensors its checkpoints may hold that the model leaves unread, each with the
    /// reason (the reference drops them too); any other unread tensor refuses the load.
    pub unread: Unread,
}

impl Family {
    /// Whether its checkpoints are drafters.
    pub fn is_drafter(&self) -> bool {
        matches!(self.loader, Loader::Drafter(_))
    }
}

/// Every family Quince loads.
pub const FAMILIES: &[Family] = &[
    Family {
        name: "Gemma 4",
        model_types: &["gemma4", "gemma4_text"],
        loader: Loader::Model(gemma4::load),
        takes_images: gemma4::takes_images,
        unread: gemma4::unread,
    },
    Family {
        name: "Gemma 3",
        model_types: &["gemma3", "gemma3_text"],
        loader: Loader::Model(gemma3::load),
        takes_images: gemma3::takes_images,
        unread: gemma3::unread,
    },
    Family {
        name: "Qwen3.5",
        model_types: &["qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"],
        loader: Loader::Model(qwen3_5::load),
        takes_images: qwen3_5::takes_images,
        unread: qwen3_5::unread,
    },
    Family {
        name: "Qwen3.5 MTP",
        model_types: &["qwen3_5_mtp"],
        loader: Loader::Drafter(qwen3_5::mtp::load),
        takes_images: |_| false,
        unread: |_, _| None,
    },
    Family {
        name: "Gemma 4 assistant",
        model_types: &["gemma4_assistant"],
        loader: Loader::Drafter(gemma4::load_assistant),
        takes_images: |_| false,
        unread: gemma4::assistant_unread,
    },
];

/// The family that loads `model_type`.
pub fn family(model_type: &str) -> Option<&'static Family> {
    FAMILIES.iter().find(|f| f.model_types.contains(&model_type))
}

/// Every `model_type` a chat model may have (drafters apart), for messages.
pub fn model_types() -> Vec<&'static str> {
    FAMILIES
        .iter()
        .filter(|f| !f.is_drafter())
        .flat_map(|f| f.model_types.iter().copied())
        .collect()
}

/// The `model_type` in `config.json` (`""` when it names none).
pub fn model_type_of(config: &Value) -> &str {
    config.get("model_type").and_then(Value::as_str).unwrap_or_default()
}

/// The family of the checkpoint whose `config.json` is `config`, or why none loads it.
pub fn family_of(config: &Value) -> Result<&'static Family> {
    let model_type = model_type_of(config);
    family(model_type).ok_or_else(|| Error::Unsupported {
        key: "model_type".into(),
        value: model_type.into(),
        reason: format!("supported: {}", model_types().join(", ")),
    })
}

/// The family of the model folder at `path`, from its `config.json` alone.
pub fn inspect(path: &Path) -> Result<&'static Family> {
    family_of(&read_json(&path.join("config.json"))?)
}

/// Loads the model a checkpoint directory holds, by its `model_type`.
pub fn load_model(path: impl AsRef<Path>, options: &LoadOptions) -> Result<Box<dyn Model>> {
    let dir = ModelDir::open(path)?;
    let family = family_of(&dir.config)?;
    match family.loader {
        Loader::Model(load) => {
            let model = load(&dir, options)?;
            dir.refuse_unread(family.unread)?;
            Ok(model)
        }
        Loader::Drafter(_) => Err(Error::Unsupported {
            key: "model_type".into(),
            value: model_type_of(&dir.config).into(),
            reason: "a drafter drafts for a target model; load the model it was made for".into(),
        }),
    }
}

/// Loads the drafter a checkpoint directory holds, by its `model_type`.
pub fn load_drafter(path: impl AsRef<Path>, options: &LoadOptions) -> Result<Box<dyn DraftMethod>> {
    let dir = ModelDir::open(path)?;
    let family = family_of(&dir.config)?;
    match family.loader {
        Loader::Drafter(load) => {
            let drafter = load(&dir, options)?;
            dir.refuse_unread(family.unread)?;
            Ok(drafter)
        }
        Loader::Model(_) => Err(Error::Unsupported {
            key: "model_type".into(),
            value: model_type_of(&dir.config).into(),
            reason: "not a drafter (a model of another family drafts as a draft model)".into(),
        }),
    }
}
