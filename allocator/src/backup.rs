//! Backups: where a paused allocation's contents live, by policy.
//!
//! * [`HostBuffer::Pinned`] (`cpu`): page-locked memory ([`PinnedBuffer`]: mapped and faulted
//!   in by the kernel, then registered with the driver in bounded chunks). Copies run at the
//!   PCIe limit, but pinning is slow (0.35-0.65 s per GiB in 16 MiB steps on an H100:
//!   `docs/logs/2026-11-25-h100-issue21/`) and holds up the process's other driver calls while
//!   each chunk registers.
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
use crate::driver::sys::CUdeviceptr;
use crate::driver::{Context, Driver, DriverError, Stream};
pub use crate::pinned::{PIN_CHUNK, PinnedBuffer};
use crate::pinned::{PinJob, Staging, Way};

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
    /// Pinned memory (the `cpu` policy), pinned in steps of [`PIN_CHUNK`] bytes.
    pub fn new(driver: &Arc<Driver>, ctx: Context, len: usize) -> Result<Self, DriverError> {
        PinnedBuffer::new(driver, ctx, len).map(HostBuffer::Pinned)
    }

    pub fn mmap(len: usize) -> std::io::Result<Self> {
        MmapBuffer::new(len).map(HostBuffer::Mmap)
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        match self {
            HostBuffer::Pinned(b) => b.as_ptr(),
            HostBuffer::Mmap(b) => b.ptr,
        }
    }

    pub fn as_ptr(&self) -> *const u8 {
        match self {
            HostBuffer::Pinned(b) => b.as_ptr(),
            HostBuffer::Mmap(b) => b.ptr,
        }
    }

    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        match self {
            HostBuffer::Pinned(b) => b.len(),
            HostBuffer::Mmap(b) => b.len,
        }
    }

    pub fn kind(&self) -> BackupKind {
        match self {
            HostBuffer::Pinned(_) => BackupKind::Pinned,
            HostBuffer::Mmap(_) => BackupKind::Mmap,
        }
    }

    /// Whether the device may read and write the whole buffer (at its host address, where
    /// the device can: `packed.rs`): pinned throughout.
    pub(crate) fn registered(&self) -> bool {
        matches!(self, HostBuffer::Pinned(b) if b.fully_pinned())
    }

    /// The handle through which the rest of a partly pinned buffer is pinned in the background
    /// (`prepare.rs`); `None` for pageable memory and for a buffer pinned throughout.
    pub(crate) fn pin_job(&self) -> Option<PinJob> {
        match self {
            HostBuffer::Pinned(b) => b.job(),
            _ => None,
        }
    }

    /// Copies `n` bytes of device memory at `src` into this buffer at `off`, on `s`: pinned
    /// memory split where the host side crosses from one step into the next (see
    /// [`PinnedBuffer`] for steps not pinned yet), pageable memory in one copy. Copies into
    /// registered memory are queued; those into pageable memory are complete on return.
    ///
    /// # Safety
    /// `src..src+n` is mapped device memory of the context `ctx`, which the caller has made
    /// current, and this buffer is not dropped or touched by the host until the copies
    /// complete on `s`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn copy_from_device(
        &mut self,
        d: &Driver,
        ctx: Context,
        off: usize,
        src: CUdeviceptr,
        n: usize,
        s: Stream,
        staging: Option<&Staging>,
    ) -> Result<(), DriverError> {
        assert!(off + n <= self.len(), "a copy outside its host buffer");
        match self {
            // SAFETY: guaranteed by the caller.
            HostBuffer::Pinned(b) => unsafe {
                b.copy(d, ctx, off, src, n, s, Way::ToHost, staging)
            },
            // SAFETY: `off..off+n` lies in this buffer (asserted above); the rest is
            // guaranteed by the caller.
            HostBuffer::Mmap(b) => unsafe { d.copy_dtoh_async(b.ptr.add(off), src, n, s) },
        }
    }

    /// Copies `n` bytes of this buffer at `off` to device memory at `dst`, on `s`, split as
    /// [`HostBuffer::copy_from_device`] splits them. Copies out of pageable memory have read
    /// it on return.
    ///
    /// # Safety
    /// `dst..dst+n` is mapped device memory of the context `ctx`, which the caller has made
    /// current, and this buffer is not dropped or changed until the copies complete on `s`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn copy_to_device(
        &self,
        d: &Driver,
        ctx: Context,
        off: usize,
        dst: CUdeviceptr,
        n: usize,
        s: Stream,
        staging: Option<&Staging>,
    ) -> Result<(), DriverError> {
        assert!(off + n <= self.len(), "a copy outside its host buffer");
        match self {
            // SAFETY: guaranteed by the caller.
            HostBuffer::Pinned(b) => unsafe {
                b.copy(d, ctx, off, dst, n, s, Way::ToDevice, staging)
            },
            // SAFETY: as in `copy_from_device`.
            HostBuffer::Mmap(b) => unsafe { d.copy_htod_async(dst, b.ptr.add(off), n, s) },
        }
    }
}

/// The backup of one allocation.
pub enum Backup {
    Host(HostBuffer),
    /// The non-zero blocks of the contents, packed in pinned host memory by the device, and
    /// how many (`packed.rs` says where each lies).
    Packed(HostBuffer, u32),
    Disk(DiskFile),
}

impl Backup {
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        match self {
            Backup::Host(b) | Backup::Packed(b, _) => b.len(),
            Backup::Disk(f) => f.len(),
        }
    }

    pub fn kind(&self) -> BackupKind {
        match self {
            Backup::Host(b) | Backup::Packed(b, _) => b.kind(),
            Backup::Disk(_) => BackupKind::Disk,
        }
    }

    /// The host copy, for `cpu` and `mmap` backups (not packed ones: those are no image of
    /// the memory).
    pub(crate) fn host(&self) -> Option<&HostBuffer> {
        match self {
            Backup::Host(b) => Some(b),
            Backup::Packed(..) | Backup::Disk(_) => None,
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
