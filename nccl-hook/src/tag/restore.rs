//! Resume step 1 of the `nccl` tag ([`restore_local`]): this process's own memory created
//! again at the same addresses, a run of adjacent buffers as one physical allocation
//! ([`units`]), exported buffers first, and its backups put back.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use memsaver_allocator::driver::Handle;
use memsaver_allocator::steps::{Memory, Op, Piece, Place, Steps, external_key, is_out_of_memory};
use memsaver_allocator::{Allocator, Backup as HostBackup, Error, Result};

use crate::registry::{self, Ranges, Registry, TAG};
use crate::tag::local::{Backup, by_device, incomplete, places, tag};
use crate::tag::release::forget_retired;

/// Resume restores private buffers in batches of this many physical allocations (a run is
/// one), letting the threads that serve peers in between.
const RESTORE_BATCH: usize = 64;

/// What resume step 1 restored.
#[derive(Default)]
pub(crate) struct Restored {
    pub(crate) handles: usize,
    pub(crate) bytes: u64,
    pub(crate) copied: u64,
    /// Where the time went: creating and mapping memory (with its access), queueing the
    /// zero fills and restores, and waiting for them.
    pub(crate) map_time: Duration,
    pub(crate) queue_time: Duration,
    pub(crate) wait_time: Duration,
    /// Choosing the units (claims, runs) and recording the buffers restored (the ledger
    /// included).
    pub(crate) plan_time: Duration,
    pub(crate) record_time: Duration,
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
        // A buffer NCCL holds but does not map (created and not mapped yet, or unmapped and
        // not released yet: a pause released it with its run) gets fresh memory and nothing
        // else: no backup was taken of it, and NCCL maps it before using it.
        let unmapped = pl.is_empty();
        // Buffers backed up in part (`headers`) get zeros behind what comes back, as NCCL's
        // zeroed allocations had, and packed ones zeros where their blocks held nothing: one
        // fill over the unit, queued before its restores.
        let partial = !unmapped
            && backup != Backup::Discard
            && unit.iter().zip(&pieces).any(|(vh, piece)| {
                let p = &reg.physicals[vh];
                p.backup_len < p.size || matches!(piece.backup, Some(HostBackup::Packed(..)))
            });
        let t0 = Instant::now();
        let mapped = steps
            .map_fresh(&dev, Memory::Like(&prop), size as usize, &pl, TAG)
            .and_then(|h| {
                total.map_time += t0.elapsed();
                let t1 = Instant::now();
                let filled = if partial {
                    steps.zero(&dev, pl[0].ptr, size as usize)
                } else {
                    Ok(())
                };
                let copied = filled.and_then(|()| {
                    pieces
                        .iter()
                        .filter(|_| !unmapped)
                        .try_for_each(|piece| steps.copy_in(piece))
                });
                total.queue_time += t1.elapsed();
                match copied {
                    Ok(()) => Ok(h),
                    Err(e) => {
                        let _ = steps.finish(&dev);
                        // SAFETY: mapped just above; the stream was synchronised.
                        let _ = unsafe { steps.unmap(&dev, &pl) };
                        steps.release(h, pl.first().map_or(0, |p| p.ptr));
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
    let t0 = Instant::now();
    let mut r = steps.finish(&dev).and(r);
    total.wait_time += t0.elapsed();
    let t0 = Instant::now();
    // Exported buffers restored: each starts its next generation in the owner's ledger.
    let mut exports = Vec::new();
    for (unit, h, pieces) in made {
        let base = pieces[0].ptr;
        if unit.len() > 1 {
            let size = unit.iter().map(|vh| reg.physicals[vh].size).sum();
            reg.runs
                .insert(base, registry::Run::new(size, h.0, unit.len()));
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
fn units(reg: &Registry, ranges: &Ranges, vhs: Vec<u64>, limit: u64) -> Vec<Vec<u64>> {
    // (address, size) of a buffer that may join a run: mapped once, whole.
    let whole = |vh: &u64| -> Option<(u64, u64)> {
        let p = &reg.physicals[vh];
        match ranges.get(vh).map(Vec::as_slice) {
            Some([(ptr, size, _)]) if *size == p.size => Some((*ptr, *size)),
            _ => None,
        }
    };
    let mut vhs = vhs;
    vhs.sort_by_cached_key(|vh| ranges.get(vh).and_then(|rs| rs.first()).map_or(0, |r| r.0));
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
    let t0 = Instant::now();
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
        let mut p =
            registry::Physical::created(at, mib * MIB, prop(device), registry::Kind::Device);
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
