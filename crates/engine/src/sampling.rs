//! Turning logits into the next token: penalties, temperature, top-k, top-p, min-p, and a
//! seeded categorical draw. Greedy when the temperature is 0.
//!
//! Everything runs as MLX ops on the device, so the decode loop never waits on the host to
//! pick a token. Randomness comes from a key derived from the seed and the step, so a run is
//! reproducible for a seed whatever else happened before it.

use mlx::{Array, Dtype, ops, random};

use crate::constrain::Grammar;
use crate::{Error, Result};

/// Sampling settings, as a chat app exposes them.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the `k` most likely tokens (0: off).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `p` (1.0: off).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` × the most likely one (0: off).
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of tokens seen in the last
    /// `penalty_window` tokens (1.0: off).
    pub repetition_penalty: f32,
    /// Subtract from the logits of every token seen in the last `penalty_window` tokens (0: off).
    pub presence_penalty: f32,
    /// How many recent tokens the penalties look at.
    pub penalty_window: usize,
    /// Seed of the random stream.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            penalty_window: 64,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Whether a pick reads the tokens before it (a repetition or presence penalty): a step
    /// then waits for the last token before it is built, where otherwise it is built on the
    /// token still being computed.
    pub fn penalizes(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0
    }

    /// Whether every pick is the argmax of its logits alone (temperature 0, no penalty): a
    /// verify window's picks are then one argmax over its positions.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 && !self.penalizes()
    }

    /// Checks the ranges; called once when a generation starts.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str| Err(Error::InvalidRequest(what.to_string()));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad("temperature must be a finite number ≥ 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p must be in (0, 1]");
        }
        if !(0.0..1.0).contains(&self.min_p) {
            return bad("min_p must be in [0, 1)");
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad("repetition_penalty must be > 0");
        }
        Ok(())
    }
}

/// A seeded sampler. `sample` takes logits `[1, V]` and the tokens so far, and returns the
/// chosen id as a lazy `uint32` array `[1]`.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    key: Array,
    step: u64,
    grammar: Option<Grammar>,
}

impl Sampler {
    /// A sampler for `params` (validated).
    pub fn new(params: SamplingParams) -> Result<Sampler> {
        params.validate()?;
        let key = random::key(params.seed)?;
        Ok(Sampler { params, key, step: 0, grammar: None })
    }

    /// A sampler for `params` that keeps every pick to `grammar` (when there is one).
    pub fn constrained(params: SamplingParams, grammar: Option<Grammar>) -> Result<Sampler> {
        let mut sampler = Sampler::new(params)?;
        sampler.grammar = grammar;
        Ok(sampler)
    }

    /// The settings.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether each pick is the argmax of its logits alone: greedy settings
    /// ([`SamplingParams::is_greedy`]) and no grammar.
    pub fn is_argmax(&self) -> bool {
        self.grammar.is_none() && self.params.is_greedy()
    }

    /// Picks the next token from `logits` `[1, V]`; `history` is every token so far (prompt
    /// and reply) for the penalties.
    ///
    /// A constrained sampler picks among the tokens its grammar allows, and waits for the
    /// pick to feed it to the grammar.
    pub fn sample(&mut self, logits: &Array, history: &[u32]) -> Result<Array> {
        let Some(grammar) = self.grammar.as_mut() else { return self.draw(logits, history) };
        let vocab = logits.dim(-1)?;
        let mask = grammar.mask(vocab as usize)?;
        let logits = logits.astype(Dtype::Float32)?.add(&Array::from_slice(&mask, &[1, vocab])?)?;
        let token = self.draw(&logits, history)?.item::<u32>()?;
        if let Some(grammar) = self.grammar.as_mut() {
            grammar.accept(token)?;
        }
        Ok(Array::from_slice(&[token], &[1])?)
    }

    fn draw(&mut self, logits: &Array, history: &[u32]) -> Result<Array> {
        let p = &self.params;
        let mut logits = logits.astype(Dtype::Float32)?;
        if p.penalizes() {
            logits = self.penalize(&logits, history)?;
        }
        if p.temperature == 0.0 {
            return Ok(logits.argmax(-1, false)?);
        }
        let mut logits = logits.multiply_scalar(1.0 / f64::from(p.temperature))?;
        let vocab = logits.dim(-1)?;
        let neg_inf = logits.scalar_like(f64::NEG_INFINITY)?;
        if p.top_k > 0 && (p.top_k as i32) < vocab {
            // Keep values ≥ the k-th largest.
            let kth = logits.partition(vocab - p.top_k as i32, -1)?.slice(
                &[0, vocab - p.top_k as i32],
                &[1, vocab - p.top_k as i32 + 1],
                &[1, 1],
            )?;
            logits = ops::where_(&logits.lt(&kth)?, &neg_inf, &logits)?;
        }
        if p.min_p > 0.0 {
            let probs = logits.softmax(&[-1], true)?;
            let top = probs.max(&[-1], true)?;
            let floor = top.multiply_scalar(f64::from(p.min_p))?;
            logits = ops::where_(&probs.lt(&floor)?, &neg_inf, &logits)?;
        }
        if p.top_p < 1.0 {
            // Sort ascending; drop the tokens whose cumulative mass (from the top) starts
            // beyond p, keeping at least the most likely one.
            let order = logits.argsort(-1)?;
            let sorted = logits.take_along_axis(&order, -1)?;
            let probs = sorted.softmax(&[-1], true)?;
            let mass_above = probs.cumsum(-1, true, false)?; // mass strictly above each token
            let drop_sorted = mass_above.ge(&mass_above.scalar_like(f64::from(p.top_p))?)?;
            let drop = ops::zeros(&logits.shape(), Dtype::Bool)?.put_along_axis(
                &order,
                &drop_sorted,
                -1,
            )?;
            logits = ops::where_(&drop, &neg_inf, &logits)?;
        }
        let step_key = random::split(&self.key, 2)?;
        let (next, draw) = {
            let parts = step_key.split_equal(2, 0)?;
            let mut parts = parts.into_iter();
            match (parts.next(), parts.next()) {
                (Some(a), Some(b)) => (a.squeeze(&[0])?, b.squeeze(&[0])?),
                _ => return Err(Error::InvalidRequest("random split returned fewer keys".into())),
            }
        };
        self.key = next;
        self.step += 1;
        Ok(random::categorical(&logits, -1, Some(&draw))?)
    }

