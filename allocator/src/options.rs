//! Every option of memsaver, in one table. Options are read from `MEMSAVER_*` environment
//! variables once, when the process-wide allocator (or, for the hook mode, the Python package)
//! starts. `docs/options.md` is generated from [`OPTIONS`] by `memsaver options --markdown`.
//!
//! A few options have aliases: the variables of torch_memory_saver (`TMS_*`), so that a process
//! set up for it runs unchanged over memsaver. A `MEMSAVER_*` variable wins over its alias.
//!
//! An invalid value is never replaced by a default in silence: it is kept as the error of its
//! option ([`Setting`]) and reported by the first operation that needs the option, with the
//! variable and the accepted values in the message.

use std::path::PathBuf;

use crate::types::Policy;

/// One option: its environment variable, its aliases, default and a one-line description.
pub struct OptionDoc {
    pub env: &'static str,
    /// Other variables read when `env` is not set (torch_memory_saver's).
    pub aliases: &'static [&'static str],
    pub default: &'static str,
    pub doc: &'static str,
}

pub const OPTIONS: &[OptionDoc] = &[
    OptionDoc {
        env: "MEMSAVER_CUDA_LIB",
        aliases: &[],
        default: "libcuda.so.1",
        doc: "CUDA driver library to load; point it at target/fake-cuda/libcuda.so.1 to run on the fake driver",
    },
    OptionDoc {
        env: "MEMSAVER_HOOK_MODE",
        aliases: &[],
        default: "auto",
        doc: "Python package: auto (preload if libmemsaver.so is preloaded, else inprocess), preload (fail with instructions unless preloaded) or inprocess",
    },
    OptionDoc {
        env: "MEMSAVER_TORCH_MEMORY_SAVER",
        aliases: &[],
        default: "0",
        doc: "Python: 1 makes `import torch_memory_saver` give memsaver.compat in every Python process that sees it (read at interpreter start by the wheel's .pth file; says so on stderr when it shadows an installed torch_memory_saver)",
    },
    OptionDoc {
        env: "MEMSAVER_GROUP",
        aliases: &[],
        default: "0",
        doc: "group id of the process for the nccl tag: processes pause and resume NCCL memory with peers of the same group only (AMEM_GROUPID, ncclSetGroupID and memsaver.set_group work too; fixed once NCCL shared memory)",
    },
    OptionDoc {
        env: "MEMSAVER_NCCL_TIMEOUT_MS",
        aliases: &[],
        default: "30000",
        doc: "how long pause('nccl') waits for peers to release their imports, and resume for owners to come back",
    },
    OptionDoc {
        env: "MEMSAVER_NCCL_BACKUP",
        aliases: &[],
        default: "all",
        doc: "what pause('nccl') copies to host memory: all (every byte NCCL allocated) or headers (of the buffers NCCL shares with peers, only their first 64 KiB: the control block before the LL/LL128/Simple staging area, whose contents live only within one collective; see docs/nccl.md)",
    },
    OptionDoc {
        env: "MEMSAVER_NCCL_TOKENS",
        aliases: &[],
        default: "1",
        doc: "0: NCCL exports plain driver fds (for jobs with processes not preloaded); exported buffers and imports then stay resident on pause",
    },
    OptionDoc {
        env: "MEMSAVER_RUNTIME_DIR",
        aliases: &[],
        default: "$XDG_RUNTIME_DIR/memsaver or /tmp/memsaver-<uid>",
        doc: "private directory (mode 0700) for the sockets processes use to coordinate the nccl tag",
    },
    OptionDoc {
        env: "MEMSAVER_RETAIN_BACKUP",
        aliases: &["TMS_RETAIN_CPU_BACKUP"],
        default: "1 (0 when any TMS_* variable is set)",
        doc: "1: keep host backups (cpu, mmap) and disk backup files across cycles, so later pauses allocate nothing; 0: release a backup as soon as its allocation has resumed. Changed at run time by memsaver.set_retain_backups. When any TMS_* variable is set and this one is not, the default follows torch_memory_saver: off unless TMS_RETAIN_CPU_BACKUP=1",
    },
    OptionDoc {
        env: "MEMSAVER_DISK_DIR",
        aliases: &["TMS_DISK_BACKUP_DIR"],
        default: "(none)",
        doc: "directory of the disk backup files (backup='disk'), created with mode 0700 if missing; pausing a disk-backed allocation without one is refused. Also memsaver.set_disk_dir",
    },
    OptionDoc {
        env: "MEMSAVER_DISK_CHUNK_MB",
        aliases: &["TMS_DISK_BACKUP_CHUNK_MB"],
        default: "64",
        doc: "size in MiB of the pinned staging buffer disk backups are written and read through (a whole number, at least 1)",
    },
    OptionDoc {
        env: "MEMSAVER_MEMORY_MARGIN_MB",
        aliases: &[],
        default: "0",
        doc: "resume refuses to map an allocation that would leave less than this many MiB free on its device (ResumeOutOfMemory; what was resumed stays resumed). Also memsaver.set_memory_margin (in bytes)",
    },
    OptionDoc {
        env: "MEMSAVER_PROCESS_TAG",
        aliases: &["TMS_INIT_ENABLE"],
        default: "(none)",
        doc: "whole-process mode (libmemsaver.so preloaded): cudaMalloc with no region open on the thread gets this tag (TMS_INIT_ENABLE=1 means the tag 'default'). New allocations of this tag are allowed while it is paused: they are resident, and resume skips them",
    },
    OptionDoc {
        env: "MEMSAVER_PROCESS_BACKUP",
        aliases: &["TMS_INIT_ENABLE_CPU_BACKUP", "TMS_INIT_CPU_BACKUP_BACKEND"],
        default: "discard",
        doc: "backup policy of the whole-process tag: discard, cpu, mmap or disk (TMS_INIT_ENABLE_CPU_BACKUP=1 means cpu, or mmap with TMS_INIT_CPU_BACKUP_BACKEND=mmap; pinned means cpu)",
    },
    OptionDoc {
        env: "MEMSAVER_LOG",
        aliases: &[],
        default: "warn",
        doc: "log filter for tracing (error, warn, info, debug, trace, or a directive like memsaver_allocator=debug); logs go to stderr",
    },
];

