//! Fused kernels against direct formulas: rope, norms, attention (every mask kind, GQA).

use mlx::Dtype;
use mlx::fast::{
    AttentionMask, RopeFrequencies, RopeOffset, layer_norm, rms_norm, rope,
    scaled_dot_product_attention,
};

use crate::common::{assert_close, fx};

#[test]
fn rope_matches_the_formula() {
    let x = fx("rope.x");
    let base = RopeFrequencies::Base(10000.0);
    assert_close(
        &rope(&x, 16, false, base, 1.0, RopeOffset::Fixed(3)).unwrap(),
        &fx("rope.default"),
        1e-5,
    );
    assert_close(
        &rope(&x, 16, true, base, 1.0, RopeOffset::Fixed(3)).unwrap(),
        &fx("rope.traditional"),
        1e-5,
    );
    assert_close(
        &rope(&x, 8, false, RopeFrequencies::Base(500.0), 0.5, RopeOffset::Fixed(0)).unwrap(),
        &fx("rope.partial_dims8_scale05"),
        1e-5,
    );
    let freqs = fx("rope.freqs");
    assert_close(
        &rope(&x, 16, false, RopeFrequencies::Custom(&freqs), 1.0, RopeOffset::Fixed(7)).unwrap(),
        &fx("rope.custom_freqs"),
        1e-5,
    );
    let offsets = fx("rope.offsets");
    assert_close(
        &rope(&x, 16, false, base, 1.0, RopeOffset::Array(&offsets)).unwrap(),
        &fx("rope.array_offset"),
        1e-5,
    );
    // A scalar array offset equals the fixed one.
    let three = mlx::Array::scalar(3i32).unwrap();
    assert_close(
        &rope(&x, 16, false, base, 1.0, RopeOffset::Array(&three)).unwrap(),
        &fx("rope.default"),
        1e-5,
    );
}

#[test]
fn norms_match_the_formula() {
    let (x, w, b) = (fx("norm.x"), fx("norm.w"), fx("norm.b"));
    assert_close(&rms_norm(&x, Some(&w), 1e-5).unwrap(), &fx("norm.rms"), 1e-5);
    assert_close(&layer_norm(&x, Some(&w), Some(&b), 1e-5).unwrap(), &fx("norm.layer"), 1e-5);
    assert_close(&layer_norm(&x, None, None, 1e-5).unwrap(), &fx("norm.layer_plain"), 1e-5);
}

#[test]
fn attention_equals_softmax_of_scaled_scores_for_every_mask_and_head_ratio() {
    for tag in ["sdpa.h4_4_l5_s5", "sdpa.h4_2_l5_s5", "sdpa.h8_2_l3_s7", "sdpa.h4_1_l1_s6"] {
        let (q, k, v) = (fx(&format!("{tag}.q")), fx(&format!("{tag}.k")), fx(&format!("{tag}.v")));
        let scale = 1.0 / 8f32.sqrt();
        let run = |mask| scaled_dot_product_attention(&q, &k, &v, scale, mask, None).unwrap();
        assert_close(&run(AttentionMask::None), &fx(&format!("{tag}.none")), 1e-5);
        assert_close(&run(AttentionMask::Causal), &fx(&format!("{tag}.causal")), 1e-5);
        let boolmask = fx(&format!("{tag}.boolmask"));
        assert_eq!(boolmask.dtype(), Dtype::Bool);
        assert_close(&run(AttentionMask::Array(&boolmask)), &fx(&format!("{tag}.bool")), 1e-5);
        let additive = fx(&format!("{tag}.additive_mask"));
        assert_close(&run(AttentionMask::Array(&additive)), &fx(&format!("{tag}.additive")), 1e-5);
    }
}

#[test]
fn attention_in_bf16_stays_close() {
    let tag = "sdpa.h4_2_l5_s5";
    let cast = |name: &str| fx(&format!("{tag}.{name}")).astype(Dtype::Bfloat16).unwrap();
    let out = scaled_dot_product_attention(
        &cast("q"),
        &cast("k"),
        &cast("v"),
        1.0 / 8f32.sqrt(),
        AttentionMask::Causal,
        None,
    )
    .unwrap();
    assert_eq!(out.dtype(), Dtype::Bfloat16);
    assert_close(&out, &fx(&format!("{tag}.causal")), 0.05);
}

/// The ops-composed rope is MLX's CPU fallback operation for operation: bit-identical to the
/// fused call on the CPU for both pair layouts, partial rotation, custom frequencies, a scale,
/// fixed and array offsets, in f32 and bf16.
#[test]
fn rope_by_ops_is_bit_identical_to_the_fused_call_on_the_cpu() {
    use mlx::fast::rope_by_ops;
    let x = fx("rope.x");
    let freqs = fx("rope.freqs");
    let seven = mlx::Array::scalar(7i32).unwrap();
    for dtype in [Dtype::Float32, Dtype::Bfloat16] {
        let x = x.astype(dtype).unwrap();
        for traditional in [false, true] {
            for (dims, frequencies, scale, offset) in [
                (16, RopeFrequencies::Base(10000.0), 1.0, RopeOffset::Fixed(3)),
                (8, RopeFrequencies::Base(500.0), 0.5, RopeOffset::Fixed(0)),
                (16, RopeFrequencies::Custom(&freqs), 1.0, RopeOffset::Array(&seven)),
                (16, RopeFrequencies::Base(1e6), 1.0, RopeOffset::Array(&seven)),
            ] {
                let fused = rope(&x, dims, traditional, frequencies, scale, offset).unwrap();
                let ops = rope_by_ops(&x, dims, traditional, frequencies, scale, offset).unwrap();
                let context = format!(
                    "{dtype:?} traditional={traditional} dims={dims} {frequencies:?} {offset:?}"
                );
                assert_eq!(ops.shape(), fused.shape(), "{context}");
                assert_eq!(ops.dtype(), fused.dtype(), "{context}");
                assert!(
                    ops.array_equal(&fused, false).unwrap().item::<bool>().unwrap(),
                    "{context}: the ops rope differs from the fused call"
                );
            }
        }
    }
}

/// Without MLX's CUDA backend a custom CUDA kernel is a clear error, not an abort.
#[test]
fn a_cuda_kernel_off_cuda_is_an_error() {
    use mlx::fast::CudaKernel;
    if mlx::Backend::current() == mlx::Backend::Cuda {
        return;
    }
    let error = CudaKernel::new("double", &["x"], &["y"], "y[threadIdx.x] = 2 * x[threadIdx.x];")
        .unwrap_err();
    assert!(error.to_string().contains("CUDA"), "{error}");
}
