//! The `nccl` tag: pause releases NCCL's device memory behind its virtual handles, in this
//! process and, together with the peers, the references between processes; resume rebuilds it
//! at the same addresses.
//!
//! Pause, in every process of the group:
//! 1. (registry locked, local work only) synchronise the devices; queue the backup copies of
//!    the device memory NCCL created here, with an event every [`COPIES_PER_EVENT`] copies;
//!    while they run, unmap and release every import of a peer's buffer; then, batch by batch
//!    as the copies complete, unmap and release this process's own memory;
//! 2. tell each owner which of its buffers this process let go of (a thread per owner);
//! 3. meanwhile, wait until every importer of this process's exported buffers has let go (a
//!    dead process counts as let go). At the deadline, fail naming the importers that did not;
//!    an owner that did not take the notice is named in that error, or logged (the notice
//!    still reaches it when it runs again; this process's memory is released either way).
//!
//! One deadline, the start of the call plus `MEMSAVER_NCCL_TIMEOUT_MS`, bounds everything a
//! pause or a resume waits for: a stopped or hung peer costs the timeout once, not per peer
//! (`memsaver_ipc::deadline`: each peer on a thread of its own).
//!
//! Pause also lowers the kernel stack size NCCL's kernels made the driver raise, which frees the
//! local memory the driver keeps for it, but only as far as is safe for CUDA graphs and the
//! application's own limit (the rule is in [`crate::graphs`]); resume never lowers it.
//!
//! Resume: a thread per owner asks it for the new generation of the buffers imported here
//! while this process re-creates, maps and restores its own memory: first the buffers it
//! exports (the registry lock is dropped after them, so that the peers' requests are served
//! while the private buffers are restored), then the rest. Then the imports each owner served
//! are mapped at their old addresses, owner by owner: the imports of an owner that exited, is
//! stopped or did not serve them by the deadline stay paused, the error names it with what this
//! process imported of it, and a later resume maps them (or finds them freed by NCCL). What an
//! owner served but this process did not map (the driver failed, or the answer came after the
//! deadline) is reported released, so an owner never waits for an import that does not exist.
//! An owner serves a buffer only once its contents are restored. No lock is held while waiting
//! for a peer, so processes resuming (or pausing) together cannot deadlock.
//!
//! What is backed up: everything by default. `MEMSAVER_NCCL_BACKUP=headers` backs up only the
//! first [`HEADER_BYTES`] of the buffers NCCL shares with peers: NCCL lays those out as a
//! 4 KiB control block (`ncclSendMem`/`ncclRecvMem`: head and tail step counters, FIFOs)
//! followed by the LL/LL128/Simple staging buffers, whose contents live only within one
//! collective and whose flags are step numbers that stale or zeroed memory never matches.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use std::sync::Arc;

use memsaver_allocator::driver::Handle;
use memsaver_allocator::steps::{Memory, Op, Piece, Place, Steps, external_key, is_out_of_memory};
use memsaver_allocator::{
    Allocator, Backup as HostBackup, Device, DeviceUsage, Error, ExternalTag, Policy, Report,
    Result, Usage,
};
use memsaver_ipc::deadline::{Outcome, PerPeer, Progress, listed};
use memsaver_ipc::group;
use memsaver_ipc::protocol::Buffer;

use crate::graphs::{self, DEFAULT_STACK_SIZE};
use crate::peer::{self, TIMEOUT_SETTING};
use crate::registry::{self, Kind, Range, Registry};

const TAG: &str = "nccl";

/// Bytes at the start of a shared buffer that `MEMSAVER_NCCL_BACKUP=headers` keeps: NCCL's
/// control block is 4 KiB (`MEM_ALIGN`); the rest is margin.
pub(crate) const HEADER_BYTES: u64 = 64 << 10;

/// Resume restores private buffers in batches of this many handles, letting the threads that
/// serve peers in between.
const RESTORE_BATCH: usize = 64;

/// How much of NCCL's memory pause copies to host memory (`MEMSAVER_NCCL_BACKUP`).
pub(crate) use crate::options::NcclBackup as Backup;

impl Backup {
    /// The policy NCCL's buffers are backed up with: chosen as a region's is, pinned by
    /// default.
    fn policy(self) -> Policy {
        match self {
            Backup::Cpu | Backup::All | Backup::Headers => Policy::Cpu,
            Backup::Mmap => Policy::Mmap,
            Backup::Disk => Policy::Disk,
            Backup::Discard => Policy::Discard,
        }
    }
}

/// Bytes of `p` that pause backs up.
fn backup_len(backup: Backup, p: &registry::Physical) -> u64 {
    match backup {
        Backup::Discard => 0,
        Backup::Headers if p.exported => p.size.min(HEADER_BYTES),
        _ => p.size,
    }
}

/// The tag's name, as the engine's pieces carry it.
fn tag() -> Arc<str> {
    static TAG_ARC: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| TAG.into());
    TAG_ARC.clone()
}

