//! The cross-process layer's options: one list ([`memsaver_allocator::declare_options!`]):
//! the process group, the runtime directory of the sockets, and control requests.
//!
//! An invalid value fails the first operation done for the application together with every
//! other layer's (`memsaver_allocator::global`, through [`LAYER`] in
//! `memsaver_allocator::OPTION_LAYERS`); what must answer a peer or a driver call uses the
//! default meanwhile. A process that only opens other processes' memory may never call
//! `global`: its opens check the options they use here, at the first one ([`checked`],
//! [`ipc_timeout`], [`crate::group::try_fix`]), and fail naming the variable.

use std::path::PathBuf;

use memsaver_allocator::options::Env;

memsaver_allocator::declare_options! {
    layer "libmemsaver.so: between processes", "";

    /// The cross-process layer's options in force. A field whose variable is invalid holds its
    /// default, and the variable's message is in `errors`.
    pub struct Options {}

    options {

        /// group id of the process for the nccl tag: processes pause and resume NCCL memory
        /// with peers of the same group only (ncclSetGroupID and memsaver.set_group work too;
        /// fixed once NCCL shared memory)
        GROUP = "MEMSAVER_GROUP" | "AMEM_GROUPID", int(i32::MIN as i64, i32::MAX as i64, ""),
            default "0", Library
            => /// The nccl group (`MEMSAVER_GROUP`).
               pub group: i64;


        /// private directory (mode 0700) for the sockets processes use to coordinate the nccl
        /// tag
        RUNTIME_DIR = "MEMSAVER_RUNTIME_DIR", path,
            unset "$XDG_RUNTIME_DIR/memsaver or /tmp/memsaver-<uid>", Library
            => pub runtime_dir: PathBuf =
                |dir, env| dir.map_or_else(|| default_runtime_dir(env), PathBuf::from);

        /// 1: the process serves control requests (pause, resume, run a profile stage, stats)
        /// from other processes of its user and group once memsaver starts in it (`memsaver
        /// pause --pid/--group`, memsaver.control; also memsaver.serve_control()). A process
        /// that cannot serve them (a runtime directory that is not private) fails its first
        /// memsaver call, naming the directory; see docs/security.md
        CONTROL = "MEMSAVER_CONTROL", bool, default "0", Library
            => /// Serve control requests (`MEMSAVER_CONTROL`).
               pub control: bool;

        /// how long the owner of memory opened by other processes (CUDA IPC handles, NCCL's
        /// registration) waits, in one pause or resume, for them to release or map it again (a
        /// process that has not by then is named in the call's PeerError, after the call did
        /// its own part; it is brought to the owner's state once it can, and its mapping keeps
        /// the memory until it lets go); also how long an open waits for the owner
        IPC_TIMEOUT_MS = "MEMSAVER_IPC_TIMEOUT_MS", int(1, 86_400_000, "ms"), default "30000",
            Library
            => /// The CUDA IPC deadline (`MEMSAVER_IPC_TIMEOUT_MS`).
               pub ipc_timeout: std::time::Duration =
                   |ms| std::time::Duration::from_millis(ms as u64);
    }
}

/// The option that sets [`timeout`], named in messages.
pub const TIMEOUT_SETTING: &str = "MEMSAVER_IPC_TIMEOUT_MS";

/// How long an owner waits for its importers, and an importer for an owner.
pub fn timeout() -> std::time::Duration {
    get().ipc_timeout
}

/// The CUDA IPC deadline (`MEMSAVER_IPC_TIMEOUT_MS`), or the error naming the variable, its
/// value and what it accepts when it is invalid: what waits on it for the application (an
/// importer's open) calls this, never the default in its place.
pub fn ipc_timeout() -> crate::error::Result<std::time::Duration> {
    timeout_of(get())
}

fn timeout_of(o: &Options) -> crate::error::Result<std::time::Duration> {
    o.check_one(&IPC_TIMEOUT_MS)
        .map(|()| o.ipc_timeout)
        .map_err(|e| crate::error::Error::Option(e.to_string()))
}

#[linkme::distributed_slice(memsaver_allocator::OPTION_LAYERS)]
static CHECKED: &memsaver_allocator::options::Layer = &LAYER;

