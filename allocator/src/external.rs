//! External tags: memory that another component of memsaver manages (NCCL's own memory,
//! through `nccl-hook`) but that pauses, resumes and reports with the allocator's tags, in
//! the same calls and under the same one-transition-at-a-time lock.

use std::time::Duration;

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

/// What one pause or resume did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Tags the call applied to.
    pub tags: Vec<String>,
    /// Allocations that changed state.
    pub allocations: usize,
    /// Device bytes released (pause) or mapped again (resume).
    pub bytes: u64,
    /// Of those, bytes copied to or from backups (host memory or disk).
    pub copied_bytes: u64,
    pub elapsed: Duration,
}

impl Report {
    /// Adds the figures of another part of the same call.
    pub fn merge(&mut self, other: Report) {
        self.tags.extend(other.tags);
        self.allocations += other.allocations;
        self.bytes += other.bytes;
        self.copied_bytes += other.copied_bytes;
    }
}
