//! The core's commands of the `memsaver` command line: `demo` (without a profile), `bench`
//! and `options`. The command users run is the Python package's console script; it calls
//! these through [`crate::memsaver_cli_main`], so they run on the allocator core directly (a
//! private [`Allocator`](memsaver_allocator::Allocator) over a driver opened here, not the
//! process-wide one) and print to stdout: they are only ever called by that command.
//!
//! A command's subcommands (`bench nccl`) are declared in the same table but run by the Python
//! package (they start processes under the preload, which the core cannot do): the core's
//! usage lists them, the Python command builds their parsers from [`spec_json`], and [`main`]
//! refuses them.

/// `writeln!` into the command's output, turning a write error into the command's error.
macro_rules! outln {
    ($out:expr, $($arg:tt)*) => {
        writeln!($out, $($arg)*).map_err(|e| format!("cannot write the output: {e}"))?
    };
}

/// `write!` into the command's output, like [`outln`].
macro_rules! out {
    ($out:expr, $($arg:tt)*) => {
        write!($out, $($arg)*).map_err(|e| format!("cannot write the output: {e}"))?
    };
}

mod bench;
mod demo;
mod devmem;

use std::io::Write;
use std::sync::Arc;

use memsaver_allocator::driver::{Driver, LoadError};
use memsaver_allocator::options::Options;

use crate::options;

/// One flag of a command: `--name VALUE` (with `value`, its metavar) or `--name` alone.
pub struct Flag {
    pub name: &'static str,
    /// The metavar of its value (`N`, `X`), `None` for a flag without one.
    pub value: Option<&'static str>,
    /// The value when the flag is absent (flags with a value only).
    pub default: Option<&'static str>,
    pub help: &'static str,
}

/// One command of the core, with its flags.
pub struct Command {
    pub name: &'static str,
    /// What it does, in one line (or a few, for the usage text).
    pub help: &'static str,
    pub flags: &'static [Flag],
    /// `memsaver <name> <subcommand> ...`: run by the Python package, not by [`main`].
    pub subcommands: &'static [Command],
}

const fn value(
    name: &'static str,
    metavar: &'static str,
    default: &'static str,
    help: &'static str,
) -> Flag {
    Flag {
        name,
        value: Some(metavar),
        default: Some(default),
        help,
    }
}

const fn switch(name: &'static str, help: &'static str) -> Flag {
    Flag {
        name,
        value: None,
        default: None,
        help,
    }
}

/// The core's commands and their flags: the one definition. The usage text ([`usage`]), the
/// flags each command accepts ([`Flags`]) and their defaults come from it, and so do the
/// Python command's parsers for them (`memsaver_cli_spec_json`, read by
/// `python/memsaver/__main__.py`).
pub const COMMANDS: &[Command] = &[
    Command {
        name: "demo",
        help: "a staged pause/resume cycle with tagged memory, printing resident memory per tag \
               per stage and checking the kept contents (real GPU when one is present, else the \
               fake driver)",
        flags: &[
            value("--device", "N", "0", "device to use"),
            switch("--fake", "use the fake driver even if a GPU is present"),
        ],
        subcommands: &[],
    },
    Command {
        name: "bench",
        help: "pause/resume throughput of the core: cpu-policy and discard tags, checking freed \
               memory and contents every cycle",
        flags: &[
            value("--cpu-gib", "X", "8", "GiB of cpu-policy memory"),
            value("--discard-gib", "Y", "16", "GiB of discard memory"),
            value("--cycles", "N", "10", "pause/resume cycles"),
            value("--chunk-mib", "M", "1024", "MiB per allocation"),
            value("--device", "N", "0", "device to use"),
            switch("--no-verify", "do not check the contents after each resume"),
            switch("--fake", "use the fake driver even if a GPU is present"),
        ],
        subcommands: &[Command {
            name: "nccl",
            help: "NCCL's switch time: N rank processes under the preload with C communicators \
                   pause and resume the nccl tag together K times, checking the collectives \
                   after each resume; one NCCL_BENCH line of JSON per rank",
            flags: &[
                value(
                    "--ranks",
                    "N",
                    "2",
                    "rank processes, one GPU each (2 or more)",
                ),
                value("--comms", "C", "1", "communicators over all ranks"),
                value("--cycles", "K", "5", "pause/resume cycles"),
                value(
                    "--mib",
                    "M",
                    "4",
                    "MiB of each collective's tensor (GPU), of each buffer shared with a peer \
                     (--fake)",
                ),
                value(
                    "--buffers",
                    "B",
                    "2",
                    "private 2 MiB buffers per communicator before the shared ones (--fake, \
                     --fake-nccl; NCCL makes about 320 at 2 ranks)",
                ),
                value("--timeout", "S", "300", "seconds each rank may take in all"),
                switch(
                    "--fake",
                    "the fake CUDA driver and fake NCCL (no GPU, no torch; the fake NCCL comes \
                     from a checkout: make fake-cuda)",
                ),
                switch(
                    "--fake-nccl",
                    "the fake NCCL on this machine's CUDA driver, every rank on GPU 0 (no torch; \
                     NCCL's pattern of buffers where there is one GPU)",
                ),
                switch(
                    "--native",
                    "NCCL's own ncclCommSuspend/ncclCommResume instead of memsaver's pause \
                     (NCCL 2.29.7 or later)",
                ),
            ],
            subcommands: &[],
        }],
    },
    Command {
        name: "options",
        help: "the table of MEMSAVER_* options (Markdown, as in docs/options.md)",
        flags: &[],
        subcommands: &[],
    },
];

