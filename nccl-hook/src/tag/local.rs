//! The `nccl` tag's work on this process's own memory and its mappings of peers' memory, on
//! the engine's steps (`memsaver_allocator::steps`, shared with every tag): pause step 1
//! ([`release_local`]) and resume step 1 ([`restore_local`]). The order of the steps and the
//! exchanges with peers are [`crate::tag::provider`]'s and [`crate::tag::peer`]'s; the kernel
//! stack limit NCCL made the driver raise is [`crate::interpose::graphs`]'.
//!
//! What is backed up: the `nccl` tag's policy (`MEMSAVER_NCCL_BACKUP`, pinned by default).
//! `headers` backs up only the first [`HEADER_BYTES`] of the buffers NCCL shares with peers:
//! NCCL lays those out as a 4 KiB control block (`ncclSendMem`/`ncclRecvMem`: head and tail
//! step counters, FIFOs) followed by the LL/LL128/Simple staging buffers, whose contents live
//! only within one collective. Resume zeroes what follows the headers ([`Steps::zero`]), as
//! NCCL's zeroed allocation left it: fresh memory may hold bytes that pass for a flag.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use memsaver_allocator::driver::Handle;
use memsaver_allocator::options::Pack;
use memsaver_allocator::steps::{Memory, Op, Piece, Place, Steps, external_key, is_out_of_memory};
use memsaver_allocator::{Allocator, Backup as HostBackup, Device, Error, Policy, Result};
use memsaver_ipc::protocol::Buffer;

use crate::options::HEADER_BYTES;
use crate::registry::{self, Kind, Range, Registry, TAG};

/// Resume restores private buffers in batches of this many physical allocations (a run is
/// one), letting the threads that serve peers in between.
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
        Backup::Headers if p.exported && crate::interpose::vmm::headers_apply() => {
            p.size.min(HEADER_BYTES)
        }
        _ => p.size,
    }
}

/// The tag's name, as the engine's pieces carry it.
fn tag() -> Arc<str> {
    static TAG_ARC: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| TAG.into());
    TAG_ARC.clone()
}

/// The places of a handle's mappings, with the access NCCL granted (replayed on resume).
pub(crate) fn places(rs: &[Range]) -> Vec<Place<'_>> {
    rs.iter()
        .map(|(ptr, size, access)| Place {
            ptr: *ptr,
            size: *size as usize,
            access: Some(access),
        })
        .collect()
}

