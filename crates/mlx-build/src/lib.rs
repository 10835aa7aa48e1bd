//! Finds the MLX install that Quince builds and links against, for build scripts.
//!
//! MLX comes from its official binary distribution, never from source:
//! - `MLX_DIR`, when set, is a prefix holding `include/mlx/mlx.h` and `lib/libmlx.{so,dylib}`
//!   (the `mlx` folder of an installed wheel, or a CMake install prefix);
//! - otherwise the project's Python venv (`.venv` at the workspace root, made by `make setup`),
//!   whose `site-packages/mlx` holds `include/`, `lib/` and `share/cmake/MLX`.
//!
//! The version in `include/mlx/version.h` must equal [`PINNED_VERSION`]: the C++ API (and its
//! ABI) changes between MLX releases, and our golden outputs were recorded on that version.
//!
//! `mlx-sys` uses [`find`] to compile its shim; every crate that links a test or a binary
//! against MLX calls [`emit_rpath`] from its `build.rs`, because cargo does not pass a
//! dependency's `rustc-link-arg` on to its dependents.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

/// The MLX release Quince is pinned to (`mlx==`/`mlx-cpu==` in `tests/reference/requirements.txt`).
pub const PINNED_VERSION: &str = "0.32.4";

/// An MLX install: headers and the shared library.
#[derive(Debug, Clone)]
pub struct MlxInstall {
    /// The prefix holding `include/` and `lib/`.
    pub prefix: PathBuf,
    /// `prefix/include`.
    pub include_dir: PathBuf,
    /// `prefix/lib`, where `libmlx.so` / `libmlx.dylib` lives.
    pub lib_dir: PathBuf,
    /// The version read from `mlx/version.h`, e.g. `0.32.4`.
    pub version: String,
}

/// Locates MLX and checks its version, or returns a message that names the fix.
pub fn find() -> Result<MlxInstall, String> {
    find_in(env::var_os("MLX_DIR").map(PathBuf::from), &workspace_root())
}

/// [`find`] with its inputs passed in: `mlx_dir` is the value of `MLX_DIR`, `root` the
/// workspace root whose `.venv` is searched when `mlx_dir` is `None`.
pub fn find_in(mlx_dir: Option<PathBuf>, root: &Path) -> Result<MlxInstall, String> {
    let (prefix, source) = match mlx_dir {
        Some(dir) => (dir, "MLX_DIR".to_string()),
        None => {
            let venv = root.join(".venv");
            match venv_mlx(&venv) {
                Some(prefix) => (prefix, format!("the venv at {}", venv.display())),
                None => return Err(missing_message(&venv)),
            }
        }
    };
    let include_dir = prefix.join("include");
    let lib_dir = prefix.join("lib");
    let header = include_dir.join("mlx").join("mlx.h");
    if !header.is_file() {
        return Err(format!(
            "MLX headers not found: {} does not exist (MLX taken from {source}).\n{}",
            header.display(),
            fix_text()
        ));
    }
    if !has_library(&lib_dir) {
        return Err(format!(
            "libmlx not found in {} (MLX taken from {source}).\n{}",
            lib_dir.display(),
            fix_text()
        ));
    }
    let version = read_version(&include_dir.join("mlx").join("version.h"))?;
    if version != PINNED_VERSION {
        return Err(format!(
            "MLX {version} found at {} (from {source}), but Quince is pinned to MLX {PINNED_VERSION}.\n{}",
            prefix.display(),
            fix_text()
        ));
    }
    Ok(MlxInstall { prefix, include_dir, lib_dir, version })
}

/// Prints the cargo instructions that let this crate's tests and binaries find libmlx at run
/// time (an rpath to the install's `lib/`), and reruns the build script when `MLX_DIR` changes.
///
/// Panics with the fix when MLX is missing: build scripts report errors by panicking.
#[allow(clippy::print_stdout, clippy::panic)] // cargo reads build-script instructions from stdout
pub fn emit_rpath() {
    println!("cargo:rerun-if-env-changed=MLX_DIR");
    match find() {
        Ok(install) => {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{}", install.lib_dir.display());
        }
        Err(message) => panic!("\n\n{message}\n"),
    }
}

