//! The core's commands of the `memsaver` command line: `demo` (without a profile), `bench`
//! and `options`. The command users run is the Python package's console script; it calls
//! these through [`crate::memsaver_cli_main`], so they run on the allocator core directly (a
//! private [`Allocator`](memsaver_allocator::Allocator) over a driver opened here, not the
//! process-wide one) and print to stdout: they are only ever called by that command.

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

/// The commands, with their options, as `memsaver <command> --help` shows them.
pub const USAGE: &str = "\
commands of the allocator core (run through `memsaver`):
  demo      a staged pause/resume cycle with tagged memory, printing resident memory per tag
            per stage and checking the kept contents (real GPU when one is present, else the
            fake driver)
            --device N   device to use (default 0)
            --fake       use the fake driver even if a GPU is present
  bench     pause/resume throughput of the core: cpu-policy and discard tags, checking freed
            memory and contents every cycle
            --cpu-gib X (8) --discard-gib Y (16) --cycles N (10) --chunk-mib M (1024)
            --device N (0) --no-verify --fake
  options   the table of MEMSAVER_* options (Markdown, as in docs/options.md)
";

/// Runs `args` (`["bench", "--cycles", "3"]`); what it prints goes to `out`. Exit status:
/// 0 done, 1 failed (the message is on stderr), 2 a usage error.
pub fn main(args: &[String], out: &mut dyn Write) -> i32 {
    let (cmd, rest) = match args.split_first() {
        Some((c, r)) => (c.as_str(), r),
        None => {
            eprint!("{USAGE}");
            return 2;
        }
    };
    if rest.iter().any(|a| a == "-h" || a == "--help") {
        let _ = write!(out, "{USAGE}");
        return 0;
    }
    let result = match cmd {
        "demo" => demo::run(rest, out),
        "bench" => bench::run(rest, out),
        "options" => write!(out, "{}", options::markdown()).map_err(|e| e.to_string()),
        "-h" | "--help" | "help" => write!(out, "{USAGE}").map_err(|e| e.to_string()),
        other => {
            eprintln!("memsaver: error: unknown command '{other}'\n\n{USAGE}");
            return 2;
        }
    };
    let _ = out.flush();
    match result {
        Ok(()) => 0,
        Err(msg) if msg.starts_with("unknown option") || msg.contains("needs a value") => {
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

/// Parses `--name value` flags of a subcommand.
pub struct Flags<'a>(&'a [String]);

impl<'a> Flags<'a> {
    pub fn new(args: &'a [String], known: &[&str]) -> Result<Self, String> {
        for a in args.iter().filter(|a| a.starts_with("--")) {
            if !known.contains(&a.as_str()) {
                return Err(format!("unknown option {a}; known: {}", known.join(" ")));
            }
        }
        Ok(Self(args))
    }

    pub fn has(&self, name: &str) -> bool {
        self.0.iter().any(|a| a == name)
    }

    pub fn get<T: std::str::FromStr>(&self, name: &str, default: T) -> Result<T, String> {
        match self.0.iter().position(|a| a == name) {
            None => Ok(default),
            Some(i) => {
                let v = self.0.get(i + 1).ok_or(format!("{name} needs a value"))?;
                v.parse().map_err(|_| format!("bad value for {name}: {v}"))
            }
        }
    }
}
