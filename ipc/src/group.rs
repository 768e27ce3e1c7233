//! The process group: processes that share memory with each other or control each other are
//! of one group, and only of one. It names the directory of their sockets
//! (`<runtime dir>/g<group>/`, [`crate::rundir`]), and every request and token names it.
//!
//! The group is `MEMSAVER_GROUP` (or AMem's `AMEM_GROUPID`), 0 by default, until [`set`]
//! changes it. It is fixed ([`fix`]) once this process serves its socket or imported a peer's
//! buffer: its socket lives in that group's directory and the tokens it handed out name it.
//! An invalid variable is no group: [`try_id`] and [`try_fix`] return its error (naming the
//! variable, the value and what it accepts) until [`set`] gives one; [`id`] and [`fix`], for
//! what must answer a peer or a driver call meanwhile, take the default.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicI64, Ordering};

use memsaver_allocator::options::Kind;

use crate::error::{Error, Result};
use crate::options::{self, GROUP as OPTION, Options};

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

/// The group in force, like [`id`]; but when none was set ([`set`]) and the variable is
/// invalid, its error instead of the default.
pub fn try_id() -> Result<i64> {
    in_force(GROUP.load(Ordering::Relaxed), options::get())
}

/// The group in force given the one [`set`] stored (`i64::MIN`: none) and the options.
fn in_force(set: i64, o: &Options) -> Result<i64> {
    match set {
        i64::MIN => o
            .check_one(&OPTION)
            .map(|()| o.group)
            .map_err(|e| Error::Option(e.to_string())),
        g => Ok(g),
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
/// Called when this process starts serving its socket and when it imports a peer's buffer;
/// what does so for the application calls [`try_fix`].
pub fn fix() -> i64 {
    *FIXED.get_or_init(id)
}

/// [`fix`], checked: an invalid `MEMSAVER_GROUP` (with no group [`set`]) is the error, and
/// fixes nothing (a group set later is still taken). Once fixed, the group fixed then.
pub fn try_fix() -> Result<i64> {
    if let Some(g) = fixed() {
        return Ok(g);
    }
    let g = try_id()?;
    Ok(*FIXED.get_or_init(|| g))
}

/// The group this process serves or imported under, if it is fixed yet.
pub fn fixed() -> Option<i64> {
    FIXED.get().copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `MEMSAVER_GROUP=7x` is no group: the error names the variable, its value and what it
    /// accepts, where `id` would say "group 0"; a group set with `set` is the group whatever
    /// the variable says.
    #[test]
    fn an_invalid_group_variable_is_an_error_until_a_group_is_set() {
        for (var, v) in [
            ("MEMSAVER_GROUP", "7x"),
            ("AMEM_GROUPID", "seven"),
            ("MEMSAVER_GROUP", "2147483648"),
        ] {
            let o = Options::from_vars(&[(var, v)]);
            assert_eq!(o.group, 0, "the default meanwhile");
            let e = in_force(i64::MIN, &o).unwrap_err();
            assert!(matches!(e, Error::Option(_)), "{e}");
            assert!(
                e.to_string().contains(&format!(
                    "invalid memsaver option: {var}='{v}': expected a whole number from \
                     -2147483648 to 2147483647"
                )),
                "{e}"
            );
            assert_eq!(in_force(5, &o).ok(), Some(5));
        }
        let o = Options::from_vars(&[("MEMSAVER_GROUP", "7"), ("MEMSAVER_IPC_TIMEOUT_MS", "0")]);
        assert_eq!(
            in_force(i64::MIN, &o).ok(),
            Some(7),
            "another variable's error is not the group's"
        );
        assert_eq!(in_force(i64::MIN, &Options::from_vars(&[])).ok(), Some(0));
    }

    /// The process-wide accessors, in a child test process whose environment has
    /// `MEMSAVER_GROUP=7x` (the options are read once per process): `try_fix` fails naming
    /// the variable and fixes nothing, `fix` would have fixed 0; once a group is set, it is
    /// fixed.
    #[test]
    fn try_fix_in_a_process_with_an_invalid_group_variable() {
        if std::env::var_os("IPC_GROUP_TEST_CHILD").is_some() {
            let e = try_fix().unwrap_err().to_string();
            assert!(e.contains("MEMSAVER_GROUP='7x'"), "{e}");
            assert_eq!(try_id().map_err(|e| e.to_string()), Err(e));
            assert_eq!(fixed(), None, "nothing fixed");
            assert_eq!(id(), 0);
            set(3).unwrap();
            assert_eq!(try_fix().ok(), Some(3));
            assert_eq!((fixed(), fix()), (Some(3), 3));
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "group::tests::try_fix_in_a_process_with_an_invalid_group_variable",
                "--test-threads=1",
            ])
            .env("IPC_GROUP_TEST_CHILD", "1")
            .env("MEMSAVER_GROUP", "7x")
            .env_remove("AMEM_GROUPID")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("1 passed"),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
