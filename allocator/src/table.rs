//! The allocation table: every allocation of the process, keyed by its base address, and the
//! registry of tags. It is bookkeeping only; the driver work happens outside its lock.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::backup::{Backup, BackupKind};
use crate::device::Device;
use crate::driver::Handle;
use crate::types::{Policy, State};

/// What backs a resident allocation: a physical allocation of its own, or the one of a [`Run`]
/// it shares with the allocations next to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Backing {
    Own(Handle),
    /// The run at this base address (a key of [`Table::runs`]).
    Run(u64),
}

/// One physical allocation mapped across several adjacent allocations of one tag, as a resume
/// makes them (one `cuMemCreate`, `cuMemMap` and `cuMemSetAccess` instead of one per
/// allocation; the driver's cost is per call). It lives until the tag's next pause or until
/// all its allocations are freed: an allocation freed before that keeps its address range
/// reserved and its bytes held (`dead`), since part of a mapping cannot be unmapped.
pub(crate) struct Run {
    pub handle: Handle,
    pub size: usize,
    pub device: Arc<Device>,
    /// Allocations of the run still in the table.
    pub live: usize,
    /// Ranges of freed allocations: reserved until the run is unmapped, then freed.
    pub dead: Vec<(u64, usize)>,
}

/// Where an allocation's physical memory is. The backing exists exactly while `Resident`, so it
/// lives inside that variant; during `Pausing` and `Resuming` the engine holds it.
pub(crate) enum Phase {
    Resident(Backing),
    Pausing,
    Paused,
    Resuming,
}

impl Phase {
    pub(crate) fn state(&self) -> State {
        match self {
            Phase::Resident(_) => State::Resident,
            Phase::Pausing => State::Pausing,
            Phase::Paused => State::Paused,
            Phase::Resuming => State::Resuming,
        }
    }
}

pub(crate) struct Allocation {
    /// Unique in the process for the allocator's life (addresses are reused, ids never).
    pub id: u64,
    pub tag: Arc<str>,
    pub device: Arc<Device>,
    /// Bytes reserved and, while resident, mapped: the request rounded up to the granularity.
    pub size: usize,
    pub policy: Policy,
    pub phase: Phase,
    /// The copy of the contents (every policy but `discard`), made at the first pause; kept
    /// across cycles while retention is on. When present it holds the contents as of the last
    /// completed pause. `None` while the engine holds it during a transition.
    pub backup: Option<Backup>,
    /// `free` was called while a pause or resume held this allocation; the engine frees it when
    /// it is done.
    pub free_pending: bool,
    /// Exported to other processes at least once (`sharing.rs`): a resume backs it with a
    /// physical allocation of its own, never a run.
    pub shared: bool,
}

impl Allocation {
    pub(crate) fn resident_bytes(&self) -> usize {
        match self.phase {
            Phase::Resident(_) | Phase::Pausing => self.size,
            Phase::Paused | Phase::Resuming => 0,
        }
    }

    /// The kind and size of the backup, if there is one.
    pub(crate) fn backup_usage(&self) -> Option<(BackupKind, usize)> {
        self.backup.as_ref().map(|b| (b.kind(), b.len()))
    }
}

#[derive(Default)]
pub(crate) struct TagEntry {
    /// Set by pause and cleared by a resume that completed. While set, new allocations with
    /// this tag are refused, unless `allocates_while_paused`.
    pub paused: bool,
    /// The whole-process tag: new allocations are accepted (resident) while it is paused,
    /// because torch's caching allocator may need memory during a pause; resume skips them.
    pub allocates_while_paused: bool,
    /// By device: the end of the tag's last allocation there (see `placement_hint`).
    pub next_address: std::collections::HashMap<i32, u64>,
}

#[derive(Default)]
pub(crate) struct Table {
    /// By base address, ordered so that the allocation holding an interior address is found
    /// with one range lookup.
    pub allocations: BTreeMap<u64, Allocation>,
    pub tags: BTreeMap<Arc<str>, TagEntry>,
    /// The id of the next allocation.
    pub next_id: u64,
    /// Physical allocations shared by adjacent allocations, by base address.
    pub runs: BTreeMap<u64, Run>,
}

impl Table {
    /// The tag's interned name, registering it on first use.
    pub(crate) fn intern(&mut self, tag: &str) -> Arc<str> {
        if let Some((k, _)) = self.tags.get_key_value(tag) {
            return k.clone();
        }
        let k: Arc<str> = Arc::from(tag);
        self.tags.insert(k.clone(), TagEntry::default());
        k
    }

    /// The allocation whose range holds `ptr`, with its base address.
    pub(crate) fn containing(&self, ptr: u64) -> Option<(u64, &Allocation)> {
        let (&base, a) = self.allocations.range(..=ptr).next_back()?;
        (ptr - base < a.size as u64).then_some((base, a))
    }

    /// Where a new allocation of `tag` on `device` would best be reserved: right after the
    /// tag's last allocation there, so that allocations made one after the
    /// other are adjacent and a resume can back them with one physical allocation. 0 when the
    /// tag has none on the device.
    pub(crate) fn placement_hint(&self, tag: &str, device: i32) -> u64 {
        self.tags
            .get(tag)
            .and_then(|t| t.next_address.get(&device))
            .copied()
            .unwrap_or(0)
    }

    /// Bytes of freed allocations still held by runs.
    pub(crate) fn held_by_runs(&self) -> u64 {
        self.runs
            .values()
            .flat_map(|r| &r.dead)
            .map(|(_, n)| *n as u64)
            .sum()
    }

    pub(crate) fn known_tags(&self) -> Vec<String> {
        self.tags.keys().map(|k| k.to_string()).collect()
    }
}