/// The places of a handle's mappings, with the access NCCL granted (replayed on resume).
fn places(rs: &[Range]) -> Vec<Place<'_>> {
    rs.iter()
        .map(|(ptr, size, access)| Place {
            ptr: *ptr,
            size: *size as usize,
            access: Some(access),
        })
        .collect()
}

pub struct NcclTag {
    allocator: &'static Allocator,
}

impl NcclTag {
    pub fn new(allocator: &'static Allocator) -> Self {
        Self { allocator }
    }

    /// NCCL's kernels make the driver raise the context's per-thread stack size (to 1744 bytes
    /// with NCCL 2.28 and 2+ ranks) and keep local memory for it on every SM: 186 MiB on an
    /// H200. Pause lowers it on the devices NCCL uses, to the floor [`graphs`] gives (CUDA's
    /// default unless a live graph or the application needs more), which frees that memory;
    /// kernels that need more while paused grow it again, as the driver always does.
    fn lower_stacks(&self, devices: &[i32]) {
        let d = self.allocator.driver();
        // Held throughout: no graph is instantiated or limit set between reading the floor and
        // setting the limit.
        let mut g = graphs::lock();
        for &dev in devices {
            let (floor, why) = g.floor(dev);
            let r = self.allocator.device(dev).and_then(|device| {
                Ok(d.with_context(device.ctx, || {
                    let cur = d.stack_size()?;
                    let to = floor.min(cur);
                    if to < cur {
                        d.set_stack_size(to)?;
                    }
                    Ok((cur, to))
                })?)
            });
            let (cur, to) = match r {
                Ok(v) => v,
                Err(e) => {
                    tracing::warn!(
                        device = dev,
                        error = %e,
                        "memsaver: could not lower the kernel stack size NCCL raised; its local memory stays"
                    );
                    continue;
                }
            };
            if cur <= DEFAULT_STACK_SIZE {
                continue; // nothing was raised
            }
            let per_byte = d.stack_bytes_per_thread_byte(dev).unwrap_or_else(|e| {
                tracing::warn!(device = dev, error = %e, "memsaver: cannot size local memory");
                0
            });
            let kept = to.saturating_sub(DEFAULT_STACK_SIZE);
            let why = why.filter(|_| kept > 0);
            let p = g.paused.entry(dev).or_insert(graphs::StackPause {
                saved: cur,
                lowered_bytes: 0,
                kept_bytes: 0,
                why: None,
            });
            p.lowered_bytes += ((cur - to) as u64) * per_byte;
            p.kept_bytes = kept as u64 * per_byte;
            p.why = why;
            tracing::info!(
                device = dev,
                from = cur,
                to,
                lowered_bytes = (cur - to) as u64 * per_byte,
                kept_bytes = p.kept_bytes,
                reason = why.map(graphs::Keep::reason),
                "nccl pause: kernel stack size"
            );
        }
    }

    /// Resume: gives NCCL's kernels their stack size back now rather than at their next
    /// launch, never lowering it (a graph instantiated while paused may have needed more).
    fn restore_stacks(&self) {
        let d = self.allocator.driver();
        let mut g = graphs::lock();
        for (dev, p) in std::mem::take(&mut g.paused) {
            let r = self.allocator.device(dev).and_then(|device| {
                Ok(d.with_context(device.ctx, || {
                    if d.stack_size()? < p.saved {
                        d.set_stack_size(p.saved)?;
                    }
                    Ok(())
                })?)
            });
            if let Err(e) = r {
                tracing::warn!(
                    device = dev,
                    bytes = p.saved,
                    error = %e,
                    "memsaver: could not give NCCL's kernels their stack size back; the driver grows it again at their next launch"
                );
            }
        }
    }
}

/// The device whose context handles `vh` here: for an import, the device NCCL granted access
/// to (the owner's device may not even be visible in this process); else its location.
fn device_of(reg: &Registry, ranges: &HashMap<u64, Vec<Range>>, vh: u64) -> i32 {
    let p = &reg.physicals[&vh];
    if p.kind == Kind::Imported
        && let Some(d) = ranges
            .get(&vh)
            .into_iter()
            .flatten()
            .flat_map(|(_, _, access)| access.iter())
            .find(|a| {
                a.location.type_ == memsaver_allocator::driver::sys::CU_MEM_LOCATION_TYPE_DEVICE
            })
    {
        return d.location.id;
    }
    p.device()
}

/// `vhs` grouped by the device whose context handles them, in handle order.
fn by_device(
    reg: &Registry,
    ranges: &HashMap<u64, Vec<Range>>,
    vhs: impl IntoIterator<Item = u64>,
) -> BTreeMap<i32, Vec<u64>> {
    let mut out = BTreeMap::<i32, Vec<u64>>::new();
    for vh in vhs {
        out.entry(device_of(reg, ranges, vh)).or_default().push(vh);
    }
    for v in out.values_mut() {
        v.sort_unstable();
    }
    out
}

/// Resident, mapped handles pause may release: (own device memory, imports).
fn releasable(reg: &Registry, ranges: &HashMap<u64, Vec<Range>>) -> (Vec<u64>, Vec<u64>) {
    let (mut own, mut imports) = (Vec::new(), Vec::new());
    for (vh, p) in &reg.physicals {
        if p.real().is_none() || p.pausable().is_err() || !ranges.contains_key(vh) {
            continue;
        }
        if p.kind == Kind::Imported {
            imports.push(*vh)
        } else {
            own.push(*vh)
        }
    }
    (own, imports)
}

