//! [`Drafters`]: the draft method a turn asks for, loaded on first use and kept for the next
//! turns, each turn drafting with a fork of it (the same weights, state of its own, restored
//! from the turn's checkpoint).

use std::path::Path;

use super::ChatModel;
use crate::LoadOptions;
use crate::registry;
use crate::speculative::draft_model::DraftModel;
use crate::speculative::lookup::PromptLookup;
use crate::speculative::{DraftMethod, Speculation};
use crate::{Error, Result};

/// The last draft method used, kept loaded.
#[derive(Debug, Default)]
pub struct Drafters {
    options: LoadOptions,
    loaded: Option<(Speculation, Box<dyn DraftMethod>)>,
}

impl Drafters {
    /// Drafters loaded with `options`.
    pub fn new(options: LoadOptions) -> Drafters {
        Drafters { options, loaded: None }
    }

    /// The method `speculation` asks for, bound to `target` (`None` for plain decoding). A
    /// drafter that cannot serve the target is refused with the way out.
    fn method(
        &mut self,
        target: &ChatModel,
        speculation: &Speculation,
    ) -> Result<Option<&mut dyn DraftMethod>> {
        let (what, folder) = match speculation {
            Speculation::Off => return Ok(None),
            Speculation::Lookup => ("prompt lookup", None),
            Speculation::Draft { model } => ("draft model", Some(model.as_path())),
            Speculation::Assistant { model } => ("assistant", Some(model.as_path())),
        };
        let unusable = |reason: Error| match folder {
            Some(path) => {
                Error::Drafter { what, path: path.to_path_buf(), reason: reason.to_string() }
            }
            None => reason,
        };
        if self.loaded.as_ref().is_none_or(|(s, _)| s != speculation) {
            self.loaded = None;
            let method = self.load(target, speculation).map_err(unusable)?;
            self.loaded = Some((speculation.clone(), method));
        }
        let Some((_, method)) = self.loaded.as_mut() else {
            return Err(Error::InvalidRequest("the draft method vanished".into()));
        };
        method.bind(target.model()).map_err(unusable)?;
        Ok(Some(method.as_mut()))
    }

    /// The method `speculation` asks for, for a turn (a row of a batch): a fork of the drafter
    /// kept loaded ([`DraftMethod::fork`]: the same weights, state of its own), bound to
    /// `target`. `None` for plain decoding.
    pub(super) fn fork(
        &mut self,
        target: &ChatModel,
        speculation: &Speculation,
    ) -> Result<Option<Box<dyn DraftMethod>>> {
        Ok(self.method(target, speculation)?.map(|method| method.fork()))
    }

    fn load(&self, target: &ChatModel, speculation: &Speculation) -> Result<Box<dyn DraftMethod>> {
        Ok(match speculation {
            Speculation::Off | Speculation::Lookup => Box::new(PromptLookup::default()),
            Speculation::Draft { model } => {
                DraftModel::check_same_tokenizer(target.path(), model)?;
                let loaded = registry::load_model(model, &self.options)?;
                Box::new(DraftModel::from_folder(loaded, Path::new(model))?)
            }
            Speculation::Assistant { model } => registry::load_drafter(model, &self.options)?,
        })
    }
}
