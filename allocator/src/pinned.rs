//! One topic: page-locked host memory made in steps ([`PinnedBuffer`]), the `cpu` policy's
//! backups. A buffer is reserved and mapped at once, then pinned a step of at most
//! [`PIN_CHUNK`] bytes at a time (faulted in, then registered with the driver), in the
//! background ([`PinJob`], run by `prepare.rs` and `reserve.rs`) or by the first copy that
//! needs it; copies run as pinned memory where registered, and through the staging buffers
//! ([`Staging`]) or as pageable memory elsewhere. Memory carved from the backup reserve goes
//! back to it ([`Lender`]). `backup.rs` wraps it as a [`crate::backup::HostBuffer`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use parking_lot::{Condvar, Mutex};

use crate::driver::sys::{CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY, CUdeviceptr};
use crate::driver::{Context, Driver, DriverError, Stream};

/// Which way a copy goes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Way {
    ToHost,
    ToDevice,
}

/// The most host memory pinned by one driver call. Pinning holds up every other driver call
/// of the process for as long as it runs (measured on an H100: cuMemHostAlloc of 1 GiB stalled
/// a device allocation on another thread for 1.29 s; cuMemHostRegister of 16 MiB of pages
/// already faulted in, for at most 1.2 ms), so a buffer is pinned in steps of this size.
pub const PIN_CHUNK: usize = 16 << 20;

/// How many threads (the caller's included) copy the steps of one buffer that are not pinned
/// yet. Such a copy costs mostly the page faults of fresh host memory, which threads take in
/// parallel (each fault takes only its own area's lock).
const PAGEABLE_COPY_THREADS: usize = 4;

/// The size of a transparent huge page on x86_64; reservations are aligned to it.
const HUGE_PAGE: usize = 2 << 20;

/// Bytes of one staging buffer ([`Staging`]).
const STAGE: usize = 4 << 20;
/// Staging buffers, and so threads, for the copies of steps not pinned yet.
const STAGES: usize = 8;

/// Pinned staging buffers for the copies of steps not pinned yet. Through them a copy runs at
/// pinned speed and threads move the bytes to or from the pageable steps with `memcpy`, in
/// parallel: the driver's own copies into pageable memory run at 15 GB/s on an H100 however
/// many threads issue them (it serialises them), against 55 GB/s into pinned memory, while 8
/// threads fill fresh huge pages at 24 GB/s (`bench/host_copy_rates.py`). The preparer makes
/// them once, before its first buffer, when a process backs up enough for them to pay
/// (`prepare.rs`), and keeps them (`STAGES` x `STAGE` = 32 MiB pinned); a copy that finds
/// none copies through the driver as pageable memory.
#[derive(Default)]
pub(crate) struct Staging {
    bufs: Mutex<Vec<PinnedBuffer>>,
}

impl Staging {
    /// Pins the staging buffers (at most `STAGES`; fewer if pinning fails). Outside any lock
    /// but its own, which no driver call is made under.
    pub(crate) fn prepare(&self, driver: &Arc<Driver>, ctx: Context) {
        let mut made = Vec::with_capacity(STAGES);
        for _ in 0..STAGES {
            match PinnedBuffer::new(driver, ctx, STAGE) {
                Ok(b) => made.push(b),
                Err(e) => {
                    tracing::info!(error = %e, "could not pin a staging buffer; copies of backups not pinned yet go through the driver");
                    break;
                }
            }
        }
        self.bufs.lock().extend(made);
    }
}

/// Pinned host memory: one contiguous range of address space, filled with separate mappings
/// of at most [`PIN_CHUNK`] bytes (steps), each faulted in (by touching its pages) and then
/// pinned by the driver (`cuMemHostRegister`), one after the other. Faulting the pages in takes
/// no driver lock and no process-wide lock; registering pages already present is quick, so
/// another thread's driver calls wait at most for one step's registration. Unpinned and
/// unmapped on drop, step by step (one large `munmap` stalls other threads too).
///
/// The driver refuses a copy whose host range spans two registrations
/// (`CUDA_ERROR_INVALID_VALUE`, measured on an H100), so copies go through
/// [`HostBuffer::copy_from_device`](crate::backup::HostBuffer::copy_from_device) and
/// [`HostBuffer::copy_to_device`](crate::backup::HostBuffer::copy_to_device), which split them
/// at step boundaries; the steps run at the same bandwidth as one buffer (54.6 / 52.8 GB/s D2H /
/// H2D in 16 MiB steps against 54.7 / 54.6 GB/s for one cuMemHostAlloc buffer).
///
/// A buffer may be partly pinned: steps `[0, pinned)` registered, the rest pageable (mapped
/// read-write, or still only reserved). The buffer prepared in the background for a pause
/// that came too soon is handed over so (`prepare.rs`), and the rest is pinned in place later
/// by a [`PinJob`] (the preparer's thread), one step at a time; registration keeps the pages'
/// contents. A copy never waits for that pinning, beyond the one step being registered when it
/// starts: registered steps are copied as pinned memory, the others as pageable memory (the
/// driver accepts it, and a copy into or out of pageable memory is complete for the host when
/// the call returns), several at once. A copy and the registration of the same step exclude
/// each other: a step is registered only while no copy runs (the copy holds the buffer's
/// lock), and a copy leaves the step being registered for last and waits for it.
pub struct PinnedBuffer(Arc<Shared>);