fn report(allocations: usize, bytes: u64, copied_bytes: u64, start: Instant) -> Report {
    Report {
        tags: vec![TAG.into()],
        allocations,
        bytes,
        copied_bytes,
        elapsed: start.elapsed(),
    }
}

fn peer_error(message: String) -> Error {
    Error::Peer {
        tag: TAG.into(),
        message,
    }
}

/// Released imports to tell their owners about: owner -> the items naming them there.
type Notices = BTreeMap<u32, Vec<Buffer>>;

/// What resume step 1 restored.
#[derive(Default)]
struct Restored {
    handles: usize,
    bytes: u64,
    copied: u64,
}

/// What pause step 1 did.
#[derive(Default)]
struct Released {
    /// Devices with NCCL memory released.
    devices: Vec<i32>,
    allocations: usize,
    /// Bytes of this process's own memory released.
    bytes: u64,
    copied: u64,
    notices: Notices,
    /// What of each owner's memory the notices release.
    released_imports: BTreeMap<u32, Holding>,
}

/// Unmaps every mapping of `vh` on `dev` and releases its driver handle (the device is idle
/// and any backup of it complete): `Resident` → `Paused`, `Mapped` → `Released`.
fn release_one(
    steps: &Steps<'_>,
    dev: &Device,
    reg: &mut Registry,
    ranges: &HashMap<u64, Vec<Range>>,
    vh: u64,
    out: &mut Released,
) -> Result<()> {
    let rs = ranges.get(&vh).map_or(&[][..], Vec::as_slice);
    // SAFETY: NCCL's mappings; the device is idle and the backup complete.
    unsafe { steps.unmap(dev, &places(rs)) }?;
    let p = reg
        .physicals
        .get_mut(&vh)
        .expect("releasable handles are known");
    let generation = p.mapped_generation();
    let real = p.release()?;
    steps.release(Handle(real), rs.first().map_or(0, |r| r.0));
    out.allocations += 1;
    match (p.source, generation) {
        (Some(s), Some(g)) => {
            out.notices.entry(s.owner).or_default().push(s.item(g));
            out.released_imports.entry(s.owner).or_default().add(p);
        }
        _ => out.bytes += p.size,
    }
    Ok(())
}

impl NcclTag {
    /// Pause step 1, on the engine's steps: per device, synchronise, queue the backup copy of
    /// each buffer this process owns (its piece: key, policy, the bytes `backup` says), let go
    /// of the imports while the copies run, then release each own buffer once its copy is
    /// done. A buffer that cannot be released stays resident without a backup; the error is
    /// returned after every device is done.
    fn release_local(&self, backup: Backup) -> Result<Released> {
        let a = self.allocator;
        let mut steps = a.steps(Op::Pause);
        let mut reg = registry::lock();
        crate::guard::set_paused(true);
        let ranges = reg.ranges_by_handle();
        let (own, imports) = releasable(&reg, &ranges);
        let own = by_device(&reg, &ranges, own);
        let imports = by_device(&reg, &ranges, imports);
        let mut out = Released::default();
        let devices: std::collections::BTreeSet<i32> =
            own.keys().chain(imports.keys()).copied().collect();
        out.devices = devices.iter().copied().collect();
        let largest_disk = own
            .values()
            .flatten()
            .filter(|_| backup == Backup::Disk)
            .map(|vh| reg.physicals[vh].size as usize)
            .max()
            .unwrap_or(0);
        steps.expect_disk(largest_disk);
        let mut first_error = None;
        for dev in devices {
            let device = a.device(dev)?;
            let own = own.get(&dev).map_or(&[][..], Vec::as_slice);
            let imports = imports.get(&dev).map_or(&[][..], Vec::as_slice);
            // NCCL's kernels (here) may still use the memory.
            let mut failed = steps.synchronize(&device).err();
            // Back up what this process owns (imports are backed up by their owners).
            let mut pieces: Vec<(u64, Piece)> = Vec::with_capacity(own.len());
            for vh in own {
                let p = reg.physicals.get_mut(vh).expect("listed above");
                let (ptr, size, _) = ranges[vh][0];
                let len = backup_len(backup, p).min(size) as usize;
                let mut piece = Piece::new(
                    external_key(*vh),
                    tag(),
                    device.clone(),
                    backup.policy(),
                    ptr,
                    len,
                    p.backup.take(),
                );
                if failed.is_none() {
                    failed = steps.copy_out(&mut piece).err();
                }
                pieces.push((*vh, piece));
            }
            // Imports need no copy: let go of them while the copies run.
            for vh in imports {
                if failed.is_none() {
                    failed = release_one(&steps, &device, &mut reg, &ranges, *vh, &mut out).err();
                }
            }
            for (vh, mut piece) in pieces {
                if failed.is_none() {
                    let r = steps.copied(&mut piece).and_then(|()| {
                        release_one(&steps, &device, &mut reg, &ranges, vh, &mut out)
                    });
                    match r {
                        Ok(()) => {
                            out.copied += piece.backup.as_ref().map_or(0, |_| piece.len as u64);
                            let p = reg.physicals.get_mut(&vh).expect("listed above");
                            p.backup_len = piece.len as u64;
                            p.backup = piece.backup;
                            continue;
                        }
                        Err(e) => failed = Some(e),
                    }
                }
                // Stays resident: its copy may still run, and its backup is not a pause's.
                steps.keep(&mut piece);
            }
            if let Some(e) = failed {
                first_error.get_or_insert(e);
            }
        }
        match first_error {
            None => Ok(out),
            Some(e) => {
                // Nothing released: NCCL's memory is all there, so NCCL may run. Something
                // released: the tag is paused (a resume restores what was released).
                if out.allocations == 0 {
                    crate::guard::set_paused(false);
                }
                Err(e)
            }
        }
    }

