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
use crate::driver::sys::{CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY, CUdeviceptr};
use crate::driver::{Context, Driver, DriverError, Stream};

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

    /// `[off, off + n)` of this buffer in the pieces one copy may cover: the registered chunks
    /// of pinned memory, all of it for pageable memory. (piece offset, piece length) each.
    fn pieces(&self, off: usize, n: usize) -> Vec<(usize, usize)> {
        assert!(off + n <= self.len(), "a copy outside its host buffer");
        let step = match self {
            HostBuffer::Pinned(_) => PIN_CHUNK,
            HostBuffer::Mmap(_) => usize::MAX,
        };
        let mut out = Vec::new();
        let mut at = off;
        while at < off + n {
            let end = (off + n).min((at / step).saturating_add(1).saturating_mul(step));
            out.push((at, end - at));
            at = end;
        }
        out
    }

    /// Queues copies of `n` bytes of device memory at `src` into this buffer at `off`, on `s`,
    /// split where the host side crosses from one pinned chunk into the next.
    ///
    /// # Safety
    /// `src..src+n` is mapped device memory, and this buffer is not dropped or touched by the
    /// host until the copies complete on `s`. The caller has made the right context current.
    pub unsafe fn copy_from_device(
        &mut self,
        d: &Driver,
        off: usize,
        src: CUdeviceptr,
        n: usize,
        s: Stream,
    ) -> Result<(), DriverError> {
        let base = self.as_mut_ptr();
        for (at, len) in self.pieces(off, n) {
            // SAFETY: `at..at+len` lies in this buffer (checked by `pieces`) and in one
            // registration; the rest is guaranteed by the caller.
            unsafe {
                d.copy_dtoh_async(base.add(at), src + (at - off) as u64, len, s)?;
            }
        }
        Ok(())
    }

    /// Queues copies of `n` bytes of this buffer at `off` to device memory at `dst`, on `s`,
    /// split as [`HostBuffer::copy_from_device`] splits them.
    ///
    /// # Safety
    /// `dst..dst+n` is mapped device memory, and this buffer is not dropped or changed until
    /// the copies complete on `s`. The caller has made the right context current.
    pub unsafe fn copy_to_device(
        &self,
        d: &Driver,
        off: usize,
        dst: CUdeviceptr,
        n: usize,
        s: Stream,
    ) -> Result<(), DriverError> {
        let base = self.as_ptr();
        for (at, len) in self.pieces(off, n) {
            // SAFETY: as in `copy_from_device`.
            unsafe {
                d.copy_htod_async(dst + (at - off) as u64, base.add(at), len, s)?;
            }
        }
        Ok(())
    }
}

/// The backup of one allocation.
pub enum Backup {
    Host(HostBuffer),
    Disk(DiskFile),
}

