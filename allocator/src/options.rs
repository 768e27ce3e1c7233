//! Every option of memsaver, in one table ([`OPTIONS`], after mimalloc's `options[]`): the
//! environment variable, its aliases, the values it takes ([`Kind`]), its default, who reads it
//! ([`Reader`]) and a one-line description. `docs/options.md` is generated from the table
//! (`make options-doc`, which runs `memsaver options --markdown`); a test fails when it drifts.
//!
//! Every read of a `MEMSAVER_*` variable (or an alias) in Rust goes through [`Options`], read
//! once per process by [`get`]. The Python package reads its own (`Reader::Python`) and
//! they are listed here all the same; a test checks that every `MEMSAVER_*` name in the Python
//! package and the Rust sources is in the table.
//!
//! A few options have aliases: the variables of torch_memory_saver (`TMS_*`) and AMem
//! (`AMEM_GROUPID`), so that a process set up for them runs unchanged over memsaver. A
//! `MEMSAVER_*` variable wins over its alias. Unset and empty (or blank) are the same.
//!
//! **Invalid values are errors, never silent defaults.** [`Options`] keeps one message per
//! invalid variable (`MEMSAVER_NCCL_TOKENS='maybe': expected 0 or 1`) and [`Options::check`]
//! turns them into the error of the first memsaver operation: [`crate::global`] calls it, so
//! malloc, pause, resume, regions and stats all fail with it (a preloaded library must never
//! panic, exit or abort in its host process). Hooks that cannot return an error (NCCL's export
//! of a buffer) use the default meanwhile. The log filter is the exception: it is read where no
//! error can be returned and no operation needs it, so an invalid `MEMSAVER_LOG` is one warning
//! line and the default. [`validate_all`] checks every variable of the table at once.
//!
//! Outside the table on purpose: the fake driver's own variables (`FAKE_CUDA_*`, read by
//! `tests/fake-cuda`, a stand-in for libcuda that knows nothing of memsaver), and the variables
//! of other programs memsaver only looks at (`NCCL_CUMEM_ENABLE`, `XDG_RUNTIME_DIR`). The one
//! test-only `MEMSAVER_*` variable, `MEMSAVER_FAKE_CUDA_LIB`, is in the table as
//! [`Reader::Testing`].

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::types::Policy;

/// The values an option takes.
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    /// `0` or `1` (`false`, `true` too, in any case).
    Bool,
    /// A whole number from `min` to `max`, in `unit`.
    Int {
        min: i64,
        max: i64,
        unit: &'static str,
    },
    /// One of these names.
    Enum(&'static [&'static str]),
    /// Any text.
    Text,
    /// A file or directory.
    Path,
    /// A `tracing` filter: a level or directives (`memsaver_allocator=debug,warn`).
    LogFilter,
}

/// Who reads an option, which says what an invalid value does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reader {
    /// libmemsaver.so (allocator, NCCL hook, C ABI): the first operation fails.
    Library,
    /// The Python package: the call that needs it raises `MemsaverError` (or, read at
    /// interpreter start, a warning on stderr).
    Python,
    /// The test suite and the `memsaver` command's fake-driver fallback only.
    Testing,
}

/// One option.
#[derive(Clone, Copy, Debug)]
pub struct OptionDoc {
    pub env: &'static str,
    /// Other variables read when `env` is not set (torch_memory_saver's, AMem's).
    pub aliases: &'static [&'static str],
    pub kind: Kind,
    /// The default; for `Bool`, `Int` and `Enum` a value the kind accepts (a test checks).
    pub default: &'static str,
    pub reader: Reader,
    pub doc: &'static str,
}

const MIB: u64 = 1 << 20;
const MIB_UNIT: &str = "MiB";