/// What the owner of a [`PinnedBuffer`] and its [`PinJob`] share.
struct Shared {
    ptr: *mut u8,
    len: usize,
    driver: Arc<Driver>,
    /// The context the steps are registered in (`PORTABLE`: usable from every context).
    ctx: Context,
    /// Held by a copy for its whole length, and by the pinner to start and end a step (never
    /// across a driver call of its own).
    state: Mutex<Progress>,
    /// Signalled when a step's registration ends.
    step_done: Condvar,
    /// Set (under `state`) when the owner is dropped: readable without the lock, so the
    /// preparer never takes `state` under its own lock.
    released: AtomicBool,
    /// Where the buffer's registrations start, before `ptr`: byte `o` of the buffer lies in the
    /// registration that starts at `(o + phase)` rounded down to [`PIN_CHUNK`]. 0 but for a
    /// buffer carved from a larger one ([`PinnedBuffer::lent`]).
    phase: usize,
    /// The owner of the memory of a carved buffer, which takes it back when the buffer is
    /// dropped (the memory stays mapped and pinned); `None` for a buffer that owns its steps.
    lender: Option<Arc<dyn Lender>>,
}

/// The owner of memory that [`PinnedBuffer`]s are carved from (the backup reserve,
/// `reserve.rs`): it gets the range back, still mapped and pinned, when such a buffer is
/// dropped.
pub(crate) trait Lender: Send + Sync {
    /// `ptr..ptr+len`, carved from this lender, is no longer used.
    fn give_back(&self, ptr: *mut u8, len: usize);
}

// SAFETY: the memory is plain host memory owned by the `PinnedBuffer`; every change of its
// mappings and registrations goes through `state`, and no state is thread-affine.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

/// Which steps of a buffer are pinned and mapped.
struct Progress {
    /// Bytes registered, from the start (whole steps, or `len`).
    pinned: usize,
    /// Bytes mapped read-write, from the start (`>= pinned`; whole steps, or `len`).
    mapped: usize,
    /// The step at `pinned` is being registered now (outside the lock).
    busy: bool,
    /// The owner was dropped: its steps are released, except a busy one, which its pinner
    /// releases.
    released: bool,
}

// SAFETY: the buffer is plain host memory owned by this value; no thread-affine state.
unsafe impl Send for PinnedBuffer {}

/// What one [`PinJob::step`] did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Pinned one more step; more remain.
    More,
    /// The whole buffer is pinned.
    Done,
    /// The owner dropped the buffer: nothing more to do.
    Released,
}

/// A handle on a [`PinnedBuffer`] that pins its remaining steps, one per call, while the
/// owner may copy into it or drop it.
pub(crate) struct PinJob(Arc<Shared>);

impl PinnedBuffer {
    /// A buffer of `len` bytes, every step pinned. A host mapping that fails is the driver's
    /// out-of-memory error, as `cuMemHostAlloc` reports it where the host has no memory left.
    pub(crate) fn new(driver: &Arc<Driver>, ctx: Context, len: usize) -> Result<Self, DriverError> {
        let buf = Self::reserve(driver, ctx, len)?;
        let job = PinJob(buf.0.clone());
        while job.step()? == Step::More {}
        Ok(buf)
    }

