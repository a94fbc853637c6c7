//! A VFS for the writer's connection that hands a commit's WAL frames to the kernel in a few writes.
//!
//! Why: SQLite writes each WAL frame with two `pwrite` calls (its 24-byte header, then its page),
//! and a frame straddles two pages of the file, so every frame costs two system calls and four
//! page-cache updates. Under load that was ~30 % of the writer thread's time (`perf record -t` on
//! `stockd-writer`, hot-key: `walWriteOneFrame`, almost all of it in the kernel), and the writer
//! is the one thread every SQLite write waits for (docs/PERFORMANCE.md, "A commit's WAL frames
//! in a few writes").
//!
//! How: this VFS wraps the default one ("unix") and changes nothing but the WAL file's writes.
//! Writes that continue where the previous one ended are gathered in memory; whatever else is
//! asked of the file (a sync, a read, its size, a truncation, a lock, a file control, its close)
//! first hands the gathered bytes to the kernel, in writes of up to [`CHUNK`] bytes (31 pages:
//! the default VFS's limit), so every other call sees the file exactly as it would have without
//! this layer. A write elsewhere in the file, or one that would
//! grow the buffer past [`LIMIT`], does the same first.
//!
//! Why that is safe: a frame becomes visible to anyone else (the readers' and the checkpointer's
//! connections, each with a file handle of its own) only once the commit publishes it in the
//! WAL index, and with `synchronous = FULL` SQLite syncs the WAL (here: hands over, then syncs)
//! before it does so. With `NORMAL` a commit publishes frames without syncing, so that setting
//! keeps the default VFS ([`for_writer`] answers `None`). Frames not yet handed over when the
//! process dies belonged to a commit that had not returned: nothing acknowledged is lost.

use std::ffi::CStr;
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::OnceLock;

use rusqlite::ffi;

/// The name the VFS is registered under.
pub const NAME: &CStr = c"stockd-wal-gather";

/// The most bytes one call hands the default VFS: its write takes the length modulo 128 KiB
/// (`seekAndWriteFd`, which never expects more than a page and a frame header).
const CHUNK: usize = 124 << 10;

/// Where the default VFS's file starts in ours: after our header, 8-byte aligned.
const HEADER: usize = std::mem::size_of::<File>().next_multiple_of(8);

/// The most bytes gathered before they are handed over anyway: more than a large batch's commit
/// (a `multi-line` batch of 64 orders writes ~3.5 MiB of frames).
const LIMIT: usize = 8 << 20;

/// The VFS to open the writer's connection with: this one when `synchronous` is FULL (registered
/// on first use), the default one otherwise, or when registering failed.
pub fn for_writer(synchronous_full: bool) -> Option<&'static str> {
    if !synchronous_full {
        return None;
    }
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    // SAFETY: `register` runs once, before any connection opens with this VFS.
    let registered = *REGISTERED.get_or_init(|| unsafe { register() });
    NAME.to_str().ok().filter(|_| registered)
}

/// A file opened through this VFS: SQLite's `sqlite3_file` header first (its methods), then our
/// two pointers, then (at [`HEADER`]) the default VFS's own file structure, in one allocation.
#[repr(C)]
struct File {
    base: ffi::sqlite3_file,
    /// The default VFS's file (points into this allocation, just after this struct).
    inner: *mut ffi::sqlite3_file,
    /// Gathered bytes and the offset of the first; null for every file but a WAL.
    gather: *mut Gather,
}

struct Gather {
    start: i64,
    bytes: Vec<u8>,
}

/// The default VFS, which this one wraps (set once, by `register`).
static INNER: AtomicPtr<ffi::sqlite3_vfs> = AtomicPtr::new(ptr::null_mut());

/// Registers the VFS (not as the default). False when SQLite has no default VFS or refuses.
unsafe fn register() -> bool {
    // SAFETY: SQLite is initialised by `sqlite3_vfs_find`; a null name asks for the default VFS.
    let inner = unsafe { ffi::sqlite3_vfs_find(ptr::null()) };
    if inner.is_null() {
        return false;
    }
    // SAFETY: `inner` is a registered VFS, valid for the life of the process.
    let mut vfs = unsafe { ptr::read(inner) };
    // Room for our header and the inner file.
    let Ok(size) = c_int::try_from(HEADER + usize::try_from(vfs.szOsFile).unwrap_or(0)) else { return false };
    vfs.szOsFile = size;
    vfs.pNext = ptr::null_mut();
    vfs.zName = NAME.as_ptr();
    vfs.pAppData = ptr::null_mut();
    vfs.xOpen = Some(open);
    INNER.store(inner, Ordering::Release);
    // SQLite keeps the pointer for the life of the process: leaked on purpose, once.
    let vfs: &'static mut ffi::sqlite3_vfs = Box::leak(Box::new(vfs));
    // SAFETY: `vfs` is complete and lives forever; registering does not make it the default.
    unsafe { ffi::sqlite3_vfs_register(vfs, 0) == ffi::SQLITE_OK }
}