pub const CUDA_LIB: OptionDoc = OptionDoc {
    env: "MEMSAVER_CUDA_LIB",
    aliases: &[],
    kind: Kind::Path,
    default: "libcuda.so.1",
    reader: Reader::Library,
    doc: "CUDA driver library to load; point it at target/fake-cuda/libcuda.so.1 to run on the fake driver",
};
pub const HOOK_MODE: OptionDoc = OptionDoc {
    env: "MEMSAVER_HOOK_MODE",
    aliases: &[],
    kind: Kind::Enum(&["auto", "preload", "inprocess"]),
    default: "auto",
    reader: Reader::Python,
    doc: "auto (preload if libmemsaver.so is preloaded, else inprocess), preload (fail with instructions unless preloaded) or inprocess",
};
pub const TORCH_MEMORY_SAVER: OptionDoc = OptionDoc {
    env: "MEMSAVER_TORCH_MEMORY_SAVER",
    aliases: &[],
    kind: Kind::Bool,
    default: "0",
    reader: Reader::Python,
    doc: "1 makes `import torch_memory_saver` give memsaver.compat in every Python process that sees it (read at interpreter start by the wheel's .pth file; says so on stderr when it shadows an installed torch_memory_saver)",
};
pub const TIMELINE: OptionDoc = OptionDoc {
    env: "MEMSAVER_TIMELINE",
    aliases: &[],
    kind: Kind::Path,
    default: "(none)",
    reader: Reader::Python,
    doc: "record pause/resume events (memsaver.timeline) and write them to this JSON file, {pid} replaced by the process id, at exit and on timeline.save(); `python -m memsaver timeline` charts them",
};
pub const VLLM: OptionDoc = OptionDoc {
    env: "MEMSAVER_VLLM",
    aliases: &[],
    kind: Kind::Bool,
    default: "0",
    reader: Reader::Python,
    doc: "1 makes the vLLM plugin (memsaver.vllm, a vllm.general_plugins entry point of the wheel) put vLLM's sleep-mode allocator on memsaver in every vLLM process that sees it; `--sleep-mode-backend memsaver` sets it for the engine's processes (docs/integrations.md)",
};
pub const GROUP: OptionDoc = OptionDoc {
    env: "MEMSAVER_GROUP",
    aliases: &["AMEM_GROUPID"],
    kind: Kind::Int {
        min: i32::MIN as i64,
        max: i32::MAX as i64,
        unit: "",
    },
    default: "0",
    reader: Reader::Library,
    doc: "group id of the process for the nccl tag: processes pause and resume NCCL memory with peers of the same group only (ncclSetGroupID and memsaver.set_group work too; fixed once NCCL shared memory)",
};
pub const NCCL_TIMEOUT_MS: OptionDoc = OptionDoc {
    env: "MEMSAVER_NCCL_TIMEOUT_MS",
    aliases: &[],
    kind: Kind::Int {
        min: 1,
        max: 86_400_000,
        unit: "ms",
    },
    default: "30000",
    reader: Reader::Library,
    doc: "how long pause('nccl') waits for peers to release their imports, and resume for owners to come back",
};
pub const NCCL_BACKUP: OptionDoc = OptionDoc {
    env: "MEMSAVER_NCCL_BACKUP",
    aliases: &[],
    kind: Kind::Enum(&["all", "headers"]),
    default: "all",
    reader: Reader::Library,
    doc: "what pause('nccl') copies to host memory: all (every byte NCCL allocated) or headers (of the buffers NCCL shares with peers, only their first 64 KiB: the control block before the LL/LL128/Simple staging area, whose contents live only within one collective; see docs/nccl.md)",
};
pub const NCCL_TOKENS: OptionDoc = OptionDoc {
    env: "MEMSAVER_NCCL_TOKENS",
    aliases: &[],
    kind: Kind::Bool,
    default: "1",
    reader: Reader::Library,
    doc: "0: NCCL exports plain driver fds (for jobs with processes not preloaded); exported buffers and imports then stay resident on pause",
};
pub const RUNTIME_DIR: OptionDoc = OptionDoc {
    env: "MEMSAVER_RUNTIME_DIR",
    aliases: &[],
    kind: Kind::Path,
    default: "$XDG_RUNTIME_DIR/memsaver or /tmp/memsaver-<uid>",
    reader: Reader::Library,
    doc: "private directory (mode 0700) for the sockets processes use to coordinate the nccl tag",
};
pub const CONTROL: OptionDoc = OptionDoc {
    env: "MEMSAVER_CONTROL",
    aliases: &[],
    kind: Kind::Bool,
    default: "0",
    reader: Reader::Library,
    doc: "1: the process serves control requests (pause, resume, run a profile stage, stats) from other processes of its user and group once memsaver starts in it (`memsaver pause --pid/--group`, memsaver.control; also memsaver.serve_control()). A process that cannot serve them (a runtime directory that is not private) fails its first memsaver call, naming the directory; see docs/security.md",
};
pub const RETAIN_BACKUP: OptionDoc = OptionDoc {
    env: "MEMSAVER_RETAIN_BACKUP",
    aliases: &["TMS_RETAIN_CPU_BACKUP"],
    kind: Kind::Bool,
    default: "1 (0 when any TMS_* variable is set)",
    reader: Reader::Library,
    doc: "1: keep host backups (cpu, mmap) and disk backup files across cycles, so later pauses allocate nothing; 0: release a backup as soon as its allocation has resumed. Changed at run time by memsaver.set_retain_backups. When any TMS_* variable is set and this one is not, the default follows torch_memory_saver: off unless TMS_RETAIN_CPU_BACKUP=1",
};
pub const BACKUP_PREPARE_MB: OptionDoc = OptionDoc {
    env: "MEMSAVER_BACKUP_PREPARE_MB",
    aliases: &[],
    kind: Kind::Int {
        min: 0,
        max: 1 << 30,
        unit: MIB_UNIT,
    },
    default: "(no limit)",
    reader: Reader::Library,
    doc: "with retention on, the pinned backup of a cpu allocation is allocated on a background thread when the allocation is made, so that its first pause only copies (pinning takes about 0.5 s per GiB; it is done in 16 MiB steps that hold up the application's own CUDA calls for about a millisecond at most); at most this much host memory is held that way (stats: prepared_backup_bytes). 0 turns it off: first pauses allocate their backups. Also memsaver.set_backup_prepare_limit (in bytes)",
};
pub const MERGE_MB: OptionDoc = OptionDoc {
    env: "MEMSAVER_MERGE_MB",
    aliases: &[],
    kind: Kind::Int {
        min: 0,
        max: 1 << 20,
        unit: MIB_UNIT,
    },
    default: "1024",
    reader: Reader::Library,
    doc: "resume backs adjacent allocations of one tag with one physical allocation of up to this size (the driver's cost is per call, not per byte); such memory is released as a whole, so an allocation freed before the tag's next pause stays held until then (stats: freed_held_bytes). 0: one physical allocation per allocation",
};
pub const DISK_DIR: OptionDoc = OptionDoc {
    env: "MEMSAVER_DISK_DIR",
    aliases: &["TMS_DISK_BACKUP_DIR"],
    kind: Kind::Path,
    default: "(none)",
    reader: Reader::Library,
    doc: "directory of the disk backup files (backup='disk'), created with mode 0700 if missing. An existing one must belong to this user with no write access for group or others (not /tmp, not a shared 0777 directory), and its last component must not be a symbolic link: otherwise pausing a disk-backed allocation fails, naming the directory, its owner and mode. Opened once and held; files are memsaver-<pidns>-<pid>-<start>-<nonce>-<n>.bin, mode 0600, checked (size, xxh3) on resume, removed at free and at exit, and those of dead processes by the next process that opens the directory (docs/security.md). Pausing a disk-backed allocation without a directory is refused. Also memsaver.set_disk_dir",
};
pub const DISK_CHUNK_MB: OptionDoc = OptionDoc {
    env: "MEMSAVER_DISK_CHUNK_MB",
    aliases: &["TMS_DISK_BACKUP_CHUNK_MB"],
    kind: Kind::Int {
        min: 1,
        max: 65_536,
        unit: MIB_UNIT,
    },
    default: "64",
    reader: Reader::Library,
    doc: "size of the pinned staging buffer disk backups are written and read through",
};
pub const MEMORY_MARGIN_MB: OptionDoc = OptionDoc {
    env: "MEMSAVER_MEMORY_MARGIN_MB",
    aliases: &[],
    kind: Kind::Int {
        min: 0,
        max: 1 << 30,
        unit: MIB_UNIT,
    },
    default: "0",
    reader: Reader::Library,
    doc: "resume refuses to map an allocation that would leave less than this free on its device (ResumeOutOfMemory; what was resumed stays resumed). Also memsaver.set_memory_margin (in bytes)",
};
pub const PROCESS_TAG: OptionDoc = OptionDoc {
    env: "MEMSAVER_PROCESS_TAG",
    aliases: &["TMS_INIT_ENABLE"],
    kind: Kind::Text,
    default: "(none)",
    reader: Reader::Library,
    doc: "whole-process mode (libmemsaver.so preloaded): cudaMalloc with no region open on the thread gets this tag (TMS_INIT_ENABLE, 0 or 1, 1 meaning the tag 'default'). New allocations of this tag are allowed while it is paused: they are resident, and resume skips them",
};
pub const PROCESS_BACKUP: OptionDoc = OptionDoc {
    env: "MEMSAVER_PROCESS_BACKUP",
    aliases: &["TMS_INIT_ENABLE_CPU_BACKUP", "TMS_INIT_CPU_BACKUP_BACKEND"],
    kind: Kind::Enum(&["discard", "cpu", "mmap", "disk"]),
    default: "discard",
    reader: Reader::Library,
    doc: "backup policy of the whole-process tag (TMS_INIT_ENABLE_CPU_BACKUP, 0 or 1, 1 meaning cpu, or mmap with TMS_INIT_CPU_BACKUP_BACKEND=mmap; that one takes pinned or mmap)",
};
pub const LOG: OptionDoc = OptionDoc {
    env: "MEMSAVER_LOG",
    aliases: &[],
    kind: Kind::LogFilter,
    default: "warn",
    reader: Reader::Library,
    doc: "log filter for tracing; logs go to stderr. An invalid filter is one warning line on stderr and the default (the logger starts where no error can be returned)",
};
pub const FAKE_CUDA_LIB: OptionDoc = OptionDoc {
    env: "MEMSAVER_FAKE_CUDA_LIB",
    aliases: &[],
    kind: Kind::Path,
    default: "target/<profile>/../fake-cuda/libcuda.so.1",
    reader: Reader::Testing,
    doc: "the fake driver the `memsaver` command (demo, bench) falls back to when there is no GPU (`make test` sets it)",
};

