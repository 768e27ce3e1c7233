//! CUDA IPC on memsaver memory between real processes on the fake driver: `ipc-proc` processes
//! under `LD_PRELOAD=libmemsaver.so` in whole-process mode (the tag `weights`, cpu backups),
//! calling the interposed `cudaMalloc` and `cudaIpc*MemHandle` as torch's `reduce_tensor` and
//! its receiver do. The fake driver's accounting is shared by all processes of a test (one
//! state directory): `used` is what every process holds together, and physical memory is freed
//! only once no process maps, holds or exports it.

use std::io::{BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use memsaver_scenarios::{ANSWER_WAIT, cuda_lib, preload_lib, read_line_within, tempdir};

mod common;

const MIB: u64 = 1 << 20;
/// No working peer takes this long: the deadline of every wait here.
const NEVER_MS: &str = "60000";
/// The status code of a pause or resume that other processes did not follow in time
/// (`MEMSAVER_ERR_PEER`), as `ipc-proc` answers it: `err 11 <message>`.
const PEER: &str = "11 ";

struct Dirs {
    fake: std::path::PathBuf,
    rt: std::path::PathBuf,
}

impl Dirs {
    fn new() -> Self {
        Self {
            fake: tempdir("ipc-fake"),
            rt: tempdir("ipc-rt"),
        }
    }
}

impl Drop for Dirs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.fake);
        let _ = std::fs::remove_dir_all(&self.rt);
    }
}

struct Proc {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Proc {
    fn start(dirs: &Dirs, group: &str, env: &[(&str, &str)]) -> Proc {
        Self::start_in(dirs, group, env, &[])
    }

    /// As [`Proc::start`], run by `launcher` (a command line the program is appended to).
    fn start_in(dirs: &Dirs, group: &str, env: &[(&str, &str)], launcher: &[&str]) -> Proc {
        let cuda = cuda_lib();
        let exe = env!("CARGO_BIN_EXE_ipc-proc");
        let mut cmd = match launcher.split_first() {
            None => Command::new(exe),
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(exe);
                c
            }
        };
        let mut child = cmd
            .arg(&cuda)
            .env("LD_PRELOAD", preload_lib())
            .env("MEMSAVER_CUDA_LIB", &cuda)
            .env("FAKE_CUDA_DIR", &dirs.fake)
            .env("MEMSAVER_RUNTIME_DIR", &dirs.rt)
            .env("MEMSAVER_GROUP", group)
            .env("MEMSAVER_PROCESS_TAG", "weights")
            .env("MEMSAVER_PROCESS_BACKUP", "cpu")
            .env("MEMSAVER_IPC_TIMEOUT_MS", NEVER_MS)
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start ipc-proc");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Proc {
            child,
            stdin,
            stdout,
        }
    }

    /// Sends one command; the answer line, `Ok(rest)` for `ok rest`, `Err(rest)` for `err rest`.
    fn try_cmd(&mut self, line: &str) -> Result<String, String> {
        self.send(line);
        self.answer(line)
    }

    /// Sends one command without reading its answer ([`Proc::answer`]).
    fn send(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").expect("the process takes commands");
        self.stdin.flush().unwrap();
    }

    /// The answer to the command `line` sent before.
    fn answer(&mut self, line: &str) -> Result<String, String> {
        let answer = read_line_within(&mut self.stdout, Instant::now() + ANSWER_WAIT)
            .unwrap_or_else(|e| {
                panic!(
                    "`{line}`: process {} did not answer within {} s: {e}",
                    self.child.id(),
                    ANSWER_WAIT.as_secs()
                )
            });
        let answer = answer.trim_end();
        if let Some(rest) = answer.strip_prefix("ok") {
            Ok(rest.trim().to_owned())
        } else if let Some(rest) = answer.strip_prefix("err") {
            Err(rest.trim().to_owned())
        } else {
            panic!("`{line}`: the process answered {answer:?} (did it die?)")
        }
    }

    fn cmd(&mut self, line: &str) -> String {
        self.try_cmd(line)
            .unwrap_or_else(|e| panic!("`{line}` failed: {e}"))
    }

    fn used(&mut self) -> u64 {
        self.cmd("used").parse().unwrap()
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// SIGKILL, and wait until it is reaped.
    fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), sig).unwrap();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An owner with a 4 MiB buffer written with seed 1, and its handle.
