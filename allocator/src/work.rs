//! The work phase of a transition (`engine.rs` claims and settles): the driver calls of one
//! pause or resume, made without the table lock on the jobs the claim took out of the table.
//! A pause queues every job's copy first, then unmaps and releases while the copies run; a
//! resume backs runs of adjacent allocations with one physical allocation each, maps them and
//! queues the copies back. Each job records its outcome (`backing`, `error`) for the settle.

use std::sync::Arc;

use crate::allocator::Allocator;
use crate::device::Device;
use crate::engine::{Job, Runs};
use crate::error::Error;
use crate::steps::{Memory, Place, Steps, is_out_of_memory, oom_error};
use crate::table::{Backing, Run};
use crate::types::Policy;

impl Allocator {
    pub(crate) fn pause_jobs(&self, jobs: &mut [Job], runs: &mut Runs, steps: &mut Steps<'_>) {
        // Nothing may still be running on memory we are about to copy or unmap.
        for dev in devices_of(jobs) {
            if let Err(e) = steps.synchronize(&dev) {
                for j in jobs
                    .iter_mut()
                    .filter(|j| j.device().ordinal == dev.ordinal)
                {
                    j.error = Some(e.clone());
                }
            }
        }
        // Queue every host backup copy; they run while the discard jobs are unmapped below.
        for j in jobs
            .iter_mut()
            .filter(|j| j.error.is_none() && matches!(j.piece.policy, Policy::Cpu | Policy::Mmap))
        {
            if let Err(e) = steps.copy_out(&mut j.piece) {
                j.error = Some(e);
            }
        }
        // Write the disk backups, then unmap and release: discard jobs first (sorted so), each
        // copy job after its copy.
        for j in jobs.iter_mut().filter(|j| j.error.is_none()) {
            if j.piece.policy == Policy::Disk
                && let Err(e) = steps.copy_out(&mut j.piece)
            {
                j.error = Some(e);
                continue;
            }
            // A run is unmapped below, once all of its allocations are ready.
            let Some(Backing::Own(h)) = j.backing else {
                continue;
            };
            let place = [Place {
                ptr: j.ptr(),
                size: j.size(),
                access: None,
            }];
            // SAFETY: mapped; the device was synchronised and our copy has completed.
            let r = steps
                .copied(&mut j.piece)
                .and_then(|()| unsafe { steps.unmap(&j.piece.device, &place) });
            match r {
                Ok(()) => {
                    steps.release(h, j.ptr());
                    j.backing = None;
                }
                Err(e) => {
                    steps.keep(&mut j.piece);
                    j.error.get_or_insert(e);
                }
            }
        }
        // The jobs of each run, in one pass.
        let mut members_of: Runs<Vec<usize>> = Runs::new();
        for (i, j) in jobs.iter().enumerate() {
            if let Some(Backing::Run(base)) = j.backing {
                members_of.entry(base).or_default().push(i);
            }
        }
        for (base, members) in members_of {
            let run = &runs[&base];
            let failed = members.iter().find_map(|&i| jobs[i].error.clone());
            let r = match failed {
                // The run's other allocations cannot be unmapped without it: all stay.
                Some(e) => Err(e),
                None => members
                    .iter()
                    .try_for_each(|&i| steps.copied(&mut jobs[i].piece))
                    .and_then(|()| {
                        let place = [Place {
                            ptr: base,
                            size: run.size,
                            access: None,
                        }];
                        // SAFETY: the run's mapping; the device was synchronised and every
                        // copy out of it has completed.
                        unsafe { steps.unmap(&run.device, &place) }
                    }),
            };
            match r {
                Ok(()) => {
                    let run = runs.remove(&base).expect("claimed with its allocations");
                    self.retire_run(base, &run);
                    for &i in &members {
                        jobs[i].backing = None;
                    }
                }
                Err(e) => {
                    for &i in &members {
                        steps.keep(&mut jobs[i].piece);
                        jobs[i].error.get_or_insert(e.clone());
                    }
                }
            }
        }
    }

