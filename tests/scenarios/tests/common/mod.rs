//! The harness of the multi-process `nccl` scenarios: jobs of `nccl-rank` processes on the fake
//! driver, driven one command line at a time, with per-rank environments, signals and killed
//! ranks (which later commands to "all" ranks leave out).

#![allow(dead_code)] // each test file uses part of it

use std::ffi::OsStr;
use std::io::{BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use memsaver_scenarios::{
    ANSWER_WAIT, cuda_lib, fake_nccl, preload_lib, read_line_within, tempdir,
};

pub const MIB: u64 = 1 << 20;

/// Why this user cannot make the pid namespaces the scenarios make here (`unshare --user
/// --map-root-user --pid --fork`, with and without `--mount-proc`), or `None` when it can. A
/// test that needs them reports the reason with `memsaver_test_support::skip`, which fails it
/// under `MEMSAVER_REQUIRE_ALL_TESTS=1` (CI runs as root, where they work).
pub fn pid_namespaces_missing() -> Option<String> {
    let base = ["--user", "--map-root-user", "--pid", "--fork"];
    for extra in [&[][..], &["--mount-proc"][..]] {
        let args: Vec<&str> = base.iter().chain(extra).copied().chain(["true"]).collect();
        let why = match Command::new("unshare").args(&args).output() {
            Ok(o) if o.status.success() => continue,
            Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_owned(),
            Err(e) => e.to_string(),
        };
        return Some(format!(
            "needs pid namespaces, and `unshare {}` fails here: {why}",
            args.join(" ")
        ));
    }
    None
}

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
    /// A pipe or a FIFO: read with a deadline ([`read_line_within`]).
    stdout: BufReader<std::fs::File>,
    /// Killed (reaped or not): no more commands.
    gone: bool,
}

/// A job of `world` ranks in one group, sharing the fake devices of `fake_dir`.
pub struct Job {
    pub ranks: Vec<RankProc>,
    /// Where the ranks exchange their buffers' fds (removed with the job).
    rendezvous: PathBuf,
    /// The launcher of ranks started in their own pid namespace.
    launcher: Option<Child>,
    /// How long [`Job::on`] waits for the answers to one command ([`ANSWER_WAIT`]).
    pub answer_wait: Duration,
}

