//! External tags: memory that another component of memsaver manages (NCCL's own memory,
//! through `nccl-hook`) but that pauses, resumes and reports with the allocator's tags, in
//! the same calls and under the same one-transition-at-a-time lock.

use crate::engine::Report;
use crate::error::Result;
use crate::stats::DeviceUsage;

/// A tag whose allocations live outside the allocation table.
pub trait ExternalTag: Send + Sync {
    /// Releases the tag's physical memory (idempotent).
    fn pause(&self) -> Result<Report>;
    /// Restores it at the same addresses (idempotent).
    fn resume(&self) -> Result<Report>;
    /// Whether the tag is paused.
    fn paused(&self) -> bool;
    /// Figures per device, as for a tag of the table.
    fn usage(&self) -> Vec<DeviceUsage>;
}