/// The table, in the order of the documentation.
pub const OPTIONS: &[OptionDoc] = &[
    CUDA_LIB,
    HOOK_MODE,
    TORCH_MEMORY_SAVER,
    TIMELINE,
    VLLM,
    GROUP,
    NCCL_TIMEOUT_MS,
    NCCL_BACKUP,
    NCCL_TOKENS,
    RUNTIME_DIR,
    CONTROL,
    RETAIN_BACKUP,
    BACKUP_PREPARE_MB,
    MERGE_MB,
    DISK_DIR,
    DISK_CHUNK_MB,
    MEMORY_MARGIN_MB,
    PROCESS_TAG,
    PROCESS_BACKUP,
    LOG,
    FAKE_CUDA_LIB,
];

/// The torch_memory_saver variables; when any is set the retention default follows it.
const TMS_VARS: [&str; 6] = [
    "TMS_INIT_ENABLE",
    "TMS_INIT_ENABLE_CPU_BACKUP",
    "TMS_INIT_CPU_BACKUP_BACKEND",
    "TMS_RETAIN_CPU_BACKUP",
    "TMS_DISK_BACKUP_DIR",
    "TMS_DISK_BACKUP_CHUNK_MB",
];

/// "a, b or c".
fn or_list(items: &[String]) -> String {
    match items.split_last() {
        None => String::new(),
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
    }
}

