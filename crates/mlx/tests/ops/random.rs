//! Keyed random numbers: the same key gives the same numbers as Python `mlx`.

use mlx::{Array, Dtype, random};

use crate::common::{assert_same, fx, values};

#[test]
fn keys_and_samples_match_python_mlx() {
    let key = random::key(42).unwrap();
    assert_same(&key, &fx("random.key42"));
    let u = random::uniform(0.0, 1.0, &[8], Dtype::Float32, Some(&key)).unwrap();
    assert_same(&u, &fx("random.uniform_key42"));
    let n = random::normal(&[8], Dtype::Float32, 0.0, 1.0, Some(&key)).unwrap();
    assert_same(&n, &fx("random.normal_key42"));
    assert_same(&random::split(&key, 2).unwrap(), &fx("random.split_key42"));
}

#[test]
fn same_key_same_numbers_other_key_other_numbers() {
    let a =
        random::normal(&[64], Dtype::Float32, 0.0, 1.0, Some(&random::key(1).unwrap())).unwrap();
    let b =
        random::normal(&[64], Dtype::Float32, 0.0, 1.0, Some(&random::key(1).unwrap())).unwrap();
    let c =
        random::normal(&[64], Dtype::Float32, 0.0, 1.0, Some(&random::key(2).unwrap())).unwrap();
    assert_eq!(values(&a), values(&b));
    assert_ne!(values(&a), values(&c));
    let u = values(
        &random::uniform(-2.0, 3.0, &[1000], Dtype::Float32, Some(&random::key(3).unwrap()))
            .unwrap(),
    );
    assert!(u.iter().all(|&x| (-2.0..3.0).contains(&x)), "uniform stays in [low, high)");
    let mean = u.iter().sum::<f32>() / u.len() as f32;
    assert!((mean - 0.5).abs() < 0.2, "mean of U(-2, 3) ≈ 0.5, got {mean}");
    let n = values(
        &random::normal(&[4000], Dtype::Float32, 1.0, 2.0, Some(&random::key(4).unwrap())).unwrap(),
    );
    let mean = n.iter().sum::<f32>() / n.len() as f32;
    let var = n.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / n.len() as f32;
    assert!((mean - 1.0).abs() < 0.15 && (var.sqrt() - 2.0).abs() < 0.15, "N(1, 2): {mean} {var}");
    random::seed(7).unwrap();
    let g1 = values(&random::uniform(0.0, 1.0, &[4], Dtype::Float32, None).unwrap());
    random::seed(7).unwrap();
    let g2 = values(&random::uniform(0.0, 1.0, &[4], Dtype::Float32, None).unwrap());
    assert_eq!(g1, g2, "the global key follows seed()");
}

#[test]
fn categorical_follows_dominant_logits() {
    let logits = Array::from_slice(&[0.0f32, 100.0, 0.0, 100.0, 0.0, 0.0], &[2, 3]).unwrap();
    let picks = random::categorical(&logits, -1, Some(&random::key(9).unwrap())).unwrap();
    assert_eq!(picks.to_vec::<u32>().unwrap(), vec![1, 0]);
}
