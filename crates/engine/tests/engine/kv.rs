//! Encoded KV storages against the reference, on goldens recorded by
//! `tests/golden/kv/make_golden.py`:
//!
//! - affine KV on Gemma 4's full-attention layers (`KvLayers::Full`) against mlx-lm 0.32.2
//!   driving its own model and `QuantizedKVCache`s, converted from `quantized_kv_start` as its
//!   `maybe_quantize_kv_cache` does: 48 greedy tokens identical and every step's logits within
//!   1e-4, at 4 and 8 bits, groups 32 and 64, converted after the prefill or during decoding;
//! - TurboQuant against mlx-vlm 0.7.10's `TurboQuantKVCache`: the same packed codes and norms
//!   for the same seed and bits, and the same attention output within tolerance.

use engine::backend::Ops;
use engine::cache::{
    AttentionCache, AttentionRead, Cache, KvEncoding, KvFormat, KvLayers, KvOptions, PlainCache,
};
use engine::generate::prefill;
use engine::models::Model;
use engine::tokens::ids as token_array;
use mlx::{Array, Dtype};
use test_support::{golden_dir, ids, max_diff};

fn tensors(path: &str) -> std::collections::HashMap<String, Array> {
    let file = mlx::io::load_safetensors(golden_dir(path).join("golden.safetensors")).unwrap();
    file.tensors.into_iter().collect()
}

/// Greedy decoding of `steps` tokens after `prompt` under `kv`: each step's logits (the first
/// from the prefill) and the tokens picked from them.
pub(crate) fn greedy_steps(
    model: &dyn Model,
    kv: &KvOptions,
    prompt: &[u32],
    steps: usize,
) -> (Vec<Array>, Vec<u32>) {
    let plan = model.cache_plan().with_kv(kv).unwrap();
    let mut caches = model.new_caches(&plan).unwrap();
    let mut logits = prefill(model, &mut caches, prompt, 512).unwrap().reshape(&[-1]).unwrap();
    let (mut rows, mut tokens) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        let token = logits.argmax(-1, false).unwrap().item::<u32>().unwrap();
        rows.push(logits);
        tokens.push(token);
        logits = model
            .forward_decode(&token_array(&[token]).unwrap(), &mut caches)
            .unwrap()
            .reshape(&[-1])
            .unwrap();
    }
    (rows, tokens)
}

#[test]
fn affine_kv_on_full_layers_matches_mlx_lm() {
    let g = tensors("kv/affine");
    let model = test_support::load(&golden_dir("gemma4/k_eq_v"));
    let prompt = ids(&g["prompt"]);
    for (bits, group, start) in
        [(4, 32, 0), (4, 64, 0), (8, 32, 0), (8, 64, 0), (4, 64, 44), (8, 32, 60)]
    {
        let name = format!("b{bits}_g{group}_s{start}");
        let kv = KvOptions {
            format: KvFormat::Affine { bits, group_size: group },
            quantized_start: start,
            layers: KvLayers::Full,
        };
        let want_tokens = ids(&g[&format!("{name}.tokens")]);
        let want = &g[&format!("{name}.logits")];
        let (rows, tokens) = greedy_steps(model.as_ref(), &kv, &prompt, want_tokens.len());
        assert_eq!(tokens, want_tokens, "{name}: greedy tokens");
        for (i, row) in rows.iter().enumerate() {
            let i = i as i32;
            let golden = want.slice(&[i, 0], &[i + 1, want.dim(1).unwrap()], &[1, 1]).unwrap();
            let diff = max_diff(&row.reshape(&[1, -1]).unwrap(), &golden);
            assert!(diff <= 1e-4, "{name}: step {i} logits differ by {diff}");
        }
    }
    // The same run in full precision picks other tokens: the goldens tell the formats apart.
    let (_, full) = greedy_steps(model.as_ref(), &KvOptions::full(), &prompt, 48);
    assert_ne!(full, ids(&g["b4_g32_s0.tokens"]), "4-bit KV changes this random model's greedy");
}

