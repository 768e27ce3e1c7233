//! The owners this process imports NCCL buffers from, and the epoch at which its imports of each
//! were last known to map the owner's current memory (`memsaver_ipc::epoch`). Each guarded NCCL
//! call ([`crate::interpose::guard`]) compares those with what the owners publish: one load of
//! shared memory per owner. An owner found ahead is caught up with by the `nccl` tag's layer
//! ([`crate::tag::catchup`], set as [`CATCH_UP`] at start: this module, below it, never calls up
//! into it by name).

use std::collections::BTreeMap;
use std::sync::OnceLock;

use memsaver_ipc::epoch::{self, Page, Word};
use memsaver_ipc::identity::Identity;
use parking_lot::Mutex;

/// One owner this process imports from.
struct Owner {
    /// Its epoch file, read-only (`None`: it has none; it is not followed).
    page: Option<Page>,
    /// The epoch at which every import of this owner's buffers was last known to map its
    /// current memory.
    synced: u64,
}

/// The owners, by pid (one process per pid at a time: an import of another process with the
/// same pid is refused while this one's are held, `memsaver_ipc::shared::requests::import`).
static OWNERS: Mutex<BTreeMap<u32, Owner>> = Mutex::new(BTreeMap::new());

/// Catches up with every owner [`behind`] finds, or says why the NCCL call must be refused.
pub(crate) type CatchUp = fn() -> Result<(), String>;

/// Set at start by the `nccl` tag's layer.
pub(crate) static CATCH_UP: OnceLock<CatchUp> = OnceLock::new();

/// An import of `owner`'s buffer was served at `epoch` (a new import, through its token).
pub(crate) fn served(group: i64, owner: &Identity, epoch: u64) {
    let mut owners = OWNERS.lock();
    match owners.get_mut(&owner.pid) {
        // The others were current at their epoch, this one at its own: the earlier counts.
        Some(o) => o.synced = o.synced.min(epoch),
        None => {
            let page = epoch::open(group, owner)
                .inspect_err(|e| {
                    tracing::warn!(
                        "memsaver: cannot read the epoch of process {}: {e}; if it pauses \
                         'nccl' without this process, this process follows it only at its own \
                         next pause and resume",
                        owner.pid
                    );
                })
                .ok();
            owners.insert(
                owner.pid,
                Owner {
                    page,
                    synced: epoch,
                },
            );
        }
    }
}

/// Every import of `owner`'s buffers maps what it served at `epoch` or later (a resume, or a
/// catch-up, mapped them all).
pub(crate) fn synced(owner: u32, epoch: u64) {
    if let Some(o) = OWNERS.lock().get_mut(&owner) {
        o.synced = epoch;
    }
}

/// The owners whose published epoch is later than their imports', with what they published.
pub(crate) fn behind() -> Vec<(u32, Word)> {
    OWNERS
        .lock()
        .iter()
        .filter_map(|(pid, o)| {
            let w = o.page.as_ref()?.read();
            (w.epoch > o.synced).then_some((*pid, w))
        })
        .collect()
}

/// Before an NCCL call: catches up with every owner that paused or resumed since this process
/// last followed it. `Err`: why the call must be refused.
pub(crate) fn before_nccl() -> Result<(), String> {
    if behind().is_empty() {
        return Ok(());
    }
    match CATCH_UP.get() {
        Some(catch_up) => catch_up(),
        None => Ok(()),
    }
}
