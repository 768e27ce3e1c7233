//! One topic: the owner as the allocator sees it. [`Owner`] is the allocator's
//! [`memsaver_allocator::Sharing`]: before a pause releases shared allocations it marks them
//! paused and waits for their importers (and this process's other holds, [`Aliases`]); after a
//! resume it starts their next generation and waits again. Also the figures of what this
//! process exported ([`exports`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use memsaver_allocator::{Allocator, LayerError, StartHook};

use super::couriers::*;
use super::ledger::*;
use crate::deadline::{Progress, listed};
use crate::error::{Error, Result};
use crate::group;
use crate::identity::Identity;
use crate::options::{TIMEOUT_SETTING, timeout};

/// The allocator's [`memsaver_allocator::Sharing`]: releases and rebuilds of importers.
pub struct Owner;

impl Owner {
    /// Moves the exports `ids` to `memory` (a resume: the next generation), starts the couriers
    /// of their importers and waits until every importer holds what it should, or the deadline.
    /// `Err` says which processes are behind, what they hold, and why.
    fn transition(&self, ids: &[u64], memory: Memory) -> Result<()> {
        let mut l = LEDGER.lock();
        let importers = l.mark(Delivery::Courier, ids, memory);
        for who in &importers {
            dispatch(&mut l, *who);
        }
        let deadline = Instant::now() + timeout();
        let mut progress = Progress::new(deadline, TIMEOUT_SETTING);
        let group = group::id();
        loop {
            let behind: Vec<Identity> = importers
                .iter()
                .copied()
                .filter(|who| {
                    ids.iter().any(|id| {
                        l.exports.get(&(Delivery::Courier, *id)).is_some_and(|e| {
                            e.importers.get(who).is_some_and(|i| i.has != e.wanted())
                        })
                    })
                })
                .collect();
            if behind.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::Behind {
                    pids: behind.iter().map(|w| w.pid).collect(),
                    report: report(&l, ids, &behind, memory, group),
                });
            }
            SETTLED.wait_until(&mut l, progress.next());
            progress.say(|| {
                let who: Vec<String> = behind
                    .iter()
                    .map(|w| format!("process {} (group {group})", w.pid))
                    .collect();
                format!(
                    "waiting for processes that map memsaver memory of this one to {}: {}",
                    what(memory),
                    listed(&who)
                )
            });
        }
    }
}

pub(super) fn what(memory: Memory) -> &'static str {
    match memory {
        Memory::Paused => "release it",
        Memory::Resident => "map it again",
    }
}

/// The message of a transition that importers `behind` did not follow by the deadline.
pub(super) fn report(
    l: &Ledger,
    ids: &[u64],
    behind: &[Identity],
    memory: Memory,
    group: i64,
) -> String {
    let lines: Vec<String> = behind
        .iter()
        .map(|who| {
            let (mut n, mut bytes, mut tags) = (0, 0, BTreeSet::new());
            for id in ids {
                if let Some(e) = l.exports.get(&(Delivery::Courier, *id))
                    && e.importers.get(who).is_some_and(|i| i.has != e.wanted())
                {
                    n += 1;
                    bytes += e.size;
                    tags.insert(e.tag.as_str());
                }
            }
            let why = l.failures.get(who).cloned().unwrap_or_else(|| {
                let stopped = if stopped(who) { " (it is stopped)" } else { "" };
                format!("no answer within {} ms{stopped}", timeout().as_millis())
            });
            format!(
                "process {} (group {group}) did not {} {n} buffer(s) of {} MiB of tag(s) {}: {why}",
                who.pid,
                match memory {
                    Memory::Paused => "release",
                    Memory::Resident => "map again",
                },
                bytes.div_ceil(1 << 20),
                tags.into_iter().collect::<Vec<_>>().join(", ")
            )
        })
        .collect();
    let consequence = match memory {
        Memory::Paused => {
            "this process's pause is done, but their mappings keep that memory in use"
        }
        Memory::Resident => {
            "this process's resume is done; they map the memory again once they can, and \
             reading it there before that faults"
        }
    };
    format!(
        "{consequence} ({} process(es) behind after {} ms, {TIMEOUT_SETTING}): {}",
        behind.len(),
        timeout().as_millis(),
        lines.join("; ")
    )
}

