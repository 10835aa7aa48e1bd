//! `quince logits`: a forward pass's logits written to safetensors, over the whole prompt at
//! once or one position at a time (each image block as one window), for parity checks.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, bail};
use engine::cache::Cache;
use engine::models::{Model, Phase, Rows};
use engine::tokens::ids;
use mlx::ops;

use crate::options::LoadArgs;

/// Arguments of `quince logits`.
#[derive(Debug, clap::Args)]
pub struct LogitsArgs {
    /// Model directory.
    #[arg(long)]
    model: PathBuf,
    /// Token ids, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    tokens: Vec<u32>,
    /// Output safetensors file; float32 logits [T, V] under `logits`.
    #[arg(long)]
    out: PathBuf,
    /// Prefill the first token, then one decode step per remaining token (each image block,
    /// boi … eoi, as one bidirectional window).
    #[arg(long)]
    incremental: bool,
    /// Images filling the runs of the model's image token, in order (repeatable).
    #[arg(long)]
    image: Vec<PathBuf>,
    /// Soft-token budget per image: 70, 140, 280, 560 or 1120.
    #[arg(long, default_value_t = 280)]
    max_soft_tokens: usize,
    #[command(flatten)]
    load: LoadArgs,
}

/// Decodes, preprocesses and encodes each image: features `[n_i, hidden]` per image.
pub(crate) fn encode_images(
    model: &dyn Model,
    paths: &[PathBuf],
    max_soft_tokens: usize,
) -> anyhow::Result<Vec<mlx::Array>> {
    if paths.is_empty() {
        return Ok(Vec::new());
    }
    let Some(vision) = model.vision() else {
        bail!("this model has no vision tower: it cannot take --image");
    };
    paths
        .iter()
        .map(|path| {
            let rgb = engine::vision::image::load_rgb(path)?;
            Ok(vision.encode(&vision.prepare(&rgb, max_soft_tokens)?.pixels)?)
        })
        .collect()
}

/// `quince logits`.
pub fn run(args: &LogitsArgs) -> anyhow::Result<()> {
    let model = engine::registry::load_model(&args.model, &args.load.options())
        .with_context(|| format!("loading the model at {}", args.model.display()))?;
    engine::generate::check_prompt(model.as_ref(), 0, &args.tokens, 0)?;
    let mut caches = model.fresh_caches()?;
    let images = encode_images(model.as_ref(), &args.image, args.max_soft_tokens)?;
    let logits = if !images.is_empty() {
        multimodal_logits(model.as_ref(), &mut caches, &args.tokens, &images, args.incremental)?
    } else if args.incremental {
        let mut rows = vec![model.forward(&ids(&args.tokens[..1])?, &mut caches, Phase::Window)?];
        for &token in &args.tokens[1..] {
            let row = model.forward(&ids(&[token])?, &mut caches, Phase::Decode)?;
            row.eval()?;
            rows.push(row);
        }
        ops::concatenate(&rows.iter().collect::<Vec<_>>(), 1)?
    } else {
        model.forward(&ids(&args.tokens)?, &mut caches, Phase::Window)?
    };
    let t = args.tokens.len() as i32;
    let logits = logits.reshape(&[t, -1])?.astype(mlx::Dtype::Float32)?;
    let mut tensors = BTreeMap::new();
    tensors.insert("logits".to_string(), logits);
    let mut metadata = BTreeMap::new();
    metadata.insert(
        "path".to_string(),
        if args.incremental { "incremental" } else { "full" }.to_string(),
    );
    mlx::io::save_safetensors(&args.out, &tensors, &metadata)
        .with_context(|| format!("writing {}", args.out.display()))?;
    Ok(())
}

/// Logits over a prompt with images: one window, or (incremental) text one decode step at a
/// time and each image block `boi … eoi` as one bidirectional window.
fn multimodal_logits(
    model: &dyn Model,
    caches: &mut [Box<dyn Cache>],
    tokens: &[u32],
    images: &[mlx::Array],
    incremental: bool,
) -> anyhow::Result<mlx::Array> {
    if !incremental {
        return Ok(model.forward_multimodal(tokens, images, caches, Rows::All)?);
    }
    let vision = model.vision().context("this model has no vision tower")?;
    let image = vision.image_token();
    // An image block's markers: its first and last tokens around the image tokens.
    let block = vision.image_block(1);
    let (boi, eoi) = (block[0], block[block.len() - 1]);
    let runs = engine::vision::image_runs(tokens, image);
    if runs.len() != images.len() {
        bail!("the prompt has {} image blocks but {} images were given", runs.len(), images.len());
    }
    let mut rows = Vec::new();
    let mut i = 0;
    let mut next = 0;
    while i < tokens.len() {
        let block = runs
            .get(next)
            .copied()
            .filter(|&(start, _)| start == i || (start == i + 1 && tokens[i] == boi));
        if let Some((start, len)) = block {
            let mut end = start + len;
            if end < tokens.len() && tokens[end] == eoi {
                end += 1;
            }
            rows.push(model.forward_multimodal(
                &tokens[i..end],
                &images[next..=next],
                caches,
                Rows::All,
            )?);
            next += 1;
            i = end;
        } else {
            let phase = if i == 0 { Phase::Window } else { Phase::Decode };
            let ids = ids(&tokens[i..=i])?;
            let row = model.forward(&ids, caches, phase)?;
            row.eval()?;
            rows.push(row);
            i += 1;
        }
    }
    Ok(ops::concatenate(&rows.iter().collect::<Vec<_>>(), 1)?)
}
