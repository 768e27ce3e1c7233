//! The `nccl` tag: pause releases NCCL's device memory behind its virtual handles, in this
//! process and, together with the peers, the references between processes; resume rebuilds it
//! at the same addresses. This module is the order of the steps; the work on this process's
//! memory is [`crate::tag::release`] and [`crate::tag::restore`] (on the engine's steps, as
//! every tag's), the exchanges with the peers [`crate::tag::peer`].
//!
//! Pause, in every process of the group:
//! 1. (registry locked, local work only) synchronise the devices; queue the backup copies of
//!    the device memory NCCL created here; while they run, unmap and release every import of a
//!    peer's buffer; then, as each copy completes, unmap and release this process's own memory;
//!    lower the kernel stack limit NCCL's kernels raised, as far as graphs allow;
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
//! Resume: a thread per owner asks it for the new generation of the buffers imported here
//! while this process re-creates, maps and restores its own memory: first the buffers it
//! exports (the registry lock is dropped after them, so that the peers' requests are served
//! while the private buffers are restored), then the rest. Then the imports each owner served
//! are mapped at their old addresses, owner by owner: the imports of an owner that exited, is
//! stopped or did not serve them by the deadline stay paused, the error names it with what this
//! process imported of it, and a later resume maps them (or finds them freed by NCCL). What an
//! owner served but this process did not map (the driver failed, or the answer came after the
//! deadline) is reported released, so an owner never waits for an import that does not exist.
//! An import whose buffer its owner freed meanwhile (the owner answers `Gone`) is dropped, the
//! others of that owner mapped as usual; NCCL frees the dropped one in its own time.
//! An owner serves a buffer only once its contents are restored. No lock is held while waiting
//! for a peer, so processes resuming (or pausing) together cannot deadlock.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use memsaver_allocator::driver::time_spent;
use memsaver_allocator::steps::external_key;
use memsaver_allocator::{Allocator, DeviceUsage, ExternalTag, Report, Result, Usage};
use memsaver_ipc::group;

use crate::interpose::graphs;
use crate::registry::{self, Kind, TAG};
use crate::tag::peer;
use crate::tag::{release, restore};

pub struct NcclTag {
    allocator: &'static Allocator,
}

impl NcclTag {
    pub fn new(allocator: &'static Allocator) -> Self {
        Self { allocator }
    }
}

/// Bytes the last pause and the last resume copied (`nccl_stats`).
pub(crate) static COPIED: [AtomicU64; 2] = [AtomicU64::new(0), AtomicU64::new(0)];

/// `d` in milliseconds, for the log lines.
fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
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