    fn penalize(&self, logits: &Array, history: &[u32]) -> Result<Array> {
        let p = &self.params;
        let start = history.len().saturating_sub(p.penalty_window);
        let mut seen: Vec<u32> = history[start..].to_vec();
        seen.sort_unstable();
        seen.dedup();
        if seen.is_empty() {
            return Ok(logits.clone());
        }
        let ids = Array::from_slice(&seen, &[1, seen.len() as i32])?;
        let mut picked = logits.take_along_axis(&ids, -1)?;
        if p.repetition_penalty != 1.0 {
            let r = f64::from(p.repetition_penalty);
            let zero = picked.scalar_like(0.0)?;
            picked = ops::where_(
                &picked.lt(&zero)?,
                &picked.multiply_scalar(r)?,
                &picked.multiply_scalar(1.0 / r)?,
            )?;
        }
        if p.presence_penalty != 0.0 {
            picked = picked.add_scalar(-f64::from(p.presence_penalty))?;
        }
        Ok(logits.put_along_axis(&ids, &picked, -1)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits(values: &[f32]) -> Array {
        Array::from_slice(values, &[1, values.len() as i32]).unwrap()
    }

    fn draw(params: SamplingParams, values: &[f32], n: usize) -> Vec<u32> {
        let mut sampler = Sampler::new(params).unwrap();
        (0..n)
            .map(|_| sampler.sample(&logits(values), &[]).unwrap().item::<u32>().unwrap())
            .collect()
    }

    #[test]
    fn greedy_takes_the_argmax() {
        assert_eq!(draw(SamplingParams::default(), &[0.1, 3.0, -1.0, 2.9], 3), vec![1, 1, 1]);
    }

    #[test]
    fn same_seed_same_tokens_other_seed_other_tokens() {
        let flat = vec![0.0f32; 50];
        let params = |seed| SamplingParams { temperature: 1.0, seed, ..SamplingParams::default() };
        let a = draw(params(7), &flat, 40);
        assert_eq!(a, draw(params(7), &flat, 40), "a seed fixes the stream");
        assert_ne!(a, draw(params(8), &flat, 40));
        assert!(
            a.iter().collect::<std::collections::HashSet<_>>().len() > 10,
            "a flat distribution spreads: {a:?}"
        );
    }

    #[test]
    fn top_k_top_p_and_min_p_restrict_the_support() {
        let values = [5.0f32, 4.0, 3.0, 0.0, -1.0, -2.0];
        let base = SamplingParams { temperature: 2.0, seed: 1, ..SamplingParams::default() };
        let k2 = draw(SamplingParams { top_k: 2, ..base.clone() }, &values, 200);
        assert!(k2.iter().all(|&t| t < 2), "top-k 2 keeps ids 0 and 1: {k2:?}");
        assert!(k2.contains(&0) && k2.contains(&1));
        // With T = 2: p ∝ e^{2.5}, e^{2}, e^{1.5}, … → the top two hold ≈ 0.62 of the mass.
        let p = draw(SamplingParams { top_p: 0.5, ..base.clone() }, &values, 200);
        assert!(p.iter().all(|&t| t < 2), "top-p 0.5 keeps the two tokens needed: {p:?}");
        let m = draw(SamplingParams { min_p: 0.5, ..base }, &values, 200);
        assert!(m.iter().all(|&t| t < 2), "min-p 0.5 drops tokens under half the best: {m:?}");
    }

    #[test]
    fn penalties_push_seen_tokens_down() {
        let mut sampler =
            Sampler::new(SamplingParams { repetition_penalty: 4.0, ..SamplingParams::default() })
                .unwrap();
        let out = sampler.sample(&logits(&[2.0, 1.0, 0.5]), &[0]).unwrap().item::<u32>().unwrap();
        assert_eq!(out, 1, "2.0 / 4 = 0.5 falls below 1.0");
        let mut sampler =
            Sampler::new(SamplingParams { presence_penalty: 1.5, ..SamplingParams::default() })
                .unwrap();
        let out =
            sampler.sample(&logits(&[2.0, 1.0, -3.0]), &[0, 0, 0]).unwrap().item::<u32>().unwrap();
        assert_eq!(out, 1, "2.0 − 1.5 = 0.5 < 1.0");
        let negative =
            Sampler::new(SamplingParams { repetition_penalty: 2.0, ..SamplingParams::default() })
                .unwrap()
                .penalize(&logits(&[-1.0, -1.5]), &[0])
                .unwrap();
        assert_eq!(
            negative.to_vec::<f32>().unwrap(),
            vec![-2.0, -1.5],
            "negative logits are multiplied"
        );
    }

    #[test]
    fn bad_settings_are_refused() {
        for params in [
            SamplingParams { temperature: -1.0, ..SamplingParams::default() },
            SamplingParams { top_p: 0.0, ..SamplingParams::default() },
            SamplingParams { min_p: 1.0, ..SamplingParams::default() },
            SamplingParams { repetition_penalty: 0.0, ..SamplingParams::default() },
        ] {
            assert!(Sampler::new(params).is_err());
        }
    }
}
