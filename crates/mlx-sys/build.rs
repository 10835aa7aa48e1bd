//! Compiles the C++ shim against the pinned MLX and links libmlx with an rpath.

#[allow(clippy::print_stdout, clippy::panic)] // build-script protocol: instructions on stdout
fn main() {
    println!("cargo:rerun-if-env-changed=MLX_DIR");
    let install = match mlx_build::find() {
        Ok(install) => install,
        Err(message) => panic!("\n\n{message}\n"),
    };
    let shim = ["array", "ops", "fast", "quantized", "random", "compile", "io", "device"];
    let mut build = cxx_build::bridge("src/lib.rs");
    build
        .include(&install.include_dir)
        .include("shim")
        .std("c++20")
        // MLX's headers trip a few -Wall warnings that are not ours to fix.
        .flag_if_supported("-Wno-deprecated-declarations")
        .flag_if_supported("-Wno-unused-parameter");
    for name in shim {
        build.file(format!("shim/{name}.cc"));
        println!("cargo:rerun-if-changed=shim/{name}.cc");
    }
    build.compile("quince_mlx_shim");
    println!("cargo:rerun-if-changed=shim/shim.h");
    println!("cargo:rerun-if-changed=src/lib.rs");
    println!("cargo:rustc-link-search=native={}", install.lib_dir.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", install.lib_dir.display());
    // Read by dependents' build scripts as DEP_MLX_LIB_DIR / DEP_MLX_VERSION.
    println!("cargo:lib_dir={}", install.lib_dir.display());
    println!("cargo:version={}", install.version);
}