/// This process's own second mappings of its shared allocations, made by a layer above
/// (nccl-hook: NCCL retains the handle of a buffer it registers as a window and maps it again
/// in its own address space). They hold the memory as an importer's would: the owner releases
/// them before its memory goes and maps them again once the memory is back, with its
/// importers, and a failure is reported as theirs is.
pub trait Aliases: Sync {
    /// Unmaps and releases this process's other holds on the memory of allocations `ids`
    /// (their addresses stay reserved), once no queued work uses them.
    fn release(&self, ids: &[u64]) -> Result<()>;
    /// Maps the new memory of allocations `ids` where those holds were.
    fn rebuild(&self, ids: &[u64]) -> Result<()>;
}

/// The registered [`Aliases`] (linked in by the layers above).
#[linkme::distributed_slice]
pub static ALIASES: [&'static dyn Aliases];

/// `step` on every registered [`Aliases`], then `peers`: every error of either (one as
/// itself, more as [`Error::Several`]).
pub(super) fn with_aliases(
    step: impl Fn(&dyn Aliases) -> Result<()>,
    peers: impl FnOnce() -> Result<()>,
) -> Result<()> {
    let mut errors: Vec<Error> = ALIASES.iter().filter_map(|a| step(*a).err()).collect();
    errors.extend(peers().err());
    match errors.pop() {
        None => Ok(()),
        Some(only) if errors.is_empty() => Err(only),
        Some(last) => {
            errors.push(last);
            Err(Error::Several(errors))
        }
    }
}

impl memsaver_allocator::Sharing for Owner {
    fn before_release(&self, ids: &[u64]) -> Result<(), LayerError> {
        with_aliases(|a| a.release(ids), || self.transition(ids, Memory::Paused))
            .map_err(Into::into)
    }

    fn after_resume(&self, ids: &[u64]) -> Result<(), LayerError> {
        with_aliases(
            |a| a.rebuild(ids),
            || self.transition(ids, Memory::Resident),
        )
        .map_err(Into::into)
    }

    fn freed(&self, id: u64) {
        forget(Delivery::Courier, id);
    }
}

#[linkme::distributed_slice(memsaver_allocator::START_HOOKS)]
pub(super) static START: StartHook = StartHook {
    name: "memsaver-ipc shared memory",
    order: 0,
    run: register,
};

pub(super) fn register(a: &'static Allocator) -> Result<(), LayerError> {
    a.set_sharing(Arc::new(Owner));
    Ok(())
}

/// What [`exports`] reports of one tag's exports.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct ExportStats {
    pub handles: u64,
    pub bytes: u64,
    /// Importers, counted once per export they import.
    pub importers: u64,
    /// Bytes of this tag's paused exports that some importer still maps (its pause did not
    /// free them).
    pub held_while_paused: u64,
    /// Imports of this tag's exports that do not hold what the owner's state says (not yet
    /// released, or not yet mapped again): their importers' couriers are still at work, or
    /// (collective exports) the importers have not paused or resumed yet.
    pub imports_behind: u64,
}

/// This process's exports, per tag, of either delivery (exports whose memory was freed are
/// forgotten here).
pub fn exports() -> BTreeMap<String, ExportStats> {
    let mut out: BTreeMap<String, ExportStats> = BTreeMap::new();
    let l = LEDGER.lock();
    for e in l.exports.values() {
        let s = out.entry(e.tag.clone()).or_default();
        s.handles += 1;
        s.bytes += e.size;
        s.importers += e.importers.len() as u64;
        s.imports_behind += e.importers.values().filter(|i| i.has != e.wanted()).count() as u64;
        if e.memory == Memory::Paused
            && e.importers
                .values()
                .any(|i| matches!(i.has, Has::Mapped(_)))
        {
            s.held_while_paused += e.size;
        }
    }
    out
}
