//! The NCCL hook's options: one list ([`memsaver_allocator::declare_options!`]; the rules every
//! list follows are in `memsaver_allocator::options`). The `nccl` tag's own first, then the
//! cross-process section: the group, the runtime directory, control requests, tokens and the
//! peers' deadline, which belong with the peer, server and control code and move with it.
//!
//! An invalid value of any of them fails the first operation done for the application together
//! with the core's ([`check`]); the hooks that answer NCCL's driver calls use the default
//! meanwhile.

use std::path::PathBuf;
use std::time::Duration;

use memsaver_allocator::Result;
use memsaver_allocator::options::{Env, check_messages};

memsaver_allocator::declare_options! {
    layer "libmemsaver.so: the NCCL hook", "";

    /// The NCCL hook's options in force (the core's are `memsaver_allocator::options`). A
    /// field whose variable is invalid holds its default, and the variable's message is in
    /// `errors`.
    pub struct Options {}

    options {
        /// the nccl tag's backup policy, as a region's: cpu (pinned host memory, prepared in the
        /// background when NCCL allocates), mmap, disk or discard; or headers: cpu, but of the
        /// buffers NCCL shares with peers only their first 64 KiB (the control block before the
        /// LL/LL128/Simple staging area, whose contents live only within one collective; see
        /// docs/nccl.md). all is the older name of cpu
        NCCL_BACKUP = "MEMSAVER_NCCL_BACKUP", one_of(NcclBackup {
                /// Every byte, in pinned host memory (the default).
                Cpu = "cpu",
                /// Every byte, in pageable host memory.
                Mmap = "mmap",
                /// Every byte, in a file of the disk backup directory.
                Disk = "disk",
                /// Nothing: resumed memory holds arbitrary bytes.
                Discard = "discard",
                /// Pinned, the first 64 KiB of buffers shared with peers; all of the others.
                Headers = "headers",
                /// The older name of `cpu`.
                All = "all",
            }), default "cpu", Library
            => pub nccl_backup: NcclBackup;

        // ---- cross-process: the peer, server and control code's (moves with it) ----

        /// group id of the process for the nccl tag: processes pause and resume NCCL memory
        /// with peers of the same group only (ncclSetGroupID and memsaver.set_group work too;
        /// fixed once NCCL shared memory)
        GROUP = "MEMSAVER_GROUP" | "AMEM_GROUPID", int(i32::MIN as i64, i32::MAX as i64, ""),
            default "0", Library
            => /// The nccl group (`MEMSAVER_GROUP`).
               pub group: i64;

        /// how long pause('nccl') waits for peers to release their imports, and resume for
        /// owners to come back
        NCCL_TIMEOUT_MS = "MEMSAVER_NCCL_TIMEOUT_MS", int(1, 86_400_000, "ms"), default "30000",
            Library
            => pub nccl_timeout: Duration = |ms| Duration::from_millis(ms as u64);

        /// 0: NCCL exports plain driver fds (for jobs with processes not preloaded); exported
        /// buffers and imports then stay resident on pause
        NCCL_TOKENS = "MEMSAVER_NCCL_TOKENS", bool, default "1", Library
            => pub nccl_tokens: bool;

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
    }
}

/// `$XDG_RUNTIME_DIR/memsaver`, else `/tmp/memsaver-<uid>`.
fn default_runtime_dir(env: &Env<'_>) -> PathBuf {
    match env.var("XDG_RUNTIME_DIR") {
        Some((_, d)) => PathBuf::from(d).join("memsaver"),
        // SAFETY: getuid cannot fail.
        None => PathBuf::from(format!("/tmp/memsaver-{}", unsafe { libc::getuid() })),
    }
}

/// The options libmemsaver.so reads up to this layer, the core's and the NCCL hook's, must all
/// be valid for an operation done for the application to run: the error names every invalid
/// variable (the core's first) and what it accepts.
pub fn check() -> Result<()> {
    check_of(memsaver_allocator::options::get(), get())
}

