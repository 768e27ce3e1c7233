//! The allocator's side of sharing allocations with other processes (the interface is in
//! `sharing.rs`): marking an allocation shared, and exporting its physical memory as an fd.

use crate::allocator::Allocator;
use crate::error::{Error, Result};
use crate::sharing::{ExportedMemory, SharedAllocation};
use crate::table::{Backing, Phase};

impl Allocator {
    /// Marks the allocation holding `ptr` shared (see `sharing.rs`) and describes
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
    /// The caller serialises this with its own [`Sharing::before_release`](crate::Sharing::before_release) (a pause claims the
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