#[test]
fn turbo_kv_matches_mlx_vlm_codes_and_attention() {
    let g = tensors("kv/turbo");
    let window = 5;
    for case in 0..7 {
        let at = |name: &str| g[&format!("case{case}.{name}")].clone();
        let bits = at("bits").to_vec::<f32>().unwrap();
        let (key_bits, value_bits) = (bits[0] as u8, bits[1] as u8);
        let format = KvFormat::Turbo { key_bits, value_bits };
        let (k, v) = (at("keys"), at("values"));
        let t = k.dim(2).unwrap();
        let dtype = k.dtype();

        // Codes and norms: the whole prefix encoded at once, as mlx-vlm's `from_cache`.
        let mut cache = PlainCache::encoded(KvEncoding { format, start: 0 }, &Ops::mlx());
        cache.append_window(&k, &v).unwrap();
        let state = cache.state().unwrap();
        let norms = |x: &Array| x.reshape(&[x.dim(0).unwrap(), x.dim(1).unwrap(), t]).unwrap();
        for (ours, theirs) in [("keys", "key_codes"), ("values", "value_codes")] {
            let same = state.tensors[ours].array_equal(&at(theirs), false).unwrap();
            assert!(same.item::<bool>().unwrap(), "case {case}: {ours} codes differ");
        }
        for (ours, theirs) in [("keys.norms", "key_norms"), ("values.norms", "value_norms")] {
            let same = norms(&state.tensors[ours]).array_equal(&at(theirs), false).unwrap();
            assert!(same.item::<bool>().unwrap(), "case {case}: {ours} differ");
        }

        // A decode query over every stored position.
        let scale = (k.dim(3).unwrap() as f32).powf(-0.5);
        let read = cache.as_attention().unwrap().donor_read().unwrap().unwrap();
        let decode = read.attend(&at("query"), scale).unwrap();
        assert_eq!(decode.dtype(), dtype);
        let f32 = |x: &Array| x.astype(Dtype::Float32).unwrap();
        let tolerance = if dtype == Dtype::Float32 { 1e-5 } else { 1e-2 };
        let diff = max_diff(&f32(&decode), &f32(&at("decode")));
        assert!(diff <= tolerance, "case {case}: decode attention differs by {diff}");

        // A causal window of the last positions, over stored positions already converted.
        let slice = |x: &Array, from: i32, to: i32| {
            let s = x.shape();
            x.slice(&[0, 0, from, 0], &[s[0], s[1], to, s[3]], &[1; 4]).unwrap()
        };
        let mut cache = PlainCache::encoded(KvEncoding { format, start: 0 }, &Ops::mlx());
        let split = t - window;
        cache.append_window(&slice(&k, 0, split), &slice(&v, 0, split)).unwrap();
        let read = cache.append_window(&slice(&k, split, t), &slice(&v, split, t)).unwrap();
        let out = read.attend(&at("window_query"), scale).unwrap();
        // mlx-vlm dequantizes and attends in the query's dtype; Quince attends in f32 in the
        // rotated domain: bf16 cases differ by its rounding.
        let tolerance = if dtype == Dtype::Float32 { 1e-5 } else { 3e-2 };
        let diff = max_diff(&f32(&out), &f32(&at("window")));
        assert!(diff <= tolerance, "case {case}: window attention differs by {diff}");
    }
}

