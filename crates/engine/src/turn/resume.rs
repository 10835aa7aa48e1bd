//! A turn's checkpoints: the longest usable one restored before the prefill, and the caches
//! brought to the turn's boundary and written after the reply.

use std::path::Path;

use super::prompt::{common_prefix, cut_outside_images};
use super::{ChatModel, ResumeCandidate, WrittenCheckpoint};
use crate::Result;
use crate::cache::{Cache, CachePlan, CacheState, stack_offset};
use crate::generate::{GenerateRequest, prefill};
use crate::kv_file;

/// The caches a turn starts from.
pub(super) struct Restored {
    pub(super) caches: Vec<Box<dyn Cache>>,
    /// Prompt positions they hold.
    pub(super) reused: usize,
    /// The candidate restored and what its file held (every token, and the attachments).
    pub(super) from: Option<(i64, kv_file::Contents)>,
}

/// Restores the usable checkpoint sharing the longest prefix with `prompt` into caches of
/// `plan` (trimmed back to that prefix where the storages allow). Damaged or
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
    // The candidates sharing the most with the prompt first (a conversation's ancestors are
    // already longest first; unrelated requests' checkpoints share different prefixes).
    let mut usable: Vec<(usize, &ResumeCandidate)> = candidates
        .iter()
        .filter(|c| c.signature.as_ref().is_none_or(|s| *s == signature))
        .map(|c| {
            let shared = common_prefix(&c.tokens, prompt).min(prompt.len() - 1);
            (cut_outside_images(prompt, image, shared), c)
        })
        .filter(|(keep, _)| *keep > 0)
        .collect();
    usable.sort_by_key(|(keep, _)| std::cmp::Reverse(*keep));
    for (keep, candidate) in usable {
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

/// Prefills the turn's prompt up to `split` (where the conversation before its generation
/// prompt ends; at most all but the last token) into `caches` (which hold its first `reused`
/// tokens) and returns those tokens with the caches' states there, leaving `request` the rest
/// to prefill; `None` when nothing is left to prefill before `split`.
pub(super) fn prompt_state(
    model: &dyn crate::models::Model,
    caches: &mut [Box<dyn Cache>],
    prompt: &[u32],
    reused: usize,
    split: usize,
    request: &mut GenerateRequest,
) -> Result<Option<(Vec<u32>, Vec<CacheState>)>> {
    let end = split.min(prompt.len() - 1);
    if end <= reused {
        return Ok(None);
    }
    prefill(model, caches, &prompt[reused..end], request.prefill_step)?;
    let states = caches.iter().map(|c| c.state()).collect::<Result<Vec<_>>>()?;
    request.prompt = prompt[end..].to_vec();
    Ok(Some((prompt[..end].to_vec(), states)))
}

/// Where a checkpoint goes, how durably, and what rides along.
#[derive(Debug, Clone, Copy)]
pub(super) struct Destination<'a> {
    pub path: &'a Path,
    pub durability: kv_file::Durability,
    pub attachments: &'a [kv_file::Attachment],
}