    pub(crate) fn resume_jobs(&self, jobs: &mut [Job], runs: &mut Runs, steps: &mut Steps<'_>) {
        let mut out_of_memory: Vec<i32> = Vec::new();
        // A run that does not fit is retried one allocation at a time, so that as much as fits
        // is resumed, as without runs.
        let mut todo: std::collections::VecDeque<_> = units(jobs, steps.plan.merge_limit).into();
        while let Some(unit) = todo.pop_front() {
            let dev = jobs[unit.start].device().clone();
            if out_of_memory.contains(&dev.ordinal) {
                for j in &mut jobs[unit] {
                    j.error = Some(oom_error().into());
                }
                continue;
            }
            let base = jobs[unit.start].ptr();
            let size: usize = jobs[unit.clone()].iter().map(Job::size).sum();
            let tag = jobs[unit.start].piece.tag.clone();
            let place = [Place {
                ptr: base,
                size,
                access: None,
            }];
            let r = steps
                .map_fresh(&dev, Memory::Plain, size, &place, &tag)
                .and_then(|h| {
                    let restored = jobs[unit.clone()]
                        .iter()
                        .filter(|j| j.copies())
                        .try_for_each(|j| steps.copy_in(&j.piece));
                    if let Err(e) = restored {
                        // Nothing of ours may still read or write the range once it is unmapped.
                        let _ = steps.finish(&dev);
                        // SAFETY: mapped by map_fresh; the stream was synchronised.
                        let _ = unsafe { steps.unmap(&dev, &place) };
                        steps.release(h, base);
                        return Err(e);
                    }
                    Ok(h)
                });
            match r {
                Ok(h) => {
                    let backing = if unit.len() == 1 {
                        Backing::Own(h)
                    } else {
                        let run = Run {
                            handle: h,
                            size,
                            device: dev.clone(),
                            live: unit.len(),
                            dead: Vec::new(),
                        };
                        runs.insert(base, run);
                        Backing::Run(base)
                    };
                    for j in &mut jobs[unit] {
                        j.backing = Some(backing);
                    }
                }
                // A run that does not fit, or one of whose backups cannot be restored (a disk
                // file that changed), is retried one allocation at a time: the others resume.
                Err(e)
                    if unit.len() > 1
                        && (is_out_of_memory(&e) || matches!(e, Error::Backup(_))) =>
                {
                    for i in unit.rev() {
                        todo.push_front(i..i + 1);
                    }
                }
                Err(e) if is_out_of_memory(&e) => {
                    out_of_memory.push(dev.ordinal);
                    jobs[unit.start].error = Some(oom_error().into());
                }
                Err(e) => {
                    for j in &mut jobs[unit] {
                        j.error = Some(e.clone());
                    }
                }
            }
        }
        // Wait for the restores; a device whose copies failed rolls its jobs back to paused.
        for dev in devices_of(jobs) {
            let Err(e) = steps.finish(&dev) else {
                continue;
            };
            for j in jobs
                .iter_mut()
                .filter(|j| j.device().ordinal == dev.ordinal)
            {
                let (ptr, size, h) = match j.backing.take() {
                    None => continue,
                    Some(Backing::Own(h)) => (j.ptr(), j.size(), Some(h)),
                    Some(Backing::Run(base)) => match runs.remove(&base) {
                        Some(run) => (base, run.size, Some(run.handle)),
                        None => (base, 0, None), // released with an earlier allocation of it
                    },
                };
                if let Some(h) = h {
                    let place = [Place {
                        ptr,
                        size,
                        access: None,
                    }];
                    // SAFETY: mapped by this resume; the failed stream has no pending work.
                    let _ = unsafe { steps.unmap(&dev, &place) };
                    steps.release(h, ptr);
                }
                j.error = Some(e.clone());
            }
        }
    }
}

/// The jobs of a resume, sorted by device, policy kind and address, cut into runs of adjacent
/// allocations of one tag that one physical allocation of at most `limit` bytes can back
/// (a run of one when `limit` is smaller than the allocation).
fn units(jobs: &[Job], limit: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..=jobs.len() {
        let cut = jobs.get(i).is_none_or(|j| {
            let (first, prev) = (&jobs[start], &jobs[i - 1]);
            j.device().ordinal != first.device().ordinal
                || j.piece.tag != first.piece.tag
                || j.shared
                || first.shared
                || j.copies() != first.copies()
                || j.ptr() != prev.ptr() + prev.size() as u64
                || (j.ptr() + j.size() as u64 - first.ptr()) > limit as u64
        });
        if cut {
            out.push(start..i);
            start = i;
        }
    }
    out
}

/// The distinct devices of `jobs`, in order.
fn devices_of(jobs: &[Job]) -> Vec<Arc<Device>> {
    let mut out: Vec<Arc<Device>> = Vec::new();
    for j in jobs {
        if !out.iter().any(|d| d.ordinal == j.device().ordinal) {
            out.push(j.device().clone());
        }
    }
    out
}