/// The command `name` of [`COMMANDS`].
pub fn command(name: &str) -> Option<&'static Command> {
    COMMANDS.iter().find(|c| c.name == name)
}

/// The commands, with their flags, as `memsaver <command> --help` shows them.
pub fn usage() -> String {
    let mut u = String::from("commands of the allocator core (run through `memsaver`):\n");
    for c in COMMANDS {
        command_usage(&mut u, c.name, c);
        for s in c.subcommands {
            command_usage(&mut u, &format!("{} {}", c.name, s.name), s);
        }
    }
    u
}

/// `c`'s lines of [`usage`], under the name `name`.
fn command_usage(u: &mut String, name: &str, c: &Command) {
    let mut line = format!("  {name:<10}");
    for word in c.help.split_whitespace() {
        if line.len() + 1 + word.len() > 92 {
            u.push_str(line.trim_end());
            u.push('\n');
            line = " ".repeat(12);
        } else if !line.ends_with(' ') {
            line.push(' ');
        }
        line.push_str(word);
    }
    u.push_str(&line);
    u.push('\n');
    for f in c.flags {
        let flag = match f.value {
            Some(v) => format!("{} {v}", f.name),
            None => f.name.to_owned(),
        };
        let default = f
            .default
            .map_or_else(String::new, |d| format!(" (default {d})"));
        let help = f.help.split_whitespace().collect::<Vec<_>>().join(" ");
        u.push_str(&format!("            {flag:<16} {help}{default}\n"));
    }
}

/// [`COMMANDS`] as JSON, for the Python command's parsers: `{"commands": [{"name", "help",
/// "flags": [{"name", "value", "default", "help"}], "subcommands": [...]}]}` (`value` and
/// `default` null for a flag without a value; subcommands in the shape of commands).
pub fn spec_json() -> serde_json::Result<String> {
    let commands: Vec<serde_json::Value> = COMMANDS.iter().map(command_json).collect();
    serde_json::to_string(&serde_json::json!({ "commands": commands }))
}

/// One command of [`spec_json`], its subcommands nested in the same shape.
fn command_json(c: &Command) -> serde_json::Value {
    let flags: Vec<serde_json::Value> = c
        .flags
        .iter()
        .map(|f| {
            serde_json::json!({
                "name": f.name,
                "value": f.value,
                "default": f.default,
                "help": f.help.split_whitespace().collect::<Vec<_>>().join(" "),
            })
        })
        .collect();
    serde_json::json!({
        "name": c.name,
        "help": c.help.split_whitespace().collect::<Vec<_>>().join(" "),
        "flags": flags,
        "subcommands": c.subcommands.iter().map(command_json).collect::<Vec<_>>(),
    })
}