/// Compiled decode over encoded storage (the new position encoded inside the traced step)
/// gives the op-by-op steps' tokens, on every layer of a model with KV-shared layers, and runs
/// every step compiled.
#[test]
fn compiled_decode_over_encoded_storage_is_op_by_op_decode() {
    let dir = golden_dir("gemma4/dense");
    let prompt: Vec<u32> = (0..40).map(|i| 3 + (i * 37) % 490).collect();
    let options =
        |compiled| engine::LoadOptions { compiled_decode: Some(compiled), ..Default::default() };
    let compiled = test_support::load_with(&dir, &options(true));
    let eager = test_support::load_with(&dir, &options(false));
    for format in [
        KvFormat::Affine { bits: 4, group_size: 32 },
        KvFormat::Affine { bits: 8, group_size: 32 },
        KvFormat::turbo(3.0).unwrap(),
        KvFormat::turbo(4.0).unwrap(),
    ] {
        let kv = KvOptions { format, quantized_start: 0, layers: KvLayers::All };
        let before = compiled.decode_graphs().unwrap().stats();
        let (rows, tokens) = greedy_steps(compiled.as_ref(), &kv, &prompt, 24);
        let after = compiled.decode_graphs().unwrap().stats();
        assert_eq!(after.steps - before.steps, 24, "{format:?}: every step compiled");
        assert_eq!(after.uncompiled, before.uncompiled, "{format:?}: none fell back");
        let (eager_rows, eager_tokens) = greedy_steps(eager.as_ref(), &kv, &prompt, 24);
        assert_eq!(tokens, eager_tokens, "{format:?}");
        for (i, (a, b)) in rows.iter().zip(&eager_rows).enumerate() {
            let diff = max_diff(a, b);
            assert!(diff <= 1e-5, "{format:?}: step {i} differs by {diff}");
        }
    }
}

/// The test's oracle: a full-precision cache that stores each appended position as `format`
/// would read it back (dequantized), converting what it holds after its first append as an
/// encoded storage from position 0 does. Attention over it is the naive attention over the
/// same dequantized values.
#[derive(Debug)]
struct RoundTripped {
    inner: Box<dyn AttentionCache>,
    format: KvFormat,
    converted: bool,
}

impl RoundTripped {
    fn stored(&self, keys: &Array, values: &Array) -> (Array, Array) {
        if !self.converted {
            return (keys.clone(), values.clone());
        }
        let (k, v) = self.format.round_trip(keys, values).unwrap();
        (k.astype(keys.dtype()).unwrap(), v.astype(values.dtype()).unwrap())
    }

    fn settle(&mut self) {
        if self.converted {
            return;
        }
        self.converted = true;
        let mut state = self.inner.state().unwrap();
        let (k, v) = self.stored(&state.tensors["keys"], &state.tensors["values"]);
        state.tensors.insert("keys".into(), k);
        state.tensors.insert("values".into(), v);
        self.inner.restore(&state).unwrap();
    }
}

impl Cache for RoundTripped {
    fn offset(&self) -> usize {
        self.inner.offset()
    }
    fn signature(&self) -> String {
        self.inner.signature()
    }
    fn bytes_per_token(&self) -> usize {
        self.inner.bytes_per_token()
    }
    fn stored_positions(&self) -> usize {
        self.inner.stored_positions()
    }
    fn buffers(&self) -> Vec<Array> {
        self.inner.buffers()
    }
    fn state(&self) -> engine::Result<engine::cache::CacheState> {
        self.inner.state()
    }
    fn restore(&mut self, state: &engine::cache::CacheState) -> engine::Result<()> {
        self.inner.restore(state)
    }
    fn is_trimmable(&self) -> bool {
        false
    }
    fn trim(&mut self, _: usize) -> engine::Result<usize> {
        unreachable!("the oracle is never trimmed")
    }
    fn spec_round_begin(&mut self) -> engine::Result<()> {
        unreachable!("the oracle runs no rounds")
    }
    fn spec_round_commit(&mut self) -> engine::Result<()> {
        unreachable!("the oracle runs no rounds")
    }
    fn spec_round_rollback(&mut self, _: usize) -> engine::Result<()> {
        unreachable!("the oracle runs no rounds")
    }
    fn as_attention(&self) -> Option<&dyn AttentionCache> {
        Some(self)
    }
    fn as_attention_mut(&mut self) -> Option<&mut dyn AttentionCache> {
        Some(self)
    }
}