impl Kind {
    /// The accepted values, as messages and the documentation say them.
    pub fn accepted(&self) -> String {
        match self {
            Kind::Bool => "0 or 1".into(),
            Kind::Int { min, max, unit } => {
                let unit = if unit.is_empty() {
                    String::new()
                } else {
                    format!(" ({unit})")
                };
                format!("a whole number from {min} to {max}{unit}")
            }
            Kind::Enum(names) => {
                or_list(&names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            }
            Kind::Text => "any text".into(),
            Kind::Path => "a path".into(),
            Kind::LogFilter => {
                "error, warn, info, debug, trace, off, or directives like memsaver_allocator=debug,warn"
                    .into()
            }
        }
    }
}

impl OptionDoc {
    /// The message for the invalid `value` of `var` (this option's variable or an alias).
    pub fn invalid(&self, var: &str, value: &str) -> String {
        format!("{var}='{value}': expected {}", self.kind.accepted())
    }

    /// Checks `value` of `var` against the kind.
    pub fn check(&self, var: &str, value: &str) -> std::result::Result<(), String> {
        let bad = || self.invalid(var, value);
        match self.kind {
            Kind::Bool => parse_bool(value).map(drop).ok_or_else(bad),
            Kind::Int { min, max, .. } => match value.parse::<i64>() {
                Ok(n) if (min..=max).contains(&n) => Ok(()),
                _ => Err(bad()),
            },
            Kind::Enum(names) => names.contains(&value).then_some(()).ok_or_else(bad),
            Kind::Text | Kind::Path => Ok(()),
            Kind::LogFilter => tracing_subscriber::EnvFilter::try_new(value)
                .map(drop)
                .map_err(|e| format!("{} ({e})", bad())),
        }
    }
}

/// The option of variable `name`, or of which `name` is an alias.
pub fn find(name: &str) -> Option<&'static OptionDoc> {
    OPTIONS
        .iter()
        .find(|o| o.env == name || o.aliases.contains(&name))
}

fn parse_bool(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" => Some(true),
        "0" | "false" => Some(false),
        _ => None,
    }
}

/// How NCCL's memory is backed up on pause (`MEMSAVER_NCCL_BACKUP`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NcclBackup {
    /// Every byte (the default).
    All,
    /// The first 64 KiB of buffers shared with peers; all of the others.
    Headers,
}

/// The options in force. A field whose variable is invalid holds its default, and the
/// variable's message is in `errors`: [`Options::check`] makes it the error of the first
/// operation.
#[derive(Clone, Debug)]
pub struct Options {
    pub cuda_lib: String,
    pub retain_backups: bool,
    /// Bytes of pinned backups prepared ahead of first pauses (the variable is in MiB;
    /// `u64::MAX` when unset).
    pub backup_prepare_limit: u64,
    /// Bytes: the largest physical allocation resume makes for adjacent allocations (the
    /// variable is in MiB; 0 turns merging off).
    pub merge_limit: usize,
    /// Bytes (the variable is in MiB).
    pub memory_margin: u64,
    pub disk_dir: Option<PathBuf>,
    /// Bytes of the disk staging buffer (the variable is in MiB).
    pub disk_chunk: usize,
    /// Whole-process mode: the tag and policy of allocations made outside any region. `Some`
    /// whenever it was asked for, also with an invalid value (then with the default policy,
    /// and `errors` says why).
    pub process: Option<(String, Policy)>,
    /// The nccl group (`MEMSAVER_GROUP`).
    pub group: i64,
    pub nccl_timeout: Duration,
    pub nccl_backup: NcclBackup,
    pub nccl_tokens: bool,
    pub runtime_dir: PathBuf,
    /// Serve control requests (`MEMSAVER_CONTROL`).
    pub control: bool,
    /// The log filter; the default when the variable's is invalid (`log_warning` says so).
    pub log: String,
    pub log_warning: Option<String>,
    /// One message per invalid variable read by libmemsaver.so (the log filter's excepted).
    pub errors: Vec<String>,
}

