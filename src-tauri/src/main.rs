//! The Quince desktop app.
// No console window on Windows release builds.
#![cfg_attr(not(debug_assertions), windows_subsystem = "windows")]

fn main() -> std::process::ExitCode {
    match quince_app::run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("Quince could not start: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}