unsafe extern "C" fn open(
    _vfs: *mut ffi::sqlite3_vfs,
    name: ffi::sqlite3_filename,
    file: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    let ours = file.cast::<File>();
    // SAFETY: SQLite allocated `szOsFile` bytes at `file`: our header, then the inner file.
    unsafe {
        let inner = file.cast::<u8>().add(HEADER).cast::<ffi::sqlite3_file>();
        ptr::write(ours, File { base: ffi::sqlite3_file { pMethods: ptr::null() }, inner, gather: ptr::null_mut() });
        let vfs = INNER.load(Ordering::Acquire);
        let Some(open) = vfs.as_ref().and_then(|v| v.xOpen) else { return ffi::SQLITE_CANTOPEN };
        let rc = open(vfs, name, inner, flags, out_flags);
        if rc != ffi::SQLITE_OK || (*inner).pMethods.is_null() {
            // SQLite calls xClose only when pMethods is set: leave it null, as the inner left its own.
            return rc;
        }
        if flags & ffi::SQLITE_OPEN_WAL != 0 {
            (*ours).gather = Box::into_raw(Box::new(Gather { start: 0, bytes: Vec::new() }));
        }
        (*ours).base.pMethods = &METHODS;
        rc
    }
}

/// The inner file and its methods.
unsafe fn inner(file: *mut ffi::sqlite3_file) -> (*mut ffi::sqlite3_file, &'static ffi::sqlite3_io_methods) {
    // SAFETY: every file with `METHODS` is a `File` whose inner file opened successfully.
    unsafe {
        let inner = (*file.cast::<File>()).inner;
        (inner, &*(*inner).pMethods)
    }
}

/// Hands the gathered bytes to the inner file, [`CHUNK`] bytes a write.
unsafe fn flush(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: as for `inner`; `gather` is null or ours.
    unsafe {
        let gather = (*file.cast::<File>()).gather;
        if gather.is_null() || (*gather).bytes.is_empty() {
            return ffi::SQLITE_OK;
        }
        let (inner, methods) = inner(file);
        let Some(write) = methods.xWrite else { return ffi::SQLITE_IOERR_WRITE };
        let mut rc = ffi::SQLITE_OK;
        let mut offset = (*gather).start;
        for chunk in (*gather).bytes.chunks(CHUNK) {
            // Both fit: a chunk is at most CHUNK bytes.
            let n = chunk.len() as c_int;
            rc = write(inner, chunk.as_ptr().cast(), n, offset);
            if rc != ffi::SQLITE_OK {
                break;
            }
            offset += n as i64;
        }
        (*gather).bytes.clear();
        rc
    }
}

unsafe extern "C" fn write(file: *mut ffi::sqlite3_file, data: *const c_void, amount: c_int, offset: i64) -> c_int {
    // SAFETY: as for `inner`; `data` holds `amount` bytes (SQLite's contract).
    unsafe {
        let gather = (*file.cast::<File>()).gather;
        let n = usize::try_from(amount).unwrap_or(0);
        if gather.is_null() {
            let (inner, methods) = inner(file);
            return methods.xWrite.map_or(ffi::SQLITE_IOERR_WRITE, |w| w(inner, data, amount, offset));
        }
        let (len, end) = {
            let g = &*gather;
            (g.bytes.len(), g.start + i64::try_from(g.bytes.len()).unwrap_or(i64::MAX))
        };
        if len == 0 || offset != end || len + n > LIMIT {
            let rc = flush(file);
            if rc != ffi::SQLITE_OK {
                return rc;
            }
            (*gather).start = offset;
        }
        (*gather).bytes.extend_from_slice(std::slice::from_raw_parts(data.cast::<u8>(), n));
        ffi::SQLITE_OK
    }
}

