//! The boundaries of the `nccl` tag's cross-process sharing (docs/security.md), with real
//! processes on the fake driver: the runtime directory (no links, private, checked on the
//! open descriptor), process identity across pid namespaces, groups, the wire protocol's
//! limits, liveness, and a visible fallback when tokens cannot be used.

mod common;

use std::io::{BufRead, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{Dirs, Job, MIB};
use memsaver_scenarios::wire::{
    self, FDS, Identity, R_FD, R_JSON, R_REFUSED, RELEASED, STATS, VH_BASE,
};

/// How long a test waits for an answer that must come: generous, since the outcome, not the
/// time, is what is checked.
const ANSWER: Duration = Duration::from_secs(60);

/// The NCCL timeout of every job here (`MEMSAVER_NCCL_TIMEOUT_MS`): none of these tests is
/// about it, and a live peer slowed down by a loaded machine must never turn an answer into a
/// timeout. A test whose peer is dead or stopped learns it without waiting for it.
const PEERS_ANSWER: u32 = 60_000;

/// The owner socket of the process with `pid` in `rt/g<group>`.
fn socket_of(rt: &Path, group: u32, pid: u32) -> PathBuf {
    let dir = rt.join(format!("g{group}"));
    std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            let n = p.file_name().unwrap().to_string_lossy().into_owned();
            n == format!("{pid}.sock") || n.starts_with(&format!("{pid}-")) && n.ends_with(".sock")
        })
        .unwrap_or_else(|| panic!("no socket of process {pid} in {}", dir.display()))
}

/// Makes the runtime directory of a case in (scratch dir, a private dir to point links at).
type MakeDir = fn(&Path, &Path) -> PathBuf;

fn threads_of(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .count()
}

fn stats(job: &mut Job, r: usize) -> String {
    let a = job.on(&[r], "stats").remove(0);
    a.strip_prefix("ok ")
        .unwrap_or_else(|| panic!("{a}"))
        .to_owned()
}