    /// Resume: re-creates and restores this process's own claimed handles `vhs` (all on
    /// `device`) on the engine's steps, with the memory margin, recording them resident once
    /// their contents are back, and counts them into `total`. Backups stay with retention on
    /// and are handed back in `released` with it off. On a failure, those restored before it
    /// stay restored (and counted); the others stay claimed for the caller to unclaim.
    fn restore(
        &self,
        steps: &mut Steps<'_>,
        reg: &mut Registry,
        device: i32,
        vhs: &[u64],
        total: &mut Restored,
        released: &mut Vec<HostBackup>,
    ) -> Result<()> {
        let dev = self.allocator.device(device)?;
        let ranges = reg.ranges_by_handle();
        let mut made: Vec<(u64, Handle, Piece)> = Vec::new();
        let mut r = Ok(());
        for vh in vhs {
            let p = reg.physicals.get_mut(vh).expect("listed by the caller");
            let rs = ranges.get(vh).map_or(&[][..], Vec::as_slice);
            let pl = places(rs);
            let piece = Piece::new(
                external_key(*vh),
                tag(),
                dev.clone(),
                crate::options::get().nccl_backup.policy(),
                rs.first().map_or(0, |r| r.0),
                p.backup_len as usize,
                p.backup.take(),
            );
            let mapped = steps
                .map_fresh(&dev, Memory::Like(&p.prop), p.size as usize, &pl, TAG)
                .and_then(|h| match steps.copy_in(&piece) {
                    Ok(()) => Ok(h),
                    Err(e) => {
                        let _ = steps.finish(&dev);
                        // SAFETY: mapped just above; the stream was synchronised.
                        let _ = unsafe { steps.unmap(&dev, &pl) };
                        steps.release(h, piece.ptr);
                        Err(e)
                    }
                });
            match mapped {
                Ok(h) => made.push((*vh, h, piece)),
                Err(e) => {
                    p.backup = piece.backup;
                    r = Err(e);
                    break;
                }
            }
        }
        // Whatever happened, the queued copies finish before anyone may use the memory.
        let r = steps.finish(&dev).and(r);
        for (vh, h, piece) in made {
            let p = reg.physicals.get_mut(&vh).expect("listed by the caller");
            p.resumed(h.0)?;
            total.handles += 1;
            total.bytes += p.size;
            if piece.backup.is_some() {
                total.copied += p.backup_len;
            }
            if steps.plan.retain {
                p.backup = piece.backup;
            } else {
                released.extend(piece.backup);
                p.backup_len = 0;
            }
        }
        match r {
            Ok(()) => Ok(()),
            Err(e) if is_out_of_memory(&e) => {
                let (still_paused, bytes_still_paused) = reg
                    .physicals
                    .values()
                    .filter(|p| p.is_paused_own())
                    .fold((0, 0), |(n, b), p| (n + 1, b + p.size));
                Err(Error::ResumeOutOfMemory {
                    device,
                    tags: vec![TAG.into()],
                    resumed: total.handles,
                    still_paused,
                    bytes_still_paused,
                    margin: steps.plan.margin,
                })
            }
            Err(e) => Err(e),
        }
    }

