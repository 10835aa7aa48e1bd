//! `quince bench --host-profile`: a sampling profile of the host while the timed runs decode.
//!
//! On the GPU machine a decode step is bound by host time (MLX building and recording a few
//! hundred kernels), and that machine has no profiler installed; this one runs in the process
//! (`pprof`, a `SIGPROF` sampler) and writes folded stacks, one `thread;outer;…;inner count`
//! line per distinct stack, which any flame-graph tool reads. Built only with
//! `--features host-profile`.

use std::path::Path;
#[cfg(feature = "host-profile")]
use std::path::PathBuf;

/// A running profile, or nothing when no file was asked for.
pub(crate) struct Profile {
    #[cfg(feature = "host-profile")]
    running: Option<(pprof::ProfilerGuard<'static>, PathBuf)>,
}

impl std::fmt::Debug for Profile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Profile").finish_non_exhaustive()
    }
}

/// `path` with `-{prompt_tokens}` added to its file name (one file per prompt length).
#[cfg(feature = "host-profile")]
fn file_for(path: &Path, prompt_tokens: usize) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!("-{prompt_tokens}"));
    path.with_file_name(name)
}

#[cfg(feature = "host-profile")]
impl Profile {
    /// Starts sampling at 2 kHz when `path` is given.
    pub(crate) fn start(path: Option<&Path>) -> anyhow::Result<Self> {
        let Some(path) = path else { return Ok(Self { running: None }) };
        let guard = pprof::ProfilerGuardBuilder::default()
            .frequency(2000)
            .blocklist(&["libc", "libgcc", "pthread", "vdso"])
            .build()?;
        Ok(Self { running: Some((guard, path.to_path_buf())) })
    }

    /// Stops sampling and writes the folded stacks.
    pub(crate) fn finish(self, prompt_tokens: usize) -> anyhow::Result<()> {
        use std::fmt::Write as _;
        let Some((guard, path)) = self.running else { return Ok(()) };
        let report = guard.report().build()?;
        let mut out = String::new();
        for (frames, count) in &report.data {
            out.push_str(&frames.thread_name);
            // Innermost frame first in `frames.frames`; folded stacks go outermost first.
            for frame in frames.frames.iter().rev() {
                for symbol in frame.iter().rev() {
                    out.push(';');
                    out.push_str(&symbol.name().replace(';', ":"));
                }
            }
            writeln!(out, " {count}")?;
        }
        let file = file_for(&path, prompt_tokens);
        std::fs::write(&file, out)?;
        eprintln!("host profile: {} stacks in {}", report.data.len(), file.display());
        Ok(())
    }
}

#[cfg(not(feature = "host-profile"))]
impl Profile {
    /// Without the feature, asking for a profile is an error.
    pub(crate) fn start(path: Option<&Path>) -> anyhow::Result<Self> {
        if let Some(path) = path {
            anyhow::bail!(
                "--host-profile {} needs quince built with `--features host-profile`",
                path.display()
            );
        }
        Ok(Self {})
    }

    /// Nothing to write.
    pub(crate) fn finish(self, _prompt_tokens: usize) -> anyhow::Result<()> {
        Ok(())
    }
}
