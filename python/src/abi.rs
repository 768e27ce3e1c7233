//! The C ABI of libmemsaver.so as the binding sees it: the status codes and the functions
//! it resolves. Generated from torch-shim/src by torch-shim/tests/abi_files.rs (`make abi`):
//! do not edit.

/// The status codes of the C ABI (`memsaver_status` in memsaver.h).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// Success.
    Ok = 0,
    /// A bad argument: tag name, tag list, policy, size, NULL pointer, option value.
    InvalidArgument = 1,
    /// A tag that was never used or registered.
    UnknownTag = 2,
    /// An allocation with a tag that is paused.
    TagPaused = 3,
    /// A pointer memsaver did not allocate.
    UnknownPointer = 4,
    /// The device ran out of memory.
    OutOfMemory = 5,
    /// Resume ran out of device memory: partly resumed; free memory and resume again.
    ResumeOutOfMemory = 6,
    /// A CUDA driver call failed.
    Driver = 7,
    /// The CUDA driver could not be loaded.
    DriverNotLoaded = 8,
    /// A pause or resume left some allocations in their previous state.
    Incomplete = 9,
    /// The caller's buffer is too small; call again with the size written to `*needed`.
    BufferTooSmall = 10,
    /// A peer process did not take part in a pause or resume (nccl tag).
    Peer = 11,
    /// An invalid profile: file:line:column: what was expected.
    Profile = 12,
    /// Host memory or a file for a backup failed.
    Backup = 13,
    /// A control request to another process could not be delivered, was refused or got no
    /// answer (not its operation's own error, which keeps its status).
    Control = 14,
    /// A pause refused before anything changed: memory of a tag it names could be handed out
    /// again while paused (a region of the tag is open); the message says what to do.
    PauseRefused = 15,
    /// A bug in memsaver (a caught panic): please report it with MEMSAVER_LOG=debug output.
    Internal = 99,
}

impl Status {
    /// The status of a code; `None` for a code this binding does not know.
    pub fn from_code(code: i32) -> Option<Self> {
        match code {
            0 => Some(Self::Ok),
            1 => Some(Self::InvalidArgument),
            2 => Some(Self::UnknownTag),
            3 => Some(Self::TagPaused),
            4 => Some(Self::UnknownPointer),
            5 => Some(Self::OutOfMemory),
            6 => Some(Self::ResumeOutOfMemory),
            7 => Some(Self::Driver),
            8 => Some(Self::DriverNotLoaded),
            9 => Some(Self::Incomplete),
            10 => Some(Self::BufferTooSmall),
            11 => Some(Self::Peer),
            12 => Some(Self::Profile),
            13 => Some(Self::Backup),
            14 => Some(Self::Control),
            15 => Some(Self::PauseRefused),
            99 => Some(Self::Internal),
            _ => None,
        }
    }
}

/// Calls the macro `$m` with `name: type,` for every function of the C ABI the binding
/// calls (all but torch's pluggable-allocator entry points).
macro_rules! with_functions {
    ($m:ident) => {
        $m! {
            memsaver_last_error: unsafe extern "C" fn() -> *const c_char,
            memsaver_malloc: unsafe extern "C" fn(*mut *mut c_void, usize, c_int, *const c_char, *const c_char) -> c_int,
            memsaver_free: unsafe extern "C" fn(*mut c_void) -> c_int,
            memsaver_pause: unsafe extern "C" fn(*const c_char) -> c_int,
            memsaver_resume: unsafe extern "C" fn(*const c_char) -> c_int,
            memsaver_pause_with_backup: unsafe extern "C" fn(*const c_char, *const c_char) -> c_int,
            memsaver_discard: unsafe extern "C" fn(*const c_char) -> c_int,
            memsaver_resume_keep_backups: unsafe extern "C" fn(*const c_char, c_int) -> c_int,
            memsaver_allocations_json: unsafe extern "C" fn(*const c_char, *mut c_char, usize, *mut usize) -> c_int,
            memsaver_register_tag: unsafe extern "C" fn(*const c_char) -> c_int,
            memsaver_stats_json: unsafe extern "C" fn(*mut c_char, usize, *mut usize) -> c_int,
            memsaver_nccl_stats_json: unsafe extern "C" fn(*mut c_char, usize, *mut usize) -> c_int,
            memsaver_nccl_diagnose_json: unsafe extern "C" fn(*mut c_char, usize, *mut usize) -> c_int,
            memsaver_disk_diagnose_json: unsafe extern "C" fn(*mut c_char, usize, *mut usize) -> c_int,
            memsaver_nccl_set_group: unsafe extern "C" fn(i64) -> c_int,
            memsaver_nccl_group: unsafe extern "C" fn(*mut i64) -> c_int,
            memsaver_profile_parse: unsafe extern "C" fn(*const c_char, *const c_char, *mut c_char, usize, *mut usize) -> c_int,
            memsaver_device_memory: unsafe extern "C" fn(c_int, *mut usize, *mut usize) -> c_int,
            memsaver_region_enter: unsafe extern "C" fn(*const c_char, *const c_char) -> c_int,
            memsaver_region_disable: unsafe extern "C" fn() -> c_int,
            memsaver_region_exit: unsafe extern "C" fn() -> c_int,
            memsaver_set_retain_backups: unsafe extern "C" fn(c_int) -> c_int,
            memsaver_retain_backups: unsafe extern "C" fn(*mut c_int) -> c_int,
            memsaver_backup_pointer: unsafe extern "C" fn(u64, usize, *mut *mut c_void) -> c_int,
            memsaver_set_disk_dir: unsafe extern "C" fn(*const c_char) -> c_int,
            memsaver_set_memory_margin: unsafe extern "C" fn(usize) -> c_int,
            memsaver_set_backup_prepare_limit: unsafe extern "C" fn(u64) -> c_int,
            memsaver_reserve_backups: unsafe extern "C" fn(u64) -> c_int,
            memsaver_region_current_json: unsafe extern "C" fn(*mut c_char, usize, *mut usize) -> c_int,
            memsaver_profile_load: unsafe extern "C" fn(*const c_char, *mut c_char, usize, *mut usize) -> c_int,
            memsaver_cli_main: unsafe extern "C" fn(c_int, *const *const c_char) -> c_int,
            memsaver_cli_spec_json: unsafe extern "C" fn(*mut c_char, usize, *mut usize) -> c_int,
            memsaver_runtime_dir: unsafe extern "C" fn(*mut c_char, usize, *mut usize) -> c_int,
            memsaver_set_pause_guard: unsafe extern "C" fn(MemsaverPauseGuard) -> c_int,
            memsaver_control_serve: unsafe extern "C" fn() -> c_int,
            memsaver_control_set_runner: unsafe extern "C" fn(MemsaverStageRunner) -> c_int,
            memsaver_control_json: unsafe extern "C" fn(*const c_char, *mut *mut c_char) -> c_int,
        }
    };
}
pub(crate) use with_functions;
