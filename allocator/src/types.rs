//! The vocabulary of memsaver, and the small value types built on it.
//!
//! # Glossary
//!
//! * **tag**: a name (`weights`, `kv_cache`, `cuda_graph`, `nccl`, ...) given to allocations so
//!   they can be paused and resumed together.
//! * **region**: a scope (thread-local, entered by the caller) during which new allocations get
//!   a tag and a policy.
//! * **policy**: what happens to an allocation's contents across a pause: [`Policy::Discard`]
//!   (dropped; resumed pages hold garbage), [`Policy::Cpu`] (copied to pinned host memory),
//!   [`Policy::Mmap`] (copied to pageable anonymous host memory) or [`Policy::Disk`] (written to
//!   a file in the disk backup directory); restored on resume.
//! * **allocation**: one reserved virtual range with one physical handle mapped into it while
//!   resident. Its address never changes, whatever its state.
//! * **handle**: the driver's physical-memory object (`CUmemGenericAllocationHandle`).
//! * **mapping**: a handle mapped into a virtual range with access granted to the device.
//! * **export / import**: turning a handle into a POSIX fd another process can import as its own
//!   handle to the same physical memory. The exporter of an allocation is its **owner**, a
//!   process that imported it is an **importer**.
//! * **shared allocation**: an allocation the sharing layer has exported (a CUDA IPC handle, or
//!   NCCL's registration of it): from then on a resume gives it physical memory of its own, and
//!   the sharing layer hears of its pauses and resumes (`sharing.rs`).
//! * **generation**: how many times an exported buffer's physical memory has been re-created by
//!   a resume; it names which incarnation a cross-process reference points at. The core does
//!   not count it: the owner's ledger does (memsaver-ipc's `shared`), for every export,
//!   shared allocations and the buffers a layer above exports of its own alike.
//! * **pause**: unmap and release an allocation's physical memory, keeping its virtual range
//!   reserved (after backing up its contents if its policy says so).
//! * **resume**: create fresh physical memory, map it at the same address, and restore the
//!   backup if there is one.
//! * **backup**: where an allocation's contents are kept while it is paused: a pinned (`cpu`) or
//!   pageable (`mmap`) host buffer, or a file (`disk`). With **retention** on (the default) it
//!   is kept across cycles and reused, so pausing allocates no host memory after the first
//!   time; with retention off it is released as soon as its allocation has resumed.
//! * **packed backup**: a pinned backup that holds only the 4 KiB blocks with a non-zero byte,
//!   packed by a kernel, with their index (`packed.rs`); resume zero-fills and puts them back.
//!   The `nccl` tag's by default (`MEMSAVER_PACK`).
//! * **piece**: the unit the pause and resume steps work on: one allocation's (or one NCCL
//!   buffer's) physical memory, its backup and how many bytes a pause keeps (`steps.rs`).
//! * **run**: one physical allocation a resume makes behind several adjacent NCCL buffers, and
//!   an importer's one mapping of a peer's whole run: the driver's cost is per physical
//!   allocation, not per byte (docs/nccl.md, "Runs").
//! * **chunk**: a run made ahead, from which NCCL's small buffers are carved as NCCL creates
//!   them (`MEMSAVER_NCCL_CHUNK_MB`), so that even the first pause releases one allocation per
//!   chunk, not one per buffer.
//! * **ledger**: an owner's record of everything it exported, which generation of each every
//!   importer holds, and its tombstones (memsaver-ipc's `shared/ledger.rs`).
//! * **courier**: an owner's thread that brings one importer of its shared allocations to the
//!   owner's state: released before a pause, mapped again after a resume.
//! * **token**: what an owner hands out instead of an exported buffer's fd (its identity, the
//!   buffer's id and a random key); the importer trades it for the fd with the owner, who
//!   checks it (memsaver-ipc's `token.rs`).
//! * **tombstone**: what a ledger keeps of a freed buffer that importers may still name, so
//!   that their opens of it are answered "gone" rather than refused.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

/// What a pause does with an allocation's contents.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    /// Contents are dropped on pause; after resume the memory holds arbitrary bytes.
    #[default]
    Discard,
    /// Contents are copied to pinned host memory (mapped, then registered in 16 MiB steps with
    /// `cuMemHostRegister`: [`crate::backup::PinnedBuffer`]) on pause and restored on resume:
    /// the fastest copies, but pinned memory is slow to allocate and cannot be swapped.
    Cpu,
    /// Contents are copied to pageable anonymous host memory (`mmap`) on pause and restored on
    /// resume: cheap to allocate and release (the process RSS drops when it is released), slower
    /// copies than pinned memory.
    Mmap,
    /// Contents are written to one file per allocation in the disk backup directory, through a
    /// bounded staging buffer, and read back on resume.
    Disk,
}

impl Policy {
    /// Every policy, in the order messages list them.
    pub const ALL: [Policy; 4] = [Policy::Discard, Policy::Cpu, Policy::Mmap, Policy::Disk];

    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Discard => "discard",
            Policy::Cpu => "cpu",
            Policy::Mmap => "mmap",
            Policy::Disk => "disk",
        }
    }

    /// Whether a pause keeps the contents (every policy but `discard`).
    pub fn keeps_contents(self) -> bool {
        self != Policy::Discard
    }

    /// The accepted names, quoted, for messages: `'discard', 'cpu', 'mmap' or 'disk'`.
    pub fn accepted() -> String {
        let names: Vec<String> = Self::ALL.iter().map(|p| format!("'{p}'")).collect();
        let (last, rest) = names.split_last().expect("not empty");
        format!("{} or {last}", rest.join(", "))
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Policy {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "discard" | "none" => Ok(Policy::Discard),
            "cpu" => Ok(Policy::Cpu),
            "mmap" => Ok(Policy::Mmap),
            "disk" => Ok(Policy::Disk),
            other => Err(crate::Error::InvalidArgument(format!(
                "unknown backup policy '{other}'; expected {}",
                Policy::accepted()
            ))),
        }
    }
}

/// Where an allocation is in its life. Transitions (all others are refused):
///
/// ```text
///            malloc
///              |
///              v         pause            
///         +----------+ ---------> +---------+ --ok--> +--------+
///         | Resident |            | Pausing |         | Paused |
///         +----------+ <--error-- +---------+         +--------+
///              ^                                        |    ^
///              |              +----------+   resume     |    |
///              +------ok----- | Resuming | <------------+    |
///                             +----------+ ------error-------+
/// ```
///
/// `free` is accepted in every state; in `Pausing`/`Resuming` it is recorded and carried out by
/// the pause or resume in flight when it finishes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    Resident,
    Pausing,
    Paused,
    Resuming,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_parses_and_rejects() {
        assert_eq!("cpu".parse::<Policy>().unwrap(), Policy::Cpu);
        assert_eq!("discard".parse::<Policy>().unwrap(), Policy::Discard);
        assert_eq!("mmap".parse::<Policy>().unwrap(), Policy::Mmap);
        assert_eq!("disk".parse::<Policy>().unwrap(), Policy::Disk);
        for p in Policy::ALL {
            assert_eq!(p.as_str().parse::<Policy>().unwrap(), p);
        }
        let err = "tape".parse::<Policy>().unwrap_err().to_string();
        assert!(
            err.contains("'tape'") && err.contains("'discard', 'cpu', 'mmap' or 'disk'"),
            "{err}"
        );
    }
}
