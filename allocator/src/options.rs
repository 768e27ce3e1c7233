//! memsaver's options: how every layer declares them
//! ([`declare_options!`](crate::declare_options), whose machinery is in `options/declare.rs`),
//! and the allocator core's own list.
//!
//! Every option is an environment variable, declared once, by the layer that reads it, as one
//! entry of that layer's list (the pattern of mimalloc's `options[]` and of the status list in
//! `torch-shim/src/status.rs`): the variable, its aliases, the values it takes ([`Kind`]), its
//! default, who reads it ([`Reader`]), its one-line description and, when Rust reads it, the
//! typed field it becomes and the conversion. The macro makes of each entry an [`OptionDoc`]
//! constant (a row of `docs/options.md`), the field of the layer's `Options`, and its reading
//! from the environment. The lists:
//!
//! * the core's, here ([`Options`], [`get`]): the driver, backups, merging, the memory margin,
//!   whole-process mode, the log filter;
//! * the NCCL hook's, `memsaver_nccl_hook::options`, with its cross-process section (group,
//!   runtime directory, control, tokens, timeouts);
//! * the Python package's and the test suite's, `memsaver::options` (torch-shim, the crate that
//!   links every layer), which also holds the registry of every list: the `memsaver options`
//!   command, `validate_all`, docs/options.md (`make options-doc`; a test fails when it drifts)
//!   and the test that every `MEMSAVER_*` name in the sources is in a list.
//!
//! The same rules for every list:
//!
//! * A few options have aliases: the variables of torch_memory_saver (`TMS_*`) and AMem
//!   (`AMEM_GROUPID`), so that a process set up for them runs unchanged over memsaver. A
//!   `MEMSAVER_*` variable wins over its alias. Unset and empty (or blank) are the same; values
//!   are trimmed.
//! * **Invalid values are errors, never silent defaults.** A layer's `Options` keeps one message
//!   per invalid variable (`MEMSAVER_NCCL_TOKENS='maybe': expected 0 or 1`) and holds the
//!   default meanwhile; `Options::check` turns the messages into the error of the first memsaver
//!   operation: `memsaver_nccl_hook::allocator` checks the core's and the NCCL hook's, so malloc,
//!   pause, resume, regions and stats all fail with it (a preloaded library must never panic,
//!   exit or abort in its host process). Hooks that cannot return an error (NCCL's export of a
//!   buffer) use the default meanwhile.
//! * The log filter ([`Kind::LogFilter`]) is the exception: it is read where no error can be
//!   returned and no operation needs it, so an invalid `MEMSAVER_LOG` is one warning line and
//!   the default.
//!
//! Outside the lists on purpose: the fake driver's own variables (`FAKE_CUDA_*`, read by
//! `tests/fake-cuda`, a stand-in for libcuda that knows nothing of memsaver), and the variables
//! of other programs memsaver only looks at (`NCCL_CUMEM_ENABLE`, `XDG_RUNTIME_DIR`). The one
//! test-only `MEMSAVER_*` variable, `MEMSAVER_FAKE_CUDA_LIB`, is in torch-shim's testing list
//! as [`Reader::Testing`].

mod declare;

use std::path::PathBuf;

use crate::types::Policy;
use declare::parse_bool;
pub use declare::{
    Env, FromKind, Kind, Layer, Lookup, OptionDoc, Reader, check_messages, lookup_in,
};
#[doc(hidden)]
pub use declare::{Value, convert, convert_unset, doc_line};

const MIB: u64 = 1 << 20;

