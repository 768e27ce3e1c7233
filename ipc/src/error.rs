//! The errors of the cross-process layer: what went wrong with another process, as values a
//! caller can act on (a process that is gone is not one that is busy or one that refused), each
//! with the message a user reads.

/// The refusal of a request that arrived while a process's server had too many waiting: the
/// client tries again ([`crate::client::exchange`] does, with backoff, within its deadline).
pub const BUSY: &str = "too many requests are waiting for this process already: retry later";

/// What went wrong between this process and another.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An option of this layer is invalid; the message names the variable and what it accepts.
    #[error("{0}")]
    Option(String),
    /// The other process is of another group.
    #[error(
        "the memory belongs to process {pid} of group {theirs}, this process is in group {mine}: \
         groups do not share memory; give every process of one job the same group \
         (MEMSAVER_GROUP, memsaver.set_group or ncclSetGroupID)"
    )]
    OtherGroup { pid: u32, theirs: i64, mine: i64 },
    /// Nobody serves the process's socket: it exited (a socket it left refuses connections), or
    /// it runs with another runtime directory or group.
    #[error(
        "process {pid} does not serve {path} ({source}): it exited, or runs with another \
         MEMSAVER_RUNTIME_DIR or group"
    )]
    NotServed {
        pid: u32,
        path: String,
        source: std::io::Error,
    },
    /// The socket is served, but not by the process named: another user, another pid namespace,
    /// or a later process with the pid.
    #[error("{0}")]
    NotThatProcess(String),
    /// The process refused the request (not admitted, or naming memory it does not have with
    /// that key).
    #[error("process {pid} refused: {reason}")]
    Refused { pid: u32, reason: String },
    /// The process was too busy to admit the request, until the deadline.
    #[error("process {pid} refused: {BUSY}")]
    Busy { pid: u32 },
    /// The owner has the memory paused.
    #[error("process {pid} has this memory paused: resume its tag in process {pid} first")]
    Paused { pid: u32 },
    /// The owner's own resume of the memory failed, leaving it paused there; its error.
    #[error("process {pid}'s own resume failed: {message}")]
    OwnerFailed { pid: u32, message: String },
    /// The exchange broke on the wire: a deadline passed, the connection closed, an answer that
    /// does not decode or is not the one expected.
    #[error("process {pid}: {what}")]
    Wire { pid: u32, what: String },
    /// The owner exited.
    #[error("the owner of this memory, process {pid}, exited: {cause}")]
    OwnerExited { pid: u32, cause: Box<Error> },
    /// The owner could not export the memory asked for (its driver failed, or the buffer was
    /// freed there).
    #[error("process {pid} could not export {what} (its driver failed, or it was freed there)")]
    ExportFailed { pid: u32, what: String },
    /// The owner did not restore the memory within the wait: it is still paused there.
    #[error(
        "process {pid} did not restore buffer {id:#x} (generation {generation}) within {waited_ms} \
         ms; every process of the group must resume that memory too"
    )]
    NotRestored {
        pid: u32,
        id: u64,
        generation: u64,
        waited_ms: u128,
    },
    /// The owner freed the buffer before this process imported it.
    #[error("process {pid} freed buffer {id:#x} before this process imported it")]
    Freed { pid: u32, id: u64 },
    /// The owner re-created the memory in a layout that does not fit what this process
    /// reserved for it.
    #[error("process {pid} re-created the memory in a layout that does not fit the reserved range")]
    Layout { pid: u32 },
    /// An importer answered the owner's release or rebuild with its own failure.
    #[error("{message}")]
    ImporterFailed { pid: u32, message: String },
    /// Importers (or this process's own other holds) did not follow a pause or resume of
    /// shared memory by the deadline; `report` names each, what it holds and why.
    #[error("{report}")]
    Behind { pids: Vec<u32>, report: String },
    /// This process cannot export the memory asked for; why (freed, not resident).
    #[error("{why}")]
    CannotExport { why: &'static str },
    /// A hold of a layer above on shared memory (nccl-hook: NCCL's own mapping of a buffer it
    /// registered) could not follow the memory.
    #[error("{what}: {source}")]
    Hold {
        what: &'static str,
        source: memsaver_allocator::Error,
    },
    /// Memory of this very process was asked for as an import.
    #[error("{how}: this is memory of this very process (use the pointer itself)")]
    OwnMemory { how: &'static str },
    /// A token that names something other than a memsaver allocation.
    #[error("not a token of a memsaver allocation")]
    NotAnAllocation,
    /// This process imported nothing of the process with that pid.
    #[error("process {pid}: this process has no token of it")]
    NoToken { pid: u32 },
    /// A control request names no process that serves it (none in the group, this very
    /// process, or one of another group); says which and what to do.
    #[error("{0}")]
    NoTarget(String),
    /// This process was asked for a control operation but does not serve them.
    #[error(
        "process {pid} does not serve control requests: start it with MEMSAVER_CONTROL=1 or \
         call memsaver.serve_control() in it"
    )]
    NoControl { pid: u32 },
    /// Too many control requests wait for this process's control thread already.
    #[error("process {pid} has {queued} control requests waiting already: retry later")]
    ControlQueueFull { pid: u32, queued: usize },
    /// A thread of this process panicked (a bug in memsaver).
    #[error("internal error while {what} (a bug)")]
    Panicked { what: &'static str },
    /// A control request beyond the protocol's limits (checked before sending).
    #[error("invalid control request: {0}")]
    Request(#[from] crate::protocol::Beyond),
    /// This process cannot serve its memsaver socket (needed to `doing`).
    #[error("{doing}: this process cannot serve its socket: {source}")]
    CannotServe {
        doing: &'static str,
        source: std::sync::Arc<std::io::Error>,
    },
    /// A file or socket of this process's own (its runtime directory, a random key) failed.
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    /// This process's own allocator or driver failed.
    #[error("{0}")]
    Allocator(#[from] memsaver_allocator::Error),
    /// An import was served but could not be mapped here.
    #[error("cannot map memory of process {pid}: {source}")]
    Map {
        pid: u32,
        source: memsaver_allocator::Error,
    },
    /// An import was closed here, but its owner was not told.
    #[error("closed, but process {pid} was not told: {cause}")]
    NotTold { pid: u32, cause: Box<Error> },
    /// Several errors of one step (each of this process's holders and its importers).
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Several(Vec<Error>),
    /// A thread of this process could not be started.
    #[error("cannot start a thread ({what}): {source}")]
    Thread {
        what: &'static str,
        source: std::sync::Arc<std::io::Error>,
    },
}

impl Error {
    /// Whether the other process is gone for good (a dead process holds nothing).
    pub fn gone(&self) -> bool {
        match self {
            Error::NotServed { source, .. } => matches!(
                source.kind(),
                std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
            ),
            Error::OwnerExited { .. } => true,
            _ => false,
        }
    }
}

impl From<Error> for memsaver_allocator::LayerError {
    fn from(e: Error) -> Self {
        Self::new(e)
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    /// An error handed to the core through one of its contracts stays this layer's error: the
    /// core shows its message, and a caller that knows the type gets the variant back.
    #[test]
    fn an_error_through_the_cores_contracts_keeps_its_type() {
        let e = memsaver_allocator::LayerError::from(Error::Behind {
            pids: vec![7, 9],
            report: "2 process(es) behind".into(),
        });
        assert_eq!(e.to_string(), "2 process(es) behind");
        assert!(
            matches!(e.downcast_ref::<Error>(), Some(Error::Behind { pids, .. }) if pids == &[7, 9]),
            "{e:?}"
        );
        assert!(e.downcast_ref::<std::io::Error>().is_none());
        let wrapped = memsaver_allocator::Error::Start(e.clone());
        assert_eq!(wrapped.to_string(), e.to_string());
    }

    /// Several errors of one step are each named, in order.
    #[test]
    fn several_errors_name_each() {
        let e = Error::Several(vec![Error::NoToken { pid: 3 }, Error::Layout { pid: 4 }]);
        assert_eq!(
            e.to_string(),
            "process 3: this process has no token of it; process 4 re-created the memory in a \
             layout that does not fit the reserved range"
        );
    }
}
