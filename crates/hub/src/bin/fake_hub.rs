//! `fake-hub --repo ORG/NAME --dir FOLDER [--port N] [--chunk-delay-ms N]`: serves the files of
//! FOLDER as the repo ORG/NAME on 127.0.0.1 (a stand-in for huggingface.co in the E2E test),
//! prints its URL on the first line of stdout, and runs until killed.

use std::io::Write;
use std::sync::atomic::Ordering;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value =
        |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
    let usage = "usage: fake-hub --repo ORG/NAME --dir FOLDER [--port N] [--chunk-delay-ms N]";
    let (Some(repo), Some(dir)) = (value("--repo"), value("--dir")) else {
        return Err(usage.into());
    };
    let port: u16 = value("--port").map(|p| p.parse()).transpose()?.unwrap_or(0);
    let delay: u64 = value("--chunk-delay-ms").map(|p| p.parse()).transpose()?.unwrap_or(0);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        let hub = hub::fake::FakeHub::start(port).await?;
        hub.shared.add(&repo, hub::fake::FakeRepo::from_dir(std::path::Path::new(&dir))?);
        hub.shared.chunk_delay_ms.store(delay, Ordering::SeqCst);
        println!("{}", hub.url);
        std::io::stdout().flush()?;
        std::future::pending::<()>().await;
        Ok::<(), Box<dyn std::error::Error>>(())
    })
}
