//! Python exceptions, one per status code of the C ABI, all subclasses of MemsaverError.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    memsaver,
    MemsaverError,
    PyException,
    "Base class of memsaver's errors."
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

/// The exception for a status code of the C ABI, carrying `message`.
pub fn from_status(code: i32, message: String) -> PyErr {
    match code {
        1 => InvalidArgumentError::new_err(message),
        2 => UnknownTagError::new_err(message),
        3 => TagPausedError::new_err(message),
        4 => UnknownPointerError::new_err(message),
        5 => OutOfMemoryError::new_err(message),
        6 => ResumeOutOfMemoryError::new_err(message),
        7 => DriverError::new_err(message),
        8 => DriverNotLoadedError::new_err(message),
        9 => IncompleteError::new_err(message),
        11 => PeerError::new_err(message),
        12 => ProfileError::new_err(message),
        13 => MemsaverError::new_err(message),
        _ => MemsaverError::new_err(format!("{message} (status {code})")),
    }
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
    Ok(())
}
