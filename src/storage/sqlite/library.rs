//! Process-wide settings of the SQLite library, made once before its first connection opens.
//!
//! Why: SQLite allocates with the C library's `malloc`, not the process allocator (jemalloc), and
//! by default counts every allocation under a global mutex (memory statistics that nothing here
//! reads). Under load that was ~11 % of the writer thread's samples (`perf record -t` on
//! `stockd-writer`, hot-key): glibc's `malloc`/`free` and their arena lock, `sysmalloc` growing
//! the heap, and the statistics' `pthread_mutex_lock`/`unlock`. The writer is the one thread
//! every SQLite write waits for, so its time is the server's throughput.

use std::os::raw::{c_int, c_void};
use std::sync::Once;

use rusqlite::ffi;

/// SQLite's allocations, served by jemalloc. jemalloc aligns every allocation to at least 16
/// bytes (SQLite needs 8) and knows each one's size, which is what `xSize` must answer.
mod jemalloc {
    use super::{c_int, c_void};

    fn size(n: c_int) -> usize {
        usize::try_from(n).unwrap_or(0)
    }

    pub unsafe extern "C" fn malloc(n: c_int) -> *mut c_void {
        // SAFETY: any size may be asked of jemalloc; SQLite never asks for 0.
        unsafe { tikv_jemalloc_sys::malloc(size(n).max(1)) }
    }

    pub unsafe extern "C" fn free(p: *mut c_void) {
        // SAFETY: `p` came from `malloc`/`realloc` here (SQLite frees only what it allocated).
        unsafe { tikv_jemalloc_sys::free(p) }
    }

    pub unsafe extern "C" fn realloc(p: *mut c_void, n: c_int) -> *mut c_void {
        // SAFETY: as for `free`; SQLite never reallocates to 0.
        unsafe { tikv_jemalloc_sys::realloc(p, size(n).max(1)) }
    }

    pub unsafe extern "C" fn usable_size(p: *mut c_void) -> c_int {
        // SAFETY: as for `free`.
        let n = unsafe { tikv_jemalloc_sys::malloc_usable_size(p) };
        c_int::try_from(n).unwrap_or(c_int::MAX)
    }

    pub unsafe extern "C" fn roundup(n: c_int) -> c_int {
        if n <= 0 {
            return n;
        }
        // SAFETY: `nallocx` only computes the size class; it allocates nothing.
        let rounded = unsafe { tikv_jemalloc_sys::nallocx(size(n), 0) };
        if rounded == 0 {
            n
        } else {
            c_int::try_from(rounded).unwrap_or(n)
        }
    }

    pub unsafe extern "C" fn init(_: *mut c_void) -> c_int {
        super::ffi::SQLITE_OK
    }

    pub unsafe extern "C" fn shutdown(_: *mut c_void) {}
}

static CONFIGURED: Once = Once::new();

/// Applies the settings; a no-op after the first call. SQLite takes them only before it is
/// initialised (its first connection): if something in this process opened one earlier, they
/// are refused and SQLite keeps its defaults, which is slower, not wrong.
pub fn configure() {
    CONFIGURED.call_once(|| {
        let methods = ffi::sqlite3_mem_methods {
            xMalloc: Some(jemalloc::malloc),
            xFree: Some(jemalloc::free),
            xRealloc: Some(jemalloc::realloc),
            xSize: Some(jemalloc::usable_size),
            xRoundup: Some(jemalloc::roundup),
            xInit: Some(jemalloc::init),
            xShutdown: Some(jemalloc::shutdown),
            pAppData: std::ptr::null_mut(),
        };
        // SAFETY: both options are documented for use before `sqlite3_initialize`, which `Once`
        // and the callers (before any connection opens) provide; SQLite copies `methods`
        // before returning; the variadic arguments have the types each option takes.
        let (malloc, memstatus) = unsafe {
            (
                ffi::sqlite3_config(ffi::SQLITE_CONFIG_MALLOC, &methods as *const ffi::sqlite3_mem_methods),
                ffi::sqlite3_config(ffi::SQLITE_CONFIG_MEMSTATUS, 0 as c_int),
            )
        };
        if malloc != ffi::SQLITE_OK || memstatus != ffi::SQLITE_OK {
            tracing::warn!(malloc, memstatus, "SQLite was initialised before its settings could be applied");
        }
    });
}
