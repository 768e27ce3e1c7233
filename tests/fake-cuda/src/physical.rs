//! The physical memory store, shared by every process that uses the same `FAKE_CUDA_DIR`.
//!
//! One physical allocation is one sparse file `FAKE_CUDA_DIR/dev<N>/<pid>-<seq>` (or `host/` for
//! host-located allocations). Liveness is carried by the kernel, so it stays true across
//! processes and survives crashes:
//!
//! * `cuMemCreate` opens the file once and takes `flock(LOCK_SH)` on that *open file
//!   description*. Everything that refers to the allocation shares that one description: the
//!   creating handle keeps the fd, exports are `dup`s of it (sent to other processes with
//!   `SCM_RIGHTS` they are still the same description), imports `dup` the received fd, and
//!   mappings are `mmap`s of it (a mapping holds a reference to the description). A flock is
//!   released only when the last reference to its description goes away, which is exactly when
//!   the real driver frees the memory: no handle, no mapping, no exported fd left anywhere.
//! * A scanner opens each file afresh (a new description) and tries `flock(LOCK_EX | LOCK_NB)`.
//!   Success means nothing refers to the allocation any more: the file is unlinked and not
//!   counted. `EWOULDBLOCK` means it is alive: its size counts as used device memory.
//!
//! Creation and scanning of one directory are serialised by an exclusive flock on its `.lock`
//! file, so the out-of-memory check and the creation that follows are atomic across processes.
//! A file is created under a `.tmp-` name and renamed once it holds its shared lock; scanners
//! skip names starting with `.` (and, holding the directory lock, delete `.tmp-` files left by
//! a creator that died half-way).

use std::ffi::c_int;
use std::fs::{DirBuilder, File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memsaver_allocator::driver::sys::{
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_UNKNOWN, CUresult,
};

use crate::config::Config;

/// Where a physical allocation lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// Device memory of the given ordinal: counted against `FAKE_CUDA_MEM_BYTES`.
    Device(i32),
    /// Host memory (`HOST`, `HOST_NUMA`, ...): not counted.
    Host,
}

impl Place {
    fn dir(self, cfg: &Config) -> PathBuf {
        match self {
            Place::Device(dev) => cfg.device_dir(dev),
            Place::Host => cfg.host_dir(),
        }
    }
}

/// This process's reference to one physical allocation: an fd on the allocation's shared open
/// file description. While it is open, the allocation is alive.
#[derive(Debug)]
pub struct PhysFile {
    /// `None` only while being dropped (the fd must be closed before the reap attempt).
    file: Option<File>,
    size: u64,
    place: Place,
    /// The file's path, used after the last local reference is gone to reap it if it is dead.
    path: PathBuf,
    /// `(st_dev, st_ino)`, so that a reap never deletes a different file of the same name.
    id: (u64, u64),
}

impl PhysFile {
    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn place(&self) -> Place {
        self.place
    }

    pub fn raw_fd(&self) -> RawFd {
        self.file().as_raw_fd()
    }

    fn file(&self) -> &File {
        self.file.as_ref().expect("PhysFile used during drop")
    }

    /// A new fd (close-on-exec) on the same open file description, for
    /// `cuMemExportToShareableHandle`: every export is a distinct fd, like the real driver's.
    pub fn export(&self) -> Result<OwnedFd, CUresult> {
        // try_clone_to_owned is fcntl(F_DUPFD_CLOEXEC): a new fd, the same description.
        self.file().as_fd().try_clone_to_owned().map_err(io_to_cu)
    }
}

impl Drop for PhysFile {
    fn drop(&mut self) {
        // Close first: if this was the last reference anywhere, the shared lock goes with it.
        drop(self.file.take());
        // Best effort: delete the file now if nothing refers to it any more, so dead
        // allocations do not sit in tmpfs until the next scan. Scanners reap it otherwise.
        if let Some(dir) = self.path.parent()
            && let Ok(_lock) = DirLock::acquire(dir)
        {
            let _ = reap_if_dead(&self.path, Some(self.id));
        }
    }
}

/// An exclusive flock on `<dir>/.lock`, held until dropped.
struct DirLock {
    _file: File,
}

impl DirLock {
    fn acquire(dir: &Path) -> io::Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(dir.join(".lock"))?;
        flock(&file, libc::LOCK_EX)?;
        Ok(Self { _file: file })
    }
}

