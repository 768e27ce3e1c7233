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
    /// Anything else (this process's own driver or server), as its message.
    #[error("{0}")]
    Other(String),
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

impl From<Error> for String {
    fn from(e: Error) -> String {
        e.to_string()
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
