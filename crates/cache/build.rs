fn main() {
    mlx_build::emit_rpath();
}