impl AttentionCache for RoundTripped {
    fn append_decode(&mut self, k: &Array, v: &Array) -> engine::Result<AttentionRead> {
        let (k, v) = self.stored(k, v);
        let read = self.inner.append_decode(&k, &v);
        self.settle();
        read
    }
    fn append_window(&mut self, k: &Array, v: &Array) -> engine::Result<AttentionRead> {
        let (k, v) = self.stored(k, v);
        let read = self.inner.append_window(&k, &v);
        self.settle();
        read
    }
    fn donor_read(&self) -> engine::Result<Option<AttentionRead>> {
        self.inner.donor_read()
    }
}

/// Beyond mlx-lm: every layer encoded, sliding windows included, on a model whose KV-shared
/// layers read their donor's (encoded) read. Each step's logits equal a model run over the
/// oracle's naive attention on the same dequantized values.
#[test]
fn shared_and_sliding_layers_read_their_encoded_storage() {
    let model = test_support::load(&golden_dir("gemma4/dense"));
    let prompt: Vec<u32> = (0..40).map(|i| 3 + (i * 53) % 490).collect();
    for format in [
        KvFormat::Affine { bits: 4, group_size: 32 },
        KvFormat::Affine { bits: 8, group_size: 32 },
        KvFormat::turbo(3.0).unwrap(),
        KvFormat::turbo(3.5).unwrap(),
    ] {
        let kv = KvOptions { format, quantized_start: 0, layers: KvLayers::All };
        let (rows, tokens) = greedy_steps(model.as_ref(), &kv, &prompt, 24);
        // The oracle, fed the same tokens.
        let mut caches: Vec<Box<dyn Cache>> = model
            .new_caches(&model.cache_plan())
            .unwrap()
            .into_iter()
            .map(|c| {
                let window = c.signature().starts_with("rotating");
                let inner: Box<dyn AttentionCache> = if window {
                    let w = c
                        .signature()
                        .trim_start_matches("rotating(window=")
                        .trim_end_matches(')')
                        .parse()
                        .unwrap();
                    Box::new(engine::cache::RotatingCache::new(w).unwrap())
                } else {
                    Box::new(PlainCache::new())
                };
                Box::new(RoundTripped { inner, format, converted: false }) as Box<dyn Cache>
            })
            .collect();
        let mut logits = prefill(model.as_ref(), &mut caches, &prompt, 512).unwrap();
        for (i, row) in rows.iter().enumerate() {
            let diff = max_diff(row, &logits.reshape(&[-1]).unwrap());
            assert!(diff <= 2e-4, "{format:?}: step {i} differs from the oracle by {diff}");
            let token = token_array(&[tokens[i]]).unwrap();
            logits = model.forward(&token, &mut caches, engine::models::Phase::Decode).unwrap();
        }
    }
}

