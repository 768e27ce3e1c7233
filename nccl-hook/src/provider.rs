//! The `nccl` tag: pause releases NCCL's device memory behind its virtual handles, in this
//! process and, together with the peers, the references between processes; resume rebuilds it
//! at the same addresses.
//!
//! Pause, in every process of the group:
//! 1. (registry locked, local work only) synchronise the devices; queue the backup copies of
//!    the device memory NCCL created here, with an event every [`COPIES_PER_EVENT`] copies;
//!    while they run, unmap and release every import of a peer's buffer; then, batch by batch
//!    as the copies complete, unmap and release this process's own memory;
//! 2. tell each owner which of its buffers this process let go of;
//! 3. wait until every importer of this process's exported buffers has let go, or fail after
//!    the timeout naming the processes that did not (a dead process counts as let go).
//!
//! Pause also lowers the kernel stack size NCCL's kernels made the driver raise, which frees the
//! local memory the driver keeps for it, but only as far as is safe for CUDA graphs and the
//! application's own limit (the rule is in [`crate::graphs`]); resume never lowers it.
//!
//! Resume: a thread asks each owner for the new generation of the buffers imported here while
//! this process re-creates, maps and restores its own memory: first the buffers it exports
//! (the registry lock is dropped after them, so that the peers' requests are served while the
//! private buffers are restored), then the rest. Then the imports are mapped at their old
//! addresses. An owner serves a buffer only once its contents are restored. No lock is held
//! while waiting for a peer, so processes resuming (or pausing) together cannot deadlock.
//!
//! What is backed up: everything by default. `MEMSAVER_NCCL_BACKUP=headers` backs up only the
//! first [`HEADER_BYTES`] of the buffers NCCL shares with peers: NCCL lays those out as a
//! 4 KiB control block (`ncclSendMem`/`ncclRecvMem`: head and tail step counters, FIFOs)
//! followed by the LL/LL128/Simple staging buffers, whose contents live only within one
//! collective and whose flags are step numbers that stale or zeroed memory never matches.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use memsaver_allocator::backup::HostBuffer;
use memsaver_allocator::driver::{DriverError, Event, Handle};
use memsaver_allocator::{Allocator, DeviceUsage, Error, ExternalTag, Report, Result, Usage};

use crate::graphs::{self, DEFAULT_STACK_SIZE};
use crate::peer;
use crate::registry::{self, Kind, Range, Registry};

const TAG: &str = "nccl";

/// Bytes at the start of a shared buffer that `MEMSAVER_NCCL_BACKUP=headers` keeps: NCCL's
/// control block is 4 KiB (`MEM_ALIGN`); the rest is margin.
pub(crate) const HEADER_BYTES: u64 = 64 << 10;

/// Pause releases own memory in batches of this many handles, each behind an event that
/// says its backup copies are done, so the copies overlap the unmapping.
const COPIES_PER_EVENT: usize = 32;

/// Resume restores private buffers in batches of this many handles, letting the threads that
/// serve peers in between.
const RESTORE_BATCH: usize = 64;

/// How much of NCCL's memory pause copies to host memory (`MEMSAVER_NCCL_BACKUP`).
pub(crate) use memsaver_allocator::options::NcclBackup as Backup;