impl ExternalTag for NcclTag {
    fn pause(&self) -> Result<Report> {
        let start = Instant::now();
        let driver_time = self.allocator.driver().call_time();
        // One deadline for everything this pause waits for.
        let deadline = start + peer::timeout();
        // Also checked by every way in (`crate::allocator`); the NCCL options are this
        // pause's own.
        memsaver_allocator::check_options()?;
        // Buffers exported as plain fds cannot be released: say so instead of reporting a
        // pause that freed nothing of them (nothing is changed).
        if let Some(why) = crate::interpose::tokens::fallback_reason() {
            return Err(peer::peer_error(why));
        }
        let backup = crate::options::get().nccl_backup;
        let mut released = release::release_local(self.allocator, backup)?;
        let group = group::id();
        let notifying = peer::notify_owners(group, std::mem::take(&mut released.notices), deadline);
        if let Some(e) = released.error.take() {
            // The owners waiting for imports this pause left mapped hear it now, not at their
            // deadline; the others take the notices of what it released.
            let owners = release::owners_still_mapped();
            let failing = peer::tell_pause_failed(group, owners, e.to_string(), deadline);
            let what = "pause('nccl') tells the owners of its imports that it failed";
            let _ = failing.finish(deadline, what, group);
            let _ = notifying.finish(deadline, what, group);
            return Err(e);
        }
        graphs::lower_stacks(self.allocator, &released.devices);
        let local_ms = start.elapsed().as_secs_f64() * 1e3;
        let holders = peer::wait_importers(group, deadline);
        let unacked = peer::unacknowledged(notifying.finish(
            deadline,
            "pause('nccl') waits for the owners of its imports to acknowledge their release",
            group,
        ));
        if !holders.0.is_empty() {
            return Err(peer::pause_error(
                group,
                &holders,
                &unacked,
                &released.released_imports,
            ));
        }
        // Nobody holds a run this process released: the buffers NCCL freed inside them go.
        release::forget_retired(&mut registry::lock());
        for (owner, fault) in &unacked {
            let holds = released
                .released_imports
                .get(owner)
                .map_or_else(String::new, |h| {
                    format!(", whose imports of {h} this process released")
                });
            tracing::warn!(
                "memsaver: nccl pause: {}",
                peer::describe(*owner, group, &holds, fault, peer::timeout())
            );
        }
        COPIED[0].store(released.copied, Ordering::Relaxed);
        tracing::info!(
            release_local_ms = local_ms,
            plan_ms = ms(released.plan_time),
            sync_ms = ms(released.sync_time),
            queue_ms = ms(released.queue_time),
            release_ms = ms(released.release_time),
            ledger_ms = ms(released.ledger_time),
            total_ms = start.elapsed().as_secs_f64() * 1e3,
            driver = time_spent(&driver_time, &self.allocator.driver().call_time()),
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
        let driver_time = self.allocator.driver().call_time();
        // One deadline for everything this resume waits for.
        let deadline = start + peer::timeout();
        let group = group::id();
        memsaver_ipc::shared::resume_started();
        // First, while NCCL's memory is not mapped yet: `cuCtxSetLimit` then takes about a
        // millisecond, against 5-13 ms once 16 communicators' memory is back (2 x H200).
        graphs::restore_stacks(self.allocator);
        let stack_ms = start.elapsed().as_secs_f64() * 1e3;
        let fetching = peer::fetch_imports(group, peer::imports_to_fetch(), deadline);
        let local = restore::restore_local(self.allocator).map_err(|e| {
            let e = restore::still_paused(e);
            // The peers waiting for buffers this resume left paused hear it now, not at
            // their deadline.
            memsaver_ipc::shared::resume_failed(e.to_string());
            e
        });
        let restored_ms = start.elapsed().as_secs_f64() * 1e3;
        let fetched = fetching.finish(
            deadline,
            "resume('nccl') waits for the owners of its imports to serve them (they must resume 'nccl' too)",
            group,
        );
        let fetched_ms = start.elapsed().as_secs_f64() * 1e3;
        let before_imports = self.allocator.driver().call_time();
        // The peers' memory is mapped back even if ours could not be (it is on their devices).
        let imported = peer::map_imports(self.allocator, group, fetched);
        let own = local?;
        if !imported.faults.is_empty() {
            return Err(peer::resume_error(group, &imported));
        }
        if let Some(e) = imported.map_error {
            return Err(e);
        }
        let n = own.handles + imported.mapped;
        let (bytes, copied) = (own.bytes, own.copied);
        COPIED[1].store(copied, Ordering::Relaxed);
        let mapped_ms = start.elapsed().as_secs_f64() * 1e3;
        let after_imports = self.allocator.driver().call_time();
        crate::interpose::guard::set_paused(false);
        tracing::info!(
            restore_local_ms = restored_ms,
            plan_ms = ms(own.plan_time),
            record_ms = ms(own.record_time),
            create_map_ms = ms(own.map_time),
            queue_copies_ms = ms(own.queue_time),
            wait_copies_ms = ms(own.wait_time),
            fetch_wait_ms = fetched_ms - restored_ms,
            map_imports_ms = mapped_ms - fetched_ms,
            restore_stack_ms = stack_ms,
            driver = time_spent(&driver_time, &self.allocator.driver().call_time()),
            driver_imports = time_spent(&before_imports, &after_imports),
            allocations = n,
            orphaned_imports = imported.orphaned,
            bytes,
            copied_bytes = copied,
            "nccl resume"
        );
        Ok(report(n, bytes, copied, start))
    }

    fn paused(&self) -> bool {
        crate::interpose::guard::is_paused()
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