/// `$XDG_RUNTIME_DIR/memsaver`, else `/tmp/memsaver-<uid>`.
fn default_runtime_dir(env: &Env<'_>) -> PathBuf {
    match env.var("XDG_RUNTIME_DIR") {
        Some((_, d)) => PathBuf::from(d).join("memsaver"),
        // SAFETY: getuid cannot fail.
        None => PathBuf::from(format!("/tmp/memsaver-{}", unsafe { libc::getuid() })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(vars: &[(&str, &str)]) -> Options {
        Options::from_vars(vars)
    }

    /// The one error of `vars`.
    fn error(vars: &[(&str, &str)]) -> String {
        Options::only_error(vars)
    }

    #[test]
    fn defaults() {
        let o = opts(&[("XDG_RUNTIME_DIR", "/run/user/7")]);
        assert_eq!(o.group, 0);
        assert!(!o.control);
        assert_eq!(o.runtime_dir, PathBuf::from("/run/user/7/memsaver"));
        assert!(o.errors.is_empty());
        assert!(o.check().is_ok());
        // SAFETY: getuid cannot fail.
        let uid = unsafe { libc::getuid() };
        assert_eq!(
            opts(&[]).runtime_dir,
            PathBuf::from(format!("/tmp/memsaver-{uid}"))
        );
    }

    #[test]
    fn each_type_parses() {
        let o = opts(&[
            ("MEMSAVER_GROUP", "-3"),
            ("MEMSAVER_RUNTIME_DIR", "/r"),
            ("MEMSAVER_CONTROL", "1"),
            ("XDG_RUNTIME_DIR", "/run/user/7"),
        ]);
        assert!(o.errors.is_empty(), "{:?}", o.errors);
        assert_eq!(o.group, -3);
        assert_eq!(o.runtime_dir, PathBuf::from("/r"));
        assert!(o.control);
    }

    #[test]
    fn aliases_and_precedence() {
        assert_eq!(opts(&[("AMEM_GROUPID", "9")]).group, 9);
        // MEMSAVER_* wins over the alias, also over an invalid alias value.
        let o = opts(&[("AMEM_GROUPID", "x"), ("MEMSAVER_GROUP", "4")]);
        assert!(o.errors.is_empty(), "{:?}", o.errors);
        assert_eq!(o.group, 4);
    }

    #[test]
    fn invalid_values_name_the_variable_and_the_accepted_values() {
        let cases: &[(&str, &str, &str)] = &[
            (
                "AMEM_GROUPID",
                "g1",
                "AMEM_GROUPID='g1': expected a whole number from -2147483648 to 2147483647",
            ),
            (
                "MEMSAVER_GROUP",
                "2147483648",
                "MEMSAVER_GROUP='2147483648': expected a whole number from -2147483648 to 2147483647",
            ),
            (
                "MEMSAVER_CONTROL",
                "on",
                "MEMSAVER_CONTROL='on': expected 0 or 1",
            ),
        ];
        for (var, v, want) in cases {
            assert_eq!(&error(&[(var, v)]), want);
        }
        for v in ["abc", "0", "-5", "86400001"] {
            assert_eq!(
                error(&[("MEMSAVER_IPC_TIMEOUT_MS", v)]),
                format!(
                    "MEMSAVER_IPC_TIMEOUT_MS='{v}': expected a whole number from 1 to 86400000 (ms)"
                )
            );
        }
        let o = opts(&[("MEMSAVER_CONTROL", "x"), ("MEMSAVER_GROUP", "y")]);
        let e = o.check().unwrap_err().to_string();
        assert!(
            e.contains("MEMSAVER_CONTROL='x'") && e.contains("MEMSAVER_GROUP='y'"),
            "{e}"
        );
    }

    /// The deadline an importer waits on is never an invalid variable's default in disguise:
    /// the error names the variable, the value and what it accepts.
    #[test]
    fn an_invalid_ipc_timeout_is_an_error_not_the_default() {
        for v in ["abc", "0", "-5"] {
            let o = opts(&[("MEMSAVER_IPC_TIMEOUT_MS", v)]);
            let e = timeout_of(&o).unwrap_err();
            assert!(matches!(e, crate::error::Error::Option(_)), "{e}");
            assert!(
                e.to_string().contains(&format!(
                    "MEMSAVER_IPC_TIMEOUT_MS='{v}': expected a whole number from 1 to 86400000 (ms)"
                )),
                "{e}"
            );
        }
        let o = opts(&[
            ("MEMSAVER_IPC_TIMEOUT_MS", "1500"),
            ("MEMSAVER_GROUP", "7x"),
        ]);
        assert_eq!(
            timeout_of(&o).ok(),
            Some(std::time::Duration::from_millis(1500))
        );
        assert_eq!(
            timeout_of(&opts(&[])).ok(),
            Some(std::time::Duration::from_secs(30))
        );
    }
}