/// The workspace root: two levels above a crate in `crates/`, found by walking up from
/// `CARGO_MANIFEST_DIR` to the first `Cargo.toml` that declares `[workspace]`.
pub fn workspace_root() -> PathBuf {
    let start = env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from).unwrap_or_default();
    let mut dir: Option<&Path> = Some(&start);
    while let Some(d) = dir {
        if let Ok(text) = fs::read_to_string(d.join("Cargo.toml"))
            && text.contains("[workspace]")
        {
            return d.to_path_buf();
        }
        dir = d.parent();
    }
    start
}

fn venv_mlx(venv: &Path) -> Option<PathBuf> {
    let lib = venv.join("lib");
    let entries = fs::read_dir(&lib).ok()?;
    let mut candidates: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("site-packages").join("mlx"))
        .filter(|p| p.join("include").join("mlx").join("mlx.h").is_file())
        .collect();
    candidates.sort();
    candidates.pop()
}

fn has_library(lib_dir: &Path) -> bool {
    ["libmlx.so", "libmlx.dylib"].iter().any(|name| lib_dir.join(name).is_file())
}

fn read_version(path: &Path) -> Result<String, String> {
    let text = fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}\n{}", path.display(), fix_text()))?;
    let field = |name: &str| -> Option<String> {
        text.lines().find_map(|line| {
            let rest = line.trim().strip_prefix("#define")?.trim();
            let value = rest.strip_prefix(name)?.trim();
            Some(value.to_string())
        })
    };
    match (field("MLX_VERSION_MAJOR"), field("MLX_VERSION_MINOR"), field("MLX_VERSION_PATCH")) {
        (Some(major), Some(minor), Some(patch)) => Ok(format!("{major}.{minor}.{patch}")),
        _ => Err(format!("no MLX_VERSION_* defines in {}", path.display())),
    }
}

fn missing_message(venv: &Path) -> String {
    let mut text = String::new();
    let _ = writeln!(
        text,
        "MLX not found: MLX_DIR is not set and {} has no mlx package.",
        venv.display()
    );
    text.push_str(&fix_text());
    text
}

fn fix_text() -> String {
    format!(
        "Fix: run `make setup` at the workspace root (it makes .venv with mlx=={PINNED_VERSION}, \
         plus mlx-cpu on Linux), or set MLX_DIR to an MLX {PINNED_VERSION} prefix holding \
         include/mlx/mlx.h and lib/libmlx.so (or libmlx.dylib)."
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_version_defines() {
        let dir = std::env::temp_dir().join(format!("mlx-build-test-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("version.h");
        fs::write(
            &path,
            "#define MLX_VERSION_MAJOR 0\n#define MLX_VERSION_MINOR 32\n#define MLX_VERSION_PATCH 4\n",
        )
        .expect("write");
        assert_eq!(read_version(&path).expect("parse"), "0.32.4");
        fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn missing_mlx_names_mlx_dir() {
        let empty = std::env::temp_dir().join(format!("mlx-build-empty-{}", std::process::id()));
        fs::create_dir_all(&empty).expect("temp dir");
        for attempt in [find_in(None, &empty), find_in(Some(empty.join("prefix")), &empty)] {
            let message = attempt.expect_err("no MLX there");
            assert!(message.contains("MLX_DIR"), "the fix must name MLX_DIR: {message}");
            assert!(message.contains("make setup"), "the fix must name make setup: {message}");
        }
        fs::remove_dir_all(&empty).ok();
    }

    #[test]
    fn wrong_version_is_refused() {
        let prefix = std::env::temp_dir().join(format!("mlx-build-old-{}", std::process::id()));
        fs::create_dir_all(prefix.join("include/mlx")).expect("include dir");
        fs::create_dir_all(prefix.join("lib")).expect("lib dir");
        fs::write(prefix.join("include/mlx/mlx.h"), "").expect("header");
        fs::write(prefix.join("lib/libmlx.so"), "").expect("library");
        fs::write(
            prefix.join("include/mlx/version.h"),
            "#define MLX_VERSION_MAJOR 0\n#define MLX_VERSION_MINOR 25\n#define MLX_VERSION_PATCH 0\n",
        )
        .expect("version header");
        let message = find_in(Some(prefix.clone()), &prefix).expect_err("0.25.0 is not the pin");
        assert!(message.contains("0.25.0") && message.contains(PINNED_VERSION), "{message}");
        fs::remove_dir_all(&prefix).ok();
    }
}