    /// Resume step 1: this process's own memory, exported buffers first. Claims every paused
    /// handle (`Resuming`) first, so that the handles still to restore while the lock is
    /// handed over are marked; what could not be restored goes back to `Paused`.
    fn restore_local(&self) -> Result<Restored> {
        let mut steps = self.allocator.steps(Op::Resume);
        let plan = {
            let mut reg = registry::lock();
            let ranges = reg.ranges_by_handle();
            let claimed: Vec<u64> = reg
                .physicals
                .iter_mut()
                .filter_map(|(vh, p)| p.claim().ok().map(|()| *vh))
                .collect();
            let largest_disk = claimed
                .iter()
                .filter_map(|vh| reg.physicals[vh].backup.as_ref())
                .filter(|b| b.kind() == memsaver_allocator::BackupKind::Disk)
                .map(|b| b.len())
                .max()
                .unwrap_or(0);
            steps.expect_disk(largest_disk);
            let exported = |want: bool| {
                claimed
                    .iter()
                    .copied()
                    .filter(|vh| reg.physicals[vh].exported == want)
                    .collect::<Vec<_>>()
            };
            [
                by_device(&reg, &ranges, exported(true)),
                by_device(&reg, &ranges, exported(false)),
            ]
        };
        let mut total = Restored::default();
        let mut released = Vec::new();
        // The exported buffers in one go; then the private ones in batches, handing the lock
        // over between batches (fairly, to a waiting thread first), so that peers' requests
        // for the exported buffers are answered while the private ones are restored.
        let [exported, private] = plan;
        let private = private.into_iter().flat_map(|(dev, vhs)| {
            vhs.chunks(RESTORE_BATCH)
                .map(|c| (dev, c.to_vec()))
                .collect::<Vec<_>>()
        });
        let mut r = Ok(());
        for (device, vhs) in exported.into_iter().chain(private) {
            let mut reg = registry::lock();
            // NCCL may have freed some meanwhile.
            let vhs: Vec<u64> = vhs
                .into_iter()
                .filter(|vh| {
                    reg.physicals
                        .get(vh)
                        .is_some_and(|p| p.state() == registry::State::Resuming)
                })
                .collect();
            r = self.restore(
                &mut steps,
                &mut reg,
                device,
                &vhs,
                &mut total,
                &mut released,
            );
            parking_lot::MappedMutexGuard::unlock_fair(reg);
            if r.is_err() {
                break;
            }
        }
        let mut reg = registry::lock();
        for p in reg.physicals.values_mut() {
            let _ = p.unclaim();
        }
        drop(reg);
        // Backups retention no longer keeps (outside the lock: freeing pinned memory is a
        // driver call).
        drop(released);
        r.map(|()| total)
    }
}

/// What this process holds of a peer's memory, or a peer of this process's: for messages.
#[derive(Default)]
struct Holding {
    buffers: usize,
    bytes: u64,
    devices: std::collections::BTreeSet<i32>,
}

impl Holding {
    fn add(&mut self, p: &registry::Physical) {
        self.buffers += 1;
        self.bytes += p.size;
        self.devices.insert(p.device());
    }
}

impl std::fmt::Display for Holding {
    /// `2 buffers (8 MiB) on device 0`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (n, s) = (self.buffers, if self.buffers == 1 { "" } else { "s" });
        let bytes = if self.bytes.is_multiple_of(1 << 20) {
            format!("{} MiB", self.bytes >> 20)
        } else {
            format!("{} bytes", self.bytes)
        };
        let devs: Vec<String> = self.devices.iter().map(i32::to_string).collect();
        let d = if devs.len() == 1 { "device" } else { "devices" };
        write!(f, "{n} buffer{s} ({bytes}) on {d} {}", devs.join(", "))
    }
}

