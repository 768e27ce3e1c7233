//! Pause step 1 of the `nccl` tag ([`release_local`]): per device, back up what this process
//! owns (its pieces, packed where the device can), let go of its imports of peers' memory, and
//! release its own memory once the copies are done, a run at once. Also the release of one
//! owner's imports for an importer that catches up ([`release_imports_of`]).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use memsaver_allocator::driver::Handle;
use memsaver_allocator::options::Pack;
use memsaver_allocator::steps::{Op, Piece, Place, Steps, external_key};
use memsaver_allocator::{Allocator, Device, Result};

use crate::options::HEADER_BYTES;
use crate::registry::{self, Kind, Ranges, Registry};
use crate::tag::local::{Backup, Holding, Notices, by_device, incomplete, places, tag};

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

/// Resident, mapped handles pause may release: (own device memory, imports). A run is
/// released whole or not at all: if one of its buffers must stay (given to a NIC, say), all
/// stay.
fn releasable(reg: &Registry, ranges: &Ranges) -> (Vec<u64>, Vec<u64>) {
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

/// Own runs NCCL maps none of the buffers of (a chunk whose buffers NCCL has made and not
/// mapped yet), by device: a pause releases them whole too, as it does the runs of the
/// buffers it releases. Runs with a buffer that must stay are kept (see [`releasable`]). Costs
/// a lookup per run; only such a run's buffers are looked for.
fn unmapped_runs(reg: &Registry) -> BTreeMap<i32, Vec<u64>> {
    let mut out: BTreeMap<i32, Vec<u64>> = BTreeMap::new();
    for (&base, run) in &reg.runs {
        // Runs of imports name their owner; a mapping of NCCL's in the run: released with it.
        if run.source.is_some() || reg.mappings.range(base..base + run.size).next().is_some() {
            continue;
        }
        let members: Vec<&registry::Physical> = reg
            .physicals
            .values()
            .filter(|p| p.run == Some(base))
            .collect();
        if let Some(first) = members.first()
            && members
                .iter()
                .all(|p| p.kind == Kind::Device && p.pausable().is_ok())
        {
            out.entry(first.prop.location.id).or_default().push(base);
        }
    }
    out
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
    pub(crate) plan_time: Duration,
    pub(crate) sync_time: Duration,
    pub(crate) queue_time: Duration,
    pub(crate) release_time: Duration,
    pub(crate) ledger_time: Duration,
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
    ranges: &Ranges,
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
    reg.run_unmapped(base, &run);
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
        // Carved from the chunk and not mapped yet: a place NCCL never reserved is memsaver's.
        let unreserved = p.carved.take().filter(|c| !c.reserved);
        p.release()?;
        out.allocations += 1;
        out.bytes += p.size;
        // A buffer NCCL holds but does not map (carved and not mapped yet, or unmapped and
        // not released yet) has no piece: nothing of it is kept, and the backup an earlier
        // pause left is dropped (the resume gives it fresh memory only).
        let piece = pieces.remove(&vh);
        p.backup_len = piece.as_ref().map_or(0, |piece| piece.len as u64);
        p.backup = piece.and_then(|piece| piece.backup);
        if let Some(c) = unreserved {
            reg.free_range(c.at);
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
    let t0 = Instant::now();
    let mut steps = a.steps(Op::Pause);
    let mut reg = registry::lock();
    crate::interpose::guard::set_paused(true);
    let ranges = reg.ranges_by_handle();
    let (own, imports) = releasable(&reg, &ranges);
    let own = by_device(&reg, &ranges, own);
    let imports = by_device(&reg, &ranges, imports);
    let unmapped = unmapped_runs(&reg);
    let mut out = Released::default();
    let devices: std::collections::BTreeSet<i32> = own
        .keys()
        .chain(imports.keys())
        .chain(unmapped.keys())
        .copied()
        .collect();
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
        let t = Instant::now();
        let mut failed = steps.synchronize(&device).err();
        out.sync_time += t.elapsed();
        let t = Instant::now();
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
        let t = Instant::now();
        // Runs are released whole, each once the copies of all its buffers are done.
        let mut runs: BTreeMap<u64, Vec<(u64, Piece)>> = unmapped
            .get(&dev)
            .into_iter()
            .flatten()
            .map(|base| (*base, Vec::new()))
            .collect();
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
    let t = Instant::now();
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
