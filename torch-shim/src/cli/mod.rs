//! The `memsaver` command: `demo`, `bench`, `options`.

mod bench;
mod demo;
mod devmem;

use std::process::ExitCode;
use std::sync::Arc;

use memsaver_allocator::driver::{Driver, LoadError};
use memsaver_allocator::options::Options;

const USAGE: &str = "\
usage: memsaver <command> [options]

commands:
  demo      a staged pause/resume cycle with tagged memory, printing resident memory per tag
            per stage (real GPU when one is present, else the fake driver)
            --device N   device to use (default 0)
            --fake       use the fake driver even if a GPU is present
  bench     pause/resume throughput of the core: cpu-policy and discard tags
            --cpu-gib X --discard-gib Y --cycles N --chunk-mib M --device N --no-verify --fake
  options   the table of MEMSAVER_* options (--markdown for docs/options.md)
";

fn main() -> ExitCode {
    memsaver_nccl_hook::init_logging();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (cmd, rest) = match args.split_first() {
        Some((c, r)) => (c.as_str(), r),
        None => {
            eprint!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let result = match cmd {
        "demo" => demo::run(rest),
        "bench" => bench::run(rest),
        "options" => {
            print!("{}", Options::markdown());
            Ok(())
        }
        "-h" | "--help" | "help" => {
            print!("{USAGE}");
            Ok(())
        }
        other => Err(format!("unknown command '{other}'\n\n{USAGE}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("memsaver: error: {msg}");
            ExitCode::FAILURE
        }
    }
}

/// Opens the real driver when it loads and sees a GPU, else the fake driver built beside this
/// executable (`target/<profile>/../fake-cuda/libcuda.so.1`) or named by
/// `MEMSAVER_FAKE_CUDA_LIB`. `MEMSAVER_CUDA_LIB`, when set, is used as is.
pub fn open_driver(force_fake: bool) -> Result<Arc<Driver>, String> {
    let opts = Options::from_env();
    if std::env::var_os("MEMSAVER_CUDA_LIB").is_some() && !force_fake {
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
            let exe = std::env::current_exe().map_err(|e| e.to_string())?;
            let dir = exe
                .parent()
                .and_then(|p| p.parent())
                .ok_or("cannot locate the fake driver")?;
            dir.join("fake-cuda/libcuda.so.1")
                .to_string_lossy()
                .into_owned()
        }
    };
    Driver::load(&fake)
        .map(Arc::new)
        .map_err(|e| format!("{e}\n(build the fake driver with `make fake-cuda`)"))
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