/// The value of an option, or why the environment's value is invalid (reported by the first
/// operation that needs it).
pub type Setting<T> = std::result::Result<T, String>;

/// The options in force, as read from the environment.
#[derive(Clone, Debug)]
pub struct Options {
    pub cuda_lib: String,
    pub retain_backups: Setting<bool>,
    /// Bytes (the variable is in MiB).
    pub memory_margin: Setting<u64>,
    pub disk_dir: Setting<Option<PathBuf>>,
    /// Bytes of the disk staging buffer (the variable is in MiB).
    pub disk_chunk: Setting<usize>,
    /// Whole-process mode: the tag and policy of allocations made outside any region.
    pub process: Setting<Option<(String, Policy)>>,
}

const MIB: u64 = 1 << 20;

impl Default for Options {
    fn default() -> Self {
        Self {
            cuda_lib: OPTIONS[0].default.into(),
            retain_backups: Ok(true),
            memory_margin: Ok(0),
            disk_dir: Ok(None),
            disk_chunk: Ok(64 << 20),
            process: Ok(None),
        }
    }
}

/// The torch_memory_saver variables; when any is set the retention default follows it.
const TMS_VARS: [&str; 6] = [
    "TMS_INIT_ENABLE",
    "TMS_INIT_ENABLE_CPU_BACKUP",
    "TMS_INIT_CPU_BACKUP_BACKEND",
    "TMS_RETAIN_CPU_BACKUP",
    "TMS_DISK_BACKUP_DIR",
    "TMS_DISK_BACKUP_CHUNK_MB",
];

impl Options {
    pub fn from_env() -> Self {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// The options from `get` (the environment, or a table in tests). Unset and empty
    /// variables are the same.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Self {
        let get = |name: &str| get(name).filter(|v| !v.trim().is_empty());
        // The MEMSAVER_* variable, else the first alias that is set: (variable, value).
        let first = |names: &[&'static str]| {
            names
                .iter()
                .find_map(|n| get(n).map(|v| (*n, v.trim().to_owned())))
        };
        let mut o = Self::default();
        if let Some(v) = get("MEMSAVER_CUDA_LIB") {
            o.cuda_lib = v;
        }
        let tms = TMS_VARS.iter().any(|n| get(n).is_some());
        o.retain_backups = match first(&["MEMSAVER_RETAIN_BACKUP", "TMS_RETAIN_CPU_BACKUP"]) {
            Some((var, v)) => parse_bool(var, &v),
            None => Ok(!tms),
        };
        if let Some((var, v)) = first(&["MEMSAVER_MEMORY_MARGIN_MB"]) {
            o.memory_margin = parse_mib(var, &v, 0).map(|m| m * MIB);
        }
        if let Some((_, v)) = first(&["MEMSAVER_DISK_DIR", "TMS_DISK_BACKUP_DIR"]) {
            o.disk_dir = Ok(Some(PathBuf::from(v)));
        }
        if let Some((var, v)) = first(&["MEMSAVER_DISK_CHUNK_MB", "TMS_DISK_BACKUP_CHUNK_MB"]) {
            o.disk_chunk = parse_mib(var, &v, 1).map(|m| (m * MIB) as usize);
        }
        o.process = process_tag(&first).and_then(|tag| {
            let Some(tag) = tag else { return Ok(None) };
            process_backup(&first).map(|p| Some((tag, p)))
        });
        o
    }