impl Default for Options {
    /// The defaults (no variable set).
    fn default() -> Self {
        Self::from_lookup(|_| None)
    }
}

/// The variables of a lookup: unset and blank are the same; values are trimmed.
struct Env<'a> {
    get: &'a dyn Fn(&str) -> Option<String>,
    errors: Vec<String>,
}

impl Env<'_> {
    fn var(&self, name: &'static str) -> Option<(&'static str, String)> {
        (self.get)(name)
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
            .map(|v| (name, v))
    }

    /// The option's variable, else its first alias that is set.
    fn raw(&self, o: &OptionDoc) -> Option<(&'static str, String)> {
        std::iter::once(&o.env)
            .chain(o.aliases)
            .find_map(|n| self.var(n))
    }

    /// A checked value: `None` when unset, or invalid (with the message kept).
    fn checked(&mut self, o: &OptionDoc) -> Option<String> {
        let (var, v) = self.raw(o)?;
        match o.check(var, &v) {
            Ok(()) => Some(v),
            Err(e) => {
                self.errors.push(e);
                None
            }
        }
    }

    fn bool_or(&mut self, o: &OptionDoc, default: bool) -> bool {
        self.checked(o)
            .and_then(|v| parse_bool(&v))
            .unwrap_or(default)
    }

    fn bool(&mut self, o: &OptionDoc) -> bool {
        let default = parse_bool(o.default).unwrap_or_default();
        self.bool_or(o, default)
    }

    fn int(&mut self, o: &OptionDoc) -> i64 {
        let default = o.default.parse().unwrap_or_default();
        self.checked(o)
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    }

    fn choice(&mut self, o: &OptionDoc) -> String {
        self.checked(o).unwrap_or_else(|| o.default.to_owned())
    }
}

impl Options {
    /// The options of this process's environment, read now. Most callers want [`get`].
    pub fn from_env() -> Self {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// The options from `get` (the environment, or a table in tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Self {
        let mut env = Env {
            get: &get,
            errors: Vec::new(),
        };
        let tms = TMS_VARS.iter().any(|n| env.var(n).is_some());
        let nccl_backup = match env.choice(&NCCL_BACKUP).as_str() {
            "headers" => NcclBackup::Headers,
            _ => NcclBackup::All,
        };
        let runtime_dir = match env.raw(&RUNTIME_DIR) {
            Some((_, d)) => PathBuf::from(d),
            None => match env.var("XDG_RUNTIME_DIR") {
                Some((_, d)) => PathBuf::from(d).join("memsaver"),
                // SAFETY: getuid cannot fail.
                None => PathBuf::from(format!("/tmp/memsaver-{}", unsafe { libc::getuid() })),
            },
        };
        let (log, log_warning) = match env.raw(&LOG) {
            None => (LOG.default.to_owned(), None),
            Some((var, v)) => match LOG.check(var, &v) {
                Ok(()) => (v, None),
                Err(e) => (LOG.default.to_owned(), Some(e)),
            },
        };
        let mut o = Self {
            cuda_lib: env
                .raw(&CUDA_LIB)
                .map_or_else(|| CUDA_LIB.default.to_owned(), |(_, v)| v),
            retain_backups: env.bool_or(&RETAIN_BACKUP, !tms),
            backup_prepare_limit: env
                .checked(&BACKUP_PREPARE_MB)
                .and_then(|v| v.parse::<u64>().ok())
                .map_or(u64::MAX, |mb| mb * MIB),
            merge_limit: (env.int(&MERGE_MB) as u64 * MIB) as usize,
            memory_margin: env.int(&MEMORY_MARGIN_MB) as u64 * MIB,
            disk_dir: env.raw(&DISK_DIR).map(|(_, v)| PathBuf::from(v)),
            disk_chunk: (env.int(&DISK_CHUNK_MB) as u64 * MIB) as usize,
            process: None,
            group: env.int(&GROUP),
            nccl_timeout: Duration::from_millis(env.int(&NCCL_TIMEOUT_MS) as u64),
            nccl_backup,
            nccl_tokens: env.bool(&NCCL_TOKENS),
            runtime_dir,
            control: env.bool(&CONTROL),
            log,
            log_warning,
            errors: Vec::new(),
        };
        o.process = process(&mut env);
        o.errors = env.errors;
        o
    }