fn check_of(core: &memsaver_allocator::Options, own: &Options) -> Result<()> {
    check_messages(core.errors.iter().chain(&own.errors))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |n| m.get(n).cloned()
    }

    fn opts(vars: &[(&str, &str)]) -> Options {
        Options::from_lookup(lookup(vars))
    }

    /// The one error of `vars`.
    fn error(vars: &[(&str, &str)]) -> String {
        let o = opts(vars);
        assert_eq!(o.errors.len(), 1, "{:?}", o.errors);
        o.errors[0].clone()
    }

    #[test]
    fn defaults() {
        let o = opts(&[("XDG_RUNTIME_DIR", "/run/user/7")]);
        assert_eq!(o.group, 0);
        assert_eq!(o.nccl_timeout, Duration::from_secs(30));
        assert_eq!(o.nccl_backup, NcclBackup::Cpu);
        assert!(o.nccl_tokens);
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
            ("MEMSAVER_NCCL_TIMEOUT_MS", "250"),
            ("MEMSAVER_NCCL_BACKUP", "headers"),
            ("MEMSAVER_NCCL_TOKENS", "0"),
            ("MEMSAVER_RUNTIME_DIR", "/r"),
            ("MEMSAVER_CONTROL", "1"),
            ("XDG_RUNTIME_DIR", "/run/user/7"),
        ]);
        assert!(o.errors.is_empty(), "{:?}", o.errors);
        assert_eq!(o.group, -3);
        assert_eq!(o.nccl_timeout, Duration::from_millis(250));
        assert_eq!(o.nccl_backup, NcclBackup::Headers);
        assert!(!o.nccl_tokens);
        assert_eq!(o.runtime_dir, PathBuf::from("/r"));
        assert!(o.control);
        // Blank is unset.
        assert!(opts(&[("MEMSAVER_NCCL_TOKENS", " ")]).nccl_tokens);
        assert_eq!(
            NcclBackup::NAMES,
            ["cpu", "mmap", "disk", "discard", "headers", "all"]
        );
        assert_eq!(
            opts(&[("MEMSAVER_NCCL_BACKUP", "all")]).nccl_backup,
            NcclBackup::All
        );
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
                "MEMSAVER_NCCL_TOKENS",
                "maybe",
                "MEMSAVER_NCCL_TOKENS='maybe': expected 0 or 1",
            ),
            (
                "MEMSAVER_NCCL_TIMEOUT_MS",
                "soon",
                "MEMSAVER_NCCL_TIMEOUT_MS='soon': expected a whole number from 1 to 86400000 (ms)",
            ),
            (
                "MEMSAVER_NCCL_TIMEOUT_MS",
                "0",
                "MEMSAVER_NCCL_TIMEOUT_MS='0': expected a whole number from 1 to 86400000 (ms)",
            ),
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
                "MEMSAVER_NCCL_BACKUP",
                "some",
                "MEMSAVER_NCCL_BACKUP='some': expected cpu, mmap, disk, discard, headers or all",
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
        // The default is kept meanwhile, and check() names it.
        let o = opts(&[("MEMSAVER_NCCL_TOKENS", "maybe")]);
        assert!(o.nccl_tokens);
        let e = o.check().unwrap_err().to_string();
        assert!(
            e.contains("MEMSAVER_NCCL_TOKENS='maybe': expected 0 or 1"),
            "{e}"
        );
        // Several at once: all of them.
        let o = opts(&[("MEMSAVER_NCCL_TOKENS", "x"), ("MEMSAVER_GROUP", "y")]);
        let e = o.check().unwrap_err().to_string();
        assert!(
            e.contains("MEMSAVER_NCCL_TOKENS='x'") && e.contains("MEMSAVER_GROUP='y'"),
            "{e}"
        );
    }

    /// The operations of libmemsaver.so fail on the core's invalid options and on this
    /// layer's, named in one message (the core's first).
    #[test]
    fn check_names_the_core_and_the_hook_options() {
        let vars = lookup(&[
            ("MEMSAVER_NCCL_TOKENS", "maybe"),
            ("MEMSAVER_RETAIN_BACKUP", "sometimes"),
        ]);
        let core = memsaver_allocator::Options::from_lookup(&vars);
        let own = Options::from_lookup(&vars);
        let e = check_of(&core, &own).unwrap_err().to_string();
        assert!(
            e.contains(
                "invalid memsaver options: MEMSAVER_RETAIN_BACKUP='sometimes': expected 0 or 1; \
                 MEMSAVER_NCCL_TOKENS='maybe': expected 0 or 1"
            ),
            "{e}"
        );
        let none = lookup(&[]);
        let (core, own) = (
            memsaver_allocator::Options::from_lookup(&none),
            Options::from_lookup(&none),
        );
        assert!(check_of(&core, &own).is_ok());
    }
}
