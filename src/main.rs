//! The `stockd` binary; everything lives in the library.

#[tokio::main]
async fn main() -> std::process::ExitCode {
    stockd::telemetry::limit_malloc_arenas();
    match stockd::cli::main().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("stockd: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
