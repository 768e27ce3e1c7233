//! memsaver's cross-process layer: how memsaver processes of one user find, trust and talk to
//! each other. It knows none of its users by name: nccl-hook shares NCCL's buffers through it,
//! the control service ([`control`]) runs on it, and any tag's memory exported to other
//! processes can use it the same way.
//!
//! Modules, from the bottom up (each uses only those before it):
//! * [`error`]: what went wrong with another process, as values;
//! * [`rundir`]: the runtime directory and its group directories (`<runtime dir>/g<group>/`),
//!   opened without following links and checked on the open descriptor;
//! * [`group`]: the process group in force (`MEMSAVER_GROUP`, [`group::set`]), fixed once the
//!   process serves or imports;
//! * [`identity`]: who a process is (pid, start time, nonce), whether it still runs, whether it
//!   is in this pid namespace, and the socket name that spells its identity;
//! * [`frame`]: the frames on the wire (length prefix, fd passing, the size bound, one deadline
//!   per frame);
//! * [`protocol`]: the messages in the frames (typed, bounded, decoded strictly);
//! * [`log`]: the rate-limited log of the threads that serve other processes;
//! * [`deadline`]: talking to several peers at once under one deadline;
//! * [`token`]: what an owner hands out instead of an exported buffer's fd;
//! * [`epoch`]: an owner's count of its pauses and resumes, in a file its importers read;
//! * [`server`]: a process's server: admission (user, pid namespace, identity, group) and
//!   routing of each request to the [`server::Handler`] a layer above registered for it;
//! * [`client`]: connecting to another process's server and exchanging requests and replies
//!   under one deadline;
//! * [`control`]: pause, resume, stats and profile stages of one process run for another;
//! * [`shared`]: memory shared with other processes, a folder of its own: the CUDA IPC handle
//!   of memsaver memory, the owner's ledger of every export (whether couriers carry the
//!   owner's pauses and resumes to its importers, or the importers follow in a pause of their
//!   own that the owner waits for), its serve path, couriers and `Sharing`, and the importer's
//!   requests and imports: released and rebuilt in the importers around the owner's pauses and
//!   resumes.
//!
//! Who may talk to whom, and what enforces it, is docs/security.md.

pub mod client;
pub mod control;
pub mod deadline;
pub mod epoch;
pub mod error;
pub mod frame;
pub mod group;
pub mod identity;
pub mod log;
pub mod options;
pub mod protocol;
pub mod rundir;
pub mod server;
pub mod shared;
pub mod token;

pub use error::{Error, Result};

use std::path::PathBuf;

use rundir::Found;

/// What `memsaver diagnostics` reports about this process's place among its peers.
#[derive(Debug, serde::Serialize)]
pub struct Diagnosis {
    pub runtime_dir: PathBuf,
    pub runtime_dir_state: Found,
    pub group: i64,
    pub group_dir_state: Found,
    /// The processes serving this group (socket name, pid, alive); a dead one left its socket
    /// behind (it exited without its exit handlers: harmless, nobody else removes it).
    pub owners: Vec<(String, u32, bool)>,
}

/// Checks the runtime directory and the group's directory without creating anything, and
/// lists the group's processes.
pub fn diagnose() -> Diagnosis {
    let runtime_dir = rundir::runtime_dir();
    let group = group::id();
    let (base, dir, entries) = rundir::inspect(&runtime_dir, group);
    Diagnosis {
        runtime_dir,
        runtime_dir_state: base,
        group,
        group_dir_state: dir,
        owners: identity::owners_in(&entries),
    }
}
