//! A turn's checkpoints: the longest usable one restored before the prefill, and the caches
//! brought to the turn's boundary and written after the reply.

use std::path::Path;

use super::prompt::{common_prefix, cut_outside_images};
use super::{ChatModel, ResumeCandidate, WrittenCheckpoint};
use crate::cache::{Cache, CachePlan, stack_offset};
use crate::error::Result;
use crate::generate::prefill;
use crate::kv_file;

/// The caches a turn starts from.
pub(super) struct Restored {
    pub(super) caches: Vec<Box<dyn Cache>>,
    /// Prompt positions they hold.
    pub(super) reused: usize,
    /// The candidate restored and what its file held (every token, and the attachments).
    pub(super) from: Option<(i64, kv_file::Contents)>,
}

/// Restores the longest usable checkpoint into caches of `plan`: one whose tokens share a
/// prefix with `prompt` (trimmed back to that prefix where the storages allow). Damaged or
/// foreign files, and files of another storage, are added to `rejected`; fresh caches when
/// none serves.
pub(super) fn restore(
    chat: &ChatModel,
    plan: &CachePlan,
    candidates: &[ResumeCandidate],
    prompt: &[u32],
    rejected: &mut Vec<(i64, String)>,
) -> Result<Restored> {
    let model = chat.model();
    let image = model.vision().map(|v| v.image_token());
    let signature = plan.signature()?;
    for candidate in candidates {
        if candidate.signature.as_ref().is_some_and(|s| *s != signature) {
            continue;
        }
        let shared = common_prefix(&candidate.tokens, prompt).min(prompt.len() - 1);
        let keep = cut_outside_images(prompt, image, shared);
        if keep == 0 {
            continue;
        }
        let mut restored = model.new_caches(plan)?;
        let read =
            kv_file::read(&candidate.path, &candidate.sha256, chat.identity(), &mut restored);
        let contents = match read {
            Ok(contents) => contents,
            Err(error) => {
                rejected.push((candidate.id, error.to_string()));
                continue;
            }
        };
        if contents.tokens != candidate.tokens {
            rejected.push((candidate.id, "its tokens differ from the index".into()));
            continue;
        }
        let drop = contents.tokens.len() - keep;
        if drop > 0 {
            // A ring that evicted, or storage converted past `keep`, cannot go back there.
            if !restored.iter().all(|c| c.is_trimmable() && c.minimum_reusable_offset() <= keep) {
                continue;
            }
            for cache in &mut restored {
                cache.trim(drop)?;
            }
        }
        let buffers: Vec<mlx::Array> = restored.iter().flat_map(|c| c.buffers()).collect();
        mlx::eval(&buffers.iter().collect::<Vec<_>>())?;
        return Ok(Restored {
            caches: restored,
            reused: keep,
            from: Some((candidate.id, contents)),
        });
    }
    Ok(Restored { caches: model.new_caches(plan)?, reused: 0, from: None })
}

/// Brings `caches` (holding `held`) to `boundary`, the tokens the next turn's prompt starts
/// with, and writes them to `path`. The reply's own tokens may re-tokenize differently: the
/// caches are trimmed back to the shared prefix where the storages allow it and the rest of
/// the boundary prefilled; where they cannot (a ring that wrapped), no checkpoint is written
/// and the next turn resumes from an earlier one.
pub(super) fn write_boundary(
    chat: &ChatModel,
    boundary: Vec<u32>,
    held: Vec<u32>,
    caches: &mut [Box<dyn Cache>],
    path: &Path,
    attachments: &[kv_file::Attachment],
) -> Result<Option<WrittenCheckpoint>> {
    let image = chat.model().vision().map(|v| v.image_token());
    let keep = cut_outside_images(&boundary, image, common_prefix(&held, &boundary));
    let drop = held.len() - keep;
    if drop > 0 {
        if !caches.iter().all(|c| c.is_trimmable() && c.minimum_reusable_offset() <= keep) {
            return Ok(None);
        }
        for cache in caches.iter_mut() {
            cache.trim(drop)?;
        }
    }
    if boundary.len() > keep {
        prefill(chat.model(), caches, &boundary[keep..], 512)?;
    }
    debug_assert_eq!(stack_offset(caches), boundary.len());
    let file = kv_file::write(path, caches, &boundary, chat.identity(), attachments)?;
    Ok(Some(WrittenCheckpoint { file, tokens: boundary }))
}
