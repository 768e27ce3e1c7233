//! Allocations shared with other processes: the core's downward interface to the layer that
//! shares them (memsaver-ipc's `shared`), which knows the other processes; the core does not.
//!
//! An allocation becomes *shared* the first time that layer exports it ([`Allocator::share`]).
//! From then on a resume gives it a physical allocation of its own (never one of a `Run`), so
//! every later export of it is a whole handle mapped at offset 0. Around each transition the
//! engine tells the layer which shared allocations it is about to release or has just restored
//! ([`Sharing`]), under the transition lock: the layer makes the importers let go before the
//! owner's memory goes, and map the new memory once the owner's contents are back.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::allocator::Allocator;
use crate::error::{Error, Result};
use crate::table::{Backing, Phase};

/// What the sharing layer does around a transition (registered with
/// [`Allocator::set_sharing`] by a start hook).
pub trait Sharing: Send + Sync {
    /// A pause is about to release the memory of these shared allocations (ids): every other
    /// process must unmap and release its imports of them first, within the layer's deadline.
    /// The pause goes on either way; `Err` names each process that did not let go in time and
    /// what it holds (the pause then reports [`crate::Error::Peer`]: its memory may not be free).
    fn before_release(&self, ids: &[u64]) -> Result<(), String>;
    /// A resume mapped these shared allocations again and restored their contents (or a
    /// pause released before failed for them, so they stayed resident): the importers map
    /// the memory again. `Err` names each process that did not within the deadline (the
    /// resume then reports [`crate::Error::Peer`]; those processes follow once they can).
    fn after_resume(&self, ids: &[u64]) -> Result<(), String>;
    /// The shared allocation `id` is being freed: whatever the layer holds of its memory
    /// (an exported fd keeps the memory alive) must go. The importers keep their mappings, as
    /// with CUDA IPC.
    fn freed(&self, id: u64);
}

/// A shared allocation, as [`Allocator::share`] found it.
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

impl Allocator {
    /// Registers the sharing layer (once; a second call is ignored).
    pub fn set_sharing(&self, s: Arc<dyn Sharing>) {
        let _ = self.sharing.set(s);
    }

    pub(crate) fn sharing(&self) -> Option<&Arc<dyn Sharing>> {
        self.sharing.get()
    }

    /// Marks the allocation holding `ptr` shared (see the module documentation) and describes
    /// it; `UnknownPointer` if memsaver did not allocate `ptr`.
    pub fn share(&self, ptr: u64) -> Result<SharedAllocation> {
        let mut t = self.table.lock();
        let base = t.containing(ptr).map(|(b, _)| b);
        let Some(base) = base else {
            return Err(Error::UnknownPointer { ptr });
        };
        let a = t.allocations.get_mut(&base).expect("found above");
        a.shared = true;
        Ok(SharedAllocation {
            id: a.id,
            base,
            size: a.size,
            tag: a.tag.to_string(),
            device: a.device.ordinal,
        })
    }

    /// A new fd of allocation `id`'s physical memory; `Ok(None)` while it is not resident
    /// (paused, or being paused or resumed), `UnknownPointer` when it is no longer allocated.
    /// The caller serialises this with its own [`Sharing::before_release`] (a pause claims the
    /// allocation before it calls that, so a handle read here stays valid until it returns).
    pub fn export_shared(&self, id: u64) -> Result<Option<ExportedMemory>> {
        let (h, offset, handle_size) = {
            let t = self.table.lock();
            let Some((&base, a)) = t.allocations.iter().find(|(_, a)| a.id == id) else {
                return Err(Error::UnknownPointer { ptr: 0 });
            };
            match a.phase {
                Phase::Resident(Backing::Own(h)) => (h, 0, a.size),
                Phase::Resident(Backing::Run(run)) => {
                    let r = &t.runs[&run];
                    (r.handle, base - run, r.size)
                }
                _ => return Ok(None),
            }
        };
        let fd = self.driver.export_fd(h)?;
        Ok(Some(ExportedMemory {
            fd,
            offset,
            handle_size,
        }))
    }
}
