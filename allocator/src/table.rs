//! The allocation table: every allocation of the process, keyed by its base address, and the
//! registry of tags. It is bookkeeping only; the driver work happens outside its lock.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::backup::HostBuffer;
use crate::device::Device;
use crate::driver::Handle;
use crate::types::{Policy, State};

/// Where an allocation's physical memory is. The handle exists exactly while `Resident`, so it
/// lives inside that variant; during `Pausing` and `Resuming` the engine holds it.
pub(crate) enum Phase {
    Resident(Handle),
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
    pub tag: Arc<str>,
    pub device: Arc<Device>,
    /// Bytes reserved and, while resident, mapped: the request rounded up to the granularity.
    pub size: usize,
    pub policy: Policy,
    pub phase: Phase,
    /// The pinned copy of the contents (`cpu` policy only), kept across cycles once made.
    /// `None` while the engine holds it during a transition.
    pub backup: Option<HostBuffer>,
    /// Incremented at every successful resume.
    pub generation: u64,
    /// `free` was called while a pause or resume held this allocation; the engine frees it when
    /// it is done.
    pub free_pending: bool,
}

impl Allocation {
    pub(crate) fn resident_bytes(&self) -> usize {
        match self.phase {
            Phase::Resident(_) | Phase::Pausing => self.size,
            Phase::Paused | Phase::Resuming => 0,
        }
    }

    pub(crate) fn backup_bytes(&self) -> usize {
        self.backup.as_ref().map_or(0, HostBuffer::len)
    }
}

#[derive(Default)]
pub(crate) struct TagEntry {
    /// Set by pause and cleared by a resume that completed. While set, new allocations with
    /// this tag are refused.
    pub paused: bool,
}

#[derive(Default)]
pub(crate) struct Table {
    pub allocations: HashMap<u64, Allocation>,
    pub tags: BTreeMap<Arc<str>, TagEntry>,
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

    pub(crate) fn known_tags(&self) -> Vec<String> {
        self.tags.keys().map(|k| k.to_string()).collect()
    }
}
