//! The steps of a pause and a resume, defined once and used by every tag: the allocation
//! table's transitions (`engine.rs`) and the external tags' (the `nccl` tag of nccl-hook,
//! whose memory NCCL created). A tag's own code decides *what* to pause and resume and in
//! which order; these steps do the work on one [`Piece`] of physical memory at a time:
//!
//! * pause: [`Steps::synchronize`] the device, [`Steps::copy_out`] the contents into the
//!   piece's backup (queued behind an event for host backups, only the blocks that hold
//!   something where the piece asks and the device can: `packed.rs`; written through the
//!   staging buffer for disk), [`Steps::unmap`] each mapping once [`Steps::copied`] says the
//!   copy is done, [`Steps::release`] the handle; [`Steps::keep`] a piece that must stay
//!   resident;
//! * resume: [`Steps::map_fresh`] creates physical memory and maps it at the piece's old
//!   addresses, unless that would leave less than the memory margin free, [`Steps::copy_in`]
//!   queues the restore, and [`Steps::finish`] waits for a device's restores;
//!   with retention off ([`Plan::retain`]) the caller releases the backups of what resumed.
//!
//! The settings they follow (retention, memory margin, disk directory, staging chunk) are
//! read once per transition ([`Plan`]); backups come from the same place for every tag (the
//! buffer prepared in the background for the piece's key, else one carved from the backup
//! reserve, else a new one of the piece's policy).
//!
//! The steps see of the allocator only what they need: the driver, the prepared backups and
//! the [`Plan`] (`Steps::new`, called by `Allocator::steps`). They never name `Allocator`,
//! so the modules that add its methods (`allocator.rs`, `engine.rs`) import this one and not
//! the other way round.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::backup::{Backup, BackupKind, HostBuffer};
use crate::device::Device;
use crate::disk::DiskFile;
use crate::driver::sys::{CUmemAccessDesc, CUmemAllocationProp};
use crate::driver::{Driver, DriverError, Event, Handle};
use crate::error::{Error, Result};
use crate::options::Pack;
use crate::packed::{self, Batches, Kernels, Layout};
use crate::pinned::{PinJob, PinnedBuffer};
use crate::prepare::Preparer;
use crate::private_dir::Dir;
use crate::types::Policy;
use crate::units::human_bytes;

/// Which way a transition goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Pause,
    Resume,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Pause => "pause",
            Op::Resume => "resume",
        }
    }
}

/// Keys of prepared backups: an allocation's id for the allocation table, and
/// `EXTERNAL_KEY | key` for an external tag's buffers (see [`external_key`]).
const EXTERNAL_KEY: u64 = 1 << 63;

/// The key under which an external tag's buffer `key` has its backup prepared: a space apart
/// from allocation ids.
pub fn external_key(key: u64) -> u64 {
    EXTERNAL_KEY | key
}

/// Physical memory that one pause backs up and releases and one resume re-creates and
/// restores: an allocation of the table, a run's member, or one of NCCL's buffers.
pub struct Piece {
    /// The key of its prepared backup (an allocation's id, or [`external_key`]).
    pub key: u64,
    pub tag: Arc<str>,
    pub device: Arc<Device>,
    pub policy: Policy,
    /// Where the contents start: the first mapping.
    pub ptr: u64,
    /// The bytes a pause backs up from `ptr` (the whole allocation, or a prefix of it).
    pub len: usize,
    /// Its contents as of the last completed pause, if it has a backup.
    pub backup: Option<Backup>,
    /// A pinned backup keeps only the blocks that hold something, where the device can pack
    /// them (`packed.rs`); else it is a whole copy.
    pub pack: bool,
    /// The copy queued into `backup`, waited for before the memory is unmapped.
    copy_done: Option<Event>,
    /// The copy is a packing, in this batch, whose count [`Steps::copied`] reads.
    packing: Option<u64>,
}

impl Piece {
    pub fn new(
        key: u64,
        tag: Arc<str>,
        device: Arc<Device>,
        policy: Policy,
        ptr: u64,
        len: usize,
        backup: Option<Backup>,
    ) -> Self {
        Self {
            key,
            tag,
            device,
            policy,
            ptr,
            len,
            backup,
            pack: false,
            copy_done: None,
            packing: None,
        }
    }

