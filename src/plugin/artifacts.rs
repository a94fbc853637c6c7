//! Compiled plugins kept on disk, so that a restart or another process on the same machine maps
//! a component's machine code in milliseconds instead of compiling it again (a JavaScript or
//! Python component takes Cranelift tens of seconds of CPU).
//!
//! An artifact is named by the component's sha256, its language profile and the engine's
//! compatibility hash (`{sha256}-{runtime}-{engine}.cwasm`): a different wasmtime or engine
//! setting never finds another's artifact, and wasmtime checks again when mapping one.
//!
//! Mapping an artifact runs its machine code, so the directory must be one only this user can
//! write: [`ArtifactStore::open`] creates it `0700` and refuses one that is owned by someone
//! else or writable by group or others. Files are written to a temporary name and renamed, so a
//! reader sees a whole artifact or none. The directory is bounded: beyond `max_bytes` the
//! least recently used artifacts are deleted (a process that mapped one keeps its mapping).

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

/// Extension of stored artifacts; anything else in the directory is left alone.
const EXTENSION: &str = "cwasm";

/// A directory of compiled plugins.
#[derive(Debug)]
pub struct ArtifactStore {
    dir: PathBuf,
    max_bytes: u64,
    next_temp: AtomicU64,
}

impl ArtifactStore {
    /// Opens (creating it `0700` when missing) the store at `dir`, holding at most `max_bytes`.
    /// Refuses a directory another user owns or others may write to: its files would be run.
    pub fn open(dir: &Path, max_bytes: u64) -> anyhow::Result<ArtifactStore> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| anyhow::anyhow!("creating the plugin artifact directory {}: {e}", dir.display()))?;
        let meta = fs::metadata(dir)
            .map_err(|e| anyhow::anyhow!("reading the plugin artifact directory {}: {e}", dir.display()))?;
        // SAFETY: geteuid only reads this process's effective user id.
        let me = unsafe { libc::geteuid() };
        anyhow::ensure!(meta.is_dir(), "the plugin artifact directory {} is not a directory", dir.display());
        anyhow::ensure!(
            meta.uid() == me && meta.permissions().mode() & 0o022 == 0,
            "the plugin artifact directory {} must belong to this user and be writable by no one else \
             (its files are run as machine code): chmod 700 it, or set [plugins] artifact_dir elsewhere",
            dir.display()
        );
        Ok(ArtifactStore { dir: dir.to_path_buf(), max_bytes, next_temp: AtomicU64::new(0) })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.{EXTENSION}"))
    }

    /// The stored artifact named `key`, marked as used now; `None` when there is none (or it is
    /// not a file this user wrote).
    pub fn get(&self, key: &str) -> Option<PathBuf> {
        let path = self.path(key);
        let meta = fs::symlink_metadata(&path).ok()?;
        // SAFETY: geteuid only reads this process's effective user id.
        let me = unsafe { libc::geteuid() };
        if !meta.is_file() || meta.uid() != me {
            return None;
        }
        // Recently used artifacts are the last evicted.
        if let Ok(file) = fs::File::options().append(true).open(&path) {
            let _ = file.set_modified(SystemTime::now());
        }
        Some(path)
    }

    /// Copies the artifact at `from` into the store as `key` (atomically), then deletes the
    /// least recently used artifacts beyond the store's size.
    pub fn put(&self, key: &str, from: &Path) -> io::Result<()> {
        let n = self.next_temp.fetch_add(1, Ordering::Relaxed);
        let temp = self.dir.join(format!(".{key}.{}.{n}.tmp", std::process::id()));
        let copied = fs::copy(from, &temp).and_then(|_| {
            fs::set_permissions(&temp, fs::Permissions::from_mode(0o600))?;
            fs::File::open(&temp)?.sync_all()?;
            fs::rename(&temp, self.path(key))
        });
        if copied.is_err() {
            let _ = fs::remove_file(&temp);
        }
        copied?;
        self.evict();
        Ok(())
    }

    /// Forgets the artifact named `key` (one this engine could not map).
    pub fn remove(&self, key: &str) {
        let _ = fs::remove_file(self.path(key));
    }

    /// Deletes the least recently used artifacts until the store holds at most `max_bytes`.
    fn evict(&self) {
        let Ok(entries) = fs::read_dir(&self.dir) else { return };
        let mut files: Vec<(SystemTime, u64, PathBuf)> = entries
            .filter_map(Result::ok)
            .filter(|e| e.path().extension().is_some_and(|x| x == EXTENSION))
            .filter_map(|e| {
                let meta = e.metadata().ok()?;
                meta.is_file().then(|| (meta.modified().unwrap_or(SystemTime::UNIX_EPOCH), meta.len(), e.path()))
            })
            .collect();
        let mut total: u64 = files.iter().map(|(_, len, _)| len).sum();
        files.sort();
        for (_, len, path) in files {
            if total <= self.max_bytes {
                break;
            }
            if fs::remove_file(&path).is_ok() {
                total = total.saturating_sub(len);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::ArtifactStore;

    /// A stored artifact is found by its key; beyond the size the oldest goes first; a
    /// directory others may write to is refused.
    #[test]
    fn stores_finds_evicts_and_refuses_a_shared_directory() {
        let root = tempfile::tempdir().expect("a temporary directory");
        let store = ArtifactStore::open(&root.path().join("artifacts"), 250).expect("opens");
        let source = root.path().join("a.bin");
        std::fs::write(&source, [7u8; 100]).expect("writes");
        assert!(store.get("one").is_none());
        store.put("one", &source).expect("stores one");
        let one = store.get("one").expect("finds one");
        assert_eq!(std::fs::read(&one).expect("reads"), vec![7u8; 100]);
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
        std::fs::File::options().append(true).open(&one).and_then(|f| f.set_modified(old)).expect("ages one");
        store.put("two", &source).expect("stores two");
        store.put("three", &source).expect("stores three");
        assert!(store.get("one").is_none(), "the least recently used went");
        assert!(store.get("two").is_some() && store.get("three").is_some());

        let shared = root.path().join("shared");
        std::fs::create_dir(&shared).expect("creates");
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).expect("chmods");
        let refused = ArtifactStore::open(&shared, 1 << 20).expect_err("refused");
        assert!(refused.to_string().contains("writable by no one else"), "{refused}");
    }
}