    /// A buffer of `len` bytes of address space, nothing mapped or pinned yet: copies use it
    /// as pageable memory (mapping it as they go) until a [`PinJob`] pins it.
    pub(crate) fn reserve(
        driver: &Arc<Driver>,
        ctx: Context,
        len: usize,
    ) -> Result<Self, DriverError> {
        if len == 0 {
            return Err(DriverError {
                call: "mmap (pinned host memory)",
                code: CUDA_ERROR_INVALID_VALUE,
            });
        }
        // The whole range is reserved first (no access, no memory), so the steps are adjacent,
        // and aligned to a huge page so that every step can be backed by huge pages.
        let total = len.checked_add(HUGE_PAGE).ok_or_else(host_oom)?;
        // SAFETY: a fresh anonymous mapping at an address of the kernel's choosing.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(host_oom());
        }
        let base = p as usize;
        let start = base.next_multiple_of(HUGE_PAGE);
        let (head, tail) = (start - base, base + total - (start + len));
        // SAFETY: both pieces lie in the reservation just made, outside the part kept.
        unsafe {
            if head > 0 {
                libc::munmap(p, head);
            }
            if tail > 0 {
                libc::munmap((start + len) as *mut libc::c_void, tail);
            }
        }
        Ok(Self(Arc::new(Shared {
            ptr: start as *mut u8,
            len,
            driver: driver.clone(),
            ctx,
            state: Mutex::new(Progress {
                pinned: 0,
                mapped: 0,
                busy: false,
                released: false,
            }),
            step_done: Condvar::new(),
            released: AtomicBool::new(false),
            phase: 0,
            lender: None,
        })))
    }

    /// A buffer over `ptr..ptr+len`, memory that `lender` owns, already mapped and pinned in
    /// registrations of [`PIN_CHUNK`] bytes that start `phase` bytes before `ptr` (and every
    /// `PIN_CHUNK` after). Copies split at those registrations; dropping the buffer gives the
    /// range back to `lender` instead of unpinning it.
    ///
    /// # Safety
    /// `ptr..ptr+len` is mapped read-write and registered as said, stays so while the buffer
    /// lives, and nothing else uses it meanwhile.
    pub(crate) unsafe fn lent(
        driver: &Arc<Driver>,
        ctx: Context,
        ptr: *mut u8,
        len: usize,
        phase: usize,
        lender: Arc<dyn Lender>,
    ) -> Self {
        Self(Arc::new(Shared {
            ptr,
            len,
            driver: driver.clone(),
            ctx,
            state: Mutex::new(Progress {
                pinned: len,
                mapped: len,
                busy: false,
                released: false,
            }),
            step_done: Condvar::new(),
            released: AtomicBool::new(false),
            phase: phase % PIN_CHUNK,
            lender: Some(lender),
        }))
    }

    #[allow(clippy::len_without_is_empty)]
    pub(crate) fn len(&self) -> usize {
        self.0.len
    }

    /// The start of the buffer.
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.0.ptr
    }

    /// Bytes pinned so far, from the start.
    pub(crate) fn pinned_bytes(&self) -> usize {
        self.0.state.lock().pinned
    }

    /// A handle that pins the buffer's remaining steps, one per call (`None` once all are).
    pub(crate) fn job(&self) -> Option<PinJob> {
        (!self.fully_pinned()).then(|| PinJob(self.0.clone()))
    }

    pub(crate) fn fully_pinned(&self) -> bool {
        self.0.state.lock().pinned == self.0.len
    }

    /// Copies `[off, off + n)` of this buffer from or to device memory at `dev` (see
    /// [`HostBuffer::copy_from_device`](crate::backup::HostBuffer::copy_from_device)):
    /// registered steps as pinned memory (queued on `s`), the others through the staging
    /// buffers of `staging` if it has them, else as pageable memory (mapped first, faulted in
    /// and copied by up to [`PAGEABLE_COPY_THREADS`] threads), and the step being registered,
    /// if any, once its registration ends.
    ///
    /// # Safety
    /// As for [`HostBuffer::copy_from_device`](crate::backup::HostBuffer::copy_from_device) and
    /// [`HostBuffer::copy_to_device`](crate::backup::HostBuffer::copy_to_device).
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn copy(
        &self,
        d: &Driver,
        ctx: Context,
        off: usize,
        dev: CUdeviceptr,
        n: usize,
        s: Stream,
        way: Way,
        staging: Option<&Staging>,
    ) -> Result<(), DriverError> {
        let sh = &*self.0;
        let mut g = sh.state.lock();
        // A step not mapped yet holds nothing, but a copy to the host needs it mapped, and the
        // buffer must stay one range for `memsaver_backup_pointer` and the disk path.
        if g.mapped < sh.len {
            sh.map(g.mapped, sh.len - g.mapped)?;
            g.mapped = sh.len;
        }
        let busy = g.busy.then_some(g.pinned);
        let (mut pinned, mut pageable, mut deferred) = (Vec::new(), Vec::new(), Vec::new());
        for (at, len) in steps_of(sh.phase, off, n) {
            if Some(at - at % PIN_CHUNK) == busy {
                deferred.push((at, len));
            } else if at < g.pinned {
                pinned.push((at, len));
            } else {
                pageable.push((at, len));
            }
        }
        let one = |at: usize, len: usize| {
            let dev_at = dev + (at - off) as u64;
            // SAFETY: `at..at+len` lies in this buffer's mapped range and in one step (one
            // registration or none), which no registration changes meanwhile (the lock is
            // held, and the step being registered is copied only once it is done); the rest
            // is guaranteed by the caller.
            unsafe {
                match way {
                    Way::ToHost => d.copy_dtoh_async(sh.ptr.add(at), dev_at, len, s),
                    Way::ToDevice => d.copy_htod_async(dev_at, sh.ptr.add(at), len, s),
                }
            }
        };
        for &(at, len) in &pinned {
            one(at, len)?;
        }
        let stages = match staging {
            Some(st) if !pageable.is_empty() => std::mem::take(&mut *st.bufs.lock()),
            _ => Vec::new(),
        };
        if stages.is_empty() {
            copy_pageable(d, ctx, sh, &pageable, way == Way::ToHost, &one)?;
        } else {
            let place = |at: usize| dev + (at - off) as u64;
            let r = copy_staged(d, ctx, sh, &pageable, way, &place, s, &stages);
            if let Some(st) = staging {
                st.bufs.lock().extend(stages);
            }
            r?;
        }
        if let Some(step) = busy
            && !deferred.is_empty()
        {
            // Only for that step: the pinner may start the next one before this thread wakes.
            while g.busy && g.pinned == step {
                sh.step_done.wait(&mut g);
            }
            // Registered now, or still pageable if its registration failed.
            for &(at, len) in &deferred {
                one(at, len)?;
            }
        }
        Ok(())
    }
}

