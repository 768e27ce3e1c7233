//! The harness of the multi-process `nccl` scenarios: jobs of `nccl-rank` processes on the fake
//! driver, driven one command line at a time.

#![allow(dead_code)] // each test file uses part of it

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use memsaver_scenarios::{cuda_lib, fake_nccl, preload_lib, tempdir};

pub const MIB: u64 = 1 << 20;

/// A fake-driver state directory and a runtime directory, removed when dropped (declare it
/// before the jobs that use it, so they are dropped first).
pub struct Dirs {
    pub fake: PathBuf,
    pub rt: PathBuf,
}

impl Dirs {
    pub fn new() -> Self {
        Self {
            fake: tempdir("fake"),
            rt: tempdir("rt"),
        }
    }
}

impl Drop for Dirs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.fake);
        let _ = std::fs::remove_dir_all(&self.rt);
    }
}

pub struct RankProc {
    /// The rank's process (`None` when it runs under a launcher: see [`Job::start_in_pid_namespace`]).
    pub child: Option<Child>,
    stdin: Box<dyn Write + Send>,
    stdout: BufReader<Box<dyn Read + Send>>,
}

/// A job of `world` ranks in one group, sharing the fake devices of `fake_dir`.
pub struct Job {
    pub ranks: Vec<RankProc>,
    /// Where the ranks exchange their buffers' fds (removed with the job).
    rendezvous: PathBuf,
    /// The launcher of ranks started in their own pid namespace.
    launcher: Option<Child>,
}

#[allow(clippy::too_many_arguments)] // one per thing a rank is told
fn rank_command(
    rendezvous: &Path,
    r: usize,
    world: usize,
    group: u32,
    fake_dir: &Path,
    runtime_dir: &Path,
    timeout_ms: u32,
    env: &[(&str, &str)],
) -> Command {
    let (preload, cuda) = (preload_lib(), cuda_lib());
    let mut c = Command::new(env!("CARGO_BIN_EXE_nccl-rank"));
    c.arg(fake_nccl())
        .arg(&cuda)
        .arg(rendezvous)
        .arg(r.to_string())
        .arg(world.to_string())
        .env("LD_PRELOAD", &preload)
        .env("MEMSAVER_CUDA_LIB", &cuda)
        .env("FAKE_CUDA_DIR", fake_dir)
        .env("MEMSAVER_RUNTIME_DIR", runtime_dir)
        .env("MEMSAVER_GROUP", group.to_string())
        .env("MEMSAVER_NCCL_TIMEOUT_MS", timeout_ms.to_string())
        .envs(env.iter().copied());
    c
}