    /// The options read by libmemsaver.so must all be valid for any operation to run: the
    /// error names every invalid variable and what it accepts.
    pub fn check(&self) -> Result<()> {
        if self.errors.is_empty() {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!(
            "invalid memsaver option{}: {} (fix or unset it; docs/options.md lists every option)",
            if self.errors.len() > 1 { "s" } else { "" },
            self.errors.join("; ")
        )))
    }

    /// docs/options.md.
    pub fn markdown() -> String {
        markdown()
    }
}

/// The whole-process tag and policy: `MEMSAVER_PROCESS_TAG`/`MEMSAVER_PROCESS_BACKUP`, else
/// torch_memory_saver's `TMS_INIT_*` (whose values have types of their own). Every one of
/// these variables is checked whether or not whole-process mode is on: a mistyped backup
/// policy is an error even while the tag is unset.
fn process(env: &mut Env<'_>) -> Option<(String, Policy)> {
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
                    env.errors
                        .push(format!("{var}='{v}': expected {}", Kind::Bool.accepted()));
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
            env.errors
                .push(format!("{var}='{v}': expected {}", Kind::Bool.accepted()));
        }
        b
    };
    let tms_backup = bool_var(env, "TMS_INIT_ENABLE_CPU_BACKUP");
    let tms_backend = match env.var("TMS_INIT_CPU_BACKUP_BACKEND") {
        None => Some(Policy::Cpu),
        Some((_, v)) if v == "pinned" => Some(Policy::Cpu),
        Some((_, v)) if v == "mmap" => Some(Policy::Mmap),
        Some((var, v)) => {
            env.errors
                .push(format!("{var}='{v}': expected pinned or mmap"));
            None
        }
    };
    if let Some((var, v)) = env.var(PROCESS_BACKUP.env) {
        return match (PROCESS_BACKUP.check(var, &v), v.parse::<Policy>()) {
            (Ok(()), Ok(p)) => Some(p),
            _ => {
                env.errors.push(PROCESS_BACKUP.invalid(var, &v));
                None
            }
        };
    }
    if !tms_backup.unwrap_or(false) {
        return Some(Policy::Discard);
    }
    tms_backend
}

/// The options of this process, read from the environment once (on first use).
pub fn get() -> &'static Options {
    static OPTIONS: OnceLock<Options> = OnceLock::new();
    OPTIONS.get_or_init(Options::from_env)
}

/// Every invalid variable of the table in `get`, one message each: those libmemsaver.so reads
/// (as [`Options::errors`]), the log filter, and the Python package's and the tests'.
pub fn validate(get: impl Fn(&str) -> Option<String>) -> Vec<String> {
    let o = Options::from_lookup(&get);
    let mut errors = o.errors;
    errors.extend(o.log_warning);
    let env = Env {
        get: &get,
        errors: Vec::new(),
    };
    for opt in OPTIONS.iter().filter(|o| o.reader != Reader::Library) {
        if let Some((var, v)) = env.raw(opt)
            && let Err(e) = opt.check(var, &v)
        {
            errors.push(e);
        }
    }
    errors
}

/// [`validate`] of this process's environment.
pub fn validate_all() -> Vec<String> {
    validate(|name| std::env::var(name).ok())
}

const DOC_HEAD: &str = "\
# Options

<!-- Generated from allocator/src/options.rs by `make options-doc` (`memsaver options --markdown`); edit the table there, not this file. -->

Every option is an environment variable. libmemsaver.so (the allocator, the NCCL hook and the C
ABI) reads its options once, on first use; the Python package reads its own when it needs them.
An alias (torch_memory_saver's `TMS_*`, AMem's `AMEM_GROUPID`) is read when the `MEMSAVER_*`
variable is not set: the `MEMSAVER_*` variable wins. Unset and empty are the same.

An invalid value is an error, never a silent default. For libmemsaver.so's options the first
memsaver operation (malloc, pause, resume, a region, stats, ...) fails with a message that names
every invalid variable and what it accepts, for example
`MEMSAVER_NCCL_TOKENS='maybe': expected 0 or 1`; NCCL's own calls, which cannot fail on our
account, go on with the default meanwhile. The exception is `MEMSAVER_LOG`: the logger starts
where no error can be returned, so an invalid filter is one warning line on stderr and the
default. The Python package's options raise `memsaver.MemsaverError` in the call that needs them
(`MEMSAVER_TORCH_MEMORY_SAVER`, read at interpreter start, warns on stderr and stays off
instead).

";

const DOC_TAIL: &str = "
Not options: the fake driver's own variables (`FAKE_CUDA_DIR`, `FAKE_CUDA_MEM_BYTES`,
`FAKE_CUDA_DEVICES`, ..., read by `tests/fake-cuda`, a stand-in for libcuda that knows nothing of
memsaver) and the variables of other programs that memsaver looks at (`NCCL_CUMEM_ENABLE`,
`XDG_RUNTIME_DIR`).
";