/// The device whose context handles `vh` here: for an import, the device NCCL granted access
/// to (the owner's device may not even be visible in this process); else its location.
pub(crate) fn device_of(reg: &Registry, ranges: &HashMap<u64, Vec<Range>>, vh: u64) -> i32 {
    let p = &reg.physicals[&vh];
    if matches!(p.kind, Kind::Imported | Kind::Registered)
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

/// Resident, mapped handles pause may release: (own device memory, imports). A run is
/// released whole or not at all: if one of its buffers must stay (given to a NIC, say), all
/// stay.
fn releasable(reg: &Registry, ranges: &HashMap<u64, Vec<Range>>) -> (Vec<u64>, Vec<u64>) {
    let staying = reg.runs_that_stay();
    let (mut own, mut imports) = (Vec::new(), Vec::new());
    for (vh, p) in &reg.physicals {
        // A peer's memsaver memory NCCL registered follows its owner's tag, not this one.
        if p.real().is_none()
            || p.pausable().is_err()
            || p.kind == Kind::Registered
            || !ranges.contains_key(vh)
            || p.run.is_some_and(|base| staying.contains(&base))
        {
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

/// Released imports to tell their owners about: owner -> the items naming them there.
pub(crate) type Notices = BTreeMap<u32, Vec<Buffer>>;

/// What resume step 1 restored.
#[derive(Default)]
pub(crate) struct Restored {
    pub(crate) handles: usize,
    pub(crate) bytes: u64,
    pub(crate) copied: u64,
    /// Where the time went: creating and mapping memory (with its access), queueing the
    /// zero fills and restores, and waiting for them.
    pub(crate) map_time: std::time::Duration,
    pub(crate) queue_time: std::time::Duration,
    pub(crate) wait_time: std::time::Duration,
    /// Choosing the units (claims, runs) and recording the buffers restored (the ledger
    /// included).
    pub(crate) plan_time: std::time::Duration,
    pub(crate) record_time: std::time::Duration,
}

/// What pause step 1 did.
#[derive(Default)]
pub(crate) struct Released {
    /// Devices with NCCL memory released.
    pub(crate) devices: Vec<i32>,
    pub(crate) allocations: usize,
    /// Bytes of this process's own memory released.
    pub(crate) bytes: u64,
    pub(crate) copied: u64,
    pub(crate) notices: Notices,
    /// What of each owner's memory the notices release.
    pub(crate) released_imports: BTreeMap<u32, Holding>,
    /// The first failure: what it did not release stays resident (and imports mapped).
    pub(crate) error: Option<memsaver_allocator::Error>,
    /// Where the time went: choosing what to release, waiting for the devices, queueing the
    /// backups (and releasing imports), releasing own memory once its backups are done (the
    /// wait for them included), telling the ledger.
    pub(crate) plan_time: std::time::Duration,
    pub(crate) sync_time: std::time::Duration,
    pub(crate) queue_time: std::time::Duration,
    pub(crate) release_time: std::time::Duration,
    pub(crate) ledger_time: std::time::Duration,
}

/// Unmaps the run of imports at `base` on `dev` once and releases its driver handle: every
/// import in it goes `Mapped` → `Released`, told to its owner.
fn release_import_run(
    steps: &Steps<'_>,
    dev: &Device,
    reg: &mut Registry,
    base: u64,
    out: &mut Released,
) -> Result<()> {
    let size = reg.runs[&base].size;
    let place = [Place {
        ptr: base,
        size: size as usize,
        access: None,
    }];
    // SAFETY: the run's mapping; the device is idle (imports need no copy).
    unsafe { steps.unmap(dev, &place) }?;
    let run = reg.runs.remove(&base).expect("seen above");
    steps.release(Handle(run.real), base);
    free_dead(reg, &run.around);
    for p in reg.physicals.values_mut().filter(|p| p.run == Some(base)) {
        let generation = p.mapped_generation();
        p.release()?;
        out.allocations += 1;
        if let (Some(s), Some(g)) = (p.source, generation) {
            out.notices.entry(s.owner).or_default().push(s.item(g));
            out.released_imports.entry(s.owner).or_default().add(p);
        }
    }
    Ok(())
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

/// Unmaps the run at `base` on `dev` once the copies of its buffers `members` (those NCCL
/// still maps, with their pieces) are done, and releases its driver handle: every buffer of
/// the run goes `Resident` → `Paused` (one `cuMemUnmap` and `cuMemRelease` for all), and the
/// reservations NCCL freed inside it are freed. If a copy fails, the whole run stays resident.
fn release_run(
    steps: &Steps<'_>,
    dev: &Device,
    reg: &mut Registry,
    base: u64,
    mut members: Vec<(u64, Piece)>,
    out: &mut Released,
) -> Result<()> {
    let copied = members
        .iter_mut()
        .try_for_each(|(_, piece)| steps.copied(piece));
    let run = &reg.runs[&base];
    let place = [Place {
        ptr: base,
        size: run.size as usize,
        access: None,
    }];
    // SAFETY: the run's mapping; the device is idle and every member's copy complete.
    let r = copied.and_then(|()| unsafe { steps.unmap(dev, &place) });
    if let Err(e) = r {
        for (_, piece) in &mut members {
            steps.keep(piece);
        }
        return Err(e);
    }
    let run = reg.runs.remove(&base).expect("seen above");
    steps.release(Handle(run.real), base);
    free_dead(reg, &run.dead);
    reg.run_released(base);
    let in_run: Vec<u64> = reg
        .physicals
        .iter()
        .filter(|(_, p)| p.run == Some(base))
        .map(|(vh, _)| *vh)
        .collect();
    let mut pieces: HashMap<u64, Piece> = members.into_iter().collect();
    for vh in in_run {
        let p = reg.physicals.get_mut(&vh).expect("listed above");
        p.release()?;
        out.allocations += 1;
        out.bytes += p.size;
        // A buffer NCCL unmapped but still holds has no piece: nothing of it to keep.
        if let Some(piece) = pieces.remove(&vh) {
            p.backup_len = piece.len as u64;
            p.backup = piece.backup;
        }
    }
    Ok(())
}

/// Settles the buffers NCCL freed inside runs that a pause released
/// ([`registry::Retired`]): their exports are forgotten by the owner's ledger. Called once a
/// pause's wait found none of their importers holding, and by the resume (which rebuilds the
/// runs without them) for those a failed pause left.
pub(crate) fn forget_retired(reg: &mut Registry) {
    for vh in reg.forget_retired_released() {
        memsaver_ipc::shared::forget(memsaver_ipc::shared::Delivery::Collective, vh);
    }
}

/// Frees reservations NCCL freed while a run covered them, now that the run is unmapped:
/// memsaver's ranges in its records, the others with the driver.
fn free_dead(reg: &mut Registry, dead: &[(u64, u64)]) {
    let drivers: Vec<&(u64, u64)> = dead
        .iter()
        .filter(|(ptr, _)| !reg.free_range(*ptr))
        .collect();
    if drivers.is_empty() {
        return;
    }
    let Ok(d) = memsaver_allocator::global_driver() else {
        return;
    };
    for &(ptr, size) in drivers {
        // SAFETY: NCCL freed the range and its run is unmapped: nothing is mapped in it and
        // no one uses it.
        if let Err(e) = unsafe { d.address_free(ptr, size as usize) } {
            tracing::warn!(error = %e, "memsaver: freeing a range NCCL freed failed");
        }
    }
}

/// Unmaps and releases every import of `owner`'s buffers this process maps (after the
/// devices finished what they run), as a pause does: each goes `Mapped` → `Released`, with
/// its notice to the owner in the answer. For an importer that catches up with an owner that
/// paused or resumed without it ([`crate::tag::catchup`]).
pub(crate) fn release_imports_of(a: &'static Allocator, owner: u32) -> Result<Released> {
    let steps = a.steps(Op::Pause);
    let mut reg = registry::lock();
    let ranges = reg.ranges_by_handle();
    let (_, imports) = releasable(&reg, &ranges);
    let mine = imports
        .into_iter()
        .filter(|vh| reg.physicals[vh].source.is_some_and(|s| s.owner == owner));
    let mut out = Released::default();
    for (dev, vhs) in by_device(&reg, &ranges, mine) {
        let device = a.device(dev)?;
        steps.synchronize(&device)?;
        let mut runs = std::collections::BTreeSet::new();
        for vh in vhs {
            match reg.physicals[&vh].run {
                Some(base) => {
                    runs.insert(base);
                }
                None => release_one(&steps, &device, &mut reg, &ranges, vh, &mut out)?,
            }
        }
        for base in runs {
            release_import_run(&steps, &device, &mut reg, base, &mut out)?;
        }
    }
    Ok(out)
}

/// Pause step 1, on the engine's steps: per device, synchronise, queue the backup copy of
/// each buffer this process owns (its piece: key, policy, the bytes `backup` says), let go
/// of the imports while the copies run, then release each own buffer once its copy is
/// done. A buffer that cannot be released stays resident without a backup; the error is
/// returned after every device is done.
pub(crate) fn release_local(a: &'static Allocator, backup: Backup) -> Result<Released> {
    let t0 = std::time::Instant::now();
    let mut steps = a.steps(Op::Pause);
    let mut reg = registry::lock();
    crate::interpose::guard::set_paused(true);
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
    out.plan_time = t0.elapsed();
    let mut first_error = None;
    for dev in devices {
        let device = match a.device(dev) {
            Ok(d) => d,
            Err(e) => {
                first_error.get_or_insert(e);
                continue;
            }
        };
        let own = own.get(&dev).map_or(&[][..], Vec::as_slice);
        let imports = imports.get(&dev).map_or(&[][..], Vec::as_slice);
        // NCCL's kernels (here) may still use the memory.
        let t = std::time::Instant::now();
        let mut failed = steps.synchronize(&device).err();
        out.sync_time += t.elapsed();
        let t = std::time::Instant::now();
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
            )
            .packed(steps.plan.pack != Pack::Off);
            if failed.is_none() {
                failed = steps.copy_out(&mut piece).err();
            }
            pieces.push((*vh, piece));
        }
        // Imports need no copy: let go of them while the copies run (a run of them at once).
        let mut import_runs = std::collections::BTreeSet::new();
        for vh in imports {
            if let Some(base) = reg.physicals[vh].run {
                import_runs.insert(base);
            } else if failed.is_none() {
                failed = release_one(&steps, &device, &mut reg, &ranges, *vh, &mut out).err();
            }
        }
        for base in import_runs {
            if failed.is_none() {
                failed = release_import_run(&steps, &device, &mut reg, base, &mut out).err();
            }
        }
        out.queue_time += t.elapsed();
        let t = std::time::Instant::now();
        // Runs are released whole, each once the copies of all its buffers are done.
        let mut runs: BTreeMap<u64, Vec<(u64, Piece)>> = BTreeMap::new();
        let mut singles = Vec::with_capacity(pieces.len());
        for (vh, piece) in pieces {
            match reg.physicals[&vh].run {
                Some(base) => runs.entry(base).or_default().push((vh, piece)),
                None => singles.push((vh, piece)),
            }
        }
        for (base, mut members) in runs {
            if failed.is_none() {
                failed = release_run(&steps, &device, &mut reg, base, members, &mut out).err();
            } else {
                for (_, piece) in &mut members {
                    steps.keep(piece);
                }
            }
        }
        for (vh, mut piece) in singles {
            if failed.is_none() {
                let r = steps
                    .copied(&mut piece)
                    .and_then(|()| release_one(&steps, &device, &mut reg, &ranges, vh, &mut out));
                match r {
                    Ok(()) => {
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
        out.release_time += t.elapsed();
        if let Some(e) = failed {
            first_error.get_or_insert(e);
        }
    }
    let t = std::time::Instant::now();
    // Exported buffers released (now or by an earlier pause that failed), and those NCCL
    // freed inside the runs released, which their importers map whole: paused in the owner's
    // ledger, whose importers step 3 waits for.
    let exports: Vec<u64> = reg
        .physicals
        .iter()
        .filter(|(_, p)| p.exported && p.is_paused_own())
        .map(|(vh, _)| *vh)
        .chain(reg.retired_released())
        .collect();
    memsaver_ipc::shared::paused(&exports);
    drop(reg);
    out.ledger_time = t.elapsed();
    out.copied = steps.copied_bytes();
    if let Some(e) = first_error {
        // Nothing released: NCCL's memory is all there, so NCCL may run. Something
        // released: the tag is paused (a resume restores what was released).
        if out.allocations == 0 {
            crate::interpose::guard::set_paused(false);
        }
        out.error = Some(incomplete("pause", e, |p| {
            p.real().is_some() && p.pausable().is_ok() && p.kind != Kind::Registered
        }));
    }
    Ok(out)
}

/// The owners of the imports this process still maps (those of a pause that failed).
pub(crate) fn owners_still_mapped() -> BTreeMap<u32, ()> {
    registry::lock()
        .physicals
        .values()
        .filter(|p| p.mapped_generation().is_some() && p.kind == Kind::Imported)
        .filter_map(|p| Some((p.source?.owner, ())))
        .collect()
}

/// Resume: re-creates and restores this process's own claimed handles, `units` of them (all
/// on `device`), on the engine's steps, with the memory margin, recording them resident once
/// their contents are back, and counts them into `total`. A unit of several buffers is a run
/// ([`units`]): one physical allocation mapped over all of them; one that does not fit (out of
/// memory, the margin) or whose backups cannot be restored is retried one buffer at a time.
/// Backups stay with retention on and are handed back in `released` with it off. On a
/// failure, those restored before it stay restored (and counted); the others stay claimed for
/// the caller to unclaim.
fn restore(
    a: &'static Allocator,
    steps: &mut Steps<'_>,
    reg: &mut Registry,
    device: i32,
    units: Vec<Vec<u64>>,
    total: &mut Restored,
    released: &mut Vec<HostBackup>,
) -> Result<()> {
    let dev = a.device(device)?;
    let ranges = reg.ranges_by_handle();
    let backup = crate::options::get().nccl_backup;
    let policy = backup.policy();
    // (the unit's buffers, the handle backing them, their pieces).
    let mut made: Vec<(Vec<u64>, Handle, Vec<Piece>)> = Vec::new();
    let mut todo: std::collections::VecDeque<Vec<u64>> = units.into();
    let mut r = Ok(());
    while let Some(unit) = todo.pop_front() {
        let pieces: Vec<Piece> = unit
            .iter()
            .map(|vh| {
                let p = reg.physicals.get_mut(vh).expect("listed by the caller");
                let ptr = ranges.get(vh).and_then(|rs| rs.first()).map_or(0, |r| r.0);
                let (len, backup) = (p.backup_len as usize, p.backup.take());
                Piece::new(
                    external_key(*vh),
                    tag(),
                    dev.clone(),
                    policy,
                    ptr,
                    len,
                    backup,
                )
            })
            .collect();
        let first = &reg.physicals[&unit[0]];
        let prop = first.prop;
        let size: u64 = unit.iter().map(|vh| reg.physicals[vh].size).sum();
        let rs = ranges.get(&unit[0]).map_or(&[][..], Vec::as_slice);
        // A run is one place over all its buffers, with their access (the same for all).
        let pl = if unit.len() == 1 {
            places(rs)
        } else {
            vec![Place {
                ptr: rs[0].0,
                size: size as usize,
                access: Some(&rs[0].2),
            }]
        };
        // Buffers backed up in part (`headers`) get zeros behind what comes back, as NCCL's
        // zeroed allocations had, and packed ones zeros where their blocks held nothing: one
        // fill over the unit, queued before its restores.
        let partial = backup != Backup::Discard
            && unit.iter().zip(&pieces).any(|(vh, piece)| {
                let p = &reg.physicals[vh];
                p.backup_len < p.size || matches!(piece.backup, Some(HostBackup::Packed(..)))
            });
        let t0 = std::time::Instant::now();
        let mapped = steps
            .map_fresh(&dev, Memory::Like(&prop), size as usize, &pl, TAG)
            .and_then(|h| {
                total.map_time += t0.elapsed();
                let t1 = std::time::Instant::now();
                let filled = if partial {
                    steps.zero(&dev, pl[0].ptr, size as usize)
                } else {
                    Ok(())
                };
                let copied =
                    filled.and_then(|()| pieces.iter().try_for_each(|piece| steps.copy_in(piece)));
                total.queue_time += t1.elapsed();
                match copied {
                    Ok(()) => Ok(h),
                    Err(e) => {
                        let _ = steps.finish(&dev);
                        // SAFETY: mapped just above; the stream was synchronised.
                        let _ = unsafe { steps.unmap(&dev, &pl) };
                        steps.release(h, pl[0].ptr);
                        Err(e)
                    }
                }
            });
        match mapped {
            Ok(h) => made.push((unit, h, pieces)),
            Err(e) => {
                for (vh, piece) in unit.iter().zip(pieces) {
                    reg.physicals.get_mut(vh).expect("listed").backup = piece.backup;
                }
                if unit.len() > 1 && (is_out_of_memory(&e) || matches!(e, Error::Backup(_))) {
                    for vh in unit.into_iter().rev() {
                        todo.push_front(vec![vh]);
                    }
                    continue;
                }
                r = Err(e);
                break;
            }
        }
    }
    // Whatever happened, the queued copies finish before anyone may use the memory.
    let t0 = std::time::Instant::now();
    let mut r = steps.finish(&dev).and(r);
    total.wait_time += t0.elapsed();
    let t0 = std::time::Instant::now();
    // Exported buffers restored: each starts its next generation in the owner's ledger.
    let mut exports = Vec::new();
    for (unit, h, pieces) in made {
        let base = pieces[0].ptr;
        if unit.len() > 1 {
            let size = unit.iter().map(|vh| reg.physicals[vh].size).sum();
            let run = registry::Run {
                size,
                real: h.0,
                live: unit.len(),
                dead: Vec::new(),
                around: Vec::new(),
            };
            reg.runs.insert(base, run);
        }
        for (vh, piece) in unit.iter().zip(pieces) {
            let p = reg.physicals.get_mut(vh).expect("listed by the caller");
            if let Err(e) = p.resumed(h.0) {
                r = r.and(Err(e.into()));
                continue;
            }
            if p.exported {
                exports.push(*vh);
            }
            p.run = (unit.len() > 1).then_some(base);
            total.handles += 1;
            total.bytes += p.size;
            if steps.plan.retain {
                p.backup = piece.backup;
            } else {
                released.extend(piece.backup);
                p.backup_len = 0;
            }
        }
    }
    memsaver_ipc::shared::resumed(&exports);
    total.record_time += t0.elapsed();
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

/// `vhs` (claimed own buffers of one device) as the units a resume backs with one physical
/// allocation each: runs of buffers that NCCL mapped once each, whole, at adjacent addresses,
/// with the same properties and access, of at most `limit` bytes, inside one block of
/// [`registry::MIRROR_BLOCK`]; every other buffer alone. In address order. Shared and private
/// buffers join alike: each importer of a buffer in a run maps the run whole, in its copy of
/// this process's layout, which is what makes the calls per pause and resume depend on peers
/// and bytes, not on buffers or communicators (NCCL allocates its private and shared buffers
/// in turn, per communicator and peer). Importers are this process's NCCL peers: processes of
/// its group given a token of that run's buffers (docs/security.md).
fn units(
    reg: &Registry,
    ranges: &HashMap<u64, Vec<Range>>,
    vhs: Vec<u64>,
    limit: u64,
) -> Vec<Vec<u64>> {
    // (address, size) of a buffer that may join a run: mapped once, whole.
    let whole = |vh: &u64| -> Option<(u64, u64)> {
        let p = &reg.physicals[vh];
        match ranges.get(vh).map(Vec::as_slice) {
            Some([(ptr, size, _)]) if *size == p.size => Some((*ptr, *size)),
            _ => None,
        }
    };
    let mut vhs = vhs;
    vhs.sort_by_key(|vh| ranges.get(vh).and_then(|rs| rs.first()).map_or(0, |r| r.0));
    let mut out: Vec<Vec<u64>> = Vec::new();
    let mut span: Option<(u64, u64)> = None; // the current run's (start, end)
    // Why buffers did not join the one before them, for the log.
    let mut cuts: BTreeMap<&'static str, usize> = BTreeMap::new();
    for vh in vhs {
        let cut = match (out.last(), span, whole(&vh)) {
            (None, ..) => None,
            (_, None, _) | (_, _, None) => Some("mapped other than once and whole"),
            (Some(unit), Some((start, end)), Some((ptr, size))) => {
                let (p, q) = (&reg.physicals[&unit[0]], &reg.physicals[&vh]);
                if ptr != end {
                    Some("not adjacent")
                } else if ptr + size - start > limit {
                    Some("MEMSAVER_NCCL_MERGE_MB")
                } else if start / registry::MIRROR_BLOCK
                    != (ptr + size - 1) / registry::MIRROR_BLOCK
                {
                    Some("a block's end")
                } else if p.prop != q.prop {
                    Some("other properties")
                } else if ranges[&unit[0]][0].2 != ranges[&vh][0].2 {
                    Some("other access")
                } else {
                    None
                }
            }
        };
        match (cut, out.last_mut()) {
            (None, Some(unit)) => {
                unit.push(vh);
                span = span.map(|(start, end)| (start, end + reg.physicals[&vh].size));
            }
            (cut, _) => {
                if let Some(why) = cut {
                    *cuts.entry(why).or_default() += 1;
                }
                span = whole(&vh).map(|(ptr, size)| (ptr, ptr + size));
                out.push(vec![vh]);
            }
        }
    }
    tracing::debug!(
        units = out.len(),
        ?cuts,
        "nccl resume: runs of adjacent buffers"
    );
    out
}

/// Resume step 1: this process's own memory, exported buffers first. Claims every paused
/// handle (`Resuming`) first, so that the handles still to restore while the lock is
/// handed over are marked; what could not be restored goes back to `Paused`.
pub(crate) fn restore_local(a: &'static Allocator) -> Result<Restored> {
    let t0 = std::time::Instant::now();
    let mut steps = a.steps(Op::Resume);
    let plan = {
        let mut reg = registry::lock();
        // Buffers NCCL freed inside runs a pause released: the runs are rebuilt without them.
        forget_retired(&mut reg);
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
        // Units with a buffer peers import first (in one go), then the others.
        let limit = crate::options::get().nccl_merge_limit;
        let mut plan: [Vec<(i32, Vec<Vec<u64>>)>; 2] = Default::default();
        for (dev, vhs) in by_device(&reg, &ranges, claimed) {
            let (shared, private): (Vec<_>, Vec<_>) = units(&reg, &ranges, vhs, limit)
                .into_iter()
                .partition(|unit| unit.iter().any(|vh| reg.physicals[vh].exported));
            plan[0].push((dev, shared));
            plan[1].push((dev, private));
        }
        plan
    };
    let mut total = Restored {
        plan_time: t0.elapsed(),
        ..Restored::default()
    };
    let mut released = Vec::new();
    // The units peers import from in one go; then the private ones in batches, handing the
    // lock over between batches (fairly, to a waiting thread first), so that peers' requests
    // for the exported buffers are answered while the private ones are restored.
    let [exported, private] = plan;
    let private = private.into_iter().flat_map(|(dev, units)| {
        units
            .chunks(RESTORE_BATCH)
            .map(|c| (dev, c.to_vec()))
            .collect::<Vec<_>>()
    });
    let mut r = Ok(());
    let mut batches = exported.into_iter().chain(private).peekable();
    // The lock of the last batch, kept to unclaim what was not restored: handed over, it
    // would go to the thread serving a peer, which holds it for its whole answer.
    let mut last = None;
    while let Some((device, units)) = batches.next() {
        let mut reg = registry::lock();
        // NCCL may have freed some meanwhile (a run then leaves a gap: its buffers go alone).
        let units: Vec<Vec<u64>> = units
            .into_iter()
            .flat_map(|unit| {
                let resuming = |vh: &u64| {
                    reg.physicals
                        .get(vh)
                        .is_some_and(|p| p.state() == registry::State::Resuming)
                };
                if unit.iter().all(resuming) {
                    vec![unit]
                } else {
                    unit.into_iter()
                        .filter(resuming)
                        .map(|vh| vec![vh])
                        .collect()
                }
            })
            .collect();
        r = restore(
            a,
            &mut steps,
            &mut reg,
            device,
            units,
            &mut total,
            &mut released,
        );
        if r.is_err() || batches.peek().is_none() {
            last = Some(reg);
            break;
        }
        parking_lot::MappedMutexGuard::unlock_fair(reg);
    }
    let mut reg = last.unwrap_or_else(registry::lock);
    for p in reg.physicals.values_mut() {
        let _ = p.unclaim();
    }
    drop(reg);
    // Backups retention no longer keeps (outside the lock: freeing pinned memory is a
    // driver call).
    drop(released);
    total.copied = steps.copied_bytes();
    r.map(|()| total)
}

/// The error of a resume that failed (`e`), saying what it left paused and what to do, as an
/// out-of-memory error already does.
pub(crate) fn still_paused(e: memsaver_allocator::Error) -> memsaver_allocator::Error {
    if matches!(e, memsaver_allocator::Error::ResumeOutOfMemory { .. }) {
        return e;
    }
    incomplete("resume", e, registry::Physical::is_paused_own)
}

/// `op`'s failure `e`, with how many handles it `left` as they were.
fn incomplete(
    op: &'static str,
    e: memsaver_allocator::Error,
    left: impl Fn(&registry::Physical) -> bool,
) -> memsaver_allocator::Error {
    let failed = registry::lock()
        .physicals
        .values()
        .filter(|p| left(p))
        .count();
    memsaver_allocator::Error::Incomplete {
        op,
        tags: vec![registry::TAG.into()],
        failed,
        first: Box::new(e),
    }
}

/// What this process holds of a peer's memory, or a peer of this process's: for messages.
#[derive(Default)]
pub(crate) struct Holding {
    pub(crate) buffers: usize,
    pub(crate) bytes: u64,
    pub(crate) devices: std::collections::BTreeSet<i32>,
}

impl Holding {
    pub(crate) fn add(&mut self, p: &registry::Physical) {
        self.count(p.size, p.device());
    }

    /// One buffer of `size` bytes on `device`.
    pub(crate) fn count(&mut self, size: u64, device: i32) {
        self.buffers += 1;
        self.bytes += size;
        self.devices.insert(device);
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

#[cfg(test)]
mod tests {
    use super::*;
    use memsaver_allocator::driver::sys::*;

    const MIB: u64 = 1 << 20;

    fn prop(device: i32) -> CUmemAllocationProp {
        CUmemAllocationProp {
            location: CUmemLocation {
                type_: CU_MEM_LOCATION_TYPE_DEVICE,
                id: device,
            },
            ..Default::default()
        }
    }

    /// A buffer of `mib` MiB at `at`, NCCL's, mapped once, whole; shared with peers or not.
    fn buffer(reg: &mut Registry, at: u64, mib: u64, device: i32, shared: bool) -> u64 {
        let mut p = registry::Physical::created(at, mib * MIB, prop(device), Kind::Device);
        p.exported = shared;
        let vh = reg.insert(p);
        let access = vec![CUmemAccessDesc {
            location: prop(device).location,
            flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        }];
        reg.mappings.insert(
            at,
            registry::Mapping {
                size: mib * MIB,
                vh,
                access,
            },
        );
        vh
    }

    #[test]
    fn runs_join_adjacent_buffers_of_one_kind_whoever_they_are_shared_with() {
        let mut reg = Registry::default();
        let g = 2 * MIB;
        let base = registry::MIRROR_BLOCK - 8 * g; // eight granules before a block's end
        let a = buffer(&mut reg, base, 2, 0, false);
        let b = buffer(&mut reg, base + g, 2, 0, false);
        // Shared with peers: in the same run as the private ones before it.
        let c = buffer(&mut reg, base + 2 * g, 2, 0, true);
        let d = buffer(&mut reg, base + 3 * g, 2, 0, true);
        let e = buffer(&mut reg, base + 4 * g, 2, 0, true);
        // Another device's properties, then a gap.
        let f = buffer(&mut reg, base + 5 * g, 2, 1, false);
        let h = buffer(&mut reg, base + 7 * g, 2, 0, false);
        // The next block: a run never crosses into it.
        let i = buffer(&mut reg, base + 8 * g, 2, 0, false);
        let ranges = reg.ranges_by_handle();
        let all = vec![i, h, f, e, d, c, b, a];
        assert_eq!(
            units(&reg, &ranges, all.clone(), u64::MAX),
            vec![vec![a, b, c, d, e], vec![f], vec![h], vec![i]]
        );
        // The limit cuts too; 0 keeps every buffer alone.
        assert_eq!(
            units(&reg, &ranges, vec![a, b, c, d], 2 * MIB)
                .into_iter()
                .map(|u| u.len())
                .collect::<Vec<_>>(),
            vec![1, 1, 1, 1]
        );
        assert!(units(&reg, &ranges, all, 0).iter().all(|u| u.len() == 1));
    }

    #[test]
    fn a_buffer_mapped_twice_or_in_part_stays_alone() {
        let mut reg = Registry::default();
        let g = 2 * MIB;
        let a = buffer(&mut reg, 0x7000_0000_0000, 2, 0, false);
        let b = buffer(&mut reg, 0x7000_0000_0000 + g, 2, 0, false);
        let c = buffer(&mut reg, 0x7000_0000_0000 + 2 * g, 2, 0, false);
        // b is mapped a second time elsewhere, as single-process NCCL maps a peer's handle.
        let second = reg.mappings[&(0x7000_0000_0000 + g)].access.clone();
        reg.mappings.insert(
            0x7100_0000_0000,
            registry::Mapping {
                size: g,
                vh: b,
                access: second,
            },
        );
        let ranges = reg.ranges_by_handle();
        assert_eq!(
            units(&reg, &ranges, vec![a, b, c], u64::MAX),
            vec![vec![a], vec![b], vec![c]]
        );
    }
}
