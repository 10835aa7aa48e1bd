//! Gemma 3 text against the reference: logits of mlx-lm 0.32.2 (`gemma3_text`, and the text
//! path of an mlx-vlm 0.7.10 `gemma3` checkpoint) and their greedy continuation, recorded by
//! `tests/golden/gemma3/make_golden.py` on tiny random-weight checkpoints (f32 and 4-bit). The
//! sliding window (6) is shorter than the 40-token prompt, the global layers scale rope
//! linearly (factor 8), and `query_pre_attn_scalar` (48) differs from the head size (32).

use std::path::PathBuf;

use super::gemma4::check_checkpoint;

fn golden_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden/gemma3").join(name)
}

#[test]
fn text_f32_matches_the_reference() {
    check_checkpoint(&golden_dir("text"), 1e-4);
}

#[test]
fn text_four_bit_matches_the_reference() {
    check_checkpoint(&golden_dir("text_q4"), 1e-3);
}

#[test]
fn the_text_path_of_a_vision_checkpoint_matches_the_reference() {
    check_checkpoint(&golden_dir("vlm"), 1e-4);
}