    /// The piece, its pinned backup packed where the device can (see [`Piece::pack`]).
    pub fn packed(mut self, pack: bool) -> Self {
        self.pack = pack;
        self
    }

    /// Whether a pause copies its contents (every policy but `discard`).
    pub fn copies(&self) -> bool {
        self.policy.keeps_contents() && self.len > 0
    }

    /// Bytes of its backup.
    pub fn backup_bytes(&self) -> u64 {
        self.backup.as_ref().map_or(0, |b| b.len() as u64)
    }
}

/// How [`Steps::map_fresh`] creates physical memory: as memsaver allocates it (device memory
/// of the piece's device), or as another caller's `cuMemCreate` asked for it.
#[derive(Clone, Copy)]
pub enum Memory<'a> {
    Plain,
    Like(&'a CUmemAllocationProp),
}

/// One mapping of a piece: where, how many bytes, and the access to grant (`None`: read-write
/// for the piece's device, as memsaver maps its own allocations).
#[derive(Clone, Copy)]
pub struct Place<'a> {
    pub ptr: u64,
    pub size: usize,
    pub access: Option<&'a [CUmemAccessDesc]>,
}

/// The settings one transition runs with, read once before it claims anything.
pub struct Plan {
    /// Pause: which tags' pinned backups keep only their non-zero blocks (`packed.rs`).
    pub pack: Pack,
    /// Resume: keep the backups of resumed pieces (else release them).
    pub retain: bool,
    /// Resume: bytes to keep free on each device.
    pub margin: u64,
    /// Resume: the largest physical allocation that backs adjacent allocations together (0:
    /// one per allocation).
    pub merge_limit: usize,
    /// Pause: the disk backup directory, or why there is none (an error only if a disk-backed
    /// piece is paused).
    pub disk_dir: Result<Arc<Dir>>,
    /// The staging chunk of disk backups.
    pub disk_chunk: usize,
}

/// The steps of one transition (see the module documentation). Made by `Allocator::steps`;
/// holds the disk staging buffer until dropped.
pub struct Steps<'a> {
    /// The only way to the CUDA driver (host backups keep a reference to it).
    driver: &'a Arc<Driver>,
    /// The pinned backups prepared ahead of first pauses, by piece key.
    preparer: &'a Arc<Preparer>,
    pub plan: Plan,
    staging: Staging,
    unpinned: Unpinned<'a>,
    /// Bytes this transition copied between device and host (blocks and index of packed
    /// backups, whole pieces otherwise).
    copied_bytes: AtomicU64,
    /// The packing launches queued, made and waited for.
    batches: Mutex<Batches>,
    /// Ranges [`Steps::zero`] filled: a packed restore into one needs no fill of its own.
    zeroed: Mutex<Vec<(u64, u64)>>,
}

/// The backups this transition copied that are only partly pinned (a pause took them before
/// their preparation ended): when the steps are dropped, after every copy of the transition,
/// the preparer is asked to pin the rest of each in the background, so later copies run at
/// pinned speed. Not sooner: each step pinned holds up the process's driver calls, the
/// transition's copies among them.
struct Unpinned<'a> {
    preparer: &'a Arc<Preparer>,
    jobs: Vec<(u64, PinJob)>,
}

impl Unpinned<'_> {
    /// Notes `buf`, the backup of piece `key`, if part of it is not pinned.
    fn note(&mut self, key: u64, buf: &HostBuffer) {
        if let Some(job) = buf.pin_job()
            && !self.jobs.iter().any(|(k, _)| *k == key)
        {
            self.jobs.push((key, job));
        }
    }
}

impl Drop for Unpinned<'_> {
    fn drop(&mut self) {
        for (key, job) in self.jobs.drain(..) {
            self.preparer.finish(key, job);
        }
    }
}

