//! The UI's IPC types (`ui/src/ipc/bindings.ts`) are generated from the Rust view types; this
//! fails when the committed file is stale. `UPDATE_BINDINGS=1` rewrites it.
#![allow(clippy::unwrap_used)] // test code: a failing unwrap is a failing test

#[test]
fn the_committed_typescript_bindings_are_current() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../ui/src/ipc/bindings.ts");
    let generated = chat::view::typescript_bindings();
    if std::env::var_os("UPDATE_BINDINGS").is_some() {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "{} is stale: run `UPDATE_BINDINGS=1 cargo test -p chat --test bindings` and commit it",
        path.display()
    );
}