impl<'a> Destination<'a> {
    /// `path`, synced, with no attachments.
    #[cfg(test)]
    fn synced(path: &'a Path) -> Destination<'a> {
        Destination { path, durability: kv_file::Durability::Synced, attachments: &[] }
    }
}

/// Brings `caches` (holding `held`) to `boundary`, the tokens the next turn's prompt starts
/// with, and writes them to `to`'s path. The reply's own tokens may re-tokenize differently: the
/// caches are trimmed back to the shared prefix where the storages allow it and the rest of
/// the boundary prefilled. Where they cannot (recurrent state, a ring that wrapped), the
/// checkpoint is written from `at_prompt` instead: the tokens and states kept where the
/// conversation before the generation prompt ends, which the next prompt starts with whatever
/// the reply becomes, so the next turn prefills only the reply and its own text. The same when
/// `at_prompt`'s flag says the template renders the reply otherwise in later turns' history.
/// Without it no checkpoint is written and the next turn resumes from an earlier one.
pub(super) fn write_boundary(
    chat: &ChatModel,
    boundary: Vec<u32>,
    held: Vec<u32>,
    caches: &mut [Box<dyn Cache>],
    at_prompt: Option<(&[u32], &[CacheState], bool)>,
    to: &Destination<'_>,
) -> Result<Option<WrittenCheckpoint>> {
    let Destination { path, durability, attachments } = *to;
    let image = chat.model().vision().map(|v| v.image_token());
    let keep = cut_outside_images(&boundary, image, common_prefix(&held, &boundary));
    let drop = held.len() - keep;
    let trimmable = caches.iter().all(|c| c.is_trimmable() && c.minimum_reusable_offset() <= keep);
    if let Some((tokens, states, rewritten)) = at_prompt
        && (rewritten || (drop > 0 && !trimmable))
        && states.len() == caches.len()
    {
        for (cache, state) in caches.iter_mut().zip(states) {
            cache.restore(state)?;
        }
        let file =
            kv_file::write_with(path, caches, tokens, chat.identity(), attachments, durability)?;
        return Ok(Some(WrittenCheckpoint { file, tokens: tokens.to_vec() }));
    }
    if drop > 0 {
        if !trimmable {
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
    let file =
        kv_file::write_with(path, caches, &boundary, chat.identity(), attachments, durability)?;
    Ok(Some(WrittenCheckpoint { file, tokens: boundary }))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::path::PathBuf;

    use super::*;
    use crate::LoadOptions;
    use crate::batch::generate;
    use crate::generate::Flow;

    fn qwen() -> ChatModel {
        let dir =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden/qwen3_5/dense");
        ChatModel::load(&dir, &LoadOptions::default()).unwrap()
    }

    /// On recurrent state, a reply whose boundary re-tokenizes differently is written from the
    /// state kept where the prompt's history ends: the checkpoint holds those tokens, and
    /// continuing from it reads as a cold prefill does. A reply the template rewrites in
    /// history (its thinking dropped) is written there too, even when its boundary extends
    /// what the caches hold.
    #[test]
    fn untrimmable_state_is_written_where_the_prompt_history_ends() {
        let chat = qwen();
        let model = chat.model();
        let prompt: Vec<u32> = (0..20).map(|i| (i * 37 % 400) + 3).collect();
        let split = 17;
        let mut caches = model.fresh_caches().unwrap();
        let mut request = GenerateRequest::new(prompt.clone(), 8);
        let kept =
            prompt_state(model, &mut caches, &prompt, 0, split, &mut request).unwrap().unwrap();
        assert_eq!(kept.0, prompt[..split]);
        assert_eq!(request.prompt, prompt[split..]);
        let reply = generate(model, &mut caches, &request, |_| Flow::Continue).unwrap().tokens;
        let held: Vec<u32> = prompt.iter().chain(&reply[..reply.len() - 1]).copied().collect();
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("turn.safetensors");
        // The next turn starts with the prompt and another spelling of the reply.
        let respelled: Vec<u32> = prompt.iter().chain(&[7, 8, 9, 10]).copied().collect();
        let without = write_boundary(
            &chat,
            respelled.clone(),
            held.clone(),
            &mut caches,
            None,
            &Destination::synced(&path),
        );
        assert!(without.unwrap().is_none(), "recurrent state cannot be trimmed back");
        let at_prompt = Some((kept.0.as_slice(), kept.1.as_slice(), false));
        let written = write_boundary(
            &chat,
            respelled.clone(),
            held,
            &mut caches,
            at_prompt,
            &Destination::synced(&path),
        )
        .unwrap()
        .expect("written from the prompt's state");
        assert_eq!(written.tokens, prompt[..split]);
        let mut restored = model.fresh_caches().unwrap();
        let contents =
            kv_file::read(&written.file.path, &written.file.sha256, chat.identity(), &mut restored)
                .unwrap();
        assert_eq!(contents.tokens, prompt[..split]);
        let next: Vec<u32> = respelled[split..].iter().chain(&[11, 12, 13]).copied().collect();
        let warm = prefill(model, &mut restored, &next, 512).unwrap();
        let mut cold_caches = model.fresh_caches().unwrap();
        let all: Vec<u32> = respelled.iter().chain(&[11, 12, 13]).copied().collect();
        let cold = prefill(model, &mut cold_caches, &all, 512).unwrap();
        let diff = warm.subtract(&cold).unwrap().abs().unwrap().max_all(false).unwrap();
        assert!(diff.item::<f32>().unwrap() < 1e-4);

        // A boundary that extends what the caches hold is written as is, unless the reply
        // is rewritten in history.
        let mut caches = model.fresh_caches().unwrap();
        let mut request = GenerateRequest::new(prompt.clone(), 8);
        let kept =
            prompt_state(model, &mut caches, &prompt, 0, split, &mut request).unwrap().unwrap();
        let reply = generate(model, &mut caches, &request, |_| Flow::Continue).unwrap().tokens;
        let held: Vec<u32> = prompt.iter().chain(&reply[..reply.len() - 1]).copied().collect();
        let extended: Vec<u32> = prompt.iter().chain(&reply).copied().collect();
        let plain = Some((kept.0.as_slice(), kept.1.as_slice(), false));
        let written = write_boundary(
            &chat,
            extended.clone(),
            held.clone(),
            &mut caches,
            plain,
            &Destination::synced(&path),
        )
        .unwrap()
        .unwrap();
        assert_eq!(written.tokens, extended);
        let mut caches = model.fresh_caches().unwrap();
        let mut request = GenerateRequest::new(prompt.clone(), 8);
        let kept =
            prompt_state(model, &mut caches, &prompt, 0, split, &mut request).unwrap().unwrap();
        generate(model, &mut caches, &request, |_| Flow::Continue).unwrap();
        let rewritten = Some((kept.0.as_slice(), kept.1.as_slice(), true));
        let written = write_boundary(
            &chat,
            extended,
            held,
            &mut caches,
            rewritten,
            &Destination::synced(&path),
        )
        .unwrap()
        .unwrap();
        assert_eq!(written.tokens, prompt[..split]);
    }
}