impl Backup {
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        match self {
            Backup::Host(b) => b.len(),
            Backup::Disk(f) => f.len(),
        }
    }

    pub fn kind(&self) -> BackupKind {
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

/// The most host memory pinned by one driver call. Pinning holds up every other driver call
/// of the process for as long as it runs (measured on an H100: cuMemHostAlloc of 1 GiB stalled
/// a device allocation on another thread for 1.29 s; cuMemHostRegister of 16 MiB of pages
/// already faulted in, for at most 1.2 ms), so a buffer is pinned in steps of this size.
pub const PIN_CHUNK: usize = 16 << 20;

/// Pinned host memory: one contiguous range of address space, filled with separate mappings
/// of at most [`PIN_CHUNK`] bytes, each faulted in (by touching its pages) and then pinned by
/// the driver (`cuMemHostRegister`), one after the other. Faulting the pages in takes no
/// driver lock and no process-wide lock; registering pages already present is quick, so
/// another thread's driver calls wait at most for one chunk's registration. Unpinned and unmapped on drop,
/// chunk by chunk (one large `munmap` stalls other threads too).
///
/// The driver refuses a copy whose host range spans two registrations
/// (`CUDA_ERROR_INVALID_VALUE`, measured on an H100), so copies go through
/// [`HostBuffer::copy_from_device`] and [`HostBuffer::copy_to_device`], which split them at
/// chunk boundaries; the chunks run at the same bandwidth as one buffer (54.6 / 52.8 GB/s D2H /
/// H2D in 16 MiB chunks against 54.7 / 54.6 GB/s for one cuMemHostAlloc buffer).
pub struct PinnedBuffer {
    ptr: *mut u8,
    len: usize,
    /// Bytes of the range that are mapped and registered, from its start (a buffer whose
    /// pinning failed part way releases exactly these).
    pinned: usize,
    driver: Arc<Driver>,
    /// The context the chunks were registered in (`PORTABLE`: usable from every context).
    ctx: Context,
}

// SAFETY: the buffer is plain pinned host memory owned by this value; no thread-affine state.
unsafe impl Send for PinnedBuffer {}

impl PinnedBuffer {
    /// A host mapping that fails is the driver's out-of-memory error, as `cuMemHostAlloc`
    /// reports it where the host has no memory left.
    fn new(driver: &Arc<Driver>, ctx: Context, len: usize) -> Result<Self, DriverError> {
        let map_err = || DriverError {
            call: "mmap (pinned host memory)",
            code: if len == 0 {
                CUDA_ERROR_INVALID_VALUE
            } else {
                CUDA_ERROR_OUT_OF_MEMORY
            },
        };
        if len == 0 {
            return Err(map_err());
        }
        // The whole range is reserved first (no access, no memory), so the chunks are adjacent.
        // SAFETY: a fresh anonymous mapping at an address of the kernel's choosing.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(map_err());
        }
        let mut buf = Self {
            ptr: p.cast(),
            len,
            pinned: 0,
            driver: driver.clone(),
            ctx,
        };
        while buf.pinned < len {
            let n = PIN_CHUNK.min(len - buf.pinned);
            // SAFETY: `pinned..pinned+n` lies in the reservation made above, which this value
            // owns; MAP_FIXED replaces that part of it only.
            let at = unsafe { buf.ptr.add(buf.pinned) };
            // SAFETY: as above.
            let q = unsafe {
                libc::mmap(
                    at.cast(),
                    n,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
            if q == libc::MAP_FAILED {
                return Err(map_err());
            }
            // Fault the pages in by touching them, not with MAP_POPULATE or
            // MADV_POPULATE_WRITE: those hold the process's mmap lock for the whole step, and
            // every other thread's mmap or munmap (the driver makes them for device memory)
            // waits (measured on an H100 host: up to 35.16 ms behind 16 MiB MAP_POPULATE
            // steps), where a fault takes only its area's lock (0.43 ms at most when the pages
            // are touched; docs/logs/2026-11-25-h100-issue21/mmap_lock.log).
            for page in (0..n).step_by(4096) {
                // SAFETY: `at..at+n` was just mapped read-write and is owned by this value.
                unsafe { at.add(page).write_volatile(0) };
            }
            // SAFETY: `at..at+n` was just mapped and stays mapped until drop unregisters it.
            driver.with_context(ctx, || unsafe { driver.host_register(at, n) })?;
            buf.pinned += n;
        }
        Ok(buf)
    }

    /// The registered pieces: (offset, length), in order.
    fn chunks(&self) -> impl Iterator<Item = (usize, usize)> + use<> {
        let len = self.len;
        (0..len)
            .step_by(PIN_CHUNK)
            .map(move |off| (off, PIN_CHUNK.min(len - off)))
    }
}

/// `CUDA_ERROR_DEINITIALIZED`: the driver is shutting down (process exit).
const DRIVER_DEINITIALIZED: crate::driver::sys::CUresult = 4;

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let d = &self.driver;
        for (off, n) in self.chunks().take_while(|&(off, _)| off < self.pinned) {
            // SAFETY: `off` is the start of a chunk registered in `new`; the engine waits for
            // every copy touching a backup before the backup can be dropped.
            let at = unsafe { self.ptr.add(off) };
            // SAFETY: as above; this value is the registration's only owner.
            let r = d.with_context(self.ctx, || unsafe { d.host_unregister(at) });
            // At process exit the driver may be torn down before the backups: it drops their
            // registrations itself, so that is not worth a line per chunk.
            if let Err(e) = r
                && e.code != DRIVER_DEINITIALIZED
            {
                tracing::warn!(bytes = n, error = %e, "could not unpin a pinned backup chunk");
            }
            // SAFETY: the chunk's mapping, owned by this value and no longer registered.
            unsafe { libc::munmap(at.cast(), n) };
        }
        if self.pinned < self.len {
            // SAFETY: the rest of the reservation made in `new` (mapped or not), owned here.
            unsafe { libc::munmap(self.ptr.add(self.pinned).cast(), self.len - self.pinned) };
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