impl Shared {
    /// Maps `[off, off + n)` of the reservation read-write (pages not faulted in yet).
    fn map(&self, off: usize, n: usize) -> Result<(), DriverError> {
        // SAFETY: `off..off+n` lies in the reservation this value owns; MAP_FIXED replaces that
        // part of it only, which holds no data (not mapped before).
        let q = unsafe {
            libc::mmap(
                self.ptr.add(off).cast(),
                n,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if q == libc::MAP_FAILED {
            return Err(host_oom());
        }
        // Huge pages where the kernel allows them (transparent huge pages, `madvise` mode):
        // faulting a step in then costs 8 zeroed 2 MiB pages instead of 4096 small ones
        // (measured on the H100 host: 7.7 against 2.2 GB/s on one thread, 26 against 8.5 on
        // four), which is most of what preparing a buffer, or copying into a step not pinned
        // yet, costs. Without them the step keeps small pages.
        // SAFETY: advice on the mapping just made, which this value owns.
        unsafe { libc::madvise(q, n, libc::MADV_HUGEPAGE) };
        Ok(())
    }

    /// Unregisters (if `registered`) and unmaps the step at `off` of `n` bytes.
    fn release_step(&self, off: usize, n: usize, registered: bool) {
        // SAFETY: a step of the reservation this value owns, which nothing uses any more.
        let at = unsafe { self.ptr.add(off) };
        if registered {
            let d = &self.driver;
            // SAFETY: `at` is the start of a step registered by `PinJob::step`; the engine
            // waits for every copy touching a backup before the backup can be dropped.
            let r = d.with_context(self.ctx, || unsafe { d.host_unregister(at) });
            // At process exit the driver may be torn down before the backups: it drops their
            // registrations itself, so that is not worth a line per step.
            if let Err(e) = r
                && e.code != DRIVER_DEINITIALIZED
            {
                tracing::warn!(bytes = n, error = %e, "could not unpin a pinned backup step");
            }
        }
        // SAFETY: as above; no longer registered.
        unsafe { libc::munmap(at.cast(), n) };
    }
}

impl PinJob {
    /// Pins the next step of the buffer: maps it and faults it in by touching its pages if no
    /// copy has mapped it yet (a mapped step may hold contents, which registration keeps), then
    /// registers it. Holds the buffer's lock only to start and to end the step, so a copy
    /// waits for at most this one step.
    pub(crate) fn step(&self) -> Result<Step, DriverError> {
        let sh = &*self.0;
        let (off, n, fresh) = {
            let mut g = sh.state.lock();
            if g.released {
                return Ok(Step::Released);
            }
            if g.pinned == sh.len {
                return Ok(Step::Done);
            }
            let off = g.pinned;
            let n = PIN_CHUNK.min(sh.len - off);
            let fresh = g.mapped < off + n;
            if fresh {
                sh.map(off, n)?;
                g.mapped = off + n;
            }
            g.busy = true;
            (off, n, fresh)
        };
        // SAFETY: `off..off+n` lies in the buffer's reservation, mapped above or by a copy.
        let at = unsafe { sh.ptr.add(off) };
        if fresh {
            // Fault the pages in by touching them, not with MAP_POPULATE or
            // MADV_POPULATE_WRITE: those hold the process's mmap lock for the whole step, and
            // every other thread's mmap or munmap (the driver makes them for device memory)
            // waits (measured on an H100 host: up to 35.16 ms behind 16 MiB MAP_POPULATE
            // steps), where a fault takes only its area's lock (0.43 ms at most when the pages
            // are touched; docs/logs/2026-11-25-h100-issue21/mmap_lock.log). The step is new:
            // nothing else reads or writes it while it is busy.
            touch(at, n);
        }
        let d = &sh.driver;
        // SAFETY: `at..at+n` is mapped and stays mapped until it is unregistered (by the owner's
        // drop, or below once released); no copy uses the step while it is busy.
        let r = d.with_context(sh.ctx, || unsafe { d.host_register(at, n) });
        let mut g = sh.state.lock();
        g.busy = false;
        let released = g.released;
        if !released && r.is_ok() {
            g.pinned += n;
        }
        let done = g.pinned == sh.len;
        drop(g);
        sh.step_done.notify_all();
        if released {
            // The owner released every other step and left this one to us.
            sh.release_step(off, n, r.is_ok());
            return Ok(Step::Released);
        }
        r?;
        Ok(if done { Step::Done } else { Step::More })
    }

    /// Whether the owner dropped the buffer (no lock taken).
    pub(crate) fn released(&self) -> bool {
        self.0.released.load(Ordering::Acquire)
    }

    pub(crate) fn len(&self) -> usize {
        self.0.len
    }
}

/// `CUDA_ERROR_DEINITIALIZED`: the driver is shutting down (process exit).
const DRIVER_DEINITIALIZED: crate::driver::sys::CUresult = 4;

/// A host mapping that fails is the driver's out-of-memory error, as `cuMemHostAlloc`
/// reports it where the host has no memory left.
fn host_oom() -> DriverError {
    DriverError {
        call: "mmap (pinned host memory)",
        code: CUDA_ERROR_OUT_OF_MEMORY,
    }
}

/// `[off, off + n)` in pieces that each lie in one step, the steps starting `phase` bytes
/// before offset 0 and every [`PIN_CHUNK`] after: (offset, length) each.
fn steps_of(phase: usize, off: usize, n: usize) -> impl Iterator<Item = (usize, usize)> {
    let end = off + n;
    let mut at = off;
    std::iter::from_fn(move || {
        (at < end).then(|| {
            let piece = (at, (end - at).min(PIN_CHUNK - (at + phase) % PIN_CHUNK));
            at += piece.1;
            piece
        })
    })
}

/// Writes a zero to every page of `at..at+n`, faulting it in.
fn touch(at: *mut u8, n: usize) {
    for page in (0..n).step_by(4096) {
        // SAFETY: callers pass a range mapped read-write that holds no contents yet.
        unsafe { at.add(page).write_volatile(0) };
    }
}

/// Copies the `pieces` of `sh` that are pageable memory through the staging buffers `stages`,
/// one thread each ([`for_each_piece`]): a piece goes in parts of `STAGE` bytes, each copied
/// between the device (at `place(offset)`) and the thread's staging buffer on `s` and waited
/// for, and moved between the staging buffer and the piece with `memcpy` (which faults fresh
/// pages in, in parallel). Complete when it returns.
#[allow(clippy::too_many_arguments)]
fn copy_staged(
    d: &Driver,
    ctx: Context,
    sh: &Shared,
    pieces: &[(usize, usize)],
    way: Way,
    place: &(dyn Fn(usize) -> CUdeviceptr + Sync),
    s: Stream,
    stages: &[PinnedBuffer],
) -> Result<(), DriverError> {
    for_each_piece(d, ctx, pieces, stages.len(), &|worker, at, len| {
        let staging = stages[worker].0.ptr;
        for part in (0..len).step_by(STAGE) {
            let n = STAGE.min(len - part);
            // SAFETY: `at..at+len` lies in the buffer's mapped range, which the caller's lock
            // keeps mapped.
            let host = unsafe { sh.ptr.add(at + part) };
            // SAFETY: the staging buffer is this worker's alone, pinned, of `STAGE >= n` bytes,
            // and each copy through it is waited for before it is used again; the device range
            // is guaranteed by the caller of `copy`, and the host range is in no registration
            // and read or written by this worker only.
            unsafe {
                match way {
                    Way::ToHost => {
                        d.copy_dtoh_async(staging, place(at + part), n, s)?;
                        d.event_wait(d.event_record(s)?)?;
                        std::ptr::copy_nonoverlapping(staging, host, n);
                    }
                    Way::ToDevice => {
                        std::ptr::copy_nonoverlapping(host, staging, n);
                        d.copy_htod_async(place(at + part), staging, n, s)?;
                        d.event_wait(d.event_record(s)?)?;
                    }
                }
            }
        }
        Ok(())
    })
}

/// Copies the `pieces` of `sh` that are pageable memory with `one`, from up to
/// [`PAGEABLE_COPY_THREADS`] threads ([`for_each_piece`]), each faulting its piece in first
/// for a copy to the host, so that the faults are taken in parallel whatever the driver does
/// inside the copy.
fn copy_pageable(
    d: &Driver,
    ctx: Context,
    sh: &Shared,
    pieces: &[(usize, usize)],
    to_host: bool,
    one: &(dyn Fn(usize, usize) -> Result<(), DriverError> + Sync),
) -> Result<(), DriverError> {
    for_each_piece(d, ctx, pieces, PAGEABLE_COPY_THREADS, &|_, at, len| {
        if to_host {
            // SAFETY: `at..at+len` is mapped (the caller holds the lock that keeps it so) and
            // is about to be overwritten by the copy.
            touch(unsafe { sh.ptr.add(at) }, len);
        }
        one(at, len)
    })
}

/// Runs `each(worker, offset, len)` for every piece of `pieces`, from up to `threads` workers
/// (this thread is worker 0, the others scoped threads; each makes `ctx` current), each taking
/// the next piece; a thread that cannot be started leaves its share to the others. Returns the
/// first failure, after which no piece is started.
fn for_each_piece(
    d: &Driver,
    ctx: Context,
    pieces: &[(usize, usize)],
    threads: usize,
    each: &(dyn Fn(usize, usize, usize) -> Result<(), DriverError> + Sync),
) -> Result<(), DriverError> {
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let work = |worker: usize| {
        d.with_context(ctx, || {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= pieces.len() || failed.load(Ordering::Relaxed) {
                    return Ok(());
                }
                let (at, len) = pieces[i];
                if let Err(e) = each(worker, at, len) {
                    failed.store(true, Ordering::Relaxed);
                    return Err(e);
                }
            }
        })
    };
    let threads = threads.min(pieces.len());
    if threads <= 1 {
        return if pieces.is_empty() { Ok(()) } else { work(0) };
    }
    let work = &work;
    std::thread::scope(|scope| {
        let spawned: Vec<_> = (1..threads)
            .filter_map(|w| {
                std::thread::Builder::new()
                    .name("memsaver-copy".into())
                    .spawn_scoped(scope, move || work(w))
                    .ok()
            })
            .collect();
        let mine = work(0);
        spawned
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .fold(mine, Result::and)
    })
}

impl Drop for PinnedBuffer {
    /// Releases every step but one being registered now, which its pinner releases when the
    /// registration ends: dropping never waits for pinning.
    fn drop(&mut self) {
        let sh = &*self.0;
        if let Some(lender) = &sh.lender {
            // Carved memory: every copy into it is done (the engine waits for them before a
            // backup is dropped), and it goes back mapped and pinned.
            sh.state.lock().released = true;
            sh.released.store(true, Ordering::Release);
            lender.give_back(sh.ptr, sh.len);
            return;
        }
        let (pinned, busy) = {
            let mut g = sh.state.lock();
            g.released = true;
            sh.released.store(true, Ordering::Release);
            (g.pinned, g.busy)
        };
        for off in (0..sh.len).step_by(PIN_CHUNK) {
            if busy && off == pinned {
                continue;
            }
            sh.release_step(off, PIN_CHUNK.min(sh.len - off), off < pinned);
        }
    }
}
