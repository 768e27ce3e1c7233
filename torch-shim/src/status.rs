//! The status codes of the C ABI, defined once: the list in `statuses!` below makes the Rust
//! enum, the header's `memsaver_status` enum and the Python binding's copy of it
//! (`python/src/abi.rs`); `tests/abi_files.rs` regenerates the last two and fails when the
//! checked-in files differ.

use memsaver_allocator::Error;

/// Defines [`Status`] and its tables from one list: `Variant = code => "C_NAME"`, each with
/// its doc comment (which is also the header's comment for the value).
macro_rules! statuses {
    ($( $(#[doc = $doc:literal])* $variant:ident = $code:literal => $c_name:literal, )*) => {
        /// Status codes of the C ABI. Stable: add new codes, never renumber.
        #[repr(C)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Status {
            $( $(#[doc = $doc])* $variant = $code, )*
        }

        impl Status {
            /// Every status, in the order of the list (ascending codes).
            pub const ALL: &'static [Status] = &[$(Status::$variant,)*];

            /// Its name in C: `MEMSAVER_OK`, `MEMSAVER_ERR_...`.
            pub const fn c_name(self) -> &'static str {
                match self {
                    $(Status::$variant => $c_name,)*
                }
            }

            /// Its name in Rust (the variant), as the Python binding's copy of the enum uses.
            pub const fn rust_name(self) -> &'static str {
                match self {
                    $(Status::$variant => stringify!($variant),)*
                }
            }

            /// Its doc comment, one line per `///` line (each with its leading space).
            pub const fn doc(self) -> &'static [&'static str] {
                match self {
                    $(Status::$variant => &[$($doc,)*],)*
                }
            }
        }
    };
}

statuses! {
    /// Success.
    Ok = 0 => "MEMSAVER_OK",
    /// A bad argument: tag name, tag list, policy, size, NULL pointer, option value.
    InvalidArgument = 1 => "MEMSAVER_ERR_INVALID_ARGUMENT",
    /// A tag that was never used or registered.
    UnknownTag = 2 => "MEMSAVER_ERR_UNKNOWN_TAG",
    /// An allocation with a tag that is paused.
    TagPaused = 3 => "MEMSAVER_ERR_TAG_PAUSED",
    /// A pointer memsaver did not allocate.
    UnknownPointer = 4 => "MEMSAVER_ERR_UNKNOWN_POINTER",
    /// The device ran out of memory.
    OutOfMemory = 5 => "MEMSAVER_ERR_OUT_OF_MEMORY",
    /// Resume ran out of device memory: partly resumed; free memory and resume again.
    ResumeOutOfMemory = 6 => "MEMSAVER_ERR_RESUME_OUT_OF_MEMORY",
    /// A CUDA driver call failed.
    Driver = 7 => "MEMSAVER_ERR_DRIVER",
    /// The CUDA driver could not be loaded.
    DriverNotLoaded = 8 => "MEMSAVER_ERR_DRIVER_NOT_LOADED",
    /// A pause or resume left some allocations in their previous state.
    Incomplete = 9 => "MEMSAVER_ERR_INCOMPLETE",
    /// The caller's buffer is too small; call again with the size written to `*needed`.
    BufferTooSmall = 10 => "MEMSAVER_ERR_BUFFER_TOO_SMALL",
    /// A peer process did not take part in a pause or resume (nccl tag).
    Peer = 11 => "MEMSAVER_ERR_PEER",
    /// An invalid profile: file:line:column: what was expected.
    Profile = 12 => "MEMSAVER_ERR_PROFILE",
    /// Host memory or a file for a backup failed.
    Backup = 13 => "MEMSAVER_ERR_BACKUP",
    /// A control request to another process could not be delivered, was refused or got no
    /// answer (not its operation's own error, which keeps its status).
    Control = 14 => "MEMSAVER_ERR_CONTROL",
    /// A pause refused before anything changed: memory of a tag it names could be handed out
    /// again while paused (a region of the tag is open); the message says what to do.
    PauseRefused = 15 => "MEMSAVER_ERR_PAUSE_REFUSED",
    /// A bug in memsaver (a caught panic): please report it with MEMSAVER_LOG=debug output.
    Internal = 99 => "MEMSAVER_ERR_INTERNAL",
}

impl Status {
    /// The status of a core error.
    pub fn of(e: &Error) -> Self {
        match e {
            Error::Load(_) => Status::DriverNotLoaded,
            Error::Driver(_) => Status::Driver,
            Error::UnknownTag { .. } => Status::UnknownTag,
            Error::TagPaused { .. } => Status::TagPaused,
            Error::UnknownPointer { .. } => Status::UnknownPointer,
            Error::OutOfMemory { .. } => Status::OutOfMemory,
            Error::ResumeOutOfMemory { .. } => Status::ResumeOutOfMemory,
            Error::Incomplete { .. } => Status::Incomplete,
            // A start hook that failed is refused as an invalid option is.
            Error::InvalidArgument(_) | Error::Start(_) => Status::InvalidArgument,
            Error::Peer { .. } => Status::Peer,
            Error::Backup(_) => Status::Backup,
            Error::PauseRefused(_) => Status::PauseRefused,
        }
    }
}
