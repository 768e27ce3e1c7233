//! The `nccl` tag when a peer fails, across real processes on the fake driver: an owner that
//! died or is stopped (SIGSTOP) while the others pause or resume, an importer that died or is a
//! zombie, an import that cannot be mapped again. Checks that the live peers' memory is paused
//! and resumed all the same, that no process is left registered as an importer of memory it
//! did not map, that `MEMSAVER_NCCL_TIMEOUT_MS` bounds a whole pause or resume, and that the
//! errors name the peer (pid, group, device, what is held) and say what to do.
//!
//! Ranks are `nccl-rank` programs (one rank of an NCCL-like job, see its source); this file has
//! its own small harness, with per-rank environments and signals.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use memsaver_scenarios::{cuda_lib, fake_nccl, preload_lib, tempdir};

const MIB: u64 = 1 << 20;

/// A timeout short enough for tests, long enough for a loaded machine.
const TIMEOUT_MS: u32 = 2000;

/// A generous upper bound for a pause or resume under [`TIMEOUT_MS`]: the code before the fix
/// took the timeout plus 5 s per stopped peer (9 s for a pause, 7 s for a resume).
const BOUND: Duration = Duration::from_secs(6);

struct Rank {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// Killed (reaped or not): no more commands.
    gone: bool,
}

/// A job of ranks in one group on a fresh fake machine and runtime directory.
struct Job {
    ranks: Vec<Rank>,
    dirs: [PathBuf; 3],
}