/// Runs `args` (`["bench", "--cycles", "3"]`); what it prints goes to `out`. Exit status:
/// 0 done, 1 failed (the message is on stderr), 2 a usage error.
pub fn main(args: &[String], out: &mut dyn Write) -> i32 {
    let (cmd, rest) = match args.split_first() {
        Some((c, r)) => (c.as_str(), r),
        None => {
            eprint!("{}", usage());
            return 2;
        }
    };
    if let Some(sub) = command(cmd).and_then(|c| {
        let first = rest.first()?;
        c.subcommands.iter().find(|s| s.name == first)
    }) {
        eprintln!(
            "memsaver {cmd} {}: error: a command of the Python package: run it as `memsaver \
             {cmd} {}` (or `python -m memsaver {cmd} {}`)",
            sub.name, sub.name, sub.name
        );
        return 2;
    }
    if rest.iter().any(|a| a == "-h" || a == "--help") {
        let _ = write!(out, "{}", usage());
        return 0;
    }
    let result = match cmd {
        "demo" => demo::run(rest, out),
        "bench" => bench::run(rest, out),
        "options" => write!(out, "{}", options::markdown()).map_err(|e| e.to_string()),
        "-h" | "--help" | "help" => write!(out, "{}", usage()).map_err(|e| e.to_string()),
        other => {
            eprintln!("memsaver: error: unknown command '{other}'\n\n{}", usage());
            return 2;
        }
    };
    let _ = out.flush();
    match result {
        Ok(()) => 0,
        Err(msg)
            if msg.starts_with("unknown option")
                || msg.contains("needs a value")
                || msg.starts_with("bad value for") =>
        {
            eprintln!("memsaver {cmd}: error: {msg}");
            2
        }
        Err(msg) => {
            eprintln!("memsaver {cmd}: error: {msg}");
            1
        }
    }
}

/// Opens the real driver when it loads and sees a GPU, else the fake driver named by
/// `MEMSAVER_FAKE_CUDA_LIB`, shipped beside this library (`memsaver/_fake/libcuda.so.1` in the
/// wheel) or built beside it (`target/<profile>/libmemsaver.so` ->
/// `target/fake-cuda/libcuda.so.1`). `MEMSAVER_CUDA_LIB`, when set and not empty, is used
/// as is.
pub fn open_driver(force_fake: bool) -> Result<Arc<Driver>, String> {
    let opts = Options::from_env();
    let named = std::env::var_os("MEMSAVER_CUDA_LIB").is_some_and(|v| !v.is_empty());
    if named && !force_fake {
        return Driver::load(&opts.cuda_lib)
            .map(Arc::new)
            .map_err(|e| e.to_string());
    }
    if !force_fake {
        match Driver::load(&opts.cuda_lib) {
            Ok(d) if d.device_count().unwrap_or(0) > 0 => return Ok(Arc::new(d)),
            Ok(_) => eprintln!("memsaver: the CUDA driver sees no GPU; using the fake driver"),
            Err(LoadError::Library { .. }) => {
                eprintln!("memsaver: no CUDA driver on this machine; using the fake driver")
            }
            Err(e) => eprintln!("memsaver: {e}; using the fake driver"),
        }
    }
    let fake = match std::env::var("MEMSAVER_FAKE_CUDA_LIB") {
        Ok(p) => p,
        Err(_) => {
            // Beside an installed library (the wheel's memsaver/_fake/), else in the build tree
            // (target/<profile>/libmemsaver.so -> target/fake-cuda/libcuda.so.1).
            let lib = own_path().ok_or("cannot locate libmemsaver.so")?;
            let dir = std::path::Path::new(&lib)
                .parent()
                .ok_or("cannot locate the fake driver")?;
            let bundled = dir.join("_fake/libcuda.so.1");
            let built = dir
                .parent()
                .map(|p| p.join("fake-cuda/libcuda.so.1"))
                .unwrap_or_default();
            let found = if bundled.exists() { bundled } else { built };
            found.to_string_lossy().into_owned()
        }
    };
    Driver::load(&fake).map(Arc::new).map_err(|e| {
        format!(
            "{e}\n(no GPU here: build the fake driver with `make fake-cuda`, or name it with \
             MEMSAVER_FAKE_CUDA_LIB or MEMSAVER_CUDA_LIB)"
        )
    })
}

