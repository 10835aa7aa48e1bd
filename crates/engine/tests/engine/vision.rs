//! Gemma 4 vision against mlx-vlm 0.7.10, on the golden images and the tiny `dense`
//! checkpoint's vision tower (`tests/golden/vision/make_golden.py`).

use std::path::{Path, PathBuf};

use engine::batch::generate;
use engine::generate::{Flow, GenerateRequest, prefill_multimodal};
use engine::models::gemma4::processor::{preprocess, rescale};
use engine::models::{Model, Phase, Rows};
use engine::tokens::ids as token_array;
use engine::vision::image::{decode_rgb, load_rgb};
use mlx::{Array, Dtype};
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden")
}

fn json(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(root().join("vision").join(name)).unwrap())
        .unwrap()
}

pub(crate) fn tensors(name: &str) -> std::collections::HashMap<String, Array> {
    mlx::io::load_safetensors(root().join("vision").join(name)).unwrap().tensors
}

fn image_path(name: &str) -> PathBuf {
    root().join("vision/images").join(name)
}

fn max_diff(a: &Array, b: &Array) -> f32 {
    assert_eq!(a.shape(), b.shape());
    let (a, b) = (a.astype(Dtype::Float32).unwrap(), b.astype(Dtype::Float32).unwrap());
    a.subtract(&b).unwrap().abs().unwrap().max_all(false).unwrap().item::<f32>().unwrap()
}

pub(crate) fn ids(a: &Array) -> Vec<u32> {
    a.astype(Dtype::Int32).unwrap().to_vec::<i32>().unwrap().into_iter().map(|v| v as u32).collect()
}

/// The resized image as `[3, H, W]` u8 (channel-first, like the goldens).
fn chw_u8(image: &::image::RgbImage) -> Array {
    let (w, h) = (image.width() as i32, image.height() as i32);
    Array::from_slice(image.as_raw(), &[h, w, 3]).unwrap().transpose(&[2, 0, 1]).unwrap()
}

fn crop(a: &Array, [y, x]: [i32; 2]) -> Array {
    a.slice(&[0, y, x], &[3, y + 48, x + 48], &[1, 1, 1]).unwrap()
}

fn yx(v: &Value) -> [i32; 2] {
    [v[0].as_i64().unwrap() as i32, v[1].as_i64().unwrap() as i32]
}

