//! Allocations shared with other processes: the core's downward interface to the layer that
//! shares them (memsaver-ipc's `shared`), which knows the other processes; the core does not.
//! This module holds the interface only (the trait and its value types); the allocator's
//! methods that mark an allocation shared and export its memory are in `export.rs`.
//!
//! An allocation becomes *shared* the first time that layer exports it
//! ([`Allocator::share`](crate::Allocator::share)).
//! From then on a resume gives it a physical allocation of its own (never one of a `Run`), so
//! every later export of it is a whole handle mapped at offset 0. Around each transition the
//! engine tells the layer which shared allocations it is about to release or has just restored
//! ([`Sharing`]), under the transition lock: the layer makes the importers let go before the
//! owner's memory goes, and map the new memory once the owner's contents are back.

use std::os::fd::OwnedFd;

use crate::error::LayerError;

/// What the sharing layer does around a transition (registered with
/// [`Allocator::set_sharing`](crate::Allocator::set_sharing) by a start hook).
pub trait Sharing: Send + Sync {
    /// A pause is about to release the memory of these shared allocations (ids): every other
    /// process must unmap and release its imports of them first, within the layer's deadline.
    /// The pause goes on either way; `Err` names each process that did not let go in time and
    /// what it holds (the pause then reports [`crate::Error::Peer`]: its memory may not be free).
    fn before_release(&self, ids: &[u64]) -> Result<(), LayerError>;
    /// A resume mapped these shared allocations again and restored their contents (or a
    /// pause released before failed for them, so they stayed resident): the importers map
    /// the memory again. `Err` names each process that did not within the deadline (the
    /// resume then reports [`crate::Error::Peer`]; those processes follow once they can).
    fn after_resume(&self, ids: &[u64]) -> Result<(), LayerError>;
    /// The shared allocation `id` is being freed: whatever the layer holds of its memory
    /// (an exported fd keeps the memory alive) must go. The importers keep their mappings, as
    /// with CUDA IPC.
    fn freed(&self, id: u64);
}

/// A shared allocation, as [`Allocator::share`](crate::Allocator::share) found it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedAllocation {
    pub id: u64,
    /// Its base address (the pointer malloc returned).
    pub base: u64,
    pub size: usize,
    pub tag: String,
    pub device: i32,
}

/// An exported fd of a shared allocation's physical memory, and where the allocation lies in it.
pub struct ExportedMemory {
    pub fd: OwnedFd,
    /// The allocation's offset in the exported physical allocation (non-zero only while the
    /// allocation is still backed by a run made before it was first shared).
    pub offset: u64,
    /// The physical allocation's size.
    pub handle_size: usize,
}
