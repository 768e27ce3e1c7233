//! The allocator's error type. Every message says what went wrong and what to do about it.

use crate::driver::{DriverError, LoadError};
use crate::units::human_bytes;

#[derive(Clone, Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Load(#[from] LoadError),

    #[error("CUDA driver call failed: {0}")]
    Driver(#[from] DriverError),

    #[error("unknown tag '{tag}'; known tags: {}", list_or_none(.known))]
    UnknownTag { tag: String, known: Vec<String> },

    #[error("tag '{tag}' is paused; resume it before allocating with it or entering its region")]
    TagPaused { tag: String },

    #[error("pointer {ptr:#x} was not allocated by memsaver (or was already freed)")]
    UnknownPointer { ptr: u64 },

    #[error(
        "out of device memory allocating {} for tag '{tag}' on device {device} ({source}); free \
         memory or pause other tags first",
        human_bytes(*.bytes)
    )]
    OutOfMemory {
        tag: String,
        device: i32,
        bytes: u64,
        source: DriverError,
    },

    #[error(
        "resume ran out of device memory on device {device}: {resumed} allocation(s) resumed, \
         {still_paused} ({}) still paused in tag(s) {}{}; free device memory and call resume again",
        human_bytes(*.bytes_still_paused),
        .tags.join(", "),
        margin_note(*.margin)
    )]
    ResumeOutOfMemory {
        device: i32,
        tags: Vec<String>,
        resumed: usize,
        still_paused: usize,
        bytes_still_paused: u64,
        /// The memory margin in force (0: none): resume leaves at least this much free.
        margin: u64,
    },

    #[error(
        "{op} of tag(s) {} left {failed} allocation(s) in their previous state ({}): {first}; \
         what completed stays done: fix the cause and call {op} again",
        .tags.join(", "),
        if *.op == "resume" { "paused" } else { "resident" }
    )]
    Incomplete {
        op: &'static str,
        tags: Vec<String>,
        failed: usize,
        first: Box<Error>,
    },

    #[error("{tag}: {message}")]
    Peer { tag: String, message: String },

    /// Host memory or a file for a backup could not be made, written or read.
    #[error("backup: {0}")]
    Backup(String),

    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The pause guard (`guard.rs`) refused a pause before anything changed: its memory could
    /// be handed out again while paused.
    #[error("pause refused: {0}")]
    PauseRefused(LayerError),

    /// A layer's start hook failed (`start.rs`): every operation done for the application
    /// reports it, as it reports an invalid option.
    #[error("{0}")]
    Start(LayerError),
}

fn margin_note(margin: u64) -> String {
    if margin == 0 {
        String::new()
    } else {
        format!(
            " (resume keeps a memory margin of {} free: lower it with memsaver.set_memory_margin \
             or MEMSAVER_MEMORY_MARGIN_MB)",
            human_bytes(margin)
        )
    }
}

fn list_or_none(v: &[String]) -> String {
    if v.is_empty() {
        "(none yet: allocate with a tag first)".into()
    } else {
        v.join(", ")
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An error that a layer above the core returns through one of the core's contracts (a start
/// hook, the sharing layer, the pause guard). The core cannot name the layers' error types, so
/// it keeps the layer's typed error whole behind this (a caller that knows the type gets it
/// back with [`LayerError::downcast_ref`]) and shows its message.
#[derive(Clone, Debug)]
pub struct LayerError(std::sync::Arc<dyn std::error::Error + Send + Sync + 'static>);

impl LayerError {
    pub fn new(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self(std::sync::Arc::new(e))
    }

    /// The layer's own error, if it is of type `E`.
    pub fn downcast_ref<E: std::error::Error + 'static>(&self) -> Option<&E> {
        self.0.downcast_ref()
    }
}

impl std::fmt::Display for LayerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for LayerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}