/// Why a peer did not do its part, as a user can act on it.
enum Fault {
    /// It exited (or was killed).
    Exited,
    /// It did not answer by the deadline; what it did not do.
    NoAnswer(&'static str),
    /// It still holds imports of this process's paused memory at the deadline.
    StillHolds,
    /// It answered with an error, or could not be reached.
    Failed(String),
}

/// One line of a Peer error: which process, what it holds (`holds`, a clause that follows
/// the process's name), what went wrong, what to do.
fn describe(pid: u32, group: i64, holds: &str, fault: &Fault, timeout: Duration) -> String {
    let who = format!("process {pid} (group {group}){holds}");
    let ms = timeout.as_millis();
    // The scheduler state: `R`, `S`, `T` (stopped), `Z`, ...
    let state = memsaver_allocator::process::stat(&pid.to_string()).map(|(s, _)| s);
    let (stopped, zombie) = (
        matches!(state, Some('T' | 't')),
        matches!(state, Some('Z' | 'X')),
    );
    match fault {
        Fault::Exited => format!(
            "{who}: the process exited: restart the job (or destroy the communicators it was in)"
        ),
        _ if zombie => format!(
            "{who}: the process exited (a zombie its parent has not reaped): restart the job"
        ),
        _ if stopped => format!(
            "{who}: it is stopped (SIGSTOP or a debugger) and does not answer: continue it \
             (kill -CONT {pid}), then retry"
        ),
        Fault::NoAnswer(what) => format!(
            "{who}: it {what} within {ms} ms: is it stopped or hung? raise \
             MEMSAVER_NCCL_TIMEOUT_MS if it is slow"
        ),
        Fault::StillHolds => format!(
            "{who} and did not let go within {ms} ms: every process of the group must pause \
             'nccl' too; is it stopped or hung? raise MEMSAVER_NCCL_TIMEOUT_MS if it is slow"
        ),
        Fault::Failed(e) => format!(
            "{who}: {e}: is it stopped or hung? raise MEMSAVER_NCCL_TIMEOUT_MS if it is slow"
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// The steps of pause and resume that involve peers.
// ---------------------------------------------------------------------------------------------

/// Pause step 2 (threads): tells each owner which of its buffers this process released.
fn notify_owners(
    group: i64,
    notices: Notices,
    deadline: Instant,
) -> PerPeer<std::result::Result<(), String>> {
    PerPeer::start(
        "nccl-notify",
        TIMEOUT_SETTING,
        notices,
        deadline,
        move |owner, items: Vec<Buffer>| peer::notify_released(group, owner, &items),
        // Delivered late, the notice still does its job.
        |_, _| {},
    )
}

/// Pause step 2, collected: the owners that are alive and did not take the notice by the
/// deadline (a dead owner has nothing left to release).
fn unacknowledged(
    outcomes: BTreeMap<u32, Outcome<std::result::Result<(), String>>>,
) -> BTreeMap<u32, Fault> {
    outcomes
        .into_iter()
        .filter_map(|(owner, o)| {
            let fault = match o {
                Outcome::Done(Ok(())) => return None,
                Outcome::Done(Err(e)) | Outcome::NotStarted(e) => Fault::Failed(e),
                Outcome::NoAnswer => {
                    Fault::NoAnswer("did not take the notice that its buffers were released")
                }
            };
            peer::alive(owner).then_some((owner, fault))
        })
        .collect()
}

/// Pause step 3: waits until every importer of this process's paused exported buffers (also
/// those paused by an earlier, failed call) has let go, or `deadline`. Returns what the
/// processes that did not still hold (a dead process has let go of everything).
fn wait_importers(group: i64, deadline: Instant) -> BTreeMap<u32, Holding> {
    let mut progress = Progress::new(deadline, TIMEOUT_SETTING);
    loop {
        let holders = {
            let mut reg = registry::lock();
            let mut paused: Vec<&mut registry::Physical> = reg
                .physicals
                .values_mut()
                .filter(|p| p.exported && p.is_paused_own())
                .collect();
            // Each importer asked once.
            let mut pids: Vec<u32> = paused
                .iter()
                .flat_map(|p| p.importers.iter().copied())
                .collect();
            pids.sort_unstable();
            pids.dedup();
            pids.retain(|pid| peer::alive(*pid));
            let mut holders = BTreeMap::<u32, Holding>::new();
            for p in &mut paused {
                p.importers.retain(|pid| pids.binary_search(pid).is_ok());
                for pid in &p.importers {
                    holders.entry(*pid).or_default().add(p);
                }
            }
            holders
        };
        if holders.is_empty() || Instant::now() >= deadline {
            return holders;
        }
        progress.say(|| {
            let who: Vec<String> = holders
                .iter()
                .map(|(pid, h)| format!("process {pid} (group {group}) holds {h}"))
                .collect();
            format!(
                "pause('nccl') waits for peers to release their imports of this process's memory: {}",
                listed(&who)
            )
        });
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// `, whose imports of <holding> this process released`, for an owner told so.
fn released_clause(h: Option<&Holding>) -> String {
    h.map_or_else(String::new, |h| {
        format!(", whose imports of {h} this process released")
    })
}

/// The error of a pause whose importers did not all let go.
fn pause_error(
    group: i64,
    holders: &BTreeMap<u32, Holding>,
    unacked: &BTreeMap<u32, Fault>,
    released_imports: &BTreeMap<u32, Holding>,
) -> Error {
    let t = peer::timeout();
    let mut lines: Vec<String> = holders
        .iter()
        .map(|(pid, h)| {
            let holds = format!(" holds imports of {h} of this process");
            describe(*pid, group, &holds, &Fault::StillHolds, t)
        })
        .collect();
    // An owner that also holds imports of ours is named once, above.
    lines.extend(
        unacked
            .iter()
            .filter(|(pid, _)| !holders.contains_key(pid))
            .map(|(pid, f)| {
                describe(
                    *pid,
                    group,
                    &released_clause(released_imports.get(pid)),
                    f,
                    t,
                )
            }),
    );
    peer_error(format!(
        "pause released this process's memory, but {} process(es) still hold imports of it, \
         so that device memory is not free yet: {}",
        holders.len(),
        lines.join("; ")
    ))
}

/// An import to fetch at resume: its handle here, and the item asking its owner for it.
#[derive(Clone, Copy)]
struct Wanted {
    vh: u64,
    owner: Buffer,
}

/// An import's new generation, served by its owner: its handle here, the item naming it there
/// (with the generation served), and the fd.
struct Fetched {
    vh: u64,
    owner: Buffer,
    fd: OwnedFd,
}

type FetchResult = std::result::Result<Vec<Fetched>, String>;

/// The paused imports, per owner: the generation after the one each mapped.
fn imports_to_fetch() -> BTreeMap<u32, Vec<Wanted>> {
    let mut fetch = BTreeMap::<u32, Vec<Wanted>>::new();
    for (vh, p) in &registry::lock().physicals {
        if let (Some(g), Some(s)) = (p.released_generation(), p.source) {
            fetch.entry(s.owner).or_default().push(Wanted {
                vh: *vh,
                owner: s.item(g + 1),
            });
        }
    }
    fetch
}

/// Resume step 2 (threads): asks each owner for the new generation of its buffers. An owner
/// registers this process as an importer of what it serves, so what is not mapped in the end
/// is reported released: on a failure here (the owner may have served part of it) and when
/// the answer comes after the deadline.
fn fetch_imports(
    group: i64,
    fetch: BTreeMap<u32, Vec<Wanted>>,
    deadline: Instant,
) -> PerPeer<FetchResult> {
    PerPeer::start(
        "nccl-fetch",
        TIMEOUT_SETTING,
        fetch,
        deadline,
        move |owner, wants: Vec<Wanted>| {
            let asks: Vec<Buffer> = wants.iter().map(|w| w.owner).collect();
            match peer::request_fds(group, owner, &asks) {
                Ok(fds) => Ok(wants
                    .into_iter()
                    .zip(fds)
                    .map(|(w, (fd, generation))| Fetched {
                        vh: w.vh,
                        owner: Buffer {
                            generation,
                            ..w.owner
                        },
                        fd,
                    })
                    .collect()),
                Err(e) => {
                    if peer::alive(owner) {
                        let _ = peer::notify_released(group, owner, &asks);
                    }
                    Err(e)
                }
            }
        },
        move |owner, late: FetchResult| {
            if let Ok(fetched) = late {
                let items: Vec<Buffer> = fetched.iter().map(|f| f.owner).collect();
                let _ = peer::notify_released(group, owner, &items);
            }
        },
    )
}

/// What resume step 3 did.
#[derive(Default)]
struct Imported {
    /// Imports mapped.
    mapped: usize,
    /// Owners whose imports stay paused, what this process imported of them, and why.
    faults: BTreeMap<u32, (Holding, Fault)>,
    /// The first import that was served but could not be mapped.
    map_error: Option<Error>,
}

impl NcclTag {
    /// Resume step 3: maps the new generations served by each owner where the imports were.
    /// The imports of an owner that did not serve them stay paused (a later resume fetches
    /// them again); a served import that cannot be mapped is reported released to its owner,
    /// so that the owner's next pause does not wait for it.
    fn map_imports(&self, group: i64, fetched: BTreeMap<u32, Outcome<FetchResult>>) -> Imported {
        let d = self.allocator.driver();
        let steps = self.allocator.steps(Op::Resume);
        let mut out = Imported::default();
        let mut unused = Notices::new();
        let mut reg = registry::lock();
        let ranges = reg.ranges_by_handle();
        for (owner, outcome) in fetched {
            let served = match outcome {
                Outcome::Done(Ok(served)) => served,
                Outcome::Done(Err(e)) | Outcome::NotStarted(e) => {
                    let fault = if peer::alive(owner) {
                        Fault::Failed(e)
                    } else {
                        Fault::Exited
                    };
                    out.faults.insert(owner, (Holding::default(), fault));
                    continue;
                }
                Outcome::NoAnswer => {
                    let fault = if peer::alive(owner) {
                        Fault::NoAnswer(
                            "did not serve its buffers (every process of the group must resume 'nccl')",
                        )
                    } else {
                        Fault::Exited
                    };
                    out.faults.insert(owner, (Holding::default(), fault));
                    continue;
                }
            };
            for f in served {
                let Some(p) = reg.physicals.get(&f.vh) else {
                    // NCCL freed it meanwhile.
                    unused.entry(owner).or_default().push(f.owner);
                    continue;
                };
                if p.released_generation().is_none() {
                    continue;
                }
                let rs = ranges.get(&f.vh).map_or(&[][..], Vec::as_slice);
                let r = self
                    .allocator
                    .device(device_of(&reg, &ranges, f.vh))
                    .and_then(|dev| {
                        let fd = std::os::fd::AsRawFd::as_raw_fd(&f.fd);
                        let h = d.with_context(dev.ctx, || d.import_fd(fd))?;
                        steps.map_handle(&dev, h, &places(rs)).inspect_err(|_| {
                            let _ = d.release(h);
                        })?;
                        Ok(h)
                    });
                match r {
                    Ok(h) => {
                        // A released import, checked above under the same lock.
                        let p = reg.physicals.get_mut(&f.vh).expect("checked above");
                        match p.remapped(h.0, f.owner.generation) {
                            Ok(()) => out.mapped += 1,
                            Err(e) => {
                                out.map_error.get_or_insert(e.into());
                            }
                        }
                    }
                    Err(e) => {
                        unused.entry(owner).or_default().push(f.owner);
                        out.map_error.get_or_insert(e);
                    }
                }
            }
        }
        // What this process imported of the owners at fault, for the message.
        for p in reg.physicals.values() {
            if let (Some(_), Some(s)) = (p.released_generation(), p.source)
                && let Some((h, _)) = out.faults.get_mut(&s.owner)
            {
                h.add(p);
            }
        }
        drop(reg);
        // The owners that just served this process answer; wait for them within the deadline
        // of this resume, at least a moment.
        let deadline = Instant::now() + Duration::from_millis(200);
        let _ = notify_owners(group, unused, deadline).finish(
            deadline,
            "resume('nccl') tells owners which imports it did not use",
            group,
        );
        out
    }
}

/// The error of a resume that left imports paused.
fn resume_error(group: i64, imported: &Imported) -> Error {
    let t = peer::timeout();
    let lines: Vec<String> = imported
        .faults
        .iter()
        .map(|(pid, (h, f))| {
            let holds = format!(", whose {h} this process imported");
            describe(*pid, group, &holds, f, t)
        })
        .collect();
    let unmapped = imported.map_error.as_ref().map_or_else(String::new, |e| {
        format!("; besides, an import that was served could not be mapped: {e}")
    });
    peer_error(format!(
        "resume restored this process's memory and mapped {} import(s), but the imports of \
         {} owner(s) stay paused (a later resume maps them once their owner serves them, or \
         once NCCL has freed them): {}{unmapped}",
        imported.mapped,
        imported.faults.len(),
        lines.join("; ")
    ))
}

impl ExternalTag for NcclTag {
    fn pause(&self) -> Result<Report> {
        let start = Instant::now();
        // One deadline for everything this pause waits for.
        let deadline = start + peer::timeout();
        // Also checked by every way in (`crate::allocator`); the NCCL options are this
        // pause's own.
        memsaver_allocator::check_options()?;
        // Buffers exported as plain fds cannot be released: say so instead of reporting a
        // pause that freed nothing of them (nothing is changed).
        if let Some(why) = crate::vmm::fallback_reason() {
            return Err(peer_error(why));
        }
        let backup = crate::options::get().nccl_backup;
        let mut released = self.release_local(backup)?;
        self.lower_stacks(&released.devices);
        let local_ms = start.elapsed().as_secs_f64() * 1e3;
        let group = group::id();
        let notifying = notify_owners(group, std::mem::take(&mut released.notices), deadline);
        let holders = wait_importers(group, deadline);
        let unacked = unacknowledged(notifying.finish(
            deadline,
            "pause('nccl') waits for the owners of its imports to acknowledge their release",
            group,
        ));
        if !holders.is_empty() {
            return Err(pause_error(
                group,
                &holders,
                &unacked,
                &released.released_imports,
            ));
        }
        for (owner, fault) in &unacked {
            let holds = released
                .released_imports
                .get(owner)
                .map_or_else(String::new, |h| {
                    format!(", whose imports of {h} this process released")
                });
            tracing::warn!(
                "memsaver: nccl pause: {}",
                describe(*owner, group, &holds, fault, peer::timeout())
            );
        }
        tracing::info!(
            release_local_ms = local_ms,
            total_ms = start.elapsed().as_secs_f64() * 1e3,
            allocations = released.allocations,
            bytes = released.bytes,
            copied_bytes = released.copied,
            ?backup,
            "nccl pause"
        );
        Ok(report(
            released.allocations,
            released.bytes,
            released.copied,
            start,
        ))
    }

    fn resume(&self) -> Result<Report> {
        let start = Instant::now();
        // One deadline for everything this resume waits for.
        let deadline = start + peer::timeout();
        let group = group::id();
        let fetching = fetch_imports(group, imports_to_fetch(), deadline);
        let local = self.restore_local();
        let restored_ms = start.elapsed().as_secs_f64() * 1e3;
        let fetched = fetching.finish(
            deadline,
            "resume('nccl') waits for the owners of its imports to serve them (they must resume 'nccl' too)",
            group,
        );
        let fetched_ms = start.elapsed().as_secs_f64() * 1e3;
        // The peers' memory is mapped back even if ours could not be (it is on their devices).
        let imported = self.map_imports(group, fetched);
        let own = local?;
        if !imported.faults.is_empty() {
            return Err(resume_error(group, &imported));
        }
        if let Some(e) = imported.map_error {
            return Err(e);
        }
        let n = own.handles + imported.mapped;
        let (bytes, copied) = (own.bytes, own.copied);
        self.restore_stacks();
        crate::guard::set_paused(false);
        tracing::info!(
            restore_local_ms = restored_ms,
            fetch_wait_ms = fetched_ms - restored_ms,
            map_imports_ms = start.elapsed().as_secs_f64() * 1e3 - fetched_ms,
            allocations = n,
            bytes,
            "nccl resume"
        );
        Ok(report(n, bytes, copied, start))
    }

    fn paused(&self) -> bool {
        crate::guard::is_paused()
    }

    fn usage(&self) -> Vec<DeviceUsage> {
        let reg = registry::lock();
        let mut out: Vec<DeviceUsage> = Vec::new();
        for (vh, p) in reg.physicals.iter().filter(|(_, p)| p.kind == Kind::Device) {
            let dev = p.device();
            let i = match out.iter().position(|u| u.device == dev) {
                Some(i) => i,
                None => {
                    out.push(DeviceUsage {
                        device: dev,
                        usage: Usage::default(),
                    });
                    out.len() - 1
                }
            };
            let resident = if p.real().is_some() { p.size } else { 0 };
            out[i].usage.add(
                p.size as usize,
                resident as usize,
                p.backup.as_ref().map(|b| (b.kind(), b.len())),
                self.allocator.prepared_bytes(external_key(*vh)) as usize,
            );
        }
        out.sort_by_key(|u| u.device);
        out
    }
}