/// `flock(2)` on the file's open file description, retrying on `EINTR`.
fn flock(file: &File, op: c_int) -> io::Result<()> {
    loop {
        // SAFETY: flock only reads the fd number, which `file` keeps open for the call.
        let rc = unsafe { libc::flock(file.as_raw_fd(), op) };
        if rc == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

fn io_to_cu(err: io::Error) -> CUresult {
    match err.raw_os_error() {
        Some(libc::ENOSPC | libc::ENOMEM | libc::EMFILE | libc::ENFILE) => CUDA_ERROR_OUT_OF_MEMORY,
        _ => CUDA_ERROR_UNKNOWN,
    }
}

/// Creates the directories of the store (idempotent).
pub fn prepare(cfg: &Config) -> io::Result<()> {
    let mut builder = DirBuilder::new();
    builder.recursive(true).mode(0o700);
    for dev in 0..cfg.devices {
        builder.create(cfg.device_dir(dev))?;
    }
    builder.create(cfg.host_dir())
}

/// Creates a physical allocation of `size` bytes. Device allocations fail with
/// `CUDA_ERROR_OUT_OF_MEMORY` when the live bytes of the device, counted across all processes,
/// plus `size` would exceed `FAKE_CUDA_MEM_BYTES`.
pub fn create(cfg: &Config, place: Place, size: u64) -> Result<PhysFile, CUresult> {
    static SEQ: AtomicU64 = AtomicU64::new(0);

    let dir = place.dir(cfg);
    let _lock = DirLock::acquire(&dir).map_err(io_to_cu)?;
    if let Place::Device(_) = place {
        let live = scan(&dir).map_err(io_to_cu)?;
        if live.saturating_add(size) > cfg.mem_bytes {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
    }
    let name = format!(
        "{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    );
    let tmp = dir.join(format!(".tmp-{name}"));
    let path = dir.join(&name);
    let result = (|| -> io::Result<PhysFile> {
        // std opens with O_CLOEXEC: children spawned later must not inherit a reference.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        file.set_len(size)?; // sparse: costs nothing until written
        if cfg.fresh_junk && matches!(place, Place::Device(_)) {
            let junk = vec![crate::config::JUNK; 1 << 20];
            let mut left = size;
            let mut f = &file;
            while left > 0 {
                let n = left.min(junk.len() as u64) as usize;
                std::io::Write::write_all(&mut f, &junk[..n])?;
                left -= n as u64;
            }
        }
        flock(&file, libc::LOCK_SH | libc::LOCK_NB)?;
        std::fs::rename(&tmp, &path)?;
        let meta = file.metadata()?;
        Ok(PhysFile {
            file: Some(file),
            size,
            place,
            path,
            id: (meta.dev(), meta.ino()),
        })
    })();
    result.map_err(|err| {
        let _ = std::fs::remove_file(&tmp);
        io_to_cu(err)
    })
}

/// Takes a new reference on the allocation behind `fd` (an fd from
/// `cuMemExportToShareableHandle`, possibly received from another process). The caller keeps
/// `fd`. `CUDA_ERROR_INVALID_VALUE` when `fd` is not open or is not a fake-cuda allocation.
pub fn import(fd: RawFd) -> Result<PhysFile, CUresult> {
    // SAFETY: F_GETFD only inspects the fd table; an invalid number yields EBADF.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } == -1 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: `fd` was just checked to be open, and the caller keeps it open during this call
    // (it owns it until it closes it after the import, as with the real driver).
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    let file = File::from(borrowed.try_clone_to_owned().map_err(io_to_cu)?);
    let meta = file.metadata().map_err(io_to_cu)?;
    if !meta.is_file() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let path = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    let place = place_of(&path).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    Ok(PhysFile {
        size: meta.len(),
        place,
        path,
        id: (meta.dev(), meta.ino()),
        file: Some(file),
    })
}

/// Which device an allocation file belongs to, from its path: `.../dev<N>/<pid>-<seq>` or
/// `.../host/<pid>-<seq>`.
fn place_of(path: &Path) -> Option<Place> {
    let name = path.file_name()?.to_str()?;
    if name.starts_with('.') || !name.contains('-') || name.ends_with(" (deleted)") {
        return None;
    }
    match path.parent()?.file_name()?.to_str()? {
        "host" => Some(Place::Host),
        d => d.strip_prefix("dev")?.parse().ok().map(Place::Device),
    }
}

/// Bytes of device `dev` held by live allocations of all processes (reaping dead ones).
pub fn live_bytes(cfg: &Config, dev: i32) -> Result<u64, CUresult> {
    let dir = cfg.device_dir(dev);
    let _lock = DirLock::acquire(&dir).map_err(io_to_cu)?;
    scan(&dir).map_err(io_to_cu)
}

/// Sums the sizes of live allocations in `dir` and deletes dead ones. The caller holds the
/// directory lock.
fn scan(dir: &Path) -> io::Result<u64> {
    let mut live = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(".tmp-") {
            // No creation is in progress while we hold the directory lock: a creator died.
            let _ = std::fs::remove_file(entry.path());
            continue;
        }
        if name.starts_with('.') {
            continue;
        }
        if let Some(size) = reap_if_dead(&entry.path(), None)? {
            live += size;
        }
    }
    Ok(live)
}

/// Opens `path` afresh and tests its liveness. Dead: unlinks it (if it is the file `expect`
/// names, when given) and returns `None`. Alive: returns its size. The caller holds the
/// directory lock.
fn reap_if_dead(path: &Path, expect: Option<(u64, u64)>) -> io::Result<Option<u64>> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let meta = file.metadata()?;
    match flock(&file, libc::LOCK_EX | libc::LOCK_NB) {
        Ok(()) => {
            if expect.is_none_or(|id| id == (meta.dev(), meta.ino())) {
                std::fs::remove_file(path).or_else(|e| match e.kind() {
                    io::ErrorKind::NotFound => Ok(()),
                    _ => Err(e),
                })?;
            }
            Ok(None)
        }
        Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => Ok(Some(meta.len())),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn place_from_path() {
        assert_eq!(place_of(Path::new("/x/dev3/12-4")), Some(Place::Device(3)));
        assert_eq!(place_of(Path::new("/x/host/12-4")), Some(Place::Host));
        assert_eq!(place_of(Path::new("/x/dev3/.tmp-12-4")), None);
        assert_eq!(place_of(Path::new("/x/other/12-4")), None);
        assert_eq!(place_of(Path::new("/x/dev1/12-4 (deleted)")), None);
    }
}