/// The file this code was loaded from (libmemsaver.so, or a test executable).
fn own_path() -> Option<String> {
    let mut info: libc::Dl_info = zeroed_dl_info();
    let addr = own_path as *const libc::c_void;
    // SAFETY: `info` is a valid out-parameter; dladdr only reads the loader's state.
    if unsafe { libc::dladdr(addr, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr gives a NUL-terminated file name that lives as long as the object.
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    Some(name.to_string_lossy().into_owned())
}

fn zeroed_dl_info() -> libc::Dl_info {
    // SAFETY: Dl_info is plain data (pointers), for which all zeroes is a valid value.
    unsafe { std::mem::zeroed() }
}

/// The flags given to a command, checked against its entry in [`COMMANDS`].
pub struct Flags<'a> {
    args: &'a [String],
    command: &'static Command,
}

impl<'a> Flags<'a> {
    /// `args` of the command `name` (of [`COMMANDS`]); an unknown flag is refused.
    pub fn new(name: &str, args: &'a [String]) -> Result<Self, String> {
        let command = command(name).ok_or_else(|| format!("unknown command '{name}'"))?;
        for a in args.iter().filter(|a| a.starts_with("--")) {
            if !command.flags.iter().any(|f| f.name == a) {
                let known: Vec<&str> = command.flags.iter().map(|f| f.name).collect();
                return Err(format!("unknown option {a}; known: {}", known.join(" ")));
            }
        }
        Ok(Self { args, command })
    }

    fn flag(&self, name: &str) -> Result<&'static Flag, String> {
        self.command
            .flags
            .iter()
            .find(|f| f.name == name)
            .ok_or_else(|| format!("{} has no flag {name}", self.command.name))
    }

    /// Whether the flag without a value `name` was given.
    pub fn has(&self, name: &str) -> bool {
        self.args.iter().any(|a| a == name)
    }

    /// The value of flag `name`, or its default.
    pub fn get<T: std::str::FromStr>(&self, name: &str) -> Result<T, String> {
        let flag = self.flag(name)?;
        let v = match self.args.iter().position(|a| a == name) {
            None => flag.default.ok_or(format!("{name} has no default"))?,
            Some(i) => self
                .args
                .get(i + 1)
                .ok_or(format!("{name} needs a value"))?,
        };
        v.parse().map_err(|_| format!("bad value for {name}: {v}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_flag_is_declared_once_with_a_usable_default() {
        for s in COMMANDS.iter().flat_map(|c| c.subcommands) {
            assert!(
                s.subcommands.is_empty(),
                "{}: one level of subcommands",
                s.name
            );
            for f in s.flags {
                assert!(f.name.starts_with("--") && !f.help.is_empty(), "{}", f.name);
                assert_eq!(f.value.is_some(), f.default.is_some(), "{}", f.name);
                if let Some(d) = f.default {
                    d.parse::<f64>().unwrap();
                }
            }
        }
        for c in COMMANDS {
            let mut names: Vec<&str> = c.flags.iter().map(|f| f.name).collect();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), c.flags.len(), "{}: a flag twice", c.name);
            let flags = Flags::new(c.name, &[]).unwrap();
            for f in c.flags {
                assert!(f.name.starts_with("--") && !f.help.is_empty(), "{}", f.name);
                assert_eq!(f.value.is_some(), f.default.is_some(), "{}", f.name);
                if f.value.is_some() {
                    flags.get::<f64>(f.name).unwrap();
                }
                assert!(
                    usage().contains(f.name),
                    "{} missing from the usage",
                    f.name
                );
            }
        }
    }

    #[test]
    fn flags_are_checked_against_the_table() {
        let args = ["--cycles".to_owned(), "3".to_owned(), "--fake".to_owned()];
        let flags = Flags::new("bench", &args).unwrap();
        assert_eq!(flags.get::<usize>("--cycles").unwrap(), 3);
        assert_eq!(flags.get::<usize>("--chunk-mib").unwrap(), 1024);
        assert!(flags.has("--fake") && !flags.has("--no-verify"));
        let err = Flags::new("demo", &args).err().unwrap();
        assert!(err.starts_with("unknown option --cycles"), "{err}");
        let spec: serde_json::Value = serde_json::from_str(&spec_json().unwrap()).unwrap();
        assert_eq!(spec["commands"][0]["flags"][0]["name"], "--device");
        assert_eq!(
            spec["commands"][0]["flags"][1]["value"],
            serde_json::Value::Null
        );
        assert_eq!(spec["commands"][1]["subcommands"][0]["name"], "nccl");
        assert!(usage().contains("bench nccl") && usage().contains("--ranks N"));
    }

    #[test]
    fn a_subcommand_is_refused_by_the_core() {
        let args: Vec<String> = ["bench", "nccl", "--ranks", "2"].map(String::from).into();
        assert_eq!(main(&args, &mut Vec::new()), 2);
    }
}
