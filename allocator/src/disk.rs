//! Disk backups: one file per `disk`-policy allocation in the disk backup directory
//! (`MEMSAVER_DISK_DIR`, `memsaver_set_disk_dir`).
//!
//! A file is named `memsaver-<pid>-<address>.bin`, so processes sharing a directory never
//! collide, and is created with mode 0600 in a directory memsaver creates with mode 0700. It is
//! written and read through a bounded staging buffer (`MEMSAVER_DISK_CHUNK_MB`), never through a
//! host copy of the whole allocation. A retained file is overwritten in place by the next pause,
//! so disk usage does not grow across cycles. The file is removed when the value is dropped:
//! on a resume without retention, on free, and when a pause fails.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The file holding one allocation's contents; removed on drop.
pub(crate) struct DiskFile {
    path: PathBuf,
    file: File,
    len: usize,
}

impl DiskFile {
    /// Creates (or truncates) the file of the allocation at `ptr` in `dir`.
    pub(crate) fn create(dir: &Path, ptr: u64, len: usize) -> io::Result<Self> {
        let path = dir.join(format!("memsaver-{}-{ptr:x}.bin", std::process::id()));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)?;
        Ok(Self { path, file, len })
    }

    #[allow(clippy::len_without_is_empty)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn write_at(&self, buf: &[u8], offset: usize) -> io::Result<()> {
        self.file.write_all_at(buf, offset as u64)
    }

    pub(crate) fn read_at(&self, buf: &mut [u8], offset: usize) -> io::Result<()> {
        self.file.read_exact_at(buf, offset as u64)
    }
}

impl Drop for DiskFile {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.path) {
            tracing::warn!(path = %self.path.display(), bytes = self.len, error = %e, "could not remove a disk backup file");
        }
    }
}

/// Makes `dir` usable as the disk backup directory: created (mode 0700, parents included) if
/// missing, and it must be a directory. `source` names where the path came from in messages.
pub(crate) fn prepare_dir(dir: &Path, source: &str) -> Result<PathBuf> {
    if dir.as_os_str().is_empty() {
        return Err(Error::InvalidArgument(format!(
            "{source}: the disk backup directory is an empty path"
        )));
    }
    if !dir.exists() {
        DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| {
                Error::InvalidArgument(format!(
                    "{source}: cannot create the disk backup directory {}: {e}",
                    dir.display()
                ))
            })?;
    }
    if !dir.is_dir() {
        return Err(Error::InvalidArgument(format!(
            "{source}: {} is not a directory; the disk backup directory must be one",
            dir.display()
        )));
    }
    Ok(dir.to_path_buf())
}

/// An I/O failure on a disk backup as an error value.
pub(crate) fn io_error(what: &str, path: &Path, e: io::Error) -> Error {
    Error::Backup(format!("{what} {} failed: {e}", path.display()))
}