fn owner(dirs: &Dirs, env: &[(&str, &str)]) -> (Proc, String) {
    let mut o = Proc::start(dirs, "1", env);
    o.cmd("alloc 4");
    o.cmd("write own 1");
    let h = o.cmd("handle");
    (o, h)
}

/// The `imports` and `exports` of a process's stats.
fn shared_stats(p: &mut Proc) -> serde_json::Value {
    let doc: serde_json::Value = serde_json::from_str(&p.cmd("stats")).unwrap();
    doc["shared"].clone()
}

#[test]
fn an_opened_handle_reads_and_writes_the_owners_memory() {
    let dirs = Dirs::new();
    let (mut o, h) = owner(&dirs, &[]);
    let mut r = Proc::start(&dirs, "1", &[]);
    let before = r.used();
    r.cmd(&format!("open {h}"));
    // One physical allocation, two mappings: opening costs no device memory.
    assert_eq!(r.used(), before);
    r.cmd("check imp 1");
    r.cmd("write imp 2");
    o.cmd("check own 2");
    // Opening it again gives the same pointer; the memory stays until the last close.
    let p1 = r.cmd(&format!("open {h}"));
    let p2 = r.cmd(&format!("open {h}"));
    assert_eq!(p1, p2);
    let s = shared_stats(&mut o);
    assert_eq!(s["exports"]["weights"]["handles"], 1, "{s}");
    assert_eq!(s["exports"]["weights"]["bytes"], 4 * MIB, "{s}");
    assert_eq!(s["exports"]["weights"]["importers"], 1, "{s}");
    let s = shared_stats(&mut r);
    assert_eq!(s["imports"][0]["bytes"], 4 * MIB, "{s}");
    assert_eq!(s["imports"][0]["paused"], false, "{s}");
}