/// A runtime directory that is a symbolic link, holds one as its group directory, is open to
/// others or belongs to another user is refused on the open descriptor: exports fall back to
/// plain fds and the stats say why, naming the path and what to do. (Before: links were
/// followed, and the refusals of the others were one log line that nothing recorded.)
#[test]
fn an_unsafe_runtime_directory_is_refused_and_the_fallback_is_recorded() {
    let cases: [(&str, MakeDir, &str); 4] = [
        (
            "a link as the runtime directory",
            |dirs, real| {
                std::os::unix::fs::symlink(real, dirs.join("link")).unwrap();
                dirs.join("link")
            },
            "link is a symbolic link",
        ),
        (
            "a link as the group directory",
            |dirs, real| {
                let rt = dirs.join("rt");
                std::fs::create_dir(&rt).unwrap();
                std::fs::set_permissions(&rt, PermissionsExt::from_mode(0o700)).unwrap();
                std::os::unix::fs::symlink(real, rt.join("g31")).unwrap();
                rt
            },
            "g31 is a symbolic link",
        ),
        (
            "a runtime directory others can enter",
            |dirs, _| {
                let rt = dirs.join("open");
                std::fs::create_dir(&rt).unwrap();
                std::fs::set_permissions(&rt, PermissionsExt::from_mode(0o755)).unwrap();
                rt
            },
            "with mode 0755",
        ),
        (
            "a runtime directory of another user",
            |dirs, _| {
                let rt = dirs.join("foreign");
                std::fs::create_dir(&rt).unwrap();
                std::fs::set_permissions(&rt, PermissionsExt::from_mode(0o700)).unwrap();
                // Only root can give it away; others test the cases above.
                let _ = std::os::unix::fs::chown(&rt, Some(12345), None);
                rt
            },
            "belongs to uid 12345",
        ),
    ];
    for (what, make, want) in cases {
        let dirs = Dirs::new();
        let real = dirs.rt.join("real");
        std::fs::create_dir(&real).unwrap();
        std::fs::set_permissions(&real, PermissionsExt::from_mode(0o700)).unwrap();
        let rt = make(&dirs.rt, &real);
        if want.contains("12345")
            && std::fs::metadata(&rt)
                .map(|m| std::os::unix::fs::MetadataExt::uid(&m))
                .ok()
                != Some(12345)
        {
            memsaver_test_support::skip(&format!(
                "{what}: only root can make a directory of another user"
            ));
            continue;
        }
        let mut job = Job::start(2, 31, &dirs.fake, &rt, PEERS_ANSWER);
        job.setup(4);
        for r in 0..2 {
            let s = stats(&mut job, r);
            assert!(s.contains(r#""fallback_exports":1"#), "{what}: {s}");
            assert!(
                s.contains(want) && s.contains("MEMSAVER_RUNTIME_DIR"),
                "{what}: wanted {want:?} in {s}"
            );
        }
        // A pause cannot free what was exported as plain fds: it fails, saying why, instead of
        // reporting success (before: success, having freed none of them).
        for answer in job.all("pause") {
            assert!(
                !answer.starts_with("ok") && answer.contains("exported as plain fds"),
                "{what}: pause answered {answer}"
            );
        }
        // Nothing was created through the link.
        assert_eq!(std::fs::read_dir(&real).unwrap().count(), 0, "{what}");
    }
}

/// Two jobs in two pid namespaces (containers) share the runtime directory and the group id,
/// and their ranks have the same pids. Each keeps its own buffers: sockets are named by
/// identity (pid, start time, nonce), created exclusively, never removed by another process,
/// and a client talks only to the process its token names. (Before: the second job deleted the
/// first one's `<pid>.sock` and the first job's imports mapped the second job's buffers.)
#[test]
fn jobs_in_two_pid_namespaces_with_the_same_pids_stay_apart() {
    if let Some(why) = common::pid_namespaces_missing() {
        return memsaver_test_support::skip(&why);
    }
    // The fake driver names its allocation files by pid: one state directory per namespace
    // (two machines' devices), one runtime directory for both.
    let (dirs, other) = (Dirs::new(), Dirs::new());
    let rt = &dirs.rt;
    let mut a = Job::start_in_pid_namespace(2, 40, &dirs.fake, rt, PEERS_ANSWER);
    let mut b = Job::start_in_pid_namespace(2, 40, &other.fake, rt, PEERS_ANSWER);
    let pids = |j: &mut Job| j.all("pid");
    assert_eq!(
        pids(&mut a),
        pids(&mut b),
        "the same pids in both namespaces"
    );
    a.all_ok("alloc 4");
    b.all_ok("alloc 4");
    let names: Vec<String> = std::fs::read_dir(rt.join("g40"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    let count = |suffix: &str| names.iter().filter(|n| n.ends_with(suffix)).count();
    assert_eq!(
        count(".sock"),
        4,
        "one socket per process, none removed: {names:?}"
    );
    assert_eq!(count(".epoch"), 4, "one epoch file per process: {names:?}");
    assert_eq!(names.len(), 8, "{names:?}");
    a.all_ok("exchange");
    b.all_ok("exchange");
    a.write_all(0);
    b.write_all(10);
    a.check_all_seeded(0);
    b.check_all_seeded(10);
    a.all_ok("pause");
    b.check_all_seeded(10);
    b.all_ok("pause");
    assert_eq!(a.used(), 0);
    assert_eq!(b.used(), 0);
    a.all_ok("resume");
    b.all_ok("resume");
    a.check_all_seeded(0);
    b.check_all_seeded(10);
    assert_eq!(a.used(), 8 * MIB);
    assert_eq!(b.used(), 8 * MIB);
}

/// Where pid namespaces cannot be made, the tests that need them say so and do not pass in
/// silence: each reports `SKIPPED <test>: <why>`, and under `MEMSAVER_REQUIRE_ALL_TESTS=1` (CI)
/// fails. Shown by running both tests in a child whose `unshare` fails as an unprivileged
/// container's does. (Before: a build script marked them ignored, which CI did not notice.)
#[test]
fn without_pid_namespaces_their_tests_are_skipped_visibly_and_fail_under_ci() {
    let bin = memsaver_scenarios::tempdir("no-unshare");
    let unshare = bin.join("unshare");
    std::fs::write(
        &unshare,
        "#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&unshare, PermissionsExt::from_mode(0o700)).unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let tests = [
        "jobs_in_two_pid_namespaces_with_the_same_pids_stay_apart",
        "another_pid_namespace_is_refused_even_naming_the_pid_the_owner_sees",
    ];
    for required in ["0", "1"] {
        for test in tests {
            let log = bin.join("log");
            let out = std::fs::File::create(&log).unwrap();
            let mut child = Command::new(std::env::current_exe().unwrap())
                .args(["--exact", test, "--include-ignored", "--test-threads=1"])
                .env("PATH", &path)
                .env(memsaver_test_support::REQUIRE_ALL, required)
                .stdout(out.try_clone().unwrap())
                .stderr(out)
                .spawn()
                .unwrap();
            // Only a test that neither skips nor fails (it waits for ranks that never start)
            // comes near this: it fails either way, instead of hanging the run.
            let deadline = Instant::now() + ANSWER;
            let status = loop {
                if let Some(status) = child.try_wait().unwrap() {
                    break status;
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!(
                        "{test} neither skipped nor failed: {}",
                        std::fs::read_to_string(&log).unwrap_or_default()
                    );
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            let text = std::fs::read_to_string(&log).unwrap();
            assert!(
                text.contains("1 passed") || text.contains("1 failed"),
                "{test} ran: {text}"
            );
            let why = "needs pid namespaces, and `unshare --user --map-root-user --pid --fork true` \
                       fails here: unshare: unshare failed: Operation not permitted";
            if required == "0" {
                assert!(status.success(), "{test}: {text}");
                assert!(text.contains(&format!("SKIPPED {test}: {why}")), "{text}");
            } else {
                assert!(!status.success(), "{test} passed under CI: {text}");
                assert!(
                    text.contains("MEMSAVER_REQUIRE_ALL_TESTS=1 requires every test to run")
                        && text.contains(why),
                    "{text}"
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&bin);
}

/// A process of another group (same user) neither imports a group's token nor gets an answer
/// from its owner. (Before: the importer asked the owner of the token's group, and was served.)
#[test]
fn another_group_cannot_cross() {
    let dirs = Dirs::new();
    let (fake, rt) = (&dirs.fake, &dirs.rt);
    let mut job = Job::start(2, 21, fake, rt, PEERS_ANSWER);
    assert_eq!(job.on(&[1], "group 22"), ["ok"]);
    job.all_ok("alloc 4");
    for (r, a) in job.all("exchange").iter().enumerate() {
        assert!(a.starts_with("err import"), "rank {r}: {a}");
    }
    // Asked directly, with a well-formed request naming the owner and another group.
    let path = socket_of(rt, 21, job.pid(0));
    let body = wire::items_request(
        RELEASED,
        Identity::this_process(7),
        Identity::of_socket(&path),
        22,
        &[],
    );
    let reply = refusal(&wire::ask(&path, &body, ANSWER).unwrap());
    assert!(
        reply.contains("group 22") && reply.contains("group 21"),
        "{reply}"
    );
}

/// The reason of the one refusal in `r` (panics on anything else).
fn refusal(r: &wire::Replies) -> String {
    assert_eq!(r.fds, 0, "{r:?}");
    match r.frames.as_slice() {
        [f] if f.kind == R_REFUSED => f.text.clone(),
        _ => panic!("expected one refusal, got {r:?}"),
    }
}

/// An owner's server holds a bounded number of threads whatever the number of connections,
/// drops a connection whose frame is too long without reading it, and answers a malformed one
/// with a refusal; its peers are served as before afterwards. (Before: a thread per
/// connection, waiting forever, and a request line buffered whatever its length.)
#[test]
fn the_server_bounds_threads_and_frames() {
    let dirs = Dirs::new();
    let (fake, rt) = (&dirs.fake, &dirs.rt);
    let mut job = Job::start(2, 23, fake, rt, PEERS_ANSWER);
    job.setup(4);
    let owner = job.pid(0);
    let path = socket_of(rt, 23, owner);
    let before = threads_of(owner);
    let fds_before = wire::open_fds(owner);
    let idle: Vec<UnixStream> = (0..200)
        .map(|i| UnixStream::connect(&path).unwrap_or_else(|e| panic!("connection {i}: {e}")))
        .collect();
    // The server has taken the connections in once it holds as many as it reads at a time (64):
    // then a thread per connection would show.
    let t = std::time::Instant::now();
    while wire::open_fds(owner) < fds_before + 64 {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the server took in {} of 200 idle connections",
            wire::open_fds(owner).saturating_sub(fds_before)
        );
        std::thread::yield_now();
    }
    let during = threads_of(owner);
    assert!(
        during <= before + 2,
        "{} idle connections: {before} threads before, {during} during",
        idle.len()
    );
    drop(idle);
    // 64 MiB that do not start with a valid frame length: the server closes the connection
    // after the first four bytes.
    let mut s = UnixStream::connect(&path).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
    let junk = vec![b'A'; 1 << 20];
    let sent = (0..64).take_while(|_| s.write_all(&junk).is_ok()).count();
    assert!(
        sent < 64,
        "the server read all 64 MiB of a frame it should refuse"
    );
    // A well-framed body of an unknown kind: refused, with the reason.
    let text = refusal(&wire::ask(&path, &[0x7f, 1, 2, 3], ANSWER).unwrap());
    assert!(text.contains("unknown message kind 0x7f"), "{text}");
    pauses_and_resumes(&mut job);
}

/// A peer that exited but was not reaped yet (a zombie) holds nothing: the owner's pause does
/// not wait for it. (Before: `kill(pid, 0)` succeeds on a zombie, and the pause failed after
/// the timeout naming it.)
#[test]
fn a_zombie_peer_is_dead() {
    let dirs = Dirs::new();
    let (fake, rt) = (&dirs.fake, &dirs.rt);
    let mut job = Job::start(2, 25, fake, rt, PEERS_ANSWER);
    job.setup(4);
    job.kill_to_zombie(1);
    assert_eq!(job.on(&[0], "pause"), ["ok"]);
    assert_eq!(job.used(), 0);
    job.kill(1, true);
}

/// The job pauses (every process lets go: nothing is left in use) and resumes (every import
/// reads its owner's contents): its processes still serve each other.
fn pauses_and_resumes(job: &mut Job) {
    job.all_ok("pause");
    assert_eq!(job.used(), 0);
    job.all_ok("resume");
    job.check_all();
}

/// The whole numbers in `text`.
fn numbers(text: &str) -> Vec<u64> {
    text.split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse().ok())
        .collect()
}

/// A process of another pid namespace (same user, same runtime directory) asks an owner for
/// its stats (a control request) and for its NCCL buffers' fds, naming itself as its own
/// namespace shows it, then with the pid and start time the owner's namespace shows for it.
/// Every request is refused at admission, and no refusal tells it the pid or start time the
/// owner sees. (Before: the first refusal said "process 1 (as it says) is process <pid>
/// here", and the request resent with that pid was served.)
#[test]
fn another_pid_namespace_is_refused_even_naming_the_pid_the_owner_sees() {
    if let Some(why) = common::pid_namespaces_missing() {
        return memsaver_test_support::skip(&why);
    }
    let dirs = Dirs::new();
    let (fake, rt) = (&dirs.fake, &dirs.rt);
    let mut job = Job::start_with(2, 41, fake, rt, PEERS_ANSWER, &[("MEMSAVER_CONTROL", "1")]);
    job.setup(4);
    let path = socket_of(rt, 41, job.pid(0));
    // Without --mount-proc: the client reads its pid in the owner's namespace from /proc, as
    // any process of a child namespace can.
    let out = Command::new("unshare")
        .args(["--user", "--map-root-user", "--pid", "--fork"])
        .arg(env!("CARGO_BIN_EXE_wire-client"))
        .arg(&path)
        .arg("41")
        .arg("8")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let answers: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(answers.len(), 4, "{stdout}");
    let outer = answers.iter().find(|a| a["as"] == "outer").unwrap();
    let (pid, start) = (
        outer["pid"].as_u64().unwrap(),
        outer["start"].as_u64().unwrap(),
    );
    assert_ne!(
        answers[0]["pid"], outer["pid"],
        "the client runs in another pid namespace"
    );
    for a in &answers {
        assert_eq!(a["fds"], 0, "{a}");
        let replies = a["replies"].as_array().unwrap();
        assert!(
            replies.len() == 1 && replies[0]["kind"] == R_REFUSED,
            "refused at admission, as a whole: {a}"
        );
        let text = replies[0]["text"].as_str().unwrap();
        assert!(text.contains("pid namespace"), "{a}");
        let said = numbers(text);
        assert!(
            !said.contains(&pid) && !said.contains(&start),
            "the refusal tells the sender what the owner sees of it (pid {pid}, start {start}): {text}"
        );
    }
    pauses_and_resumes(&mut job);
}

/// A process of the same user and pid namespace but not of the group names the group and
/// counts virtual handles: it gets no fd, whatever keys it guesses and whatever layout it
/// sends, and a buffer that exists is refused exactly as one that does not. (Before: buffer
/// ids were the registry's counter, the group was whatever the request said, and the owner
/// sent the fd of every buffer it was asked for, its imports of other processes' buffers
/// included.)
#[test]
fn buffers_cannot_be_had_by_naming_the_group_and_counting_ids() {
    let dirs = Dirs::new();
    let (fake, rt) = (&dirs.fake, &dirs.rt);
    let mut job = Job::start(2, 43, fake, rt, PEERS_ANSWER);
    job.setup(4);
    let path = socket_of(rt, 43, job.pid(0));
    let (me, owner) = (Identity::this_process(7), Identity::of_socket(&path));
    let no_fd = |what: &str, r: &wire::Replies| {
        assert!(
            r.fds == 0 && r.frames.iter().all(|f| f.kind != R_FD),
            "{what}: {r:?}"
        );
    };
    // Ids 1 to 64 with guessed keys.
    let guesses: Vec<(u64, u64, u64)> = (1..=64)
        .flat_map(|n| {
            [
                (VH_BASE | n, 0, 0),
                (VH_BASE | n, n, 1),
                (VH_BASE | n, !0, 0),
            ]
        })
        .collect();
    let body = wire::items_request(FDS, me, owner, 43, &guesses);
    no_fd("guessed keys", &wire::ask(&path, &body, ANSWER).unwrap());
    // The same ids as items of (vh, generation), without a key.
    let mut body = wire::head(FDS, me, owner, 43);
    body.extend_from_slice(&64u32.to_le_bytes());
    for n in 1..=64u64 {
        body.extend_from_slice(&(VH_BASE | n).to_le_bytes());
        body.extend_from_slice(&0u64.to_le_bytes());
    }
    no_fd("no key", &wire::ask(&path, &body, ANSWER).unwrap());
    // Nothing tells which part of an item was wrong.
    let ask_one = |vh: u64| {
        let body = wire::items_request(FDS, me, owner, 43, &[(vh, 12345, 0)]);
        wire::ask(&path, &body, ANSWER).unwrap()
    };
    let (exists, absent) = (ask_one(VH_BASE | 1), ask_one(VH_BASE | 999_999));
    no_fd("an existing buffer", &exists);
    assert_eq!(exists, absent);
    pauses_and_resumes(&mut job);
}

/// Connections that announce a whole frame and send it one byte at a time, forever
/// (reconnecting when the server closes them), until dropped.
struct Dribblers {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Dribblers {
    /// `n` connections to each of `paths`, connected and started before this returns.
    fn start(paths: &[PathBuf], n: usize) -> Self {
        let open = |p: &PathBuf| {
            let mut s = UnixStream::connect(p).ok()?;
            s.set_write_timeout(Some(Duration::from_secs(1))).ok()?;
            // A frame of 256 KiB, of which only the length is sent now.
            s.write_all(&(256u32 << 10).to_le_bytes()).ok()?;
            Some(s)
        };
        let mut conns: Vec<(PathBuf, Option<UnixStream>)> = paths
            .iter()
            .flat_map(|p| (0..n).map(|_| (p.clone(), open(p))))
            .collect();
        assert!(conns.iter().all(|(_, c)| c.is_some()));
        let stop = Arc::new(AtomicBool::new(false));
        let halt = stop.clone();
        let thread = std::thread::spawn(move || {
            while !halt.load(Ordering::Relaxed) {
                for (p, c) in &mut conns {
                    let sent = c.as_mut().is_some_and(|s| s.write_all(b"x").is_ok());
                    if !sent {
                        *c = open(p);
                    }
                }
                // The pace of the attack, not a synchronisation: one byte per connection every
                // 200 ms keeps any per-read timeout from firing.
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Dribblers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Eight connections per owner that send their request one byte at a time never hold up a
/// stats request nor the peers' requests that pause and resume need. (Before: the server's
/// timeout applied to each read, so four such connections held its four workers for as long
/// as they kept sending, and the peers' pause and resume timed out.)
#[test]
fn slow_clients_do_not_starve_stats_nor_the_peers_pause_and_resume() {
    let dirs = Dirs::new();
    let (fake, rt) = (&dirs.fake, &dirs.rt);
    let mut job = Job::start_with(2, 45, fake, rt, 20_000, &[("MEMSAVER_CONTROL", "1")]);
    job.setup(4);
    let paths = [socket_of(rt, 45, job.pid(0)), socket_of(rt, 45, job.pid(1))];
    // Connected first: ahead of every request below.
    let _slow = Dribblers::start(&paths, 8);
    let stats = wire::head(
        STATS,
        Identity::this_process(7),
        Identity::of_socket(&paths[0]),
        45,
    );
    let r = wire::ask(&paths[0], &stats, ANSWER).expect("stats answered");
    assert!(
        matches!(r.frames.as_slice(), [f] if f.kind == R_JSON),
        "{r:?}"
    );
    pauses_and_resumes(&mut job);
}

/// Waits until `done()` holds; panics naming `what` after a generous bound.
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let t = Instant::now();
    while !done() {
        assert!(t.elapsed() < ANSWER, "{what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Bytes this end sent that the other end has not read yet (`SIOCOUTQ`).
fn unread(s: &UnixStream) -> i32 {
    let mut n: libc::c_int = 0;
    // SAFETY: SIOCOUTQ (TIOCOUTQ) writes one int.
    let rc = unsafe { libc::ioctl(s.as_raw_fd(), libc::TIOCOUTQ, &mut n) };
    assert_eq!(rc, 0);
    n
}

/// Whether the other end of `s` closed it.
fn hung_up(s: &UnixStream) -> bool {
    let mut p = libc::pollfd {
        fd: s.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no wait.
    unsafe { libc::poll(&mut p, 1, 0) };
    p.revents & libc::POLLHUP != 0
}

/// A request whose every byte comes with an fd attached is refused at the first one: the
/// server holds none of them. (Before: it read the whole frame, keeping every fd, and only
/// then found it had more than one: 1004 bytes left 1004 fds open in the target.)
#[test]
fn a_frame_with_an_fd_on_each_byte_leaves_no_fd_in_the_server() {
    let dirs = Dirs::new();
    let (fake, rt) = (&dirs.fake, &dirs.rt);
    let mut job = Job::start(2, 47, fake, rt, PEERS_ANSWER);
    job.setup(4);
    let owner = job.pid(0);
    let path = socket_of(rt, 47, owner);
    let before = wire::open_fds(owner);
    let s = UnixStream::connect(&path).unwrap();
    let devnull = std::fs::File::open("/dev/null").unwrap();
    let mut bytes = 4096u32.to_le_bytes().to_vec();
    bytes.resize(4 + 1000, 0);
    let sent = wire::send_each_byte_with_fd(&s, &bytes, devnull.as_raw_fd());
    // Either the server closed the connection or it read every byte sent.
    wait_until(
        "the server neither closed the connection nor read it",
        || hung_up(&s) || unread(&s) == 0,
    );
    let after = wire::open_fds(owner);
    assert!(
        after <= before + 2,
        "{sent} bytes sent, each with an fd: the server had {before} fds open before, {after} after"
    );
    drop(s);
    pauses_and_resumes(&mut job);
}

/// Rank 0's stderr is a pipe that is full and that nobody reads, and 500 requests it refuses
/// arrive at once: a legitimate request is still answered and the job pauses and resumes, and
/// once the pipe is read the refusals are there as a few lines with a count, not one line
/// each. (Before: each refusal was a WARN line written by the worker that refused it, so the
/// first four blocked all four workers on the pipe.)
#[test]
fn refusals_with_stderr_on_a_full_pipe_do_not_stop_the_server() {
    let dirs = Dirs::new();
    let (fake, rt) = (&dirs.fake, &dirs.rt);
    let (read_end, write_end): (OwnedFd, OwnedFd) = nix::unistd::pipe().unwrap();
    let mut stderr = Some(write_end);
    let mut job = Job::start_per_rank_with_stderr(
        2,
        49,
        fake,
        rt,
        PEERS_ANSWER,
        |_| [("MEMSAVER_CONTROL", "1"), ("MEMSAVER_LOG", "warn")],
        |r| match (r, stderr.take()) {
            (0, Some(w)) => Stdio::from(w),
            _ => Stdio::inherit(),
        },
    );
    job.setup(4);
    // Fill the pipe through another open of it (non-blocking there only: rank 0's writes
    // still block).
    let filler = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(format!("/proc/self/fd/{}", read_end.as_raw_fd()))
        .unwrap();
    while (&filler).write(b".").is_ok() {}
    let path = socket_of(rt, 49, job.pid(0));
    // One after the other, each refused before the next is sent: the workers must keep
    // refusing while nothing they log can be written.
    for i in 0..500 {
        let r = wire::ask(&path, &[0x7f], ANSWER).unwrap_or_else(|e| panic!("request {i}: {e}"));
        assert!(
            refusal(&r).contains("unknown message kind"),
            "request {i}: {r:?}"
        );
    }
    let stats = wire::head(
        STATS,
        Identity::this_process(7),
        Identity::of_socket(&path),
        49,
    );
    let r = wire::ask(&path, &stats, ANSWER).expect("stats answered");
    assert!(
        matches!(r.frames.as_slice(), [f] if f.kind == R_JSON),
        "{r:?}"
    );
    pauses_and_resumes(&mut job);
    // Read the pipe now: the refusals are a few lines, one of them counting what it did not
    // show one by one.
    drop(filler);
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(std::fs::File::from(read_end))
            .lines()
            .map_while(Result::ok)
        {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let mut refusals = Vec::new();
    while !refusals.iter().any(|l: &String| l.contains(" more ")) {
        let line = rx
            .recv_timeout(ANSWER)
            .expect("a line counting the refusals not shown");
        if line.contains("refused") {
            refusals.push(line);
        }
    }
    assert!(
        refusals.len() < 50,
        "{} lines: {refusals:#?}",
        refusals.len()
    );
}

/// A control request naming 2000 tags is refused naming the limit on tags (1024), not the
/// limit on a request's items. (Before: "2000 items (at most 16380)".)
#[test]
fn too_many_tags_are_refused_naming_the_tag_limit() {
    let dirs = Dirs::new();
    let (fake, rt) = (&dirs.fake, &dirs.rt);
    let mut job = Job::start_with(1, 51, fake, rt, PEERS_ANSWER, &[("MEMSAVER_CONTROL", "1")]);
    job.all_ok("alloc 4");
    let path = socket_of(rt, 51, job.pid(0));
    let names: Vec<String> = (0..2000).map(|i| format!("t{i}")).collect();
    let tags: Vec<&str> = names.iter().map(String::as_str).collect();
    let body = wire::pause_request(
        Identity::this_process(7),
        Identity::of_socket(&path),
        51,
        &tags,
    );
    let text = refusal(&wire::ask(&path, &body, ANSWER).unwrap());
    assert!(text.contains("2000 tags (at most 1024)"), "{text}");
}