/// A new rendezvous directory and the command line of each of the job's `world` ranks.
fn rank_commands(
    world: usize,
    group: u32,
    fake_dir: &Path,
    runtime_dir: &Path,
    timeout_ms: u32,
) -> (PathBuf, Vec<Command>) {
    let rendezvous = tempdir("rdv");
    let (preload, cuda) = (preload_lib(), cuda_lib());
    let commands = (0..world)
        .map(|r| {
            let mut c = Command::new(env!("CARGO_BIN_EXE_nccl-rank"));
            c.arg(fake_nccl())
                .arg(&cuda)
                .arg(&rendezvous)
                .arg(r.to_string())
                .arg(world.to_string())
                .env("LD_PRELOAD", &preload)
                .env("MEMSAVER_CUDA_LIB", &cuda)
                .env("FAKE_CUDA_DIR", fake_dir)
                .env("MEMSAVER_RUNTIME_DIR", runtime_dir)
                .env("MEMSAVER_GROUP", group.to_string())
                .env("MEMSAVER_NCCL_TIMEOUT_MS", timeout_ms.to_string())
                // Every byte of every buffer comes back, so that a test can check them all;
                // a test of the default (headers) says so in its `env`.
                .env("MEMSAVER_NCCL_BACKUP", "cpu");
            c
        })
        .collect();
    (rendezvous, commands)
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
        Self::start_per_rank(world, group, fake_dir, runtime_dir, timeout_ms, |_| {
            env.iter().copied()
        })
    }

    /// As [`Job::start`], with extra environment variables `env(rank)` for each rank.
    pub fn start_per_rank<I, K, V>(
        world: usize,
        group: u32,
        fake_dir: &Path,
        runtime_dir: &Path,
        timeout_ms: u32,
        env: impl Fn(usize) -> I,
    ) -> Job
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<OsStr>,
        V: AsRef<OsStr>,
    {
        let inherit = |_| Stdio::inherit();
        Self::start_per_rank_with_stderr(
            world,
            group,
            fake_dir,
            runtime_dir,
            timeout_ms,
            env,
            inherit,
        )
    }

    /// As [`Job::start_per_rank`], with stderr `stderr(rank)` for each rank (a pipe nobody
    /// reads, for example).
    pub fn start_per_rank_with_stderr<I, K, V>(
        world: usize,
        group: u32,
        fake_dir: &Path,
        runtime_dir: &Path,
        timeout_ms: u32,
        env: impl Fn(usize) -> I,
        mut stderr: impl FnMut(usize) -> Stdio,
    ) -> Job
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<OsStr>,
        V: AsRef<OsStr>,
    {
        let (rendezvous, commands) = rank_commands(world, group, fake_dir, runtime_dir, timeout_ms);
        let ranks = commands
            .into_iter()
            .enumerate()
            .map(|(r, mut c)| {
                let mut child = c
                    .envs(env(r))
                    .stderr(stderr(r))
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .spawn()
                    .unwrap();
                let stdin = Box::new(child.stdin.take().unwrap());
                let stdout = child.stdout.take().unwrap();
                let stdout =
                    BufReader::new(std::fs::File::from(std::os::fd::OwnedFd::from(stdout)));
                RankProc {
                    child: Some(child),
                    stdin,
                    stdout,
                    gone: false,
                }
            })
            .collect();
        Job {
            ranks,
            rendezvous,
            launcher: None,
            answer_wait: ANSWER_WAIT,
        }
    }

    /// As [`Job::start`], with all ranks in one new pid namespace (and user namespace, which
    /// an unprivileged user needs for it, and mount namespace, with a `/proc` of the new pid
    /// namespace as a container has): `unshare` runs a shell there that starts the ranks
    /// with their stdin and stdout on FIFOs. Their pids are small and the same in every such
    /// job (the shell is 1, the ranks 2, 3, ...).
    pub fn start_in_pid_namespace(
        world: usize,
        group: u32,
        fake_dir: &Path,
        runtime_dir: &Path,
        timeout_ms: u32,
    ) -> Job {
        let (rendezvous, commands) = rank_commands(world, group, fake_dir, runtime_dir, timeout_ms);
        let mut script = String::new();
        for (r, c) in commands.iter().enumerate() {
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
        let launcher = Command::new("unshare")
            .args([
                "--user",
                "--map-root-user",
                "--pid",
                "--fork",
                // The namespace's init dies with the launcher, and every rank with it: a test
                // that fails kills the launcher (see the Drop of Job).
                "--kill-child",
                "--mount-proc",
                "sh",
                "-c",
            ])
            .arg(script)
            .envs(
                commands[0]
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
                    stdout: BufReader::new(stdout),
                    gone: false,
                }
            })
            .collect();
        Job {
            ranks,
            rendezvous,
            launcher: Some(launcher),
            answer_wait: ANSWER_WAIT,
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

    /// The ranks not killed, in order.
    pub fn live(&self) -> Vec<usize> {
        (0..self.ranks.len())
            .filter(|r| !self.ranks[*r].gone)
            .collect()
    }

    /// Sends signal `sig` to rank `r`.
    pub fn signal(&self, r: usize, sig: libc::c_int) {
        // SAFETY: a child of this test, not yet reaped.
        assert_eq!(unsafe { libc::kill(self.pid(r) as libc::pid_t, sig) }, 0);
    }

    /// SIGKILLs rank `r`; reaps it when `reap`, else leaves it a zombie (reaped when the job is
    /// dropped). It gets no more commands.
    pub fn kill(&mut self, r: usize, reap: bool) {
        let c = self.ranks[r]
            .child
            .as_mut()
            .expect("a rank started directly");
        let _ = c.kill();
        if reap {
            let _ = c.wait();
        }
        self.ranks[r].gone = true;
    }

    /// As [`Job::kill`] without reaping, and waits until rank `r` has exited: a zombie, since
    /// `waitid(WNOWAIT)` waits for the exit without reaping it. No deadline: SIGKILL ends it.
    pub fn kill_to_zombie(&mut self, r: usize) {
        let pid = self.pid(r);
        self.kill(r, false);
        loop {
            // SAFETY: zeroed siginfo_t is a valid out-parameter; `pid` is our own child.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            // SAFETY: as above.
            let rc = unsafe {
                libc::waitid(
                    libc::P_PID,
                    pid as libc::id_t,
                    &mut info,
                    libc::WEXITED | libc::WNOWAIT,
                )
            };
            if rc == 0 {
                return;
            }
            let e = std::io::Error::last_os_error();
            assert_eq!(
                e.kind(),
                std::io::ErrorKind::Interrupted,
                "waitid of rank {r}: {e}"
            );
        }
    }

    /// Sends `cmd` to the given ranks at once, then reads their answers, all within
    /// [`Job::answer_wait`]: a rank that exits or does not answer by then fails the test, naming
    /// the command and the rank (the job's drop then kills every rank).
    pub fn on(&mut self, which: &[usize], cmd: &str) -> Vec<String> {
        self.send(which, cmd);
        self.answers(which, cmd)
    }

    /// Sends `cmd` to the given ranks without reading their answers ([`Job::answers`]).
    pub fn send(&mut self, which: &[usize], cmd: &str) {
        for &r in which {
            writeln!(self.ranks[r].stdin, "{cmd}").unwrap();
            self.ranks[r].stdin.flush().unwrap();
        }
    }

    /// The answers of the given ranks to `cmd`, sent before, as [`Job::on`] reads them.
    pub fn answers(&mut self, which: &[usize], cmd: &str) -> Vec<String> {
        let deadline = Instant::now() + self.answer_wait;
        which
            .iter()
            .map(|&r| {
                let line =
                    read_line_within(&mut self.ranks[r].stdout, deadline).unwrap_or_else(|e| {
                        panic!(
                            "{} did not answer {cmd:?} within {:?}: {e}",
                            self.who(r),
                            self.answer_wait
                        )
                    });
                assert!(!line.is_empty(), "{} exited during {cmd:?}", self.who(r));
                line.trim().to_owned()
            })
            .collect()
    }

    /// Rank `r` and its process, for messages.
    fn who(&self, r: usize) -> String {
        match &self.ranks[r].child {
            Some(c) => format!("rank {r} (pid {})", c.id()),
            None => format!(
                "rank {r} (in the pid namespace of launcher {:?})",
                self.launcher.as_ref().map(Child::id)
            ),
        }
    }

    /// `nccl_stats()` of rank `r` (the `stats` command of `nccl-rank`).
    pub fn nccl_stats(&mut self, r: usize) -> serde_json::Value {
        let a = self.one(r, "stats");
        serde_json::from_str(
            a.strip_prefix("ok ")
                .unwrap_or_else(|| panic!("stats: {a}")),
        )
        .unwrap()
    }

    /// Sends `cmd` to rank `r` and returns its answer.
    pub fn one(&mut self, r: usize, cmd: &str) -> String {
        self.on(&[r], cmd).remove(0)
    }

    /// `cmd` on rank `r`, and how long it took.
    pub fn timed(&mut self, r: usize, cmd: &str) -> (String, Duration) {
        let t = Instant::now();
        let a = self.one(r, cmd);
        (a, t.elapsed())
    }

    /// How long rank `r`'s last pause or resume took, in µs, as the rank measured it (its
    /// `calls` report, which also resets its call counts).
    pub fn last_call_us(&mut self, r: usize) -> u64 {
        let calls = self.one(r, "calls");
        calls
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix("us="))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no duration in {calls:?}"))
    }

    /// Sends `cmd` to the given ranks at once; each must answer `ok`.
    pub fn ok(&mut self, which: &[usize], cmd: &str) {
        for (r, a) in which.iter().zip(self.on(which, cmd)) {
            assert_eq!(a, "ok", "rank {r}: {cmd}");
        }
    }

    /// Sends `cmd` to every live rank at once, then reads their answers.
    pub fn all(&mut self, cmd: &str) -> Vec<String> {
        self.on(&self.live(), cmd)
    }

    pub fn all_ok(&mut self, cmd: &str) {
        self.ok(&self.live(), cmd);
    }

    /// Device memory in use on the fake machine, asked of a live rank.
    pub fn used(&mut self) -> u64 {
        let r = self.live()[0];
        self.one(r, "used")
            .strip_prefix("ok ")
            .unwrap()
            .parse()
            .unwrap()
    }

    /// Allocates `mib` per live rank, exchanges, writes seed = rank, checks every import.
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

    /// Every live rank writes seed `base` + rank to its buffer.
    pub fn write_all(&mut self, base: u64) {
        for r in self.live() {
            self.ok(&[r], &format!("write {}", base + r as u64));
        }
    }

    pub fn check_all(&mut self) {
        self.check_all_seeded(0);
    }

    /// Every live rank reads every live peer's buffer through its import: seed `base` + peer.
    pub fn check_all_seeded(&mut self, base: u64) {
        let live = self.live();
        for &r in &live {
            for &peer in live.iter().filter(|p| **p != r) {
                assert_eq!(
                    self.one(r, &format!("check {peer} {}", base + peer as u64)),
                    "ok",
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
                if let Ok(None) = c.try_wait() {
                    // SAFETY: our child, not reaped (a stopped one must be continued to die of
                    // SIGKILL promptly).
                    unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGCONT) };
                }
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        self.ranks.clear(); // closes the FIFOs: ranks under a launcher see EOF and exit
        if let Some(l) = self.launcher.as_mut() {
            // A failed test may leave a rank stuck, which would never see its EOF: then the
            // launcher is killed, and with it the namespace (`--kill-child`).
            if std::thread::panicking() {
                let _ = l.kill();
            }
            let _ = l.wait();
        }
        let _ = std::fs::remove_dir_all(&self.rendezvous);
    }
}