    /// The option table as a Markdown table.
    pub fn markdown() -> String {
        let mut s = String::from("| variable | default | meaning |\n| --- | --- | --- |\n");
        for o in OPTIONS {
            let mut var = format!("`{}`", o.env);
            if !o.aliases.is_empty() {
                let aliases: Vec<String> = o.aliases.iter().map(|a| format!("`{a}`")).collect();
                var.push_str(&format!(" (alias {})", aliases.join(", ")));
            }
            s.push_str(&format!("| {var} | `{}` | {} |\n", o.default, o.doc));
        }
        s
    }
}

type Lookup<'a> = &'a dyn Fn(&[&'static str]) -> Option<(&'static str, String)>;

fn process_tag(first: Lookup<'_>) -> Setting<Option<String>> {
    if let Some((_, tag)) = first(&["MEMSAVER_PROCESS_TAG"]) {
        return Ok(Some(tag));
    }
    match first(&["TMS_INIT_ENABLE"]) {
        Some((var, v)) => Ok(parse_bool(var, &v)?.then(|| "default".to_owned())),
        None => Ok(None),
    }
}

fn process_backup(first: Lookup<'_>) -> Setting<Policy> {
    if let Some((var, v)) = first(&["MEMSAVER_PROCESS_BACKUP"]) {
        return v.parse().map_err(|_| {
            format!(
                "{var}={v:?} is not a backup policy; expected {}",
                Policy::accepted()
            )
        });
    }
    let cpu = match first(&["TMS_INIT_ENABLE_CPU_BACKUP"]) {
        Some((var, v)) => parse_bool(var, &v)?,
        None => false,
    };
    if !cpu {
        return Ok(Policy::Discard);
    }
    match first(&["TMS_INIT_CPU_BACKUP_BACKEND"]) {
        None => Ok(Policy::Cpu),
        Some((_, v)) if v == "pinned" => Ok(Policy::Cpu),
        Some((_, v)) if v == "mmap" => Ok(Policy::Mmap),
        Some((var, v)) => Err(format!(
            "{var}={v:?} is not valid; expected 'pinned' or 'mmap'"
        )),
    }
}

fn parse_bool(var: &str, v: &str) -> Setting<bool> {
    match v {
        "1" | "true" | "True" | "TRUE" => Ok(true),
        "0" | "false" | "False" | "FALSE" => Ok(false),
        _ => Err(format!("{var}={v:?} is not valid; expected 1 or 0")),
    }
}

fn parse_mib(var: &str, v: &str, min: u64) -> Setting<u64> {
    match v.parse::<u64>() {
        Ok(n) if n >= min && n.checked_mul(MIB).is_some() => Ok(n),
        _ => Err(format!(
            "{var}={v:?} is not valid; expected a whole number of MiB, at least {min}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn opts(vars: &[(&str, &str)]) -> Options {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Options::from_lookup(|n| m.get(n).cloned())
    }

    #[test]
    fn defaults() {
        let o = opts(&[]);
        assert_eq!(o.retain_backups, Ok(true));
        assert_eq!(o.memory_margin, Ok(0));
        assert_eq!(o.disk_dir, Ok(None));
        assert_eq!(o.disk_chunk, Ok(64 << 20));
        assert_eq!(o.process, Ok(None));
    }

    #[test]
    fn memsaver_variables() {
        let o = opts(&[
            ("MEMSAVER_RETAIN_BACKUP", "0"),
            ("MEMSAVER_MEMORY_MARGIN_MB", "512"),
            ("MEMSAVER_DISK_DIR", "/tmp/x"),
            ("MEMSAVER_DISK_CHUNK_MB", "8"),
            ("MEMSAVER_PROCESS_TAG", "train"),
            ("MEMSAVER_PROCESS_BACKUP", "mmap"),
        ]);
        assert_eq!(o.retain_backups, Ok(false));
        assert_eq!(o.memory_margin, Ok(512 << 20));
        assert_eq!(o.disk_dir, Ok(Some(PathBuf::from("/tmp/x"))));
        assert_eq!(o.disk_chunk, Ok(8 << 20));
        assert_eq!(o.process, Ok(Some(("train".into(), Policy::Mmap))));
    }

    #[test]
    fn torch_memory_saver_aliases() {
        // Any TMS_* variable turns the retention default off, as in torch_memory_saver.
        let o = opts(&[("TMS_INIT_ENABLE", "1")]);
        assert_eq!(o.retain_backups, Ok(false));
        assert_eq!(o.process, Ok(Some(("default".into(), Policy::Discard))));
        let o = opts(&[
            ("TMS_INIT_ENABLE", "1"),
            ("TMS_INIT_ENABLE_CPU_BACKUP", "1"),
            ("TMS_RETAIN_CPU_BACKUP", "1"),
            ("TMS_DISK_BACKUP_DIR", "/d"),
            ("TMS_DISK_BACKUP_CHUNK_MB", "4"),
        ]);
        assert_eq!(o.retain_backups, Ok(true));
        assert_eq!(o.process, Ok(Some(("default".into(), Policy::Cpu))));
        assert_eq!(o.disk_dir, Ok(Some(PathBuf::from("/d"))));
        assert_eq!(o.disk_chunk, Ok(4 << 20));
        let o = opts(&[
            ("TMS_INIT_ENABLE", "1"),
            ("TMS_INIT_ENABLE_CPU_BACKUP", "1"),
            ("TMS_INIT_CPU_BACKUP_BACKEND", "mmap"),
        ]);
        assert_eq!(o.process, Ok(Some(("default".into(), Policy::Mmap))));
        // MEMSAVER_* wins over the alias.
        let o = opts(&[
            ("TMS_RETAIN_CPU_BACKUP", "0"),
            ("MEMSAVER_RETAIN_BACKUP", "1"),
            ("TMS_INIT_ENABLE", "1"),
            ("MEMSAVER_PROCESS_TAG", "mine"),
        ]);
        assert_eq!(o.retain_backups, Ok(true));
        assert_eq!(o.process, Ok(Some(("mine".into(), Policy::Discard))));
        assert_eq!(opts(&[("TMS_INIT_ENABLE", "0")]).process, Ok(None));
    }

    #[test]
    fn invalid_values_are_errors_naming_the_variable() {
        let o = opts(&[
            ("MEMSAVER_RETAIN_BACKUP", "maybe"),
            ("MEMSAVER_MEMORY_MARGIN_MB", "-1"),
            ("MEMSAVER_DISK_CHUNK_MB", "0"),
            ("MEMSAVER_PROCESS_TAG", "t"),
            ("MEMSAVER_PROCESS_BACKUP", "tape"),
        ]);
        let e = o.retain_backups.unwrap_err();
        assert!(
            e.contains("MEMSAVER_RETAIN_BACKUP") && e.contains("1 or 0"),
            "{e}"
        );
        let e = o.memory_margin.unwrap_err();
        assert!(
            e.contains("MEMSAVER_MEMORY_MARGIN_MB") && e.contains("MiB"),
            "{e}"
        );
        let e = o.disk_chunk.unwrap_err();
        assert!(
            e.contains("MEMSAVER_DISK_CHUNK_MB") && e.contains("at least 1"),
            "{e}"
        );
        let e = o.process.unwrap_err();
        assert!(
            e.contains("MEMSAVER_PROCESS_BACKUP") && e.contains("'mmap'"),
            "{e}"
        );
        let e = opts(&[
            ("TMS_INIT_ENABLE", "1"),
            ("TMS_INIT_ENABLE_CPU_BACKUP", "1"),
            ("TMS_INIT_CPU_BACKUP_BACKEND", "cuda"),
        ])
        .process
        .unwrap_err();
        assert!(
            e.contains("TMS_INIT_CPU_BACKUP_BACKEND") && e.contains("'pinned'"),
            "{e}"
        );
    }

    #[test]
    fn markdown_names_aliases() {
        let md = Options::markdown();
        assert!(
            md.contains("`MEMSAVER_DISK_DIR` (alias `TMS_DISK_BACKUP_DIR`)"),
            "{md}"
        );
        for o in OPTIONS {
            assert!(md.contains(o.env));
        }
    }
}