crate::declare_options! {
    layer "libmemsaver.so: the allocator core", "";

    /// The core's options in force. A field whose variable is invalid holds its default, and
    /// the variable's message is in `errors`: [`Options::check`] makes it the error of the
    /// first operation.
    pub struct Options {
        /// Whole-process mode: the tag and policy of allocations made outside any region.
        /// `Some` whenever it was asked for, also with an invalid value (then with the default
        /// policy, and `errors` says why).
        pub process: Option<(String, Policy)>,
        /// Why the log filter is the default: its variable is invalid.
        pub log_warning: Option<String>,
    }

    finish cross_option_rules;

    options {
        /// CUDA driver library to load; point it at target/fake-cuda/libcuda.so.1 to run on the
        /// fake driver
        CUDA_LIB = "MEMSAVER_CUDA_LIB", path, default "libcuda.so.1", Library
            => pub cuda_lib: String;

        /// 1: keep host backups (cpu, mmap) and disk backup files across cycles, so later pauses
        /// allocate nothing; 0: release a backup as soon as its allocation has resumed. Changed
        /// at run time by memsaver.set_retain_backups. When any TMS_* variable is set and this
        /// one is not, the default follows torch_memory_saver: off unless TMS_RETAIN_CPU_BACKUP=1
        RETAIN_BACKUP = "MEMSAVER_RETAIN_BACKUP" | "TMS_RETAIN_CPU_BACKUP", bool,
            unset "1 (0 when any TMS_* variable is set)", Library
            => pub retain_backups: bool =
                |keep, env| keep.unwrap_or_else(|| !torch_memory_saver_set(env));

        /// with retention on, the pinned backup of a cpu allocation is allocated on a
        /// background thread when the allocation is made, so that its first pause only copies
        /// (pinning takes about 0.35-0.65 s per GiB; it is done in 16 MiB steps that hold up
        /// the application's own CUDA calls for a millisecond or two at most); at most this much
        /// host memory is held that way (stats: prepared_backup_bytes). 0 turns it off: first
        /// pauses allocate their backups. Also memsaver.set_backup_prepare_limit (in bytes)
        BACKUP_PREPARE_MB = "MEMSAVER_BACKUP_PREPARE_MB", int(0, 1 << 30, "MiB"),
            unset "(no limit)", Library
            => /// Bytes of pinned backups prepared ahead of first pauses (the variable is in
               /// MiB; `u64::MAX` when unset).
               pub backup_prepare_limit: u64 =
                |mb, _| mb.map_or(u64::MAX, |mb| mb as u64 * MIB);

        /// pinned host memory kept for the backups of cpu allocations, mapped and pinned on a
        /// background thread as soon as memsaver starts (in 16 MiB steps, like prepared
        /// backups, so the application's CUDA calls are not held up), i.e. while the process
        /// loads its model: a cpu backup is carved from it at once, so a first pause right
        /// after allocating copies into pinned memory only. Backups released go back to it;
        /// backups beyond it are prepared as MEMSAVER_BACKUP_PREPARE_MB says, which does not
        /// count the reserve. At most the host's memory; a reserve the host cannot pin whole
        /// keeps what it got (one log line). Stats: backup_reserve_bytes, _pinned_bytes,
        /// _used_bytes. Also memsaver.reserve_backups (in bytes)
        BACKUP_RESERVE_MB = "MEMSAVER_BACKUP_RESERVE_MB", int(0, 1 << 30, "MiB"), default "0",
            Library
            => /// Bytes of the backup reserve (the variable is in MiB; 0: none).
               pub backup_reserve: u64 = |mb| mb as u64 * MIB;

        /// resume backs adjacent allocations of one tag with one physical allocation of up to
        /// this size (the driver's cost is per call, not per byte; NCCL's buffers have their
        /// own limit, MEMSAVER_NCCL_MERGE_MB); such memory is released as a whole, so an
        /// allocation freed before the tag's next pause stays held until then (stats:
        /// freed_held_bytes). 0: one physical allocation per allocation
        MERGE_MB = "MEMSAVER_MERGE_MB", int(0, 1 << 20, "MiB"), default "1024", Library
            => /// Bytes: the largest physical allocation resume makes for adjacent allocations
               /// (the variable is in MiB; 0 turns merging off).
               pub merge_limit: usize = |mb| (mb as u64 * MIB) as usize;

        /// directory of the disk backup files (backup='disk'), created with mode 0700 if
        /// missing. An existing one must belong to this user with no write access for group or
        /// others (not /tmp, not a shared 0777 directory), and its last component must not be a
        /// symbolic link: otherwise pausing a disk-backed allocation fails, naming the
        /// directory, its owner and mode. Opened once and held; files are
        /// `memsaver-<pidns>-<pid>-<start>-<nonce>-<n>.bin`, mode 0600, checked (size, xxh3) on
        /// resume, removed at free and at exit, and those of dead processes by the next process
        /// that opens the directory (docs/security.md). Pausing a disk-backed allocation
        /// without a directory is refused. Also memsaver.set_disk_dir
        DISK_DIR = "MEMSAVER_DISK_DIR" | "TMS_DISK_BACKUP_DIR", path, unset "(none)", Library
            => pub disk_dir: Option<PathBuf> = |dir, _| dir.map(PathBuf::from);

        /// size of the pinned staging buffer disk backups are written and read through
        DISK_CHUNK_MB = "MEMSAVER_DISK_CHUNK_MB" | "TMS_DISK_BACKUP_CHUNK_MB",
            int(1, 65_536, "MiB"), default "64", Library
            => /// Bytes of the disk staging buffer (the variable is in MiB).
               pub disk_chunk: usize = |mb| (mb as u64 * MIB) as usize;

        /// resume refuses to map an allocation that would leave less than this free on its
        /// device (ResumeOutOfMemory; what was resumed stays resumed). Also
        /// memsaver.set_memory_margin (in bytes)
        MEMORY_MARGIN_MB = "MEMSAVER_MEMORY_MARGIN_MB", int(0, 1 << 30, "MiB"), default "0",
            Library
            => /// Bytes (the variable is in MiB).
               pub memory_margin: u64 = |mb| mb as u64 * MIB;

        /// whole-process mode (libmemsaver.so preloaded): cudaMalloc with no region open on the
        /// thread gets this tag (TMS_INIT_ENABLE, 0 or 1, 1 meaning the tag 'default'). New
        /// allocations of this tag are allowed while it is paused: they are resident, and
        /// resume skips them
        PROCESS_TAG = "MEMSAVER_PROCESS_TAG" | "TMS_INIT_ENABLE", text, unset "(none)", Library;

        /// backup policy of the whole-process tag (TMS_INIT_ENABLE_CPU_BACKUP, 0 or 1, 1 meaning
        /// cpu, or mmap with TMS_INIT_CPU_BACKUP_BACKEND=mmap; that one takes pinned or mmap)
        PROCESS_BACKUP = "MEMSAVER_PROCESS_BACKUP"
            | "TMS_INIT_ENABLE_CPU_BACKUP" | "TMS_INIT_CPU_BACKUP_BACKEND",
            one_of("discard", "cpu", "mmap", "disk"), default "discard", Library;

        /// which pinned (cpu) backups keep only the 4 KiB blocks that hold a non-zero byte,
        /// packed by the device straight into host memory; resume zero-fills the memory and
        /// puts them back, exact whatever it holds. nccl (the default): the nccl tag's, whose
        /// buffers are mostly empty; all: every tag's, for memory known to be mostly zeros
        /// (15-19x faster there, up to 2x slower to pause full memory; the backup is then no
        /// image of the memory: memsaver_backup_pointer gives none); off: whole copies. Where
        /// the device cannot (see docs/architecture.md), backups are copied whole
        PACK = "MEMSAVER_PACK", one_of(Pack {
                /// The nccl tag's backups (the default).
                Nccl = "nccl",
                /// Every tag's cpu backups.
                All = "all",
                /// None: whole copies.
                Off = "off",
            }), default "nccl", Library
            => pub pack: Pack;

        /// log filter for tracing; logs go to stderr. An invalid filter is one warning line on
        /// stderr and the default (the logger starts where no error can be returned)
        LOG = "MEMSAVER_LOG", log_filter, default "warn", Library
            => /// The log filter; the default when the variable's is invalid (`log_warning` says
               /// so).
               pub log: String;
    }
}

