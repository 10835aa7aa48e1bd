//! Lets this crate's tests find libmlx at run time.
fn main() {
    mlx_build::emit_rpath();
}