#[test]
fn the_owners_pause_frees_the_memory_only_once_the_importer_let_go() {
    let dirs = Dirs::new();
    let (mut o, h) = owner(&dirs, &[]);
    let mut r = Proc::start(&dirs, "1", &[]);
    let ptr = r.cmd(&format!("open {h}"));
    r.cmd("write imp 2");
    let used = o.used();
    // A stopped importer cannot let go: the pause waits for it until its deadline (the short
    // one of this owner), and the memory stays held by the importer's mapping.
    let (mut o2, h2) = owner(&dirs, &[("MEMSAVER_IPC_TIMEOUT_MS", "200")]);
    let mut r2 = Proc::start(&dirs, "1", &[]);
    r2.cmd(&format!("open {h2}"));
    let used2 = o2.used();
    r2.signal(nix::sys::signal::Signal::SIGSTOP);
    // The pause is done, and says which process still maps the memory.
    let e = o2.try_cmd("pause").unwrap_err();
    assert!(e.starts_with(PEER), "{e}");
    assert!(e.contains(&format!("process {} ", r2.pid())), "{e}");
    assert_eq!(
        o2.used(),
        used2,
        "the stopped importer's mapping holds the memory"
    );
    // Once it runs again it answers the release it was sent, and the memory goes.
    r2.signal(nix::sys::signal::Signal::SIGCONT);
    let deadline = Instant::now() + Duration::from_secs(60);
    while o2.used() != used2 - 4 * MIB {
        assert!(Instant::now() < deadline, "the importer never let go");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(shared_stats(&mut r2)["imports"][0]["paused"], true);
    // A working importer lets go within the pause: the memory is free when it returns.
    o.cmd("pause");
    assert_eq!(o.used(), used - 4 * MIB);
    let s = shared_stats(&mut r);
    assert_eq!(s["imports"][0]["paused"], true, "{s}");
    // Resume: the importer sees the owner's contents at the same address, and its writes.
    o.cmd("resume");
    assert_eq!(o.used(), used);
    r.cmd("check imp 2");
    assert_eq!(shared_stats(&mut r)["imports"][0]["paused"], false);
    o.cmd("write own 3");
    r.cmd("check imp 3");
    r.cmd("write imp 4");
    o.cmd("check own 4");
    assert_eq!(
        r.cmd(&format!("open {h}")),
        ptr,
        "the same address after a cycle"
    );
    r.cmd("close");
}

#[test]
fn a_closed_import_no_longer_holds_the_memory() {
    let dirs = Dirs::new();
    let (mut o, h) = owner(&dirs, &[]);
    let mut r = Proc::start(&dirs, "1", &[]);
    r.cmd(&format!("open {h}"));
    r.cmd("close");
    assert_eq!(shared_stats(&mut o)["exports"]["weights"]["importers"], 0);
    let used = o.used();
    o.cmd("pause");
    assert_eq!(o.used(), used - 4 * MIB);
    o.cmd("resume");
    o.cmd("check own 1");
}

#[test]
fn a_dead_importer_counts_as_released() {
    let dirs = Dirs::new();
    let (mut o, h) = owner(&dirs, &[]);
    let mut r = Proc::start(&dirs, "1", &[]);
    r.cmd(&format!("open {h}"));
    r.kill();
    let used = o.used();
    let t = Instant::now();
    o.cmd("pause");
    // Its deadline (NEVER_MS) was not waited for: a dead importer answers nothing.
    assert!(t.elapsed() < Duration::from_secs(60));
    assert_eq!(o.used(), used - 4 * MIB);
    assert_eq!(shared_stats(&mut o)["exports"]["weights"]["importers"], 0);
    o.cmd("resume");
    o.cmd("check own 1");
}

#[test]
fn a_dead_owner_is_named_and_its_import_still_closes() {
    let dirs = Dirs::new();
    let (o, h) = owner(&dirs, &[]);
    let (o2, h2) = owner(&dirs, &[]);
    let mut r = Proc::start(&dirs, "1", &[]);
    r.cmd(&format!("open {h2}"));
    let pid = o.pid();
    o.kill();
    let e = r.try_cmd(&format!("open {h}")).unwrap_err();
    assert!(e.contains(&format!("process {pid}")), "{e}");
    o2.kill();
    // The import keeps the memory it mapped (as CUDA's IPC does); closing it needs no owner.
    r.cmd("check imp 1");
    r.cmd("close");
}

#[test]
fn a_process_of_another_group_is_refused() {
    let dirs = Dirs::new();
    let (_o, h) = owner(&dirs, &[]);
    let mut r = Proc::start(&dirs, "2", &[]);
    let e = r.try_cmd(&format!("open {h}")).unwrap_err();
    assert!(e.contains("group"), "{e}");
    // A handle whose group was rewritten to the importer's: the owner serves only in its own
    // group's directory, so the importer does not reach it there.
    let mut forged = hex_bytes(&h);
    forged[28..36].copy_from_slice(&2i64.to_le_bytes());
    let e = r.try_cmd(&format!("open {}", hex(&forged))).unwrap_err();
    assert!(e.contains("does not serve") && e.contains("group"), "{e}");
}

#[test]
fn a_forged_or_replayed_key_is_refused() {
    let dirs = Dirs::new();
    let (mut o, h) = owner(&dirs, &[]);
    let mut r = Proc::start(&dirs, "1", &[]);
    let mut forged = hex_bytes(&h);
    forged[44] ^= 1;
    let e = r.try_cmd(&format!("open {}", hex(&forged))).unwrap_err();
    assert!(e.contains("refused"), "{e}");
    // Another allocation's id with this one's key: refused too.
    let mut other = hex_bytes(&h);
    other[36] ^= 1;
    let e = r.try_cmd(&format!("open {}", hex(&other))).unwrap_err();
    assert!(e.contains("refused"), "{e}");
    // The real handle opens, and nobody was recorded for the forged ones.
    r.cmd(&format!("open {h}"));
    assert_eq!(shared_stats(&mut o)["exports"]["weights"]["importers"], 1);
    r.cmd("close");
    // Replayed: the handle of an allocation freed since names nothing (ids are never reused,
    // and a new allocation gets a handle of its own).
    o.cmd("free");
    o.cmd("alloc 4");
    let e = r.try_cmd(&format!("open {h}")).unwrap_err();
    assert!(e.contains("refused"), "{e}");
    let fresh = o.cmd("handle");
    assert_ne!(fresh, h);
    r.cmd(&format!("open {fresh}"));
}

#[test]
fn a_process_of_another_pid_namespace_is_refused() {
    if let Some(why) = common::pid_namespaces_missing() {
        return memsaver_test_support::skip(&why);
    }
    let dirs = Dirs::new();
    let (mut o, h) = owner(&dirs, &[]);
    let ns = [
        "unshare",
        "--user",
        "--map-root-user",
        "--pid",
        "--fork",
        "--mount-proc",
    ];
    let mut r = Proc::start_in(&dirs, "1", &[], &ns);
    let e = r.try_cmd(&format!("open {h}")).unwrap_err();
    assert!(e.contains("pid namespace"), "{e}");
    assert!(
        !e.contains("exited"),
        "the owner runs, in another namespace: {e}"
    );
    assert_eq!(shared_stats(&mut o)["exports"]["weights"]["importers"], 0);
}

/// Waits until `ready()` holds, failing the test after 60 s (no working process takes that long).
fn wait_for(what: &str, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ready() {
        assert!(Instant::now() < deadline, "{what}: not within 60 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn an_importer_stopped_across_a_pause_and_a_resume_catches_up_once_it_runs() {
    let dirs = Dirs::new();
    let (mut o, h) = owner(&dirs, &[("MEMSAVER_IPC_TIMEOUT_MS", "300")]);
    let mut r = Proc::start(&dirs, "1", &[]);
    let ptr = r.cmd(&format!("open {h}"));
    r.cmd("check imp 1");
    let used = o.used();
    r.signal(nix::sys::signal::Signal::SIGSTOP);
    // Both calls do this process's part and say who did not follow.
    let e = o.try_cmd("pause").unwrap_err();
    assert!(e.starts_with(PEER) && e.contains("did not release"), "{e}");
    assert!(
        e.contains(&format!("process {} ", r.pid())) && e.contains("weights"),
        "{e}"
    );
    assert!(e.contains("stopped"), "{e}");
    let s = shared_stats(&mut o);
    assert_eq!(s["exports"]["weights"]["held_while_paused"], 4 * MIB, "{s}");
    let e = o.try_cmd("resume").unwrap_err();
    assert!(
        e.starts_with(PEER) && e.contains("did not map again"),
        "{e}"
    );
    o.cmd("write own 5");
    // Once it runs it converges to the owner's state now, without another cycle: the new
    // memory at the same address.
    r.signal(nix::sys::signal::Signal::SIGCONT);
    wait_for("the importer maps the owner's new memory", || {
        shared_stats(&mut o)["exports"]["weights"]["imports_behind"] == 0
    });
    r.cmd("check imp 5");
    assert_eq!(shared_stats(&mut r)["imports"][0]["paused"], false);
    assert_eq!(r.cmd(&format!("open {h}")), ptr);
    r.cmd("close");
    r.cmd("write imp 6");
    o.cmd("check own 6");
    // Only the owner's memory is in use, and the next cycle is a plain one.
    assert_eq!(o.used(), used);
    o.cmd("pause");
    assert_eq!(o.used(), used - 4 * MIB);
    o.cmd("resume");
    r.cmd("check imp 6");
}

/// A pid namespace whose pids a test can choose (`ns_last_pid`): its first process holds it,
/// and [`PidSpace::launcher`] starts a process in it. Dropped, it ends with all of them.
struct PidSpace {
    holder: Child,
    /// The holder's pid as this process sees it.
    init: u32,
}

impl PidSpace {
    fn new() -> PidSpace {
        let holder = Command::new("unshare")
            .args([
                "--user",
                "--map-root-user",
                "--pid",
                "--fork",
                "--mount-proc",
            ])
            .args(["sleep", "600"])
            .stderr(Stdio::null())
            .spawn()
            .expect("unshare");
        let children = format!("/proc/{0}/task/{0}/children", holder.id());
        let mut init = None;
        wait_for("the namespace's first process", || {
            init = std::fs::read_to_string(&children)
                .ok()
                .and_then(|s| s.split_whitespace().next()?.parse().ok());
            init.is_some()
        });
        PidSpace {
            holder,
            init: init.unwrap(),
        }
    }

    /// The command line that starts a program in the namespace; with `pid`, as that pid there.
    fn launcher(&self, pid: Option<u32>) -> Vec<String> {
        let choose = pid.map_or("exec ".into(), |p| {
            format!("echo {} > /proc/sys/kernel/ns_last_pid && ", p - 1)
        });
        let target = self.init.to_string();
        [
            "nsenter",
            "-t",
            &target,
            "-U",
            "-p",
            "-m",
            "--preserve-credentials",
        ]
        .into_iter()
        .map(str::to_owned)
        .chain(["sh".into(), "-c".into(), format!("{choose}\"$0\" \"$@\"")])
        .collect()
    }
}

impl Drop for PidSpace {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.init as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = self.holder.wait();
    }
}

#[test]
fn an_importer_whose_pid_was_reused_is_another_importer() {
    if let Some(why) = common::pid_namespaces_missing() {
        return memsaver_test_support::skip(&why);
    }
    let dirs = Dirs::new();
    let ns = PidSpace::new();
    let start = |pid: Option<u32>| {
        let l = ns.launcher(pid);
        let l: Vec<&str> = l.iter().map(String::as_str).collect();
        Proc::start_in(&dirs, "1", &[], &l)
    };
    let mut o = start(None);
    o.cmd("alloc 4");
    o.cmd("write own 1");
    let h = o.cmd("handle");
    let mut first = start(None);
    first.cmd(&format!("open {h}"));
    let pid: u32 = first.cmd("pid").parse().unwrap();
    // Killed without a word to the owner; a new process gets its pid and opens the handle.
    first.send("die");
    first.child.wait().unwrap();
    let mut second = start(Some(pid));
    assert_eq!(second.cmd("pid"), pid.to_string(), "the pid was reused");
    second.cmd(&format!("open {h}"));
    second.cmd("check imp 1");
    // The owner's pause reaches the new process: the memory is free when it returns.
    let used = o.used();
    o.cmd("pause");
    assert_eq!(o.used(), used - 4 * MIB);
    assert_eq!(shared_stats(&mut second)["imports"][0]["paused"], true);
    o.cmd("resume");
    o.cmd("write own 2");
    second.cmd("check imp 2");
    assert_eq!(shared_stats(&mut o)["exports"]["weights"]["importers"], 1);
}

#[test]
fn an_importer_with_a_bad_option_is_told_which_one() {
    let dirs = Dirs::new();
    let (_o, h) = owner(&dirs, &[]);
    let mut r = Proc::start(&dirs, "1", &[("MEMSAVER_IPC_TIMEOUT_MS", "abc")]);
    let e = r.try_cmd(&format!("open {h}")).unwrap_err();
    assert!(e.contains("MEMSAVER_IPC_TIMEOUT_MS='abc'"), "{e}");
    let mut r = Proc::start(&dirs, "7x", &[]);
    let e = r.try_cmd(&format!("open {h}")).unwrap_err();
    assert!(
        e.contains("MEMSAVER_GROUP='7x'") && !e.contains("group 0"),
        "{e}"
    );
}

#[test]
fn a_reopen_while_the_owner_is_paused_is_refused_as_a_fresh_open_is() {
    let dirs = Dirs::new();
    let (mut o, h) = owner(&dirs, &[]);
    let mut r = Proc::start(&dirs, "1", &[]);
    r.cmd(&format!("open {h}"));
    o.cmd("pause");
    let e = r.try_cmd(&format!("open {h}")).unwrap_err();
    assert!(e.contains("paused"), "{e}");
    let mut fresh = Proc::start(&dirs, "1", &[]);
    let e = fresh.try_cmd(&format!("open {h}")).unwrap_err();
    assert!(e.contains("paused"), "{e}");
    o.cmd("resume");
    r.cmd(&format!("open {h}"));
    fresh.cmd(&format!("open {h}"));
    r.cmd("check imp 1");
}

#[test]
fn a_handle_is_an_address_not_a_proof() {
    let dirs = Dirs::new();
    let (_o, h) = owner(&dirs, &[]);
    let mut r = Proc::start(&dirs, "1", &[]);
    // A forged size opens the genuine memory, and is reported at its true size.
    for size in [1u64 << 40, 0] {
        let mut forged = hex_bytes(&h);
        forged[52..60].copy_from_slice(&size.to_le_bytes());
        r.cmd(&format!("open {}", hex(&forged)));
        let s = shared_stats(&mut r);
        assert_eq!(s["imports"][0]["bytes"], 4 * MIB, "{s}");
        r.cmd("close");
    }
    // In a process that opened the handle, the same handle with a wrong key opens nothing and
    // counts nothing.
    let ptr = r.cmd(&format!("open {h}"));
    let mut wrong = hex_bytes(&h);
    wrong[44] ^= 1;
    let e = r.try_cmd(&format!("open {}", hex(&wrong))).unwrap_err();
    assert!(e.contains("refused"), "{e}");
    assert_eq!(shared_stats(&mut r)["imports"][0]["opens"], 1);
    assert_eq!(r.cmd(&format!("open {h}")), ptr);
    assert_eq!(shared_stats(&mut r)["imports"][0]["opens"], 2);
}

#[test]
fn many_importers_of_many_allocations_follow_every_cycle() {
    const IMPORTERS: usize = 120;
    const BUFFERS: usize = 3;
    let dirs = Dirs::new();
    let mut o = Proc::start(&dirs, "1", &[]);
    let handles: Vec<String> = (0..BUFFERS)
        .map(|n| {
            o.cmd("alloc 2");
            o.cmd(&format!("write own:{n} {n}"));
            o.cmd(&format!("handle {n}"))
        })
        .collect();
    let mut rs: Vec<Proc> = (0..IMPORTERS)
        .map(|_| Proc::start(&dirs, "1", &[]))
        .collect();
    // Every first open at once: more than the owner admits at a time.
    for h in &handles {
        let line = format!("open {h}");
        rs.iter_mut().for_each(|r| r.send(&line));
        for r in rs.iter_mut() {
            r.answer(&line).unwrap_or_else(|e| panic!("{line}: {e}"));
        }
    }
    let used = o.used();
    for cycle in 0..3u64 {
        o.cmd("pause");
        assert_eq!(o.used(), used - 2 * BUFFERS as u64 * MIB, "cycle {cycle}");
        o.cmd("resume");
        for n in 0..BUFFERS {
            o.cmd(&format!("write own:{n} {}", 10 * cycle + n as u64));
        }
        for (k, r) in rs.iter_mut().enumerate() {
            let s = shared_stats(r);
            let imports = s["imports"].as_array().unwrap();
            assert_eq!(imports.len(), BUFFERS, "importer {k}: {s}");
            assert!(
                imports.iter().all(|i| i["paused"] == false),
                "importer {k}, cycle {cycle}: {s}"
            );
            for n in 0..BUFFERS {
                r.cmd(&format!("check imp:{n} {}", 10 * cycle + n as u64));
            }
        }
    }
}

/// The owner's cap on its courier threads (`shared::MAX_COURIERS` in memsaver-ipc).
const MAX_COURIERS: usize = 8;

/// The threads of process `pid` now.
fn threads_of(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Whether process `pid` is stopped (SIGSTOP): its state in `/proc/<pid>/stat` is `T`.
fn is_stopped(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| Some(s[s.rfind(')')? + 1..].trim_start().starts_with('T')))
        .unwrap_or(false)
}

#[test]
fn more_stopped_importers_than_couriers_catch_up_on_a_bounded_number_of_owner_threads() {
    const IMPORTERS: usize = 3 * MAX_COURIERS;
    let dirs = Dirs::new();
    let (mut o, h) = owner(&dirs, &[("MEMSAVER_IPC_TIMEOUT_MS", "300")]);
    let mut rs: Vec<Proc> = (0..IMPORTERS)
        .map(|_| Proc::start(&dirs, "1", &[]))
        .collect();
    let line = format!("open {h}");
    rs.iter_mut().for_each(|r| r.send(&line));
    for r in rs.iter_mut() {
        r.answer(&line).unwrap_or_else(|e| panic!("{line}: {e}"));
    }
    // One plain cycle first, so that every thread the owner starts for a cycle of its own
    // (and keeps) is counted before.
    o.cmd("pause");
    o.cmd("resume");
    let used = o.used();
    let before = threads_of(o.pid());
    for r in &rs {
        r.signal(nix::sys::signal::Signal::SIGSTOP);
    }
    for r in &rs {
        wait_for("the importer stops", || is_stopped(r.pid()));
    }
    // The owner's threads, sampled from here until every importer caught up.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (done, pid) = (done.clone(), o.pid());
        std::thread::spawn(move || {
            let mut most = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                most = most.max(threads_of(pid));
                std::thread::sleep(Duration::from_millis(2));
            }
            most
        })
    };
    // Both calls do this process's part and name the importers that did not follow.
    let e = o.try_cmd("pause").unwrap_err();
    assert!(e.starts_with(PEER) && e.contains("did not release"), "{e}");
    assert!(
        e.contains(&format!("{IMPORTERS} process(es) behind")),
        "{e}"
    );
    let e = o.try_cmd("resume").unwrap_err();
    assert!(
        e.starts_with(PEER) && e.contains("did not map again"),
        "{e}"
    );
    o.cmd("write own 5");
    // Stopped a while longer: their couriers keep trying, and must not multiply.
    std::thread::sleep(Duration::from_millis(1500));
    for r in &rs {
        r.signal(nix::sys::signal::Signal::SIGCONT);
    }
    // Every one converges to the owner's state now, without another cycle.
    wait_for("every importer maps the owner's new memory", || {
        shared_stats(&mut o)["exports"]["weights"]["imports_behind"] == 0
    });
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let most = sampler.join().unwrap();
    println!("owner threads: {before} before, at most {most} with {IMPORTERS} importers behind");
    assert!(
        most <= before + MAX_COURIERS,
        "{most} owner threads with {IMPORTERS} importers behind, {before} before"
    );
    for (k, r) in rs.iter_mut().enumerate() {
        let s = shared_stats(r);
        assert_eq!(s["imports"][0]["paused"], false, "importer {k}: {s}");
        r.cmd("check imp 5");
    }
    assert_eq!(o.used(), used, "only the owner's memory is in use");
}