/// A conversation on 4-bit and on TurboQuant KV, its checkpoint reopened by a fresh load (a
/// restart): the resumed turn reuses the checkpoint and answers exactly as a cold run on the
/// same storage (f32, greedy). The conversion sits at a fixed position (`quantized_start`, 8
/// here), so cold and resumed runs read the same values whatever their chunks. A checkpoint of
/// another storage is passed over (kept, not rejected); one whose storage was not recorded is
/// read, refused by its signatures, and rejected.
#[test]
fn encoded_checkpoints_resume_as_cold_runs_on_the_same_storage() {
    use engine::generate::Flow;
    use engine::turn::{ChatModel, Drafters, Prompt, ResumeCandidate, Turn};
    let dir = golden_dir("gemma4/dense");
    let tmp = tempfile::tempdir().unwrap();
    let first: Vec<u32> = std::iter::once(2).chain((0..20).map(|i| (i * 37 % 400) + 3)).collect();
    for format in [KvFormat::Affine { bits: 4, group_size: 32 }, KvFormat::turbo(3.0).unwrap()] {
        let kv = KvOptions { format, quantized_start: 8, layers: KvLayers::All };
        let answer = |chat: &ChatModel, turn: Turn| {
            chat.answer(&turn, &mut Drafters::new(Default::default()), |_| Flow::Continue).unwrap()
        };
        let path = tmp.path().join(format!("{}.safetensors", format.signature()));
        let chat = ChatModel::load(&dir, &Default::default()).unwrap();
        let one = answer(
            &chat,
            Turn {
                max_tokens: 12,
                kv,
                checkpoint_to: Some(path.clone()),
                ..Turn::new(Prompt::Tokens { ids: first.clone(), images: Vec::new() })
            },
        );
        let checkpoint = one.checkpoint.expect("a checkpoint");
        assert!(
            checkpoint.file.signature.contains(&format.signature()[..6]),
            "{}",
            checkpoint.file.signature
        );
        drop(chat);

        // A restart: the model loaded anew, the checkpoint read from its file.
        let chat = ChatModel::load(&dir, &Default::default()).unwrap();
        let mut second = checkpoint.tokens.clone();
        second.extend([41, 97, 203, 7, 350, 12, 88, 143, 9, 301, 77]);
        let prompt = Prompt::Tokens { ids: second, images: Vec::new() };
        let turn = |resume: Vec<ResumeCandidate>, kv: KvOptions| Turn {
            max_tokens: 24,
            kv,
            resume,
            ..Turn::new(prompt.clone())
        };
        let cold = answer(&chat, turn(Vec::new(), kv));
        let candidate = ResumeCandidate {
            id: 1,
            path: checkpoint.file.path.clone(),
            sha256: checkpoint.file.sha256.clone(),
            tokens: checkpoint.tokens.clone(),
            signature: Some(checkpoint.file.signature.clone()),
        };
        let warm = answer(&chat, turn(vec![candidate.clone()], kv));
        assert_eq!(warm.resumed_from, Some(1), "{format:?}");
        assert_eq!(warm.stats.reused_tokens, checkpoint.tokens.len());
        assert_eq!(warm.tokens, cold.tokens, "{format:?}: resumed = cold on the same storage");
        assert_eq!(warm.stats.kv_storage, cold.stats.kv_storage);

        // Another storage: passed over, not rejected.
        let full = answer(&chat, turn(vec![candidate.clone()], KvOptions::full()));
        assert_eq!((full.resumed_from, full.rejected.len()), (None, 0), "{format:?}");
        // No recorded storage: the file itself refuses it.
        let unknown = ResumeCandidate { signature: None, ..candidate };
        let refused = answer(&chat, turn(vec![unknown], KvOptions::full()));
        assert_eq!(refused.resumed_from, None);
        assert_eq!(refused.rejected.len(), 1, "{:?}", refused.rejected);
        assert!(refused.rejected[0].1.contains("signature"), "{:?}", refused.rejected);
    }
}

