//! Where the time of reading a KV checkpoint goes on the default device: hashing the file,
//! MLX reading its tensors, both at once (as `kv_file::read` does), and the first op over them.
//!
//!     cargo run --release -p engine --example checkpoint_probe -- FILE [REPEATS]

use std::time::Instant;

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn load(path: &std::path::Path) -> Result<Vec<mlx::Array>, String> {
    let file = mlx::io::load_safetensors(path).map_err(|e| e.to_string())?;
    let arrays: Vec<mlx::Array> = file.tensors.into_values().collect();
    mlx::eval(&arrays.iter().collect::<Vec<_>>()).map_err(|e| e.to_string())?;
    Ok(arrays)
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let path =
        std::path::PathBuf::from(args.get(1).ok_or("usage: checkpoint_probe FILE [REPEATS]")?);
    let repeats: usize = args.get(2).and_then(|r| r.parse().ok()).unwrap_or(3);
    println!("device {:?}", mlx::Device::default_device().map_err(|e| e.to_string())?);
    for r in 0..repeats {
        let t = Instant::now();
        let digest = engine::kv_file::digest_file(&path).map_err(|e| e.to_string())?;
        let hash = ms(t);
        let t = Instant::now();
        let arrays = load(&path)?;
        let mlx_load = ms(t);
        drop(arrays);
        let t = Instant::now();
        let (digest_again, arrays) = std::thread::scope(|s| {
            let h = s.spawn(|| engine::kv_file::digest_file(&path));
            let arrays = load(&path);
            (h.join().map_err(|_| "panic".to_string()), arrays)
        });
        let both = ms(t);
        let arrays = arrays?;
        assert_eq!(digest_again?.map_err(|e| e.to_string())?, digest);
        let t = Instant::now();
        let outs: Vec<mlx::Array> = arrays
            .iter()
            .map(|a| a.add_scalar(0.0))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        mlx::eval(&outs.iter().collect::<Vec<_>>()).map_err(|e| e.to_string())?;
        let first_op = ms(t);
        println!(
            "run {r}: digest {hash:.1} ms | mlx load+eval {mlx_load:.1} ms | both at once {both:.1} ms | first op {first_op:.1} ms"
        );
    }
    Ok(())
}