/// Bytes of `p` that pause backs up.
fn backup_len(backup: Backup, p: &registry::Physical) -> u64 {
    match backup {
        Backup::Headers if p.exported => p.size.min(HEADER_BYTES),
        _ => p.size,
    }
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
            let r = self.allocator.copy_stream(dev).and_then(|(ctx, _)| {
                Ok(d.with_context(ctx, || {
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
            let r = self.allocator.copy_stream(dev).and_then(|(ctx, _)| {
                Ok(d.with_context(ctx, || {
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
        if p.real.is_none() || p.pausable().is_err() || !ranges.contains_key(vh) {
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

/// Released imports to tell their owners about: owner -> [(owner's handle, generation)].
type Notices = BTreeMap<u32, Vec<(u64, u64)>>;

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
}

/// Unmaps every mapping of `vh` and releases its driver handle (the device is idle and any
/// backup of it complete).
fn release_one(
    d: &memsaver_allocator::driver::Driver,
    reg: &mut Registry,
    ranges: &HashMap<u64, Vec<Range>>,
    vh: u64,
    out: &mut Released,
) -> std::result::Result<(), DriverError> {
    for (ptr, size, _) in ranges.get(&vh).into_iter().flatten() {
        // SAFETY: NCCL's mapping; the device is idle and the backup complete.
        unsafe { d.unmap(*ptr, *size as usize) }?;
    }
    let p = reg
        .physicals
        .get_mut(&vh)
        .expect("releasable handles are known");
    d.release(Handle(
        p.real.take().expect("releasable handles are resident"),
    ))?;
    out.allocations += 1;
    match (p.kind, p.source) {
        (Kind::Imported, Some(s)) => out
            .notices
            .entry(s.owner)
            .or_default()
            .push((s.vh, s.generation)),
        _ => out.bytes += p.size,
    }
    Ok(())
}

/// Maps `h` at every range of a paused handle, with NCCL's access. On a failure, undoes what
/// it did and releases `h`.
fn map_all(
    d: &memsaver_allocator::driver::Driver,
    h: Handle,
    ranges: &[Range],
) -> std::result::Result<Handle, DriverError> {
    for (i, (ptr, size, access)) in ranges.iter().enumerate() {
        // SAFETY: NCCL's reserved range, unmapped since the pause.
        if let Err(e) = unsafe { d.map_with_access(*ptr, *size as usize, h, access) } {
            for (ptr, size, _) in &ranges[..i] {
                // SAFETY: mapped just above, not yet visible to NCCL.
                let _ = unsafe { d.unmap(*ptr, *size as usize) };
            }
            let _ = d.release(h);
            return Err(e);
        }
    }
    Ok(h)
}

/// Creates new memory for paused own handle `vh`, maps it at every recorded range and queues
/// the copy of its backup on `stream`. The handle is recorded resident by the caller once the
/// copies are done.
fn recreate_one(
    d: &memsaver_allocator::driver::Driver,
    p: &registry::Physical,
    ranges: &[Range],
    stream: memsaver_allocator::driver::Stream,
) -> std::result::Result<Handle, DriverError> {
    let h = map_all(d, d.create_with(&p.prop, p.size as usize)?, ranges)?;
    if let (Some(b), Some((ptr, size, _))) = (&p.backup, ranges.first()) {
        let n = p.backup_len.min(*size).min(b.len() as u64) as usize;
        // SAFETY: just mapped; the backup holds `n` bytes and lives in the registry until the
        // stream is synchronised by the caller.
        unsafe { d.copy_htod_async(*ptr, b.as_ptr(), n, stream) }?;
    }
    Ok(h)
}

impl NcclTag {
    /// Pause step 1.
    fn release_local(&self, backup: Backup) -> Result<Released> {
        let a = self.allocator;
        let d = a.driver();
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
        for dev in devices {
            let (ctx, stream) = a.copy_stream(dev)?;
            let own = own.get(&dev).map_or(&[][..], Vec::as_slice);
            let imports = imports.get(&dev).map_or(&[][..], Vec::as_slice);
            let mut batches: Vec<(Event, &[u64])> = Vec::new();
            let r = d.with_context(ctx, || {
                // NCCL's kernels (here) may still use the memory.
                d.synchronize()?;
                // Back up what this process owns (imports are backed up by their owners).
                for chunk in own.chunks(COPIES_PER_EVENT) {
                    for vh in chunk {
                        let p = reg.physicals.get_mut(vh).expect("listed above");
                        let n = backup_len(backup, p);
                        if p.backup.as_ref().is_none_or(|b| (b.len() as u64) < n) {
                            p.backup = None;
                            p.backup = Some(HostBuffer::new(d, ctx, n as usize)?);
                        }
                        let (ptr, size, _) = ranges[vh][0];
                        let n = n.min(size);
                        let dst = p.backup.as_mut().expect("set above").as_mut_ptr();
                        // SAFETY: NCCL's mapped memory (the device is idle); the backup holds
                        // `n` bytes and stays in the registry; the batch's event is waited for
                        // before the memory is unmapped.
                        unsafe { d.copy_dtoh_async(dst, ptr, n as usize, stream) }?;
                        p.backup_len = n;
                        out.copied += n;
                    }
                    batches.push((d.event_record(stream)?, chunk));
                }
                // Imports need no copy: let go of them while the copies run.
                for vh in imports {
                    release_one(d, &mut reg, &ranges, *vh, &mut out)?;
                }
                let mut pending = std::mem::take(&mut batches).into_iter();
                let r = pending.by_ref().try_for_each(|(event, chunk)| {
                    d.event_wait(event)?;
                    chunk
                        .iter()
                        .try_for_each(|vh| release_one(d, &mut reg, &ranges, *vh, &mut out))
                });
                // On a failure, the remaining copies still write into the backups: wait.
                for (event, _) in pending {
                    let _ = d.event_wait(event);
                }
                r
            });
            for (event, _) in batches {
                let _ = d.event_wait(event);
            }
            r?;
        }
        Ok(out)
    }

    /// Resume: re-creates and restores this process's own paused handles `vhs` (all on
    /// `device`), recording them resident once their contents are back, and counts them into
    /// `total`. On a failure, those restored before it stay restored (and counted).
    fn restore(
        &self,
        reg: &mut Registry,
        device: i32,
        vhs: &[u64],
        total: &mut Restored,
    ) -> Result<()> {
        let a = self.allocator;
        let d = a.driver();
        let ranges = reg.ranges_by_handle();
        let (ctx, stream) = a.copy_stream(device)?;
        let mut made: Vec<(u64, Handle)> = Vec::new();
        let r = d.with_context(ctx, || {
            let r = vhs.iter().try_for_each(|vh| {
                let p = &reg.physicals[vh];
                let rs = ranges.get(vh).map_or(&[][..], Vec::as_slice);
                made.push((*vh, recreate_one(d, p, rs, stream)?));
                Ok(())
            });
            // Whatever happened, the queued copies finish before anyone may use the memory.
            d.stream_synchronize(stream).and(r)
        });
        for (vh, h) in made {
            let p = reg.physicals.get_mut(&vh).expect("listed by the caller");
            p.real = Some(h.0);
            if p.exported {
                p.generation += 1;
                p.importers.clear();
            }
            total.handles += 1;
            total.bytes += p.size;
            if p.backup.is_some() {
                total.copied += p.backup_len;
            }
        }
        match r {
            Ok(()) => Ok(()),
            Err(e) if e.is_out_of_memory() => {
                let (still_paused, bytes_still_paused) = reg
                    .physicals
                    .values()
                    .filter(|p| p.real.is_none() && p.kind != Kind::Imported)
                    .fold((0, 0), |(n, b), p| (n + 1, b + p.size));
                Err(Error::ResumeOutOfMemory {
                    device,
                    tags: vec![TAG.into()],
                    resumed: total.handles,
                    still_paused,
                    bytes_still_paused,
                    margin: 0,
                })
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Resume step 1: this process's own memory, exported buffers first.
    fn restore_local(&self) -> Result<Restored> {
        let plan = {
            let reg = registry::lock();
            let ranges = reg.ranges_by_handle();
            let paused = |exported: bool| {
                reg.physicals
                    .iter()
                    .filter(move |(_, p)| {
                        p.real.is_none() && p.source.is_none() && p.exported == exported
                    })
                    .map(|(vh, _)| *vh)
            };
            [
                by_device(&reg, &ranges, paused(true)),
                by_device(&reg, &ranges, paused(false)),
            ]
        };
        let mut total = Restored::default();
        // The exported buffers in one go; then the private ones in batches, handing the lock
        // over between batches (fairly, to a waiting thread first), so that peers' requests
        // for the exported buffers are answered while the private ones are restored.
        let [exported, private] = plan;
        let private = private.into_iter().flat_map(|(dev, vhs)| {
            vhs.chunks(RESTORE_BATCH)
                .map(|c| (dev, c.to_vec()))
                .collect::<Vec<_>>()
        });
        for (device, vhs) in exported.into_iter().chain(private) {
            let mut reg = registry::lock();
            let vhs: Vec<u64> = vhs
                .into_iter()
                .filter(|vh| reg.physicals.get(vh).is_some_and(|p| p.real.is_none()))
                .collect();
            self.restore(&mut reg, device, &vhs, &mut total)?;
            parking_lot::MappedMutexGuard::unlock_fair(reg);
        }
        Ok(total)
    }

    /// Resume step 3: import the owners' new generations and map them where they were.
    /// An import that cannot be mapped is reported released to its owner, so that the
    /// owner's next pause does not wait for it.
    fn map_imports(&self, fetched: Vec<(u64, OwnedFd, u64)>) -> Result<usize> {
        let d = self.allocator.driver();
        let mut reg = registry::lock();
        let ranges = reg.ranges_by_handle();
        let mut n = 0;
        let mut failed: Option<Error> = None;
        let mut unused = Notices::new();
        for (vh, fd, generation) in fetched {
            let Some(p) = reg.physicals.get(&vh) else {
                continue;
            };
            let owner = p.source.map(|s| (s.owner, s.vh));
            if failed.is_some() {
                if let Some((o, ovh)) = owner {
                    unused.entry(o).or_default().push((ovh, generation));
                }
                continue;
            }
            let rs = ranges.get(&vh).map_or(&[][..], Vec::as_slice);
            let r = self
                .allocator
                .copy_stream(device_of(&reg, &ranges, vh))
                .and_then(|(ctx, _)| {
                    Ok(d.with_context(ctx, || {
                        map_all(d, d.import_fd(std::os::fd::AsRawFd::as_raw_fd(&fd))?, rs)
                    })?)
                });
            match r {
                Ok(h) => {
                    let p = reg.physicals.get_mut(&vh).expect("checked above");
                    p.real = Some(h.0);
                    if let Some(s) = p.source.as_mut() {
                        s.generation = generation;
                    }
                    n += 1;
                }
                Err(e) => {
                    if let Some((o, ovh)) = owner {
                        unused.entry(o).or_default().push((ovh, generation));
                    }
                    failed = Some(e);
                }
            }
        }
        drop(reg);
        let group = crate::amem::group_id();
        for (owner, items) in unused {
            let _ = peer::notify_released(group, owner, &items);
        }
        failed.map_or(Ok(n), Err)
    }
}

/// Resume step 2 (on a thread): the fds of `fetch` (owner -> [(local handle, owner's handle,
/// wanted generation)]) from their owners.
fn fetch_imports(
    group: i64,
    fetch: BTreeMap<u32, Vec<(u64, u64, u64)>>,
) -> std::result::Result<Vec<(u64, OwnedFd, u64)>, String> {
    let mut fetched = Vec::new();
    for (owner, items) in fetch {
        let wants: Vec<(u64, u64)> = items.iter().map(|(_, ovh, g)| (*ovh, *g)).collect();
        let fds = peer::request_fds(group, owner, &wants)?;
        for ((vh, _, _), (fd, generation)) in items.into_iter().zip(fds) {
            fetched.push((vh, fd, generation));
        }
    }
    Ok(fetched)
}

impl ExternalTag for NcclTag {
    fn pause(&self) -> Result<Report> {
        let start = Instant::now();
        // Also checked by every way in (`memsaver_allocator::global`); the NCCL options are
        // this pause's own.
        let opts = memsaver_allocator::options::get();
        opts.check()?;
        let backup = opts.nccl_backup;
        let released = self.release_local(backup)?;
        self.lower_stacks(&released.devices);
        let local_ms = start.elapsed().as_secs_f64() * 1e3;
        let group = crate::amem::group_id();
        for (owner, items) in &released.notices {
            if let Err(e) = peer::notify_released(group, *owner, items)
                && peer::alive(*owner)
            {
                tracing::warn!(
                    "memsaver: could not tell process {owner} that its NCCL buffers were released: {e}"
                );
            }
        }
        // Every exported buffer of ours that is paused (also by an earlier, failed call) is
        // free only once its importers have let go.
        let deadline = Instant::now() + peer::timeout();
        loop {
            let holders: Vec<u32> = {
                let mut reg = registry::lock();
                let mut paused: Vec<_> = reg
                    .physicals
                    .values_mut()
                    .filter(|p| p.exported && p.real.is_none())
                    .collect();
                // Each importer asked once: a dead process has let go of everything.
                let mut holders: Vec<u32> = paused
                    .iter()
                    .flat_map(|p| p.importers.iter().copied())
                    .collect();
                holders.sort_unstable();
                holders.dedup();
                holders.retain(|pid| peer::alive(*pid));
                for p in &mut paused {
                    p.importers.retain(|pid| holders.binary_search(pid).is_ok());
                }
                holders
            };
            if holders.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                return Err(Error::PeersHoldMemory {
                    tag: TAG.into(),
                    peers: holders,
                    waited_ms: peer::timeout().as_millis() as u64,
                });
            }
            std::thread::sleep(Duration::from_micros(200));
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
        // Imports to fetch, per owner: (local handle, owner's handle, wanted generation).
        let mut fetch = BTreeMap::<u32, Vec<(u64, u64, u64)>>::new();
        for (vh, p) in &registry::lock().physicals {
            if let (None, Some(s)) = (p.real, p.source) {
                fetch
                    .entry(s.owner)
                    .or_default()
                    .push((*vh, s.vh, s.generation + 1));
            }
        }
        let group = crate::amem::group_id();
        let fetcher = (!fetch.is_empty()).then(|| {
            std::thread::Builder::new()
                .name("memsaver-nccl-fetch".into())
                .spawn(move || fetch_imports(group, fetch))
        });
        let local = self.restore_local();
        let restored_ms = start.elapsed().as_secs_f64() * 1e3;
        let fetched = match fetcher {
            None => Ok(Vec::new()),
            Some(Err(e)) => Err(format!("cannot start a thread: {e}")),
            Some(Ok(t)) => t
                .join()
                .unwrap_or_else(|_| Err("the fetching thread panicked".into())),
        };
        let fetched_ms = start.elapsed().as_secs_f64() * 1e3;
        // The peers' memory is mapped back even if ours could not be (it is on their devices).
        let imported = fetched
            .map_err(peer_error)
            .and_then(|f| self.map_imports(f));
        let own = local?;
        let n = own.handles + imported?;
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
        for p in reg.physicals.values().filter(|p| p.kind == Kind::Device) {
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
            let u = &mut out[i].usage;
            u.allocations += 1;
            u.reserved_bytes += p.size;
            u.resident_bytes += if p.real.is_some() { p.size } else { 0 };
            u.backup_bytes += p.backup.as_ref().map_or(0, |b| b.len() as u64);
        }
        out.sort_by_key(|u| u.device);
        out
    }
}
