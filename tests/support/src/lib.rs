//! What the tests of every crate share: reporting a test that cannot run on this machine, and
//! reading a crate's module layering from its sources ([`layers`]).
//!
//! libtest has no skip decided at run time: a test that returns early is reported `ok`, like
//! one that ran. A test whose precondition is missing (root, a C compiler, pid namespaces)
//! calls [`skip`] instead, which
//!
//! * writes `SKIPPED <test>: <reason>` to the process's stderr, where libtest does not capture
//!   it, so the run shows which tests did not run and why;
//! * fails the test when `MEMSAVER_REQUIRE_ALL_TESTS=1`: CI (`.ci/run`) sets it, since it runs as
//!   root with a compiler, and there a missing precondition is a broken machine, not a skip.
//!
//! The Python tests follow the same variable (`tests/python/conftest.py` turns each skip into a
//! failure when it is set).

use std::io::Write;

pub mod layers;

/// The variable that turns every skip into a failure.
pub const REQUIRE_ALL: &str = "MEMSAVER_REQUIRE_ALL_TESTS";

/// Whether every test must run here (`MEMSAVER_REQUIRE_ALL_TESTS=1`).
pub fn all_required() -> bool {
    std::env::var_os(REQUIRE_ALL).is_some_and(|v| v == "1")
}

/// Reports that the calling test cannot run here because of `reason` (say what is missing and
/// how to provide it); the test then returns: `return skip("...")`. Panics instead when every
/// test must run ([`all_required`]).
#[track_caller]
pub fn skip(reason: &str) {
    // libtest runs each test on a thread named after it.
    let name = std::thread::current()
        .name()
        .unwrap_or("<unnamed test>")
        .to_owned();
    if all_required() {
        panic!("{name} cannot run here and {REQUIRE_ALL}=1 requires every test to run: {reason}");
    }
    // Not eprintln!: libtest captures that and shows it only for failed tests.
    let _ = writeln!(std::io::stderr().lock(), "SKIPPED {name}: {reason}");
}

/// Whether this process runs as root (tests that make files of another user need it).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    #[ignore = "run by a_skip_is_reported_or_fails in a child process"]
    fn a_test_that_cannot_run() {
        skip("it needs what this machine lacks");
    }

    /// Runs `a_test_that_cannot_run` in a child with `MEMSAVER_REQUIRE_ALL_TESTS=value`:
    /// (passed, the child's stdout and stderr).
    fn child(value: &str) -> (bool, String) {
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "tests::a_test_that_cannot_run", "--ignored"])
            .env(REQUIRE_ALL, value)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text.into_owned())
    }

    #[test]
    fn a_skip_is_reported_or_fails() {
        let (passed, text) = child("0");
        assert!(passed, "{text}");
        assert!(
            text.contains(
                "SKIPPED tests::a_test_that_cannot_run: it needs what this machine lacks"
            ),
            "the skip line is not captured: {text}"
        );
        let (passed, text) = child("1");
        assert!(!passed, "{text}");
        assert!(
            text.contains("MEMSAVER_REQUIRE_ALL_TESTS=1 requires every test to run: it needs what"),
            "{text}"
        );
    }
}