impl Job {
    /// `world` ranks; `env(rank)` gives extra variables per rank.
    fn start(world: usize, group: u32, env: impl Fn(usize) -> Vec<(&'static str, String)>) -> Job {
        let dirs = [tempdir("fake"), tempdir("rt"), tempdir("rdv")];
        let (preload, cuda) = (preload_lib(), cuda_lib());
        let ranks = (0..world)
            .map(|r| {
                let mut child = Command::new(env!("CARGO_BIN_EXE_nccl-rank"))
                    .arg(fake_nccl())
                    .arg(&cuda)
                    .arg(&dirs[2])
                    .arg(r.to_string())
                    .arg(world.to_string())
                    .env("LD_PRELOAD", &preload)
                    .env("MEMSAVER_CUDA_LIB", &cuda)
                    .env("FAKE_CUDA_DIR", &dirs[0])
                    .env("MEMSAVER_RUNTIME_DIR", &dirs[1])
                    .env("MEMSAVER_GROUP", group.to_string())
                    .env("MEMSAVER_NCCL_TIMEOUT_MS", TIMEOUT_MS.to_string())
                    .envs(env(r))
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .spawn()
                    .unwrap();
                Rank {
                    stdin: child.stdin.take().unwrap(),
                    stdout: BufReader::new(child.stdout.take().unwrap()),
                    child,
                    gone: false,
                }
            })
            .collect();
        Job { ranks, dirs }
    }

    fn pid(&self, r: usize) -> u32 {
        self.ranks[r].child.id()
    }

    /// Sends `cmd` to the given ranks at once, then reads their answers.
    fn on(&mut self, which: &[usize], cmd: &str) -> Vec<String> {
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

    fn one(&mut self, r: usize, cmd: &str) -> String {
        self.on(&[r], cmd).remove(0)
    }

    /// `cmd` on rank `r`, and how long it took.
    fn timed(&mut self, r: usize, cmd: &str) -> (String, Duration) {
        let t = Instant::now();
        let a = self.one(r, cmd);
        (a, t.elapsed())
    }

    fn ok(&mut self, which: &[usize], cmd: &str) {
        for (r, a) in which.iter().zip(self.on(which, cmd)) {
            assert_eq!(a, "ok", "rank {r}: {cmd}");
        }
    }

    fn live(&self) -> Vec<usize> {
        (0..self.ranks.len())
            .filter(|r| !self.ranks[*r].gone)
            .collect()
    }

    /// Device memory in use on the fake machine, asked of a live rank.
    fn used(&mut self) -> u64 {
        let r = self.live()[0];
        self.one(r, "used")
            .strip_prefix("ok ")
            .unwrap()
            .parse()
            .unwrap()
    }

    /// Allocates `mib` per rank, exchanges, writes seed = rank, checks every import.
    fn setup(&mut self, mib: u64) {
        let all = self.live();
        self.ok(&all, &format!("alloc {mib}"));
        self.ok(&all, "exchange");
        for r in all {
            self.ok(&[r], &format!("write {r}"));
        }
        self.check_all();
    }

    fn check_all(&mut self) {
        let all = self.live();
        for &r in &all {
            for &p in all.iter().filter(|p| **p != r) {
                assert_eq!(
                    self.one(r, &format!("check {p} {p}")),
                    "ok",
                    "rank {r} reads rank {p}"
                );
            }
        }
    }

    fn signal(&self, r: usize, sig: libc::c_int) {
        // SAFETY: a child of this test, not yet reaped.
        assert_eq!(unsafe { libc::kill(self.pid(r) as libc::pid_t, sig) }, 0);
    }

    /// SIGKILLs rank `r` and reaps it.
    fn kill(&mut self, r: usize) {
        let _ = self.ranks[r].child.kill();
        let _ = self.ranks[r].child.wait();
        self.ranks[r].gone = true;
    }

    /// SIGKILLs rank `r` and leaves it a zombie (not reaped until the job is dropped).
    fn kill_to_zombie(&mut self, r: usize) {
        self.signal(r, libc::SIGKILL);
        let stat = format!("/proc/{}/stat", self.pid(r));
        let t = Instant::now();
        while !std::fs::read_to_string(&stat).unwrap().contains(") Z ") {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "rank {r} did not become a zombie"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        self.ranks[r].gone = true;
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        for r in &mut self.ranks {
            // SAFETY: our child (a stopped one must be continued to die of SIGKILL promptly).
            unsafe { libc::kill(r.child.id() as libc::pid_t, libc::SIGCONT) };
            let _ = r.child.kill();
            let _ = r.child.wait();
        }
        for d in &self.dirs {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// Asserts that `a` is a Peer error (MEMSAVER_ERR_PEER = 11) containing every one of `parts`.
fn assert_peer_error(a: &str, parts: &[&str]) {
    assert!(a.starts_with("err 11 "), "{a}");
    for p in parts {
        assert!(a.contains(p), "{a:?} does not say {p:?}");
    }
}

fn no_env(_: usize) -> Vec<(&'static str, String)> {
    Vec::new()
}

/// Three ranks paused; rank 2 dies; ranks 0 and 1 resume. Each maps the
/// live peer's buffer (before: nothing was mapped when any owner failed) and fails naming the
/// dead owner with what it imported of it. Their next pause together completes at once
/// (before: each had registered with the other for a generation it never mapped, so the
/// other's pause waited for it until the timeout). Once the communicator is torn down, a
/// resume succeeds.
#[test]
fn a_dead_owner_leaves_only_its_imports_paused() {
    let mut job = Job::start(3, 21, no_env);
    job.setup(4);
    job.ok(&[0, 1, 2], "pause");
    assert_eq!(job.used(), 0);
    let dead = job.pid(2).to_string();
    job.kill(2);
    let answers = job.on(&[0, 1], "resume");
    for a in &answers {
        assert_peer_error(a, &[&dead]);
    }
    // The live owner's memory is back and holds its contents.
    assert_eq!(job.one(0, "check 1 1"), "ok");
    assert_eq!(job.one(1, "check 0 0"), "ok");
    assert_eq!(job.used(), 8 * MIB);
    // The errors say who, what and what to do (checked after the behaviour above).
    for a in &answers {
        assert_peer_error(
            a,
            &[
                &format!(
                    "process {dead} (group 21), whose 1 buffer (4 MiB) on device 0 this process imported"
                ),
                "the process exited: restart the job",
                "mapped 1 import(s)",
            ],
        );
    }
    // Pausing together: nobody waits for a registration that was never mapped.
    let t = Instant::now();
    job.ok(&[0, 1], "pause");
    println!("pause after a partial resume: {:?}", t.elapsed());
    assert!(
        t.elapsed() < Duration::from_millis(TIMEOUT_MS as u64),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(job.used(), 0);
    // Still paused imports of the dead owner: the resume says so again, the rest comes back.
    for a in job.on(&[0, 1], "resume") {
        assert_peer_error(&a, &[&format!("process {dead} (group 21)")]);
    }
    job.check_all();
    // The job tears its communicator down (NCCL frees every buffer): a resume then succeeds.
    job.ok(&[0, 1], "free");
    job.ok(&[0, 1], "resume");
    assert_eq!(job.used(), 0);
}

/// An import that was served but cannot be mapped (the fake driver fails rank 0's
/// 5th cuMemMap: its own buffer, two imports, its own buffer again at resume, then the import
/// of rank 1's buffer). Rank 0 must tell rank 1 it does not hold it, so that rank 1's pause
/// (alone) does not wait for rank 0.
#[test]
fn an_import_that_cannot_be_mapped_is_not_held() {
    let mut job = Job::start(3, 22, |r| {
        if r == 0 {
            vec![("FAKE_CUDA_FAIL_MAP_AT", "5".to_string())]
        } else {
            Vec::new()
        }
    });
    job.setup(4);
    job.ok(&[0, 1, 2], "pause");
    let dead = job.pid(2).to_string();
    job.kill(2);
    let answers = job.on(&[0, 1], "resume");
    // Rank 1 pauses alone: rank 0 holds nothing of it.
    let (a, took) = job.timed(1, "pause");
    println!("owner's pause with an importer that could not map: {took:?}: {a}");
    assert_eq!(a, "ok");
    assert_peer_error(
        &answers[0],
        &[
            &format!("process {dead} (group 22)"),
            "mapped 0 import(s)",
            "could not be mapped",
        ],
    );
    assert_peer_error(
        &answers[1],
        &[&format!("process {dead} (group 22)"), "mapped 1 import(s)"],
    );
    assert!(took < Duration::from_millis(TIMEOUT_MS as u64), "{took:?}");
}

/// Rank 1 is stopped (SIGSTOP). Rank 0's pause must end within the
/// timeout (before: telling the stopped owner took the timeout plus 5 s, then the importer wait
/// took the timeout again), naming rank 1, what it holds, and what to do. Once rank 1 is
/// continued, the job pauses and resumes as usual.
#[test]
fn a_stopped_peer_bounds_the_pause_by_the_timeout() {
    let mut job = Job::start(2, 23, no_env);
    job.setup(4);
    job.signal(1, libc::SIGSTOP);
    let (a, took) = job.timed(0, "pause");
    println!("pause with a stopped peer (timeout {TIMEOUT_MS} ms): {took:?}");
    assert!(took < BOUND, "{took:?}: {a}");
    let stopped = job.pid(1);
    assert_peer_error(
        &a,
        &[
            &format!("process {stopped} (group 23) holds imports of 1 buffer (4 MiB) on device 0"),
            "it is stopped",
            &format!("kill -CONT {stopped}"),
        ],
    );
    job.signal(1, libc::SIGCONT);
    assert_eq!(job.one(1, "pause"), "ok");
    assert_eq!(job.one(0, "pause"), "ok", "retried once rank 1 let go");
    assert_eq!(job.used(), 0);
    job.ok(&[0, 1], "resume");
    job.check_all();
}

/// Both ranks paused; rank 1 is stopped. Rank 0's resume must
/// end within the timeout (before: the timeout plus 5 s) with its own memory back, naming
/// rank 1. Once rank 1 is continued, resuming again completes, and later cycles are clean (no
/// registration left by the abandoned request).
#[test]
fn a_stopped_owner_bounds_the_resume_by_the_timeout() {
    let mut job = Job::start(2, 24, no_env);
    job.setup(4);
    job.ok(&[0, 1], "pause");
    job.signal(1, libc::SIGSTOP);
    let (a, took) = job.timed(0, "resume");
    println!("resume with a stopped owner (timeout {TIMEOUT_MS} ms): {took:?}");
    assert!(took < BOUND, "{took:?}: {a}");
    let stopped = job.pid(1);
    assert_peer_error(
        &a,
        &[
            &format!("process {stopped} (group 24), whose 1 buffer (4 MiB) on device 0"),
            "it is stopped",
        ],
    );
    assert_eq!(job.used(), 4 * MIB, "rank 0's own memory is back");
    job.signal(1, libc::SIGCONT);
    job.ok(&[0, 1], "resume");
    job.check_all();
    for cycle in 0..2 {
        let t = Instant::now();
        job.ok(&[0, 1], "pause");
        assert!(
            t.elapsed() < Duration::from_millis(TIMEOUT_MS as u64),
            "cycle {cycle}"
        );
        assert_eq!(job.used(), 0, "cycle {cycle}");
        job.ok(&[0, 1], "resume");
        job.check_all();
    }
}

/// A peer that runs but does not pause is named with what it holds.
#[test]
fn a_peer_that_does_not_pause_is_named_with_what_it_holds() {
    let mut job = Job::start(2, 25, no_env);
    job.setup(4);
    let (a, took) = job.timed(0, "pause");
    println!("pause with a peer that does not pause: {took:?}");
    assert!(took < BOUND, "{took:?}");
    assert_peer_error(
        &a,
        &[
            &format!(
                "process {} (group 25) holds imports of 1 buffer (4 MiB) on device 0",
                job.pid(1)
            ),
            "must pause 'nccl' too",
            "MEMSAVER_NCCL_TIMEOUT_MS",
        ],
    );
}

/// An importer that died has let go.
#[test]
fn a_dead_importer_counts_as_released() {
    let mut job = Job::start(2, 26, no_env);
    job.setup(4);
    job.kill(1);
    let (a, took) = job.timed(0, "pause");
    assert_eq!(a, "ok");
    assert!(took < Duration::from_millis(TIMEOUT_MS as u64), "{took:?}");
    assert_eq!(job.used(), 0);
}

/// A zombie (dead, not yet reaped by its parent) has let go too: the kernel closed
/// its files and dropped its mappings.
#[test]
fn a_zombie_importer_counts_as_released() {
    let mut job = Job::start(2, 27, no_env);
    job.setup(4);
    job.kill_to_zombie(1);
    let (a, took) = job.timed(0, "pause");
    assert_eq!(a, "ok");
    assert!(took < Duration::from_millis(TIMEOUT_MS as u64), "{took:?}");
    assert_eq!(job.used(), 0);
}