/// The socket process `p` serves (group 1).
fn socket_of(dirs: &Dirs, p: &mut Proc) -> std::path::PathBuf {
    let pid: u32 = p.cmd("pid").parse().unwrap();
    std::fs::read_dir(dirs.rt.join("g1"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|s| {
            let name = s.file_name().unwrap().to_string_lossy().into_owned();
            name.starts_with(&format!("{pid}-")) && name.ends_with(".sock")
        })
        .expect("the process's socket")
}

#[test]
fn a_sender_is_who_its_pid_and_start_time_say() {
    use memsaver_scenarios::wire;
    let dirs = Dirs::new();
    let (_o, h) = owner(&dirs, &[]);
    let mut r = Proc::start(&dirs, "1", &[]);
    r.cmd(&format!("open {h}"));
    let sock = socket_of(&dirs, &mut r);
    let to = wire::Identity::of_socket(&sock);
    let me = wire::Identity::this_process(7);
    let release = |from| wire::items_request(wire::RELEASE, from, to, 1, &[(1, 2, 3)]);
    let wait = Duration::from_secs(60);
    // This test's own pid with another start time: a process that had this pid before.
    for from in [
        wire::Identity {
            start: me.start + 1,
            ..me
        },
        wire::Identity {
            pid: me.pid + 1,
            ..me
        },
    ] {
        let r = wire::ask(&sock, &release(from), wait).unwrap();
        assert_eq!(r.frames.len(), 1, "{r:?}");
        assert_eq!(r.frames[0].kind, wire::R_REFUSED, "{r:?}");
        assert!(r.frames[0].text.contains("naming itself as it is"), "{r:?}");
    }
    // As it is: admitted (a release of nothing it holds is done at once).
    let r = wire::ask(&sock, &release(me), wait).unwrap();
    assert_eq!(
        r.frames.first().map(|f| f.kind),
        Some(wire::R_DONE),
        "{r:?}"
    );
}

#[test]
fn a_flood_of_releases_does_not_multiply_the_importers_threads() {
    use memsaver_scenarios::wire;
    let dirs = Dirs::new();
    let (_o, h) = owner(&dirs, &[]);
    let mut r = Proc::start(&dirs, "1", &[]);
    r.cmd(&format!("open {h}"));
    let before: usize = r.cmd("threads").parse().unwrap();
    let sock = socket_of(&dirs, &mut r);
    let to = wire::Identity::of_socket(&sock);
    let from = wire::Identity::this_process(7);
    // Releases of buffers it does not hold, as fast as one process can send them, none waited
    // for: each would have had a thread of its own.
    let body = wire::items_request(wire::RELEASE, from, to, 1, &[(1, 2, 3)]);
    let mut streams = Vec::new();
    let mut most = before;
    for n in 0..3000 {
        if let Ok(s) = std::os::unix::net::UnixStream::connect(&sock) {
            use std::io::Write;
            let _ = (&s).write_all(&wire::frame(&body));
            streams.push(s);
        }
        if n % 100 == 0 {
            most = most.max(r.cmd("threads").parse().unwrap());
            streams.clear();
        }
    }
    drop(streams);
    most = most.max(r.cmd("threads").parse().unwrap());
    assert!(
        most <= before + 8,
        "{most} threads under the flood, {before} before"
    );
    r.cmd("check imp 1");
}

fn hex_bytes(h: &str) -> Vec<u8> {
    (0..h.len() / 2)
        .map(|i| u8::from_str_radix(&h[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