fn table(s: &mut String, options: impl Iterator<Item = &'static OptionDoc>) {
    s.push_str("| variable | values | default | meaning |\n| --- | --- | --- | --- |\n");
    for o in options {
        let mut var = format!("`{}`", o.env);
        if !o.aliases.is_empty() {
            let aliases: Vec<String> = o.aliases.iter().map(|a| format!("`{a}`")).collect();
            var.push_str(&format!(" (alias {})", aliases.join(", ")));
        }
        let doc = match o.reader {
            Reader::Python => format!("Python package: {}", o.doc),
            _ => o.doc.to_owned(),
        };
        s.push_str(&format!(
            "| {var} | {} | `{}` | {doc} |\n",
            o.kind.accepted(),
            o.default
        ));
    }
}

/// docs/options.md, all of it.
pub fn markdown() -> String {
    let mut s = String::from(DOC_HEAD);
    table(
        &mut s,
        OPTIONS.iter().filter(|o| o.reader != Reader::Testing),
    );
    s.push_str("\n## Testing\n\nRead by the test suite and the `memsaver` command only.\n\n");
    table(
        &mut s,
        OPTIONS.iter().filter(|o| o.reader == Reader::Testing),
    );
    s.push_str(DOC_TAIL);
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::path::Path;

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
        assert_eq!(o.cuda_lib, "libcuda.so.1");
        assert!(o.retain_backups);
        assert_eq!(o.memory_margin, 0);
        assert_eq!(o.disk_dir, None);
        assert_eq!(o.disk_chunk, 64 << 20);
        assert_eq!(o.process, None);
        assert_eq!(o.group, 0);
        assert_eq!(o.nccl_timeout, Duration::from_secs(30));
        assert_eq!(o.nccl_backup, NcclBackup::All);
        assert!(o.nccl_tokens);
        assert_eq!(o.runtime_dir, PathBuf::from("/run/user/7/memsaver"));
        assert_eq!(o.log, "warn");
        assert_eq!(o.backup_prepare_limit, u64::MAX, "no limit unless set");
        assert_eq!(o.merge_limit, 1 << 30);
        assert!(o.errors.is_empty() && o.log_warning.is_none());
        assert!(o.check().is_ok());
    }

    #[test]
    fn every_typed_default_is_a_value_its_kind_accepts() {
        for o in OPTIONS {
            if matches!(o.kind, Kind::Bool | Kind::Int { .. } | Kind::Enum(_))
                && o.env != RETAIN_BACKUP.env
                && o.env != BACKUP_PREPARE_MB.env
            {
                assert_eq!(o.check(o.env, o.default), Ok(()), "{}", o.env);
            }
        }
    }

    #[test]
    fn names_are_unique_and_all_memsaver() {
        let mut names: Vec<&str> = OPTIONS
            .iter()
            .flat_map(|o| std::iter::once(&o.env).chain(o.aliases))
            .copied()
            .collect();
        assert!(OPTIONS.iter().all(|o| o.env.starts_with("MEMSAVER_")));
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n, "a name is listed twice");
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
            ("MEMSAVER_GROUP", "-3"),
            ("MEMSAVER_NCCL_TIMEOUT_MS", "250"),
            ("MEMSAVER_NCCL_BACKUP", "headers"),
            ("MEMSAVER_NCCL_TOKENS", "0"),
            ("MEMSAVER_RUNTIME_DIR", "/r"),
            ("MEMSAVER_LOG", "memsaver_allocator=debug,warn"),
        ]);
        assert!(o.errors.is_empty(), "{:?}", o.errors);
        assert_eq!(o.cuda_lib, "/x/libcuda.so.1");
        assert!(!o.retain_backups);
        assert_eq!(o.memory_margin, 512 << 20);
        assert_eq!(o.disk_dir, Some(PathBuf::from("/tmp/x")));
        assert_eq!(o.disk_chunk, 8 << 20);
        assert_eq!(o.process, Some(("train".into(), Policy::Mmap)));
        assert_eq!(o.group, -3);
        assert_eq!(o.nccl_timeout, Duration::from_millis(250));
        assert_eq!(o.nccl_backup, NcclBackup::Headers);
        assert!(!o.nccl_tokens);
        assert_eq!(o.runtime_dir, PathBuf::from("/r"));
        assert_eq!(o.log, "memsaver_allocator=debug,warn");
        // Blank is unset.
        assert!(opts(&[("MEMSAVER_NCCL_TOKENS", " ")]).nccl_tokens);
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
            ("AMEM_GROUPID", "9"),
        ]);
        assert!(o.retain_backups);
        assert_eq!(o.process, Some(("default".into(), Policy::Cpu)));
        assert_eq!(o.disk_dir, Some(PathBuf::from("/d")));
        assert_eq!(o.disk_chunk, 4 << 20);
        assert_eq!(o.group, 9);
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
            ("AMEM_GROUPID", "x"),
            ("MEMSAVER_GROUP", "4"),
            ("TMS_DISK_BACKUP_CHUNK_MB", "0"),
            ("MEMSAVER_DISK_CHUNK_MB", "2"),
        ]);
        assert!(o.errors.is_empty(), "{:?}", o.errors);
        assert!(o.retain_backups);
        assert_eq!(o.process, Some(("mine".into(), Policy::Discard)));
        assert_eq!(o.group, 4);
        assert_eq!(o.disk_chunk, 2 << 20);
        assert_eq!(opts(&[("TMS_INIT_ENABLE", "0")]).process, None);
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
                "AMEM_GROUPID",
                "g1",
                "AMEM_GROUPID='g1': expected a whole number from -2147483648 to 2147483647",
            ),
            (
                "MEMSAVER_NCCL_BACKUP",
                "some",
                "MEMSAVER_NCCL_BACKUP='some': expected all or headers",
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
        let o = opts(&[("MEMSAVER_NCCL_TOKENS", "maybe")]);
        assert!(o.nccl_tokens);
        let e = o.check().unwrap_err().to_string();
        assert!(
            e.contains("MEMSAVER_NCCL_TOKENS='maybe': expected 0 or 1"),
            "{e}"
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
        let o = opts(&[("MEMSAVER_NCCL_TOKENS", "x"), ("MEMSAVER_GROUP", "y")]);
        let e = o.check().unwrap_err().to_string();
        assert!(
            e.contains("MEMSAVER_NCCL_TOKENS='x'") && e.contains("MEMSAVER_GROUP='y'"),
            "{e}"
        );
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

    #[test]
    fn validate_checks_every_option_of_the_table() {
        let errors = validate(lookup(&[
            ("MEMSAVER_HOOK_MODE", "sometimes"),
            ("MEMSAVER_TORCH_MEMORY_SAVER", "yes"),
            ("MEMSAVER_NCCL_TOKENS", "maybe"),
            ("MEMSAVER_LOG", "a=b=c"),
            ("MEMSAVER_TIMELINE", "/tmp/t.json"),
        ]));
        assert_eq!(errors.len(), 4, "{errors:?}");
        assert!(errors.contains(
            &"MEMSAVER_HOOK_MODE='sometimes': expected auto, preload or inprocess".to_owned()
        ));
        assert!(errors.contains(&"MEMSAVER_TORCH_MEMORY_SAVER='yes': expected 0 or 1".to_owned()));
        assert!(errors.iter().any(|e| e.starts_with("MEMSAVER_LOG='a=b=c'")));
        assert!(validate(lookup(&[])).is_empty());
    }

    fn repo() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
    }

    /// Drift between the table and docs/options.md.
    #[test]
    fn docs_options_md_is_generated_from_the_table() {
        let path = repo().join("docs/options.md");
        if std::env::var_os("WRITE_OPTIONS_DOC").is_some() {
            std::fs::write(&path, markdown()).expect("write docs/options.md");
        }
        let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            on_disk == markdown(),
            "docs/options.md differs from the option table in allocator/src/options.rs: run \
             `make options-doc` and commit the result"
        );
    }

    /// Every `MEMSAVER_*` name in `dir`'s files ending in `ext`.
    fn names_in(dir: &Path, ext: &str, out: &mut Vec<(String, PathBuf)>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                names_in(&p, ext, out);
            } else if p.extension().is_some_and(|x| x == ext) {
                let text = std::fs::read_to_string(&p).unwrap_or_default();
                for (i, _) in text.match_indices("MEMSAVER_") {
                    let name: String = text[i..]
                        .chars()
                        .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                        .collect();
                    // Not variables: the C ABI's status codes (MEMSAVER_OK, MEMSAVER_ERR_*).
                    let status = name == "MEMSAVER_OK" || name.starts_with("MEMSAVER_ERR_");
                    if !name.ends_with('_') && !status {
                        out.push((name, p.clone()));
                    }
                }
            }
        }
    }

    /// The Python package and the Rust code name no variable the table lacks.
    #[test]
    fn every_memsaver_variable_in_the_sources_is_in_the_table() {
        let mut found = Vec::new();
        names_in(&repo().join("python/memsaver"), "py", &mut found);
        names_in(&repo().join("python"), "pth", &mut found);
        for dir in [
            "allocator/src",
            "nccl-hook/src",
            "torch-shim/src",
            "python/src",
        ] {
            names_in(&repo().join(dir), "rs", &mut found);
        }
        assert!(found.iter().any(|(n, _)| n == "MEMSAVER_HOOK_MODE"));
        let missing: Vec<String> = found
            .iter()
            .filter(|(n, _)| find(n).is_none())
            .map(|(n, p)| format!("{n} ({})", p.display()))
            .collect();
        assert!(
            missing.is_empty(),
            "not in allocator/src/options.rs: {missing:?}"
        );
    }
}
