//! The `stockd` binary; everything lives in the library.

/// mimalloc: per-thread heaps that take back what other threads free, so RSS stays bounded
/// without funnelling every thread through one lock (glibc's malloc needed one arena for that).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    // A plugin compiler child (see `plugin::compile`) does its one job before any runtime or
    // thread starts, under the limits its parent set.
    if let Some(code) = stockd::plugin::compile::child_main_if_requested() {
        return code;
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("stockd: starting the async runtime: {err}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(stockd::cli::main());
    // Whatever is still running (a blocking read, a timer) ends with the process.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("stockd: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