/// Whether this kernel lets this user make a user and pid namespace (`None`), else why not.
pub fn pid_namespaces_unavailable() -> Option<String> {
    match Command::new("unshare")
        .args(["--user", "--map-root-user", "--pid", "--fork", "true"])
        .output()
    {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!(
            "unshare --user --map-root-user --pid --fork: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Some(format!("unshare: {e}")),
    }
}

fn quote(p: &Path) -> String {
    format!("'{}'", p.display().to_string().replace('\'', r"'\''"))
}

impl Job {
    pub fn start(
        world: usize,
        group: u32,
        fake_dir: &Path,
        runtime_dir: &Path,
        timeout_ms: u32,
    ) -> Job {
        Self::start_with(world, group, fake_dir, runtime_dir, timeout_ms, &[])
    }

    /// As [`Job::start`], with extra environment variables for every rank.
    pub fn start_with(
        world: usize,
        group: u32,
        fake_dir: &Path,
        runtime_dir: &Path,
        timeout_ms: u32,
        env: &[(&str, &str)],
    ) -> Job {
        let rendezvous = tempdir("rdv");
        let ranks = (0..world)
            .map(|r| {
                let mut child = rank_command(
                    &rendezvous,
                    r,
                    world,
                    group,
                    fake_dir,
                    runtime_dir,
                    timeout_ms,
                    env,
                )
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
                let stdin = Box::new(child.stdin.take().unwrap());
                let stdout = BufReader::new(Box::new(child.stdout.take().unwrap()) as Box<_>);
                RankProc {
                    child: Some(child),
                    stdin,
                    stdout,
                }
            })
            .collect();
        Job {
            ranks,
            rendezvous,
            launcher: None,
        }
    }

    /// As [`Job::start`], with all ranks in one new pid namespace (and user namespace, which
    /// an unprivileged user needs for it): `unshare` runs a shell there that starts the ranks
    /// with their stdin and stdout on FIFOs. Their pids are small and the same in every such
    /// job (the shell is 1, the ranks 2, 3, ...).
    pub fn start_in_pid_namespace(
        world: usize,
        group: u32,
        fake_dir: &Path,
        runtime_dir: &Path,
        timeout_ms: u32,
    ) -> Job {
        let rendezvous = tempdir("rdv");
        let mut script = String::new();
        for r in 0..world {
            let c = rank_command(
                &rendezvous,
                r,
                world,
                group,
                fake_dir,
                runtime_dir,
                timeout_ms,
                &[],
            );
            for p in [format!("in{r}"), format!("out{r}")] {
                let path = rendezvous.join(p);
                let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
                // SAFETY: a NUL-terminated path.
                assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
            }
            let args: Vec<String> = std::iter::once(c.get_program())
                .chain(c.get_args())
                .map(|a| quote(Path::new(a)))
                .collect();
            script += &format!(
                "{} <{} >{} & ",
                args.join(" "),
                quote(&rendezvous.join(format!("in{r}"))),
                quote(&rendezvous.join(format!("out{r}")))
            );
        }
        script += "wait";
        let probe = rank_command(
            &rendezvous,
            0,
            world,
            group,
            fake_dir,
            runtime_dir,
            timeout_ms,
            &[],
        );
        let launcher = Command::new("unshare")
            .args(["--user", "--map-root-user", "--pid", "--fork", "sh", "-c"])
            .arg(script)
            .envs(
                probe
                    .get_envs()
                    .filter_map(|(k, v)| Some((k.to_owned(), v?.to_owned()))),
            )
            .spawn()
            .unwrap();
        let ranks = (0..world)
            .map(|r| {
                // Opened in the order the shell's background jobs open them (each blocks until
                // the other end is open).
                let stdin = std::fs::OpenOptions::new()
                    .write(true)
                    .open(rendezvous.join(format!("in{r}")))
                    .unwrap();
                let stdout = std::fs::File::open(rendezvous.join(format!("out{r}"))).unwrap();
                RankProc {
                    child: None,
                    stdin: Box::new(stdin),
                    stdout: BufReader::new(Box::new(stdout) as Box<_>),
                }
            })
            .collect();
        Job {
            ranks,
            rendezvous,
            launcher: Some(launcher),
        }
    }

    /// The pid of rank `r` as the test sees it.
    pub fn pid(&self, r: usize) -> u32 {
        self.ranks[r]
            .child
            .as_ref()
            .expect("a rank started directly")
            .id()
    }

    /// Kills rank `r`; reaps it when `reap`, else leaves it a zombie.
    pub fn kill(&mut self, r: usize, reap: bool) {
        let c = self.ranks[r]
            .child
            .as_mut()
            .expect("a rank started directly");
        let _ = c.kill();
        if reap {
            let _ = c.wait();
        }
    }

    /// Sends `cmd` to the given ranks at once, then reads their answers.
    pub fn on(&mut self, which: &[usize], cmd: &str) -> Vec<String> {
        for &r in which {
            writeln!(self.ranks[r].stdin, "{cmd}").unwrap();
            self.ranks[r].stdin.flush().unwrap();
        }
        which
            .iter()
            .map(|&r| {
                let mut line = String::new();
                self.ranks[r].stdout.read_line(&mut line).unwrap();
                assert!(!line.is_empty(), "rank {r} exited during {cmd:?}");
                line.trim().to_owned()
            })
            .collect()
    }

    pub fn all(&mut self, cmd: &str) -> Vec<String> {
        let all: Vec<usize> = (0..self.ranks.len()).collect();
        self.on(&all, cmd)
    }

    pub fn all_ok(&mut self, cmd: &str) {
        for (r, a) in self.all(cmd).iter().enumerate() {
            assert_eq!(a, "ok", "rank {r}: {cmd}");
        }
    }

    pub fn used(&mut self) -> u64 {
        self.on(&[0], "used")[0]
            .strip_prefix("ok ")
            .unwrap()
            .parse()
            .unwrap()
    }

    /// Allocates `mib` per rank, exchanges, writes seed = rank, checks every import.
    pub fn setup(&mut self, mib: u64) {
        self.setup_seeded(mib, 0);
    }

    /// As [`Job::setup`], with seed = `base` + rank.
    pub fn setup_seeded(&mut self, mib: u64, base: u64) {
        self.all_ok(&format!("alloc {mib}"));
        self.all_ok("exchange");
        self.write_all(base);
        self.check_all_seeded(base);
    }

    pub fn write_all(&mut self, base: u64) {
        for r in 0..self.ranks.len() {
            assert_eq!(self.on(&[r], &format!("write {}", base + r as u64)), ["ok"]);
        }
    }

    pub fn check_all(&mut self) {
        self.check_all_seeded(0);
    }

    /// Every rank reads every peer's buffer through its import: seed `base` + peer.
    pub fn check_all_seeded(&mut self, base: u64) {
        let n = self.ranks.len();
        for r in 0..n {
            for peer in (0..n).filter(|p| *p != r) {
                assert_eq!(
                    self.on(&[r], &format!("check {peer} {}", base + peer as u64)),
                    ["ok"],
                    "rank {r} reads rank {peer}"
                );
            }
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        for r in &mut self.ranks {
            let _ = writeln!(r.stdin, "exit");
            let _ = r.stdin.flush();
            if let Some(c) = r.child.as_mut() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        self.ranks.clear(); // closes the FIFOs: ranks under a launcher see EOF and exit
        if let Some(l) = self.launcher.as_mut() {
            let _ = l.wait();
        }
        let _ = std::fs::remove_dir_all(&self.rendezvous);
    }
}