/// Whether any torch_memory_saver variable (an alias `TMS_*` of the list) is set: the
/// retention default then follows torch_memory_saver.
fn torch_memory_saver_set(env: &Env<'_>) -> bool {
    OPTIONS
        .iter()
        .flat_map(|o| o.aliases)
        .filter(|a| a.starts_with("TMS_"))
        .any(|a| env.var(a).is_some())
}

/// The core's cross-option rules, after its fields are read: whole-process mode (two variables
/// and torch_memory_saver's three, of kinds of their own) and the log filter's warning.
fn cross_option_rules(o: &mut Options, env: &mut Env<'_>) {
    o.process = whole_process_mode(env);
    if let Some(host) = host_memory()
        && o.backup_reserve > host
        && let Some((var, v)) = env.var(BACKUP_RESERVE_MB.env)
    {
        env.error(format!(
            "{var}='{v}': more than this host's memory; expected a whole number from 0 to {} \
             (MiB)",
            host / MIB
        ));
        o.backup_reserve = 0;
    }
    o.log_warning = env.warnings().first().cloned();
}

/// The host's physical memory in bytes, if the system says.
pub(crate) fn host_memory() -> Option<u64> {
    // SAFETY: sysconf has no preconditions.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    (pages > 0 && page > 0).then(|| pages as u64 * page as u64)
}