/// The memory guard: a reply whose projected KV cache would pass the limit is refused before
/// any work, with the numbers, and writes no checkpoint; a smaller storage fits where full
/// precision did not.
#[test]
fn a_reply_over_the_memory_limit_is_refused_up_front() {
    use engine::generate::Flow;
    use engine::turn::{ChatModel, Drafters, Prompt, Turn};
    let dir = golden_dir("gemma4/dense");
    let chat = ChatModel::load(&dir, &Default::default()).unwrap();
    let recommended = engine::memory::recommended_bytes().unwrap().expect("the CPU reports RAM");
    let plan = chat.model().cache_plan();
    let tokens = 20 + 4000;
    let full_bytes = plan.projected_bytes(tokens) as f64;
    let in_use = mlx::device::memory::active().unwrap() as f64;
    // A limit between what 4-bit KV needs and what full precision needs.
    let four =
        KvOptions { format: KvFormat::Affine { bits: 4, group_size: 32 }, ..Default::default() };
    let four_bytes = plan.with_kv(&four).unwrap().projected_bytes(tokens) as f64;
    let share = (in_use + (four_bytes + full_bytes) / 2.0) / recommended as f64;
    let tmp = tempfile::tempdir().unwrap();
    let turn = |kv| Turn {
        max_tokens: 4000,
        kv,
        memory_share: Some(share),
        checkpoint_to: Some(tmp.path().join("never.safetensors")),
        ..Turn::new(Prompt::Tokens { ids: (3..23).collect(), images: Vec::new() })
    };
    let mut drafters = Drafters::new(Default::default());
    let error =
        chat.answer(&turn(KvOptions::full()), &mut drafters, |_| Flow::Continue).unwrap_err();
    assert!(matches!(error, engine::Error::KvMemory { tokens: 4020, .. }), "{error:?}");
    let message = error.to_string();
    for words in ["KV cache", "4020 tokens", "full-precision", "4-bit or TurboQuant", "new chat"] {
        assert!(message.contains(words), "{message}");
    }
    assert!(!tmp.path().join("never.safetensors").exists(), "nothing was computed or written");
    let fits = chat.answer(&turn(four), &mut drafters, |_| Flow::Stop).unwrap();
    assert_eq!(fits.tokens.len(), 1, "4-bit KV fits under the same limit");
}

/// Bytes per token at Gemma 4 E4B's dimensions (24 layers with their own keys and values: 20
/// sliding of 2 heads × 256, 4 full of 2 heads × 512, bf16), scales and norms included: 8-bit
/// about half of bf16, 4-bit under three tenths, TurboQuant 3-bit under a quarter.
#[test]
fn bytes_per_token_at_e4b_dimensions() {
    use engine::cache::{CachePlan, KvShape, Storage};
    let shape = |head_dim| KvShape { kv_heads: 2, head_dim, dtype_bytes: 2 };
    let (layers, shapes): (Vec<_>, Vec<_>) = (0..24)
        .map(|i| {
            if i % 6 == 5 {
                (Storage::plain(), shape(512))
            } else {
                (Storage::rotating(512), shape(256))
            }
        })
        .unzip();
    let plan = CachePlan::new(layers, shapes);
    let full = plan.bytes_per_token();
    assert_eq!(full, 20 * 2 * 2 * 256 * 2 + 4 * 2 * 2 * 512 * 2);
    let ratio = |format| {
        let kv = KvOptions { format, ..Default::default() };
        plan.with_kv(&kv).unwrap().bytes_per_token() as f64 / full as f64
    };
    let eight = ratio(KvFormat::Affine { bits: 8, group_size: 64 });
    let four = ratio(KvFormat::Affine { bits: 4, group_size: 64 });
    let turbo3 = ratio(KvFormat::turbo(3.0).unwrap());
    let turbo35 = ratio(KvFormat::turbo(3.5).unwrap());
    assert!((eight - 0.53125).abs() < 1e-9, "{eight}");
    assert!((four - 0.28125).abs() < 1e-9, "{four}");
    assert!(turbo3 <= 0.25 && (turbo3 - 0.19085).abs() < 1e-4, "{turbo3}");
    assert!(turbo35 < 0.25, "{turbo35}");
    // A ring holds at most its window; a storage holds full precision until its start.
    let late = KvOptions {
        format: KvFormat::turbo(3.0).unwrap(),
        quantized_start: 1000,
        layers: KvLayers::All,
    };
    let late = plan.with_kv(&late).unwrap();
    assert_eq!(late.projected_bytes(999), plan.projected_bytes(999));
    assert!(late.projected_bytes(1000) < plan.projected_bytes(1000) / 4);
    assert_eq!(plan.projected_bytes(4096) - plan.projected_bytes(4095), 4 * 2 * 2 * 512 * 2);
}