/// A method that hands the gathered bytes over first, then asks the inner file.
macro_rules! flushing {
    ($name:ident, $method:ident, ($($arg:ident: $ty:ty),*), $missing:expr) => {
        unsafe extern "C" fn $name(file: *mut ffi::sqlite3_file $(, $arg: $ty)*) -> c_int {
            // SAFETY: as for `inner`.
            unsafe {
                let rc = flush(file);
                if rc != ffi::SQLITE_OK {
                    return rc;
                }
                let (inner, methods) = inner(file);
                methods.$method.map_or($missing, |m| m(inner $(, $arg)*))
            }
        }
    };
}

flushing!(read, xRead, (data: *mut c_void, amount: c_int, offset: i64), ffi::SQLITE_IOERR_READ);
flushing!(truncate, xTruncate, (size: i64), ffi::SQLITE_IOERR_TRUNCATE);
flushing!(sync, xSync, (flags: c_int), ffi::SQLITE_IOERR_FSYNC);
flushing!(file_size, xFileSize, (size: *mut i64), ffi::SQLITE_IOERR_FSTAT);
flushing!(lock, xLock, (level: c_int), ffi::SQLITE_IOERR_LOCK);
flushing!(unlock, xUnlock, (level: c_int), ffi::SQLITE_IOERR_UNLOCK);
flushing!(check_reserved_lock, xCheckReservedLock, (out: *mut c_int), ffi::SQLITE_IOERR_CHECKRESERVEDLOCK);
flushing!(file_control, xFileControl, (op: c_int, arg: *mut c_void), ffi::SQLITE_NOTFOUND);
flushing!(shm_map, xShmMap, (region: c_int, size: c_int, extend: c_int, out: *mut *mut c_void), ffi::SQLITE_IOERR_SHMMAP);
flushing!(shm_lock, xShmLock, (offset: c_int, n: c_int, flags: c_int), ffi::SQLITE_IOERR_SHMLOCK);
flushing!(shm_unmap, xShmUnmap, (delete: c_int), ffi::SQLITE_OK);
flushing!(fetch, xFetch, (offset: i64, amount: c_int, out: *mut *mut c_void), ffi::SQLITE_OK);
flushing!(unfetch, xUnfetch, (offset: i64, p: *mut c_void), ffi::SQLITE_OK);

unsafe extern "C" fn close(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: as for `inner`; after this SQLite frees the allocation without calling us again.
    unsafe {
        let flushed = flush(file);
        let (inner, methods) = inner(file);
        let closed = methods.xClose.map_or(ffi::SQLITE_OK, |c| c(inner));
        let ours = file.cast::<File>();
        if !(*ours).gather.is_null() {
            drop(Box::from_raw((*ours).gather));
            (*ours).gather = ptr::null_mut();
        }
        if flushed != ffi::SQLITE_OK {
            flushed
        } else {
            closed
        }
    }
}

unsafe extern "C" fn sector_size(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: as for `inner`.
    unsafe {
        let (inner, methods) = inner(file);
        methods.xSectorSize.map_or(4096, |m| m(inner))
    }
}

unsafe extern "C" fn device_characteristics(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: as for `inner`.
    unsafe {
        let (inner, methods) = inner(file);
        methods.xDeviceCharacteristics.map_or(0, |m| m(inner))
    }
}

unsafe extern "C" fn shm_barrier(file: *mut ffi::sqlite3_file) {
    // SAFETY: as for `inner`.
    unsafe {
        if flush(file) != ffi::SQLITE_OK {
            return;
        }
        let (inner, methods) = inner(file);
        if let Some(m) = methods.xShmBarrier {
            m(inner);
        }
    }
}

/// Every method of the default VFS's files, version 3 (the unix VFS's).
static METHODS: ffi::sqlite3_io_methods = ffi::sqlite3_io_methods {
    iVersion: 3,
    xClose: Some(close),
    xRead: Some(read),
    xWrite: Some(write),
    xTruncate: Some(truncate),
    xSync: Some(sync),
    xFileSize: Some(file_size),
    xLock: Some(lock),
    xUnlock: Some(unlock),
    xCheckReservedLock: Some(check_reserved_lock),
    xFileControl: Some(file_control),
    xSectorSize: Some(sector_size),
    xDeviceCharacteristics: Some(device_characteristics),
    xShmMap: Some(shm_map),
    xShmLock: Some(shm_lock),
    xShmBarrier: Some(shm_barrier),
    xShmUnmap: Some(shm_unmap),
    xFetch: Some(fetch),
    xUnfetch: Some(unfetch),
};
