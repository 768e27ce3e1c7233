//! The boundaries of the `nccl` tag's cross-process sharing (docs/security.md), with real
//! processes on the fake driver: the runtime directory (no links, private, checked on the
//! open descriptor), process identity across pid namespaces, groups, the wire protocol's
//! limits, liveness, and a visible fallback when tokens cannot be used.

mod common;

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{Dirs, Job, MIB, pid_namespaces_unavailable};

/// The owner socket of the process with `pid` in `rt/g<group>`.
fn socket_of(rt: &Path, group: u32, pid: u32) -> PathBuf {
    let dir = rt.join(format!("g{group}"));
    std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            let n = p.file_name().unwrap().to_string_lossy().into_owned();
            n == format!("{pid}.sock") || n.starts_with(&format!("{pid}-"))
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
            eprintln!("skipped {what}: only root can make a directory of another user");
            continue;
        }
        let mut job = Job::start(2, 31, &dirs.fake, &rt, 2000);
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
    if let Some(why) = pid_namespaces_unavailable() {
        eprintln!("skipped: this kernel does not let this user make pid namespaces ({why})");
        return;
    }
    // The fake driver names its allocation files by pid: one state directory per namespace
    // (two machines' devices), one runtime directory for both.
    let (dirs, other) = (Dirs::new(), Dirs::new());
    let rt = &dirs.rt;
    let mut a = Job::start_in_pid_namespace(2, 40, &dirs.fake, rt, 5000);
    let mut b = Job::start_in_pid_namespace(2, 40, &other.fake, rt, 5000);
    let pids = |j: &mut Job| j.all("pid");
    assert_eq!(
        pids(&mut a),
        pids(&mut b),
        "the same pids in both namespaces"
    );
    a.all_ok("alloc 4");
    b.all_ok("alloc 4");
    let sockets = std::fs::read_dir(rt.join("g40")).unwrap().count();
    assert_eq!(sockets, 4, "one socket per process, none removed");
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

/// A process of another group (same user) neither imports a group's token nor gets an answer
/// from its owner. (Before: the importer asked the owner of the token's group, and was served.)
#[test]
fn another_group_cannot_cross() {
    let dirs = Dirs::new();
    let (fake, rt) = (&dirs.fake, &dirs.rt);
    let mut job = Job::start(2, 21, fake, rt, 2000);
    assert_eq!(job.on(&[1], "group 22"), ["ok"]);
    job.all_ok("alloc 4");
    for (r, a) in job.all("exchange").iter().enumerate() {
        assert!(a.starts_with("err import"), "rank {r}: {a}");
    }
    // Asked directly, with a well-formed request naming the owner and another group.
    let owner = job.pid(0);
    let path = socket_of(rt, 21, owner);
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    let parts: Vec<&str> = name.trim_end_matches(".sock").split('-').collect();
    assert_eq!(parts.len(), 3, "{name}: <pid>-<start>-<nonce>.sock");
    let (start, nonce): (u64, u64) = (
        parts[1].parse().unwrap(),
        u64::from_str_radix(parts[2], 16).unwrap(),
    );
    let me = std::process::id();
    let my_start: u64 =
        std::fs::read_to_string("/proc/self/stat").unwrap()[std::fs::read_to_string(
            "/proc/self/stat",
        )
        .unwrap()
        .rfind(')')
        .unwrap()
            + 2..]
            .split_whitespace()
            .nth(19)
            .unwrap()
            .parse()
            .unwrap();
    let mut body = vec![0x02u8]; // Released
    body.extend_from_slice(&me.to_le_bytes());
    body.extend_from_slice(&my_start.to_le_bytes());
    body.extend_from_slice(&7u64.to_le_bytes());
    body.extend_from_slice(&owner.to_le_bytes());
    body.extend_from_slice(&start.to_le_bytes());
    body.extend_from_slice(&nonce.to_le_bytes());
    body.extend_from_slice(&22i64.to_le_bytes());
    body.extend_from_slice(&0u32.to_le_bytes());
    let reply = ask(&path, &body);
    assert_eq!(reply.first(), Some(&0x86), "refused: {reply:?}");
    let text = String::from_utf8_lossy(&reply[3..]);
    assert!(
        text.contains("group 22") && text.contains("group 21"),
        "{text}"
    );
}

/// Sends one frame of `body` and returns the body of the answer.
fn ask(path: &Path, body: &[u8]) -> Vec<u8> {
    let mut s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(&(body.len() as u32).to_le_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut head = [0u8; 4];
    s.read_exact(&mut head).unwrap();
    let mut reply = vec![0u8; u32::from_le_bytes(head) as usize];
    s.read_exact(&mut reply).unwrap();
    reply
}

/// An owner's server holds a bounded number of threads whatever the number of connections,
/// drops a connection whose frame is too long without reading it, and answers a malformed one
/// with a refusal; its peers are served as before afterwards. (Before: a thread per
/// connection, waiting forever, and a request line buffered whatever its length.)
#[test]
fn the_server_bounds_threads_and_frames() {
    let dirs = Dirs::new();
    let (fake, rt) = (&dirs.fake, &dirs.rt);
    let mut job = Job::start(2, 23, fake, rt, 5000);
    job.setup(4);
    let owner = job.pid(0);
    let path = socket_of(rt, 23, owner);
    let before = threads_of(owner);
    let idle: Vec<UnixStream> = (0..200)
        .filter_map(|_| UnixStream::connect(&path).ok())
        .collect();
    std::thread::sleep(Duration::from_millis(300));
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
    let reply = ask(&path, &[0x7f, 1, 2, 3]);
    assert_eq!(reply.first(), Some(&0x86), "{reply:?}");
    let text = String::from_utf8_lossy(&reply[3..]);
    assert!(text.contains("unknown message kind 0x7f"), "{text}");
    job.all_ok("pause");
    assert_eq!(job.used(), 0);
    job.all_ok("resume");
    job.check_all();
}

/// A peer that exited but was not reaped yet (a zombie) holds nothing: the owner's pause does
/// not wait for it. (Before: `kill(pid, 0)` succeeds on a zombie, and the pause failed after
/// the timeout naming it.)
#[test]
fn a_zombie_peer_is_dead() {
    let dirs = Dirs::new();
    let (fake, rt) = (&dirs.fake, &dirs.rt);
    let mut job = Job::start(2, 25, fake, rt, 1000);
    job.setup(4);
    job.kill_to_zombie(1);
    assert_eq!(job.on(&[0], "pause"), ["ok"]);
    assert_eq!(job.used(), 0);
    job.kill(1, true);
}