/// The whole-process tag and policy: `MEMSAVER_PROCESS_TAG`/`MEMSAVER_PROCESS_BACKUP`, else
/// torch_memory_saver's `TMS_INIT_*` (whose values have types of their own). Every one of
/// these variables is checked whether or not whole-process mode is on: a mistyped backup
/// policy is an error even while the tag is unset.
fn whole_process_mode(env: &mut Env<'_>) -> Option<(String, Policy)> {
    let policy = process_backup(env);
    let tag = match env.var(PROCESS_TAG.env) {
        Some((_, tag)) => tag,
        None => {
            let (var, v) = env.var("TMS_INIT_ENABLE")?;
            match parse_bool(&v) {
                Some(false) => return None,
                Some(true) => "default".to_owned(),
                None => {
                    // Asked for, with a value we cannot read: whole-process mode is on, and
                    // the error stops it from allocating.
                    env.error(format!("{var}='{v}': expected {}", Kind::Bool.accepted()));
                    "default".to_owned()
                }
            }
        }
    };
    Some((tag, policy.unwrap_or(Policy::Discard)))
}

/// The whole-process policy; `None` (with the message kept) when a variable is invalid.
/// torch_memory_saver's variables are all read, so each is checked, even those that the
/// `MEMSAVER_*` variable or a disabled CPU backup make irrelevant.
fn process_backup(env: &mut Env<'_>) -> Option<Policy> {
    let bool_var = |env: &mut Env<'_>, name| {
        let (var, v) = env.var(name)?;
        let b = parse_bool(&v);
        if b.is_none() {
            env.error(format!("{var}='{v}': expected {}", Kind::Bool.accepted()));
        }
        b
    };
    let tms_backup = bool_var(env, "TMS_INIT_ENABLE_CPU_BACKUP");
    let tms_backend = match env.var("TMS_INIT_CPU_BACKUP_BACKEND") {
        None => Some(Policy::Cpu),
        Some((_, v)) if v == "pinned" => Some(Policy::Cpu),
        Some((_, v)) if v == "mmap" => Some(Policy::Mmap),
        Some((var, v)) => {
            env.error(format!("{var}='{v}': expected pinned or mmap"));
            None
        }
    };
    if let Some((var, v)) = env.var(PROCESS_BACKUP.env) {
        return match (PROCESS_BACKUP.check(var, &v), v.parse::<Policy>()) {
            (Ok(()), Ok(p)) => Some(p),
            _ => {
                env.error(PROCESS_BACKUP.invalid(var, &v));
                None
            }
        };
    }
    if !tms_backup.unwrap_or(false) {
        return Some(Policy::Discard);
    }
    tms_backend
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::options::lookup_in as lookup;

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
        assert_eq!(o.cuda_lib, "libcuda.so.1");
        assert!(o.retain_backups);
        assert_eq!(o.memory_margin, 0);
        assert_eq!(o.disk_dir, None);
        assert_eq!(o.disk_chunk, 64 << 20);
        assert_eq!(o.process, None);
        assert_eq!(o.log, "warn");
        assert_eq!(o.backup_prepare_limit, u64::MAX, "no limit unless set");
        assert_eq!(o.backup_reserve, 0, "no reserve unless set");
        assert_eq!(o.merge_limit, 1 << 30);
        assert!(o.errors.is_empty() && o.log_warning.is_none());
        assert!(o.check().is_ok());
    }

    #[test]
    fn each_type_parses() {
        let o = opts(&[
            ("MEMSAVER_CUDA_LIB", "/x/libcuda.so.1"),
            ("MEMSAVER_RETAIN_BACKUP", "False"),
            ("MEMSAVER_MEMORY_MARGIN_MB", " 512 "),
            ("MEMSAVER_DISK_DIR", "/tmp/x"),
            ("MEMSAVER_DISK_CHUNK_MB", "8"),
            ("MEMSAVER_PROCESS_TAG", "train"),
            ("MEMSAVER_PROCESS_BACKUP", "mmap"),
            ("MEMSAVER_BACKUP_PREPARE_MB", "3"),
            ("MEMSAVER_BACKUP_RESERVE_MB", "5"),
            ("MEMSAVER_MERGE_MB", "0"),
            ("MEMSAVER_LOG", "memsaver_allocator=debug,warn"),
        ]);
        assert!(o.errors.is_empty(), "{:?}", o.errors);
        assert_eq!(o.cuda_lib, "/x/libcuda.so.1");
        assert!(!o.retain_backups);
        assert_eq!(o.memory_margin, 512 << 20);
        assert_eq!(o.disk_dir, Some(PathBuf::from("/tmp/x")));
        assert_eq!(o.disk_chunk, 8 << 20);
        assert_eq!(o.process, Some(("train".into(), Policy::Mmap)));
        assert_eq!(o.backup_prepare_limit, 3 << 20);
        assert_eq!(o.backup_reserve, 5 << 20);
        assert_eq!(o.merge_limit, 0);
        assert_eq!(o.log, "memsaver_allocator=debug,warn");
        // Blank is unset.
        assert!(opts(&[("MEMSAVER_RETAIN_BACKUP", " ")]).retain_backups);
    }

    #[test]
    fn aliases_and_precedence() {
        // Any TMS_* variable turns the retention default off, as in torch_memory_saver.
        let o = opts(&[("TMS_INIT_ENABLE", "1")]);
        assert!(!o.retain_backups);
        assert_eq!(o.process, Some(("default".into(), Policy::Discard)));
        let o = opts(&[
            ("TMS_INIT_ENABLE", "1"),
            ("TMS_INIT_ENABLE_CPU_BACKUP", "1"),
            ("TMS_RETAIN_CPU_BACKUP", "1"),
            ("TMS_DISK_BACKUP_DIR", "/d"),
            ("TMS_DISK_BACKUP_CHUNK_MB", "4"),
        ]);
        assert!(o.retain_backups);
        assert_eq!(o.process, Some(("default".into(), Policy::Cpu)));
        assert_eq!(o.disk_dir, Some(PathBuf::from("/d")));
        assert_eq!(o.disk_chunk, 4 << 20);
        let o = opts(&[
            ("TMS_INIT_ENABLE", "1"),
            ("TMS_INIT_ENABLE_CPU_BACKUP", "1"),
            ("TMS_INIT_CPU_BACKUP_BACKEND", "mmap"),
        ]);
        assert_eq!(o.process, Some(("default".into(), Policy::Mmap)));
        // MEMSAVER_* wins over the alias, also over an invalid alias value.
        let o = opts(&[
            ("TMS_RETAIN_CPU_BACKUP", "0"),
            ("MEMSAVER_RETAIN_BACKUP", "1"),
            ("TMS_INIT_ENABLE", "1"),
            ("MEMSAVER_PROCESS_TAG", "mine"),
            ("TMS_DISK_BACKUP_CHUNK_MB", "0"),
            ("MEMSAVER_DISK_CHUNK_MB", "2"),
        ]);
        assert!(o.errors.is_empty(), "{:?}", o.errors);
        assert!(o.retain_backups);
        assert_eq!(o.process, Some(("mine".into(), Policy::Discard)));
        assert_eq!(o.disk_chunk, 2 << 20);
        assert_eq!(opts(&[("TMS_INIT_ENABLE", "0")]).process, None);
    }

    /// The retention rule looks at every torch_memory_saver variable, those the list names as
    /// aliases: the six of torch_memory_saver.
    #[test]
    fn any_tms_variable_turns_the_retention_default_off() {
        let tms: Vec<&str> = OPTIONS
            .iter()
            .flat_map(|o| o.aliases)
            .copied()
            .filter(|a| a.starts_with("TMS_"))
            .collect();
        assert_eq!(
            tms,
            [
                "TMS_RETAIN_CPU_BACKUP",
                "TMS_DISK_BACKUP_DIR",
                "TMS_DISK_BACKUP_CHUNK_MB",
                "TMS_INIT_ENABLE",
                "TMS_INIT_ENABLE_CPU_BACKUP",
                "TMS_INIT_CPU_BACKUP_BACKEND",
            ]
        );
        for var in tms {
            // A value each variable accepts that keeps whole-process mode off.
            let v = if var == "TMS_DISK_BACKUP_CHUNK_MB" {
                "4"
            } else if var == "TMS_INIT_CPU_BACKUP_BACKEND" {
                "pinned"
            } else {
                "0"
            };
            let o = opts(&[(var, v)]);
            assert!(o.errors.is_empty(), "{var}: {:?}", o.errors);
            if var != "TMS_RETAIN_CPU_BACKUP" {
                assert!(!o.retain_backups, "{var}");
            }
        }
    }

    #[test]
    fn invalid_values_name_the_variable_and_the_accepted_values() {
        let cases: &[(&str, &str, &str)] = &[
            (
                "MEMSAVER_RETAIN_BACKUP",
                "2",
                "MEMSAVER_RETAIN_BACKUP='2': expected 0 or 1",
            ),
            (
                "TMS_RETAIN_CPU_BACKUP",
                "yes",
                "TMS_RETAIN_CPU_BACKUP='yes': expected 0 or 1",
            ),
            (
                "MEMSAVER_MEMORY_MARGIN_MB",
                "-1",
                "MEMSAVER_MEMORY_MARGIN_MB='-1': expected a whole number from 0 to 1073741824 (MiB)",
            ),
            (
                "MEMSAVER_DISK_CHUNK_MB",
                "0",
                "MEMSAVER_DISK_CHUNK_MB='0': expected a whole number from 1 to 65536 (MiB)",
            ),
            (
                "MEMSAVER_BACKUP_PREPARE_MB",
                "lots",
                "MEMSAVER_BACKUP_PREPARE_MB='lots': expected a whole number from 0 to 1073741824 (MiB)",
            ),
            (
                "MEMSAVER_BACKUP_RESERVE_MB",
                "8.5",
                "MEMSAVER_BACKUP_RESERVE_MB='8.5': expected a whole number from 0 to 1073741824 (MiB)",
            ),
            (
                "TMS_INIT_ENABLE",
                "on",
                "TMS_INIT_ENABLE='on': expected 0 or 1",
            ),
        ];
        for (var, v, want) in cases {
            assert_eq!(&error(&[(var, v)]), want);
        }
        // The default is kept meanwhile, and check() names it.
        let o = opts(&[("MEMSAVER_MERGE_MB", "big")]);
        assert_eq!(o.merge_limit, 1 << 30);
        let e = o.check().unwrap_err().to_string();
        assert_eq!(
            e,
            "invalid argument: invalid memsaver option: MEMSAVER_MERGE_MB='big': expected a \
             whole number from 0 to 1048576 (MiB) (fix or unset it; docs/options.md lists \
             every option)"
        );
        // An invalid limit is no limit meanwhile (its unset value).
        assert_eq!(
            opts(&[("MEMSAVER_BACKUP_PREPARE_MB", "x")]).backup_prepare_limit,
            u64::MAX
        );
        // Whole-process mode asked for with a bad value is still on (and fails).
        let o = opts(&[
            ("MEMSAVER_PROCESS_TAG", "t"),
            ("MEMSAVER_PROCESS_BACKUP", "tape"),
        ]);
        assert_eq!(o.process, Some(("t".into(), Policy::Discard)));
        assert_eq!(
            o.errors,
            ["MEMSAVER_PROCESS_BACKUP='tape': expected discard, cpu, mmap or disk"]
        );
        let e = error(&[
            ("TMS_INIT_ENABLE", "1"),
            ("TMS_INIT_ENABLE_CPU_BACKUP", "1"),
            ("TMS_INIT_CPU_BACKUP_BACKEND", "cuda"),
        ]);
        assert_eq!(
            e,
            "TMS_INIT_CPU_BACKUP_BACKEND='cuda': expected pinned or mmap"
        );
        // Several at once: all of them.
        let o = opts(&[
            ("MEMSAVER_RETAIN_BACKUP", "x"),
            ("MEMSAVER_DISK_CHUNK_MB", "y"),
        ]);
        let e = o.check().unwrap_err().to_string();
        assert!(
            e.contains("invalid memsaver options: MEMSAVER_RETAIN_BACKUP='x'")
                && e.contains("; MEMSAVER_DISK_CHUNK_MB='y'"),
            "{e}"
        );
    }

    /// A reserve larger than the host's memory is an error naming the variable and the range
    /// this host accepts (and no reserve meanwhile).
    #[test]
    fn a_backup_reserve_larger_than_the_host_is_an_error() {
        let host_mb = host_memory().expect("sysconf knows the host's memory") / MIB;
        let v = (host_mb + 1).to_string();
        let o = opts(&[("MEMSAVER_BACKUP_RESERVE_MB", &v)]);
        assert_eq!(o.backup_reserve, 0);
        assert_eq!(
            o.errors,
            [format!(
                "MEMSAVER_BACKUP_RESERVE_MB='{v}': more than this host's memory; expected a \
                 whole number from 0 to {host_mb} (MiB)"
            )]
        );
        let o = opts(&[("MEMSAVER_BACKUP_RESERVE_MB", "16")]);
        assert!(o.errors.is_empty() && o.backup_reserve == 16 << 20);
    }

    #[test]
    fn an_invalid_log_filter_is_a_warning_and_the_default() {
        let o = opts(&[("MEMSAVER_LOG", "memsaver=loud")]);
        assert!(o.errors.is_empty());
        assert_eq!(o.log, "warn");
        let w = o.log_warning.unwrap();
        assert!(
            w.starts_with("MEMSAVER_LOG='memsaver=loud': expected error, warn"),
            "{w}"
        );
        // validate() lists it with the errors.
        let v = validate(&lookup(&[("MEMSAVER_LOG", "memsaver=loud")]));
        assert_eq!(v.len(), 1);
        assert!(v[0].starts_with("MEMSAVER_LOG='memsaver=loud'"), "{v:?}");
    }

    /// A variable is checked whatever the others say: an invalid whole-process backup policy
    /// (or torch_memory_saver backend) is an error while whole-process mode is off, and while
    /// a `MEMSAVER_*` variable makes the alias irrelevant.
    #[test]
    fn options_that_others_make_irrelevant_are_still_checked() {
        let cases: [(&[(&str, &str)], &str); 4] = [
            (
                &[("MEMSAVER_PROCESS_BACKUP", "zip")],
                "MEMSAVER_PROCESS_BACKUP='zip': expected discard, cpu, mmap or disk",
            ),
            (
                &[("TMS_INIT_CPU_BACKUP_BACKEND", "cuda")],
                "TMS_INIT_CPU_BACKUP_BACKEND='cuda': expected pinned or mmap",
            ),
            (
                &[("TMS_INIT_ENABLE_CPU_BACKUP", "sure")],
                "TMS_INIT_ENABLE_CPU_BACKUP='sure': expected 0 or 1",
            ),
            (
                &[
                    ("MEMSAVER_PROCESS_TAG", "t"),
                    ("MEMSAVER_PROCESS_BACKUP", "cpu"),
                    ("TMS_INIT_CPU_BACKUP_BACKEND", "tape"),
                ],
                "TMS_INIT_CPU_BACKUP_BACKEND='tape': expected pinned or mmap",
            ),
        ];
        for (vars, want) in cases {
            let o = opts(vars);
            assert_eq!(o.errors, [want], "{vars:?}");
            assert!(o.check().is_err());
        }
        // Valid values without whole-process mode change nothing and are no error.
        let o = opts(&[("MEMSAVER_PROCESS_BACKUP", "cpu")]);
        assert_eq!((o.process, o.errors.len()), (None, 0));
        let o = opts(&[
            ("TMS_INIT_ENABLE", "1"),
            ("TMS_INIT_ENABLE_CPU_BACKUP", "1"),
            ("TMS_INIT_CPU_BACKUP_BACKEND", "mmap"),
        ]);
        assert_eq!(o.process, Some(("default".into(), Policy::Mmap)));
    }
}
