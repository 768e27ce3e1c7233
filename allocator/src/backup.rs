//! Backups: where a paused allocation's contents live, by policy.
//!
//! * [`HostBuffer::Pinned`] (`cpu`): page-locked memory from `cuMemHostAlloc`. Copies run at
//!   the PCIe limit, but allocating it is slow (about 5 s for 8 GiB on an H200 host).
//! * [`HostBuffer::Mmap`] (`mmap`): pageable anonymous memory from `mmap`. Cheap to allocate
//!   and given back to the kernel with `munmap`, so the process RSS really drops when it is
//!   released; the driver stages its copies through pinned memory of its own.
//! * [`Backup::Disk`] (`disk`): one file per allocation ([`crate::disk`]).
//!
//! A backup is made at its allocation's first pause. With retention on it stays attached to
//! the allocation for every later cycle (a pause then allocates nothing); with retention off
//! the engine releases it once the allocation has resumed. It is always released with its
//! allocation. Invariant: a backup that exists holds its allocation's contents as of the last
//! completed pause (a pause whose copy fails drops the backup).

use std::sync::Arc;

use serde::Serialize;

use crate::disk::DiskFile;
use crate::driver::{Context, Driver, DriverError};

/// What kind of storage a backup uses, for stats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackupKind {
    Pinned,
    Mmap,
    Disk,
}

/// Host memory holding a copy of device memory.
pub enum HostBuffer {
    Pinned(PinnedBuffer),
    Mmap(MmapBuffer),
}

impl HostBuffer {
    /// Pinned memory (the `cpu` policy).
    pub fn new(driver: &Arc<Driver>, ctx: Context, len: usize) -> Result<Self, DriverError> {
        PinnedBuffer::new(driver, ctx, len).map(HostBuffer::Pinned)
    }

    pub fn mmap(len: usize) -> std::io::Result<Self> {
        MmapBuffer::new(len).map(HostBuffer::Mmap)
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        match self {
            HostBuffer::Pinned(b) => b.ptr,
            HostBuffer::Mmap(b) => b.ptr,
        }
    }

    pub fn as_ptr(&self) -> *const u8 {
        match self {
            HostBuffer::Pinned(b) => b.ptr,
            HostBuffer::Mmap(b) => b.ptr,
        }
    }

    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        match self {
            HostBuffer::Pinned(b) => b.len,
            HostBuffer::Mmap(b) => b.len,
        }
    }

    pub fn kind(&self) -> BackupKind {
        match self {
            HostBuffer::Pinned(_) => BackupKind::Pinned,
            HostBuffer::Mmap(_) => BackupKind::Mmap,
        }
    }
}

/// The backup of one allocation.
pub(crate) enum Backup {
    Host(HostBuffer),
    Disk(DiskFile),
}

impl Backup {
    pub(crate) fn len(&self) -> usize {
        match self {
            Backup::Host(b) => b.len(),
            Backup::Disk(f) => f.len(),
        }
    }

    pub(crate) fn kind(&self) -> BackupKind {
        match self {
            Backup::Host(b) => b.kind(),
            Backup::Disk(_) => BackupKind::Disk,
        }
    }

    /// The host copy, for `cpu` and `mmap` backups.
    pub(crate) fn host(&self) -> Option<&HostBuffer> {
        match self {
            Backup::Host(b) => Some(b),
            Backup::Disk(_) => None,
        }
    }
}

/// Pinned host memory from `cuMemHostAlloc`, freed on drop.
pub struct PinnedBuffer {
    ptr: *mut u8,
    len: usize,
    driver: Arc<Driver>,
    /// The context it was allocated in (pinned memory is allocated and freed in one).
    ctx: Context,
}

// SAFETY: the buffer is plain pinned host memory owned by this value; no thread-affine state.
unsafe impl Send for PinnedBuffer {}

impl PinnedBuffer {
    fn new(driver: &Arc<Driver>, ctx: Context, len: usize) -> Result<Self, DriverError> {
        let ptr = driver.with_context(ctx, || driver.host_alloc(len))?;
        Ok(Self {
            ptr,
            len,
            driver: driver.clone(),
            ctx,
        })
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let d = &self.driver;
        // SAFETY: `ptr` came from host_alloc; the engine waits for every copy touching a backup
        // before the backup can be dropped, and this value is its only owner.
        let freed = d.with_context(self.ctx, || unsafe { d.host_free(self.ptr) });
        if let Err(e) = freed {
            tracing::warn!(bytes = self.len, error = %e, "could not free a pinned backup buffer");
        }
    }
}

/// Pageable anonymous memory from `mmap`, unmapped on drop (its pages go back to the kernel).
pub struct MmapBuffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a private anonymous mapping owned by this value; no thread-affine state.
unsafe impl Send for MmapBuffer {}

impl MmapBuffer {
    fn new(len: usize) -> std::io::Result<Self> {
        if len == 0 {
            return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
        }
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self { ptr: p.cast(), len })
    }
}

impl Drop for MmapBuffer {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr+len` is the mapping made in `new`, owned by this value only; the
        // engine waits for every copy touching a backup before it can be dropped.
        if unsafe { libc::munmap(self.ptr.cast(), self.len) } != 0 {
            let e = std::io::Error::last_os_error();
            tracing::warn!(bytes = self.len, error = %e, "could not unmap an mmap backup buffer");
        }
    }
}