impl<'a> Steps<'a> {
    /// The steps of one transition over `driver`, taking host backups prepared by `preparer`,
    /// with the settings `plan`.
    pub(crate) fn new(driver: &'a Arc<Driver>, preparer: &'a Arc<Preparer>, plan: Plan) -> Self {
        Self {
            driver,
            preparer,
            plan,
            staging: Staging { len: 0, buf: None },
            unpinned: Unpinned {
                preparer,
                jobs: Vec::new(),
            },
            copied_bytes: AtomicU64::new(0),
            batches: Mutex::new(Batches::default()),
            zeroed: Mutex::new(Vec::new()),
        }
    }
}

impl Steps<'_> {
    /// Sizes the disk staging buffer for the largest disk-backed piece the transition copies
    /// (never more than the chunk); call before the first disk piece.
    pub fn expect_disk(&mut self, largest: usize) {
        self.staging.len = largest.min(self.plan.disk_chunk);
    }

    /// Waits until nothing runs on `dev` (no kernel may still use memory about to be copied
    /// or unmapped).
    pub fn synchronize(&self, dev: &Device) -> Result<()> {
        let d = self.driver;
        Ok(d.with_context(dev.ctx, || d.synchronize())?)
    }

    /// Backs up the piece's first `len` bytes as its policy says: queues the copy into host
    /// memory (its backup, the one prepared for its key, or a new one) behind an event, or
    /// writes its disk file through the staging buffer. On a failure the piece has no backup
    /// (a backup must hold the contents of a completed pause) and stays mapped.
    pub fn copy_out(&mut self, p: &mut Piece) -> Result<()> {
        if !p.copies() {
            return Ok(());
        }
        if p.policy == Policy::Disk {
            return self.write_disk(p);
        }
        // A packed backup's buffer serves again; a backup of another kind (the pause chose
        // another policy than the last one) or too small is replaced.
        p.backup = match p.backup.take() {
            Some(Backup::Packed(buf, _)) => Some(Backup::Host(buf)),
            other => other,
        };
        let kind = if p.policy == Policy::Mmap {
            BackupKind::Mmap
        } else {
            BackupKind::Pinned
        };
        let d = self.driver;
        // A packed backup needs room for the blocks that hold something only (it grows at
        // `copied` when they do not fit).
        let packs = p.pack
            && p.policy == Policy::Cpu
            && p.len >= packed::MIN_LEN
            && Kernels::of(d, &p.device).is_some();
        let need = if packs {
            packed::start_len(p.len)
        } else {
            p.len
        };
        if p.backup
            .as_ref()
            .is_none_or(|b| b.len() < need || b.kind() != kind)
        {
            p.backup = None;
            p.backup = Some(self.host_backup(p.key, &p.device, p.policy, need)?);
        }
        // A packed backup not pinned throughout yet (a first pause that came before its
        // preparation ended) cannot be packed into: the piece is copied whole, into a buffer
        // of its size whose steps are copied as pageable memory and pinned in the background
        // afterwards, as a first pause does with a whole backup it takes unpinned.
        if matches!(&p.backup, Some(Backup::Host(b)) if b.len() < p.len && !(packs && b.registered()))
        {
            p.backup = None;
            let buf = PinnedBuffer::reserve(d, p.device.ctx, p.len)?;
            p.backup = Some(Backup::Host(HostBuffer::Pinned(buf)));
        }
        let staging = self.preparer.staging();
        let Some(Backup::Host(buf)) = p.backup.as_mut() else {
            unreachable!("cpu and mmap pieces hold a host backup")
        };
        let dev = &p.device;
        if packs && buf.registered() {
            // SAFETY: the piece is mapped (its owner holds the handle) and the backup is
            // registered host memory that lives in the piece until `copied` waits for the
            // batch.
            let r = unsafe { self.batches.lock().pack(d, dev, p.ptr, p.len, buf) };
            return match r {
                Ok(seq) => {
                    p.packing = Some(seq);
                    Ok(())
                }
                Err(e) => {
                    p.backup = None;
                    Err(e.into())
                }
            };
        }
        let r = d.with_context(dev.ctx, || {
            // SAFETY: the piece is mapped (its owner holds the handle) and the backup has at
            // least `len` bytes of host memory that lives in the piece until the copy is
            // waited on (for pageable memory the driver completes the copy before returning).
            unsafe {
                buf.copy_from_device(d, dev.ctx, 0, p.ptr, p.len, dev.stream, Some(staging))
            }?;
            d.event_record(dev.stream)
        });
        match r {
            Ok(e) => {
                p.copy_done = Some(e);
                self.count(p.len as u64);
                self.unpinned.note(p.key, buf);
                Ok(())
            }
            Err(e) => {
                // Some of the copy may be queued: it finishes before the buffer goes (a
                // carved one goes back to the reserve, whose next backup may be written
                // from another stream at once).
                let _ = d.with_context(dev.ctx, || d.stream_synchronize(dev.stream));
                p.backup = None;
                Err(e.into())
            }
        }
    }

    /// Waits for the piece's backup copy, if one is queued: after this its memory may be
    /// unmapped. A packing that found more non-zero blocks than its backup has slots is
    /// followed by a whole copy here. On a failure the piece has no backup.
    pub fn copied(&self, p: &mut Piece) -> Result<()> {
        let d = self.driver;
        if let Some(e) = p.copy_done.take() {
            d.with_context(p.device.ctx, || d.event_wait(e))?;
        }
        let Some(seq) = p.packing.take() else {
            return Ok(());
        };
        if let Err(e) = self.batches.lock().wait(d, &p.device, seq) {
            p.backup = None;
            return Err(e.into());
        }
        let Some(Backup::Host(buf)) = p.backup.take() else {
            unreachable!("a packing goes into a host backup")
        };
        // SAFETY: the launch that packed into `buf` has completed (waited on above).
        let count = unsafe { packed::count(buf.as_ptr(), buf.len()) };
        if count as usize <= Layout::of(buf.len()).slots {
            self.count(Layout::copied(count as usize));
            p.backup = Some(Backup::Packed(buf, count));
            return Ok(());
        }
        tracing::debug!(tag = %p.tag, ptr = format_args!("{:#x}", p.ptr), blocks = count, "too many blocks to pack: copied whole");
        // A backup too small for the whole piece grows to its size, once: later pauses pack
        // into it, or copy whole, without allocating.
        let mut buf = if buf.len() < p.len {
            drop(buf);
            match self.host_backup(p.key, &p.device, p.policy, p.len)? {
                Backup::Host(b) => b,
                _ => unreachable!("a cpu piece's backup is a host buffer"),
            }
        } else {
            buf
        };
        let dev = &p.device;
        d.with_context(dev.ctx, || {
            // SAFETY: the piece is still mapped (its memory is unmapped only after this), and
            // the stream is synchronised before the buffer is used again.
            unsafe { buf.copy_from_device(d, dev.ctx, 0, p.ptr, p.len, dev.stream, None) }?;
            d.stream_synchronize(dev.stream)
        })?;
        self.count(p.len as u64);
        p.backup = Some(Backup::Host(buf));
        Ok(())
    }

    /// Bytes this transition copied so far between device and host memory.
    pub fn copied_bytes(&self) -> u64 {
        self.copied_bytes.load(Ordering::Relaxed)
    }

    fn count(&self, bytes: u64) {
        self.copied_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Unmaps `places` on `dev`.
    ///
    /// # Safety
    /// Each place is mapped, the device was synchronised and every copy out of it completed.
    pub unsafe fn unmap(&self, dev: &Device, places: &[Place<'_>]) -> Result<()> {
        let d = self.driver;
        Ok(d.with_context(dev.ctx, || {
            places.iter().try_for_each(|pl| {
                // SAFETY: guaranteed by the caller.
                unsafe { d.unmap(pl.ptr, pl.size) }
            })
        })?)
    }

    /// Releases a physical handle whose mappings are gone (a failure is logged: the memory
    /// may leak, but nothing maps it any more).
    pub fn release(&self, h: Handle, ptr: u64) {
        release_logged(self.driver, h, ptr);
    }

    /// A piece that stays resident after its pause failed: a copy into its backup may still
    /// run, so wait for it, then drop the backup (a backup must hold the contents of a
    /// completed pause).
    pub fn keep(&self, p: &mut Piece) {
        let d = self.driver;
        if let Some(seq) = p.packing.take() {
            // The batch may be queued or running: it writes into the backup until done.
            let _ = self.batches.lock().wait(d, &p.device, seq);
        }
        if let Some(done) = p.copy_done.take() {
            // Waiting also destroys the event.
            let _ = d.with_context(p.device.ctx, || d.event_wait(done));
        }
        if p.backup.is_some() {
            let _ = d.with_context(p.device.ctx, || d.stream_synchronize(p.device.stream));
            p.backup = None;
        }
    }

    /// Creates `size` bytes of physical memory on `dev` and maps it at `places`, unless that
    /// would leave less than the memory margin free on the device (reported as out of memory,
    /// see [`is_out_of_memory`]). On a failure nothing stays mapped or allocated.
    pub fn map_fresh(
        &self,
        dev: &Device,
        memory: Memory<'_>,
        size: usize,
        places: &[Place<'_>],
        tag: &str,
    ) -> Result<Handle> {
        let d = self.driver;
        let margin = self.plan.margin;
        Ok(d.with_context(dev.ctx, || {
            if margin > 0 {
                let (free, _) = d.mem_info()?;
                if (free as u64) < size as u64 + margin {
                    tracing::info!(
                        tag,
                        ptr = format_args!("{:#x}", places.first().map_or(0, |p| p.ptr)),
                        bytes = size,
                        free,
                        margin,
                        "resume stops at the memory margin"
                    );
                    return Err(oom_error());
                }
            }
            let h = match memory {
                Memory::Plain => d.create(dev.ordinal, size, true)?,
                Memory::Like(prop) => d.create_with(prop, size)?,
            };
            if let Err(e) = map_places(d, dev, h, places) {
                let _ = d.release(h);
                return Err(e);
            }
            Ok(h)
        })?)
    }

    /// Maps the existing handle `h` (an import of another process's memory) at `places` on
    /// `dev`. On a failure nothing stays mapped, and `h` is the caller's to release.
    pub fn map_handle(&self, dev: &Device, h: Handle, places: &[Place<'_>]) -> Result<()> {
        let d = self.driver;
        Ok(d.with_context(dev.ctx, || map_places(d, dev, h, places))?)
    }

    /// Queues the restore of a just mapped piece from its backup (nothing without one). Disk
    /// backups are read chunk by chunk into the staging buffer, after the previous chunk's
    /// copy; a disk file that changed since the pause fails here (the caller unmaps and
    /// releases what it mapped, and the piece stays paused with its backup).
    pub fn copy_in(&mut self, p: &Piece) -> Result<()> {
        let (d, staging) = (self.driver, self.preparer.staging());
        let dev = &p.device;
        match &p.backup {
            None => Ok(()),
            Some(Backup::Host(buf)) => {
                let n = p.len.min(buf.len());
                d.with_context(dev.ctx, || {
                    // SAFETY: just mapped; the backup stays in the piece until the stream is
                    // synchronised by `finish`.
                    unsafe {
                        buf.copy_to_device(d, dev.ctx, 0, p.ptr, n, dev.stream, Some(staging))
                    }
                })?;
                self.unpinned.note(p.key, buf);
                self.count(n as u64);
                Ok(())
            }
            Some(Backup::Packed(buf, count)) => {
                if Kernels::of(d, dev).is_none() {
                    return Err(Error::Backup(format!(
                        "the packed backup of tag '{}' at {:#x} needs the packing kernels, which \
                         no longer load on device {}",
                        p.tag, p.ptr, dev.ordinal
                    )));
                }
                let (start, end) = (p.ptr, p.ptr + p.len as u64);
                if !self
                    .zeroed
                    .lock()
                    .iter()
                    .any(|&(s, e)| s <= start && end <= e)
                {
                    // SAFETY: just mapped, until `finish` synchronises.
                    d.with_context(dev.ctx, || unsafe {
                        d.memset_d8_async(p.ptr, 0, p.len, dev.stream)
                    })?;
                }
                // SAFETY: just mapped and zero-filled; the backup (registered throughout, as
                // packing needs) stays in the piece until `finish` launches the batch and
                // synchronises.
                unsafe {
                    self.batches
                        .lock()
                        .unpack(d, dev, (p.ptr, p.len), buf, *count)
                }?;
                self.count(Layout::copied(*count as usize));
                Ok(())
            }
            Some(Backup::Disk(file)) => {
                let mut r = file.reader(&p.tag, p.ptr)?;
                let (buf, chunk) = self.staging.buffer(self.driver, dev)?;
                for off in (0..p.len).step_by(chunk) {
                    let n = chunk.min(p.len - off);
                    // The previous copy out of the staging buffer must be done before it is
                    // filled again.
                    d.with_context(dev.ctx, || d.stream_synchronize(dev.stream))?;
                    // SAFETY: `buf` has `chunk >= n` bytes and no copy uses it (synchronised).
                    let bytes = unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr(), n) };
                    r.read(bytes)?;
                    d.with_context(dev.ctx, || {
                        // SAFETY: just mapped; the staging buffer is not touched again before
                        // the stream is synchronised (next chunk, next piece, or `finish`).
                        unsafe {
                            buf.copy_to_device(
                                d,
                                dev.ctx,
                                0,
                                p.ptr + off as u64,
                                n,
                                dev.stream,
                                None,
                            )
                        }
                    })?;
                }
                r.finish()
            }
        }
    }

    /// Queues zeroing `n` bytes of just mapped memory at `ptr` on `dev`, ordered before the
    /// restores queued after it: what no backup restores then holds what NCCL's own
    /// allocations start with, not whatever the driver's fresh memory holds.
    pub fn zero(&self, dev: &Device, ptr: u64, n: usize) -> Result<()> {
        let d = self.driver;
        d.with_context(dev.ctx, || {
            // SAFETY: mapped by the caller and kept mapped until `finish` synchronises.
            unsafe { d.memset_d8_async(ptr, 0, n, dev.stream) }
        })?;
        self.zeroed.lock().push((ptr, ptr + n as u64));
        Ok(())
    }

    /// Waits for every restore queued on `dev` (launching the packed ones still queued): the
    /// memory is usable once this returns.
    pub fn finish(&self, dev: &Device) -> Result<()> {
        let d = self.driver;
        let launched = self.batches.lock().flush_unpack(d, dev);
        let synced = d.with_context(dev.ctx, || d.stream_synchronize(dev.stream));
        self.zeroed.lock().clear();
        Ok(launched.and(synced)?)
    }

    /// The settings, for the caller's settle phase (drops the staging buffer, and has the
    /// preparer pin the rest of partly pinned backups).
    pub fn into_plan(self) -> Plan {
        self.plan
    }

    /// A host backup of `len` bytes for the `cpu` (pinned) or `mmap` piece `key`: the buffer
    /// prepared for it if there is one and it is large enough, else a fresh one.
    fn host_backup(&self, key: u64, dev: &Device, policy: Policy, len: usize) -> Result<Backup> {
        if policy == Policy::Cpu
            && let Some(buf) = self.preparer.take(key)
            && buf.len() >= len
        {
            return Ok(Backup::Host(buf));
        }
        // Pinned memory of the backup reserve, if it has that much free now.
        if policy == Policy::Cpu
            && let Some(buf) = self.preparer.carve(len)
        {
            return Ok(Backup::Host(buf));
        }
        let buf = match policy {
            Policy::Mmap => HostBuffer::mmap(len).map_err(|e| {
                Error::Backup(format!(
                    "cannot map {} of pageable host memory: {e}",
                    human_bytes(len as u64)
                ))
            })?,
            _ => HostBuffer::new(self.driver, dev.ctx, len)?,
        };
        Ok(Backup::Host(buf))
    }

    /// Copies a resident disk-backed piece into its file, chunk by chunk through the staging
    /// buffer, computing the file's checksum on each chunk as it is written. The file of an
    /// earlier cycle is overwritten in place; on failure it is removed (the piece keeps no
    /// backup) and the piece stays resident.
    fn write_disk(&mut self, p: &mut Piece) -> Result<()> {
        let dir = self.plan.disk_dir.as_ref().map_err(Clone::clone)?.clone();
        let mut file = match p.backup.take() {
            Some(Backup::Disk(f)) => f,
            _ => DiskFile::create(&dir, p.len).map_err(|e| {
                Error::Backup(format!(
                    "cannot create a disk backup file of tag '{}' in {}: {e}",
                    p.tag,
                    dir.path().display()
                ))
            })?,
        };
        let path = file.path();
        let failed = |e: std::io::Error| {
            Error::Backup(format!(
                "writing the disk backup {} of tag '{}' failed: {e}; the allocation stays \
                 resident",
                path.display(),
                p.tag
            ))
        };
        let d = self.driver;
        let dev = p.device.clone();
        let (buf, chunk) = self.staging.buffer(self.driver, &dev)?;
        let mut w = file.writer().map_err(failed)?;
        for off in (0..p.len).step_by(chunk) {
            let n = chunk.min(p.len - off);
            d.with_context(dev.ctx, || {
                // SAFETY: the piece is mapped (its owner holds the handle) and the staging
                // buffer has `chunk >= n` bytes; the stream is synchronised before it is read.
                unsafe {
                    buf.copy_from_device(d, dev.ctx, 0, p.ptr + off as u64, n, dev.stream, None)
                }?;
                d.stream_synchronize(dev.stream)
            })?;
            // SAFETY: the copy into `buf[..n]` has completed and nothing else uses the buffer.
            let bytes = unsafe { std::slice::from_raw_parts(buf.as_ptr(), n) };
            w.write(bytes).map_err(failed)?;
        }
        w.finish();
        tracing::debug!(tag = %p.tag, ptr = format_args!("{:#x}", p.ptr), bytes = p.len, path = %path.display(), "disk backup written");
        p.backup = Some(Backup::Disk(file));
        Ok(())
    }
}

/// The pinned buffer disk backups are copied through: one per transition, allocated at the
/// first disk piece, of the chunk size (or the largest disk piece, if smaller). Allocated
/// `PORTABLE`, so it serves every device.
struct Staging {
    len: usize,
    buf: Option<HostBuffer>,
}

impl Staging {
    /// The buffer and its length, allocating it on first use.
    fn buffer(&mut self, d: &Arc<Driver>, dev: &Device) -> Result<(&mut HostBuffer, usize)> {
        if self.buf.is_none() {
            self.buf = Some(HostBuffer::new(d, dev.ctx, self.len)?);
        }
        Ok((self.buf.as_mut().expect("set above"), self.len))
    }
}

/// Releases a physical handle whose mappings are gone; a failure is logged (the memory may
/// leak, but nothing maps it any more).
pub(crate) fn release_logged(d: &Driver, h: Handle, ptr: u64) {
    if let Err(e) = d.release(h) {
        tracing::error!(ptr = format_args!("{ptr:#x}"), error = %e, "cuMemRelease failed; physical memory may leak");
    }
}

/// Maps `h` at every place (the context of `dev` current); on a failure unmaps what it mapped.
fn map_places(
    d: &Driver,
    dev: &Device,
    h: Handle,
    places: &[Place<'_>],
) -> std::result::Result<(), DriverError> {
    for (i, pl) in places.iter().enumerate() {
        // SAFETY: the piece's reserved range, unmapped while it is paused.
        let r = unsafe {
            match pl.access {
                None => d.map(pl.ptr, pl.size, h, dev.ordinal),
                Some(access) => d.map_with_access(pl.ptr, pl.size, h, access),
            }
        };
        if let Err(e) = r {
            for pl in &places[..i] {
                // SAFETY: mapped just above, not yet visible to anyone.
                let _ = unsafe { d.unmap(pl.ptr, pl.size) };
            }
            return Err(e);
        }
    }
    Ok(())
}

/// Whether `e` is running out of device memory (also at the memory margin).
pub fn is_out_of_memory(e: &Error) -> bool {
    matches!(e, Error::Driver(d) if d.is_out_of_memory())
}

/// What a piece that ran out of device memory (or was skipped after another did, on the same
/// device) records; the caller turns these into one [`Error::ResumeOutOfMemory`].
pub fn oom_error() -> DriverError {
    DriverError {
        call: "cuMemCreate",
        code: crate::driver::sys::CUDA_ERROR_OUT_OF_MEMORY,
    }
}
