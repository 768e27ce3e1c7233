//! Python exceptions for the status codes of the C ABI, all subclasses of MemsaverError: one per
//! error a caller can act on; `from_status` matches every status of `abi::Status` (generated
//! from libmemsaver.so's source), so a new status does not compile until it is mapped here.
//!
//! MemsaverError is a `RuntimeError`, as torch's errors are (`torch.OutOfMemoryError`
//! included): frameworks that catch `RuntimeError` around their memory calls (vLLM's sleep
//! mode, whose tests expect one when a wake-up runs out of memory) catch memsaver's too.

use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use crate::abi::Status;

create_exception!(
    memsaver,
    MemsaverError,
    PyRuntimeError,
    "Base class of memsaver's errors (a RuntimeError)."
);
create_exception!(
    memsaver,
    InvalidArgumentError,
    MemsaverError,
    "A bad argument (tag name, policy, size...)."
);
create_exception!(
    memsaver,
    UnknownTagError,
    MemsaverError,
    "A tag that was never used or registered."
);
create_exception!(
    memsaver,
    TagPausedError,
    MemsaverError,
    "Allocation with a tag that is paused."
);
create_exception!(
    memsaver,
    UnknownPointerError,
    MemsaverError,
    "A pointer memsaver did not allocate."
);
create_exception!(
    memsaver,
    OutOfMemoryError,
    MemsaverError,
    "The device ran out of memory."
);
create_exception!(
    memsaver,
    ResumeOutOfMemoryError,
    OutOfMemoryError,
    "Resume ran out of device memory; part is resumed, the rest stays paused. Free memory and resume again."
);
create_exception!(
    memsaver,
    DriverError,
    MemsaverError,
    "A CUDA driver call failed."
);
create_exception!(
    memsaver,
    DriverNotLoadedError,
    MemsaverError,
    "The CUDA driver could not be loaded."
);
create_exception!(
    memsaver,
    IncompleteError,
    MemsaverError,
    "A pause or resume left some allocations in their previous state."
);

create_exception!(
    memsaver,
    PeerError,
    MemsaverError,
    "A peer process did not take part in a pause or resume of the nccl tag."
);

create_exception!(
    memsaver,
    ProfileError,
    MemsaverError,
    "An invalid pause/resume profile; the message gives file:line:column and what was expected."
);

create_exception!(
    memsaver,
    BackupError,
    MemsaverError,
    "Host memory or a file for a backup could not be made, written or read."
);

create_exception!(
    memsaver,
    ControlError,
    MemsaverError,
    "A control request to another process could not be delivered, was refused or got no answer."
);

create_exception!(
    memsaver,
    PauseRefusedError,
    MemsaverError,
    "A pause refused before anything changed: memory of a tag it names could be handed out again while paused."
);

/// The exception for a failed call's status code, carrying `message`.
pub fn from_status(code: i32, message: String) -> PyErr {
    let Some(status) = Status::from_code(code) else {
        return MemsaverError::new_err(format!(
            "{message} (status {code}, unknown to this memsaver package: is libmemsaver.so of \
             another version?)"
        ));
    };
    match status {
        Status::InvalidArgument => InvalidArgumentError::new_err(message),
        Status::UnknownTag => UnknownTagError::new_err(message),
        Status::TagPaused => TagPausedError::new_err(message),
        Status::UnknownPointer => UnknownPointerError::new_err(message),
        Status::OutOfMemory => OutOfMemoryError::new_err(message),
        Status::ResumeOutOfMemory => ResumeOutOfMemoryError::new_err(message),
        Status::Driver => DriverError::new_err(message),
        Status::DriverNotLoaded => DriverNotLoadedError::new_err(message),
        Status::Incomplete => IncompleteError::new_err(message),
        Status::Peer => PeerError::new_err(message),
        Status::Profile => ProfileError::new_err(message),
        Status::Backup => BackupError::new_err(message),
        Status::Control => ControlError::new_err(message),
        Status::PauseRefused => PauseRefusedError::new_err(message),
        // Not errors a caller can act on by type: the binding retries a short buffer itself,
        // an internal error is a bug whose message says so, and success is never raised.
        Status::BufferTooSmall | Status::Internal | Status::Ok => {
            MemsaverError::new_err(format!("{message} ({status:?})"))
        }
    }
}

/// The status code of the C ABI for exception `e`: the status whose exception class `e` is
/// an instance of (the most derived one), `Internal` for anything else. The inverse of
/// [`from_status`], so Python never writes status numbers itself.
pub fn status_of(e: &Bound<'_, PyAny>) -> PyResult<i32> {
    let py = e.py();
    let mut best: Option<(i32, usize)> = None;
    for code in 0..=i32::from(u8::MAX) {
        match Status::from_code(code) {
            None | Some(Status::Ok | Status::BufferTooSmall | Status::Internal) => continue,
            Some(_) => {}
        }
        let ty = from_status(code, String::new()).get_type(py);
        if e.is_instance(&ty)? {
            let depth = ty.getattr("__mro__")?.len()?;
            if best.is_none_or(|(_, d)| depth > d) {
                best = Some((code, depth));
            }
        }
    }
    Ok(best.map_or(Status::Internal as i32, |(code, _)| code))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("MemsaverError", py.get_type::<MemsaverError>())?;
    m.add(
        "InvalidArgumentError",
        py.get_type::<InvalidArgumentError>(),
    )?;
    m.add("UnknownTagError", py.get_type::<UnknownTagError>())?;
    m.add("TagPausedError", py.get_type::<TagPausedError>())?;
    m.add("UnknownPointerError", py.get_type::<UnknownPointerError>())?;
    m.add("OutOfMemoryError", py.get_type::<OutOfMemoryError>())?;
    m.add(
        "ResumeOutOfMemoryError",
        py.get_type::<ResumeOutOfMemoryError>(),
    )?;
    m.add("DriverError", py.get_type::<DriverError>())?;
    m.add(
        "DriverNotLoadedError",
        py.get_type::<DriverNotLoadedError>(),
    )?;
    m.add("IncompleteError", py.get_type::<IncompleteError>())?;
    m.add("PeerError", py.get_type::<PeerError>())?;
    m.add("ProfileError", py.get_type::<ProfileError>())?;
    m.add("BackupError", py.get_type::<BackupError>())?;
    m.add("ControlError", py.get_type::<ControlError>())?;
    m.add("PauseRefusedError", py.get_type::<PauseRefusedError>())?;
    Ok(())
}
