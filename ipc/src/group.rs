//! The process group: processes that share memory with each other or control each other are
//! of one group, and only of one. It names the directory of their sockets
//! (`<runtime dir>/g<group>/`, [`crate::rundir`]), and every request and token names it.
//!
//! The group is `MEMSAVER_GROUP` (or AMem's `AMEM_GROUPID`), 0 by default, until [`set`]
//! changes it. It is fixed ([`fix`]) once this process serves its socket or imported a peer's
//! buffer: its socket lives in that group's directory and the tokens it handed out name it.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicI64, Ordering};

use memsaver_allocator::options::Kind;

use crate::options::{self, GROUP as OPTION};

/// The group set by [`set`]; `i64::MIN` until then, meaning the option's.
static GROUP: AtomicI64 = AtomicI64::new(i64::MIN);

/// The group this process serves or imported under, once it does (see [`fix`]).
static FIXED: OnceLock<i64> = OnceLock::new();

/// The group in force (0 when none was given; also, until an operation fails on it, when the
/// variable is invalid).
pub fn id() -> i64 {
    match GROUP.load(Ordering::Relaxed) {
        i64::MIN => options::get().group,
        g => g,
    }
}

/// Why [`set`] refused a group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SetError {
    /// Not in the range of `MEMSAVER_GROUP`.
    OutOfRange { id: i64, min: i64, max: i64 },
    /// The group is fixed already, to this one.
    Fixed(i64),
}

impl std::fmt::Display for SetError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::OutOfRange { id, min, max } => write!(
                f,
                "group {id} is out of range: a group is an integer from {min} to {max} (as {})",
                OPTION.env
            ),
            Self::Fixed(g) => write!(
                f,
                "the group of this process is already {g}: its memsaver socket serves that group"
            ),
        }
    }
}

/// Sets the group. Refused once the group is fixed to another one ([`fix`]).
pub fn set(id: i64) -> Result<(), SetError> {
    // The range of MEMSAVER_GROUP, so a group set here is one the option could name (and
    // never the "unset" sentinel above).
    let (min, max) = match OPTION.kind {
        Kind::Int { min, max, .. } => (min, max),
        _ => (i64::MIN + 1, i64::MAX),
    };
    if !(min..=max).contains(&id) {
        return Err(SetError::OutOfRange { id, min, max });
    }
    match fixed() {
        Some(g) if g != id => Err(SetError::Fixed(g)),
        _ => {
            GROUP.store(id, Ordering::Relaxed);
            Ok(())
        }
    }
}

/// Fixes the group in force (once: later calls give the group fixed then) and returns it.
/// Called when this process starts serving its socket and when it imports a peer's buffer.
pub fn fix() -> i64 {
    *FIXED.get_or_init(id)
}

/// The group this process serves or imported under, if it is fixed yet.
pub fn fixed() -> Option<i64> {
    FIXED.get().copied()
}
