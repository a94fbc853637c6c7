//! The `stockd` binary; everything lives in the library.

/// jemalloc: per-thread caches over a few arenas, dirty pages given back to the system over
/// time by a background thread, so RSS stays bounded without funnelling every thread through
/// one lock (glibc's malloc needed a single arena for that).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's settings, read at its start: a background thread purges unused dirty pages
/// (after 1 s) so memory freed after a burst leaves the process.
#[allow(non_upper_case_globals)]
#[export_name = "_rjem_malloc_conf"]
pub static malloc_conf: &[u8] = b"background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0\0";

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