#[test]
fn preprocessing_matches_the_reference_on_every_image() {
    let meta = json("preprocess.json");
    let golden = tensors("preprocess.safetensors");
    let lut = golden["lut_u8_to_f32"].clone();
    let mut checked = 0;
    for (name, info) in meta["images"].as_object().unwrap() {
        let rgb = load_rgb(&image_path(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let decoded = &info["decoded_size_wh"];
        assert_eq!(
            [rgb.width() as u64, rgb.height() as u64],
            [decoded[0].as_u64().unwrap(), decoded[1].as_u64().unwrap()],
            "{name}: size after EXIF"
        );
        for (budget, case) in info["cases"].as_object().unwrap() {
            let budget: usize = budget.parse().unwrap();
            let prepared = preprocess(&rgb, budget).unwrap();
            let hw = &case["resized_hw"];
            assert_eq!(
                [prepared.height as u64, prepared.width as u64],
                [hw[0].as_u64().unwrap(), hw[1].as_u64().unwrap()],
                "{name}@{budget}"
            );
            assert_eq!(
                prepared.soft_tokens as u64,
                case["n_soft_tokens"].as_u64().unwrap(),
                "{name}@{budget}"
            );
            let ours = chw_u8(&prepared.resized);
            // Byte-exact everywhere, JPEGs too (they decode through libjpeg-turbo like PIL's).
            let allowed = 0.0;
            for (key, at) in
                [("crop_tl", "crop_tl_yx"), ("crop_c", "crop_c_yx"), ("crop_br", "crop_br_yx")]
            {
                let want = &golden[&format!("{name}@{budget}.{key}")];
                let got = crop(&ours, yx(&case[at]));
                let d = max_diff(&got, want);
                assert!(d <= allowed, "{name}@{budget} {key}: {d} levels");
            }
            {
                let sums: Vec<u64> = (0..3)
                    .map(|c| {
                        let plane = ours
                            .slice(
                                &[c, 0, 0],
                                &[c + 1, prepared.height as i32, prepared.width as i32],
                                &[1, 1, 1],
                            )
                            .unwrap();
                        plane
                            .astype(Dtype::Int64)
                            .unwrap()
                            .sum_all(false)
                            .unwrap()
                            .item::<i64>()
                            .unwrap() as u64
                    })
                    .collect();
                let want: Vec<u64> = case["channel_sums"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_u64().unwrap())
                    .collect();
                assert_eq!(sums, want, "{name}@{budget}: every pixel, summed per channel");
            }
            if let Some(full) = golden.get(&format!("{name}@{budget}.pixels_u8")) {
                assert!(max_diff(&ours, full) <= allowed, "{name}@{budget}: whole image");
                // The float pixels are the reference's table applied to the bytes, bit for bit.
                let want = lut.take(&full.astype(Dtype::Int32).unwrap(), 0).unwrap();
                assert_eq!(max_diff(&prepared.pixels, &want), 0.0, "{name}@{budget}: f32 pixels");
            }
            checked += 1;
        }
    }
    assert!(checked >= 25, "all cases were checked ({checked})");
}

#[test]
fn rescale_is_the_references_float32_table() {
    let lut = tensors("preprocess.safetensors")["lut_u8_to_f32"].clone();
    // Every byte value through the processor's own rescale.
    let image =
        ::image::RgbImage::from_fn(256, 1, |x, _| ::image::Rgb([x as u8, x as u8, x as u8]));
    let ours = rescale(&image).unwrap();
    let ours = ours.slice(&[0, 0, 0], &[1, 1, 256], &[1, 1, 1]).unwrap().reshape(&[256]).unwrap();
    assert_eq!(max_diff(&ours, &lut), 0.0);
}

fn dense() -> Box<dyn Model> {
    engine::registry::load_model(root().join("gemma4/dense"), &engine::LoadOptions::default())
        .unwrap()
}

/// Features of a golden image, through our whole path: decode, preprocess, tower.
fn features(model: &dyn Model, name: &str, budget: usize) -> Array {
    let rgb = load_rgb(&image_path(name)).unwrap();
    model
        .vision()
        .expect("dense has a vision tower")
        .encode(&preprocess(&rgb, budget).unwrap().pixels)
        .unwrap()
}

#[test]
fn vision_features_match_encode_image() {
    let model = dense();
    let golden = tensors("vision.safetensors");
    for (name, key) in [("rgb_640x480.png", "rgb_640x480"), ("tall_100x4000.jpg", "tall_100x4000")]
    {
        let d = max_diff(&features(model.as_ref(), name, 70), &golden[&format!("{key}.features")]);
        assert!(d <= 1e-4, "{name}: {d}");
    }
    // The 1×1 golden is a constant colour.
    let tiny = ::image::RgbImage::from_pixel(1, 1, ::image::Rgb([200, 100, 50]));
    let f = model
        .vision()
        .expect("dense has a vision tower")
        .encode(&preprocess(&tiny, 70).unwrap().pixels)
        .unwrap();
    let d = max_diff(&f, &golden["tiny_1x1.features"]);
    assert!(d <= 1e-4, "1×1: {d}");
}

pub(crate) fn prompt_images(model: &dyn Model, prompt: &str) -> Vec<Array> {
    let names: &[&str] = match prompt {
        "single" | "later_turn" => &["rgb_640x480.png"],
        _ => &["rgb_640x480.png", "tall_100x4000.jpg"],
    };
    names.iter().map(|n| features(model, n, 70)).collect()
}

#[test]
fn image_prompts_match_the_reference_full_incremental_and_greedy() {
    let model = dense();
    let golden = tensors("vision.safetensors");
    for prompt in ["single", "two_images"] {
        let tokens = ids(&golden[&format!("{prompt}.ids")]);
        let want = &golden[&format!("{prompt}.logits")];
        let images = prompt_images(model.as_ref(), prompt);
        let t = tokens.len() as i32;
        let mut caches = model.fresh_caches().unwrap();
        let full = model
            .forward_multimodal(&tokens, &images, &mut caches, Rows::All)
            .unwrap()
            .reshape(&[t, -1])
            .unwrap();
        let d = max_diff(&full, want);
        assert!(d <= 1e-4, "{prompt}: one window differs by {d}");
        // Chunked prefill in small chunks: blocks stay whole, the overlay holds at offset > 0.
        let mut caches = model.fresh_caches().unwrap();
        let last = prefill_multimodal(model.as_ref(), &mut caches, &tokens, &images, 5).unwrap();
        let want_last = want.slice(&[t - 1, 0], &[t, 512], &[1, 1]).unwrap();
        assert!(max_diff(&last, &want_last) <= 1e-4, "{prompt}: chunked prefill");
        let request =
            GenerateRequest { images: images.clone(), ..GenerateRequest::new(tokens.clone(), 32) };
        let mut caches = model.fresh_caches().unwrap();
        let reply = generate(model.as_ref(), &mut caches, &request, |_| Flow::Continue).unwrap();
        assert_eq!(reply.tokens, ids(&golden[&format!("{prompt}.greedy")]), "{prompt}: greedy");
    }
}

#[test]
fn an_image_in_a_later_turn_reads_like_the_one_shot_prompt() {
    let model = dense();
    let golden = tensors("vision.safetensors");
    let meta = json("vision.json");
    let tokens = ids(&golden["later_turn.ids"]);
    let split = meta["prompts"]["later_turn"]["image_turn_start"].as_u64().unwrap() as usize;
    let want = &golden["later_turn.logits"];
    let images = prompt_images(model.as_ref(), "later_turn");
    let mut caches = model.fresh_caches().unwrap();
    // First turn and reply cached, then the image turn appended.
    let first = model
        .forward_rows(
            &token_array(&tokens[..split]).unwrap(),
            &mut caches,
            Phase::Window,
            Rows::All,
        )
        .unwrap();
    let rest = model.forward_multimodal(&tokens[split..], &images, &mut caches, Rows::All).unwrap();
    let t = tokens.len() as i32;
    let s = split as i32;
    let d_first = max_diff(
        &first.reshape(&[s, -1]).unwrap(),
        &want.slice(&[0, 0], &[s, 512], &[1, 1]).unwrap(),
    );
    let d_rest = max_diff(
        &rest.reshape(&[t - s, -1]).unwrap(),
        &want.slice(&[s, 0], &[t, 512], &[1, 1]).unwrap(),
    );
    assert!(d_first <= 1e-4 && d_rest <= 1e-4, "cached turn {d_first}, image turn {d_rest}");
}

#[test]
fn bad_images_are_rejected_before_large_allocations_and_the_engine_still_works() {
    let bad =
        |name: &str| load_rgb(&image_path(&format!("bad/{name}"))).expect_err(name).to_string();
    assert!(bad("truncated.png").contains("truncated.png"), "names the file");
    assert!(bad("empty.png").contains("empty"));
    assert!(bad("text.png").contains("supported format"));
    let bomb = bad("bomb_30000x30000.png");
    assert!(bomb.contains("30000×30000") && bomb.contains("megapixels"), "{bomb}");
    // A PNG named .jpg is read by its content, as PIL does.
    let renamed = load_rgb(&image_path("bad/png_named.jpg")).unwrap();
    assert_eq!((renamed.width(), renamed.height()), (64, 48));
    assert!(decode_rgb(b"GIF89a").is_err(), "a header alone is not an image");
    let model = dense();
    let f = features(model.as_ref(), "rgb_640x480.png", 70);
    assert_eq!(f.shape(), vec![63, 64]);
    let unused: &Path = Path::new("/nonexistent.png");
    assert!(load_rgb(unused).is_err());
}

/// The golden script's noise image: a 32-bit hash of each byte's index.
fn noise(width: u32, height: u32, seed: u32) -> ::image::RgbImage {
    let bytes: Vec<u8> = (0..width * height * 3)
        .map(|i| {
            let mut v = i.wrapping_mul(2_654_435_761).wrapping_add(seed.wrapping_mul(40_503));
            v ^= v >> 15;
            v = v.wrapping_mul(2_246_822_519);
            v ^= v >> 13;
            (v & 255) as u8
        })
        .collect();
    ::image::RgbImage::from_raw(width, height, bytes).unwrap()
}

fn sha256(bytes: &[u8]) -> String {
    use sha2::Digest;
    format!("{:x}", sha2::Sha256::digest(bytes))
}

/// Twenty image sizes drawn from a seed (odd and even sides, aspect ratios from 1:6 to 6:1) at
/// budgets 70, 140 and 280, against fresh reference outputs (`golden-check` regenerates them):
/// the resized bytes and the float pixels bit for bit, and the image prompt's logits within
/// 1e-4 in one window (first and last image token, last position) and after a chunked prefill.
#[test]
fn drawn_image_sizes_match_the_reference_at_every_budget() {
    let meta = json("sizes.json");
    let golden = tensors("sizes.safetensors");
    let model = dense();
    let vision = model.vision().unwrap();
    let cases = meta["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 60, "20 sizes × 3 budgets");
    let mut worst = (0.0f32, 0.0f32);
    for case in cases {
        let key = case["key"].as_str().unwrap();
        let n = |k: &str| case[k].as_u64().unwrap() as u32;
        let rgb = noise(n("width"), n("height"), n("seed"));
        let prepared = preprocess(&rgb, n("budget") as usize).unwrap();
        let u8 = chw_u8(&prepared.resized).to_vec::<u8>().unwrap();
        assert_eq!(sha256(&u8), case["u8_chw_sha256"].as_str().unwrap(), "{key}: resized bytes");
        let pixels: Vec<u8> =
            prepared.pixels.to_vec::<f32>().unwrap().iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(sha256(&pixels), case["f32_chw_sha256"].as_str().unwrap(), "{key}: pixels");
        let tokens = ids(&golden[&format!("{key}.ids")]);
        let want = &golden[&format!("{key}.logits")];
        let features = vec![vision.encode(&prepared.pixels).unwrap()];
        let t = tokens.len() as i32;
        let mut caches = model.fresh_caches().unwrap();
        let full = model
            .forward_multimodal(&tokens, &features, &mut caches, Rows::All)
            .unwrap()
            .reshape(&[t, -1])
            .unwrap();
        let rows: Vec<i32> =
            case["rows"].as_array().unwrap().iter().map(|r| r.as_i64().unwrap() as i32).collect();
        let picked = full.take(&Array::from_slice(&rows, &[3]).unwrap(), 0).unwrap();
        let one_window = max_diff(&picked, want);
        let mut caches = model.fresh_caches().unwrap();
        let last = prefill_multimodal(model.as_ref(), &mut caches, &tokens, &features, 16).unwrap();
        let want_last = want.slice(&[2, 0], &[3, 512], &[1, 1]).unwrap();
        let chunked = max_diff(&last.reshape(&[1, 512]).unwrap(), &want_last);
        assert!(one_window <= 1e-4 && chunked <= 1e-4, "{key}: {one_window}, chunked {chunked}");
        worst = (worst.0.max(one_window), worst.1.max(chunked));
    }
    eprintln!("worst logit difference: one window {:.2e}, chunked {:.2e}", worst.0, worst.1);
}
