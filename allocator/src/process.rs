//! Process identity and liveness, as `/proc` and `pidfd_open` show them.
//!
//! A process is identified by its **identity**: (pid, start time, nonce). The pid is the one in
//! the process's own pid namespace, the start time is field 22 of `/proc/<pid>/stat` (clock
//! ticks after boot) and the nonce is 64 random bits (`getrandom`). A pid alone is reused and
//! means something else in another pid namespace; with the start time it names one process of
//! this namespace for good, and the nonce tells apart two processes of different namespaces
//! that show the same pid and start time. Names made from an identity (sockets, disk backup
//! files) therefore never collide and cannot be predicted.
//!
//! Contract of the functions here:
//! * [`me`] is this process's identity, made once per process: a forked child, whose pid
//!   differs, gets its own (new start time and nonce).
//! * [`alive`]: the pid exists in this pid namespace and has not exited (a zombie is dead, pid
//!   0 is no process). It knows nothing of start times.
//! * [`is_running`]: [`alive`], and where `/proc` shows this pid namespace, the pid's start
//!   time is the identity's: a later process with the same pid is not the one named.
//!
//! Nothing here fails: what cannot be read counts as "not running" ([`is_running`]) or as an
//! unknown start time (0).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::OnceLock;

use parking_lot::Mutex;

/// A process, unique across pid namespaces and pid reuse (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Identity {
    pub pid: u32,
    /// Clock ticks after boot (`/proc/<pid>/stat` field 22).
    pub start: u64,
    pub nonce: u64,
}

/// This process's identity (made again in a forked child, whose pid differs).
pub fn me() -> Identity {
    static ME: Mutex<Option<Identity>> = Mutex::new(None);
    let pid = std::process::id();
    let mut g = ME.lock();
    match *g {
        Some(i) if i.pid == pid => i,
        _ => {
            let i = Identity {
                pid,
                start: stat("self").map_or(0, |(_, s)| s),
                nonce: random_u64(),
            };
            *g = Some(i);
            i
        }
    }
}

/// The state letter and start time of process `pid` (a number, or `self`) as this process's
/// `/proc` shows it: field 3 and field 22 of `/proc/<pid>/stat`.
pub fn stat(pid: &str) -> Option<(char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold anything: parse after it.
    let rest = &text[text.rfind(')')? + 1..];
    let mut f = rest.split_whitespace();
    let state = f.next()?.chars().next()?;
    // Fields 4.. ; the start time is field 22, the 20th after the state.
    let start = f.nth(18)?.parse().ok()?;
    Some((state, start))
}

/// The start time of process `pid` as this process's `/proc` shows it.
pub fn start_time(pid: u32) -> Option<u64> {
    stat(&pid.to_string()).map(|(_, s)| s)
}

/// Whether `/proc` shows this process's pid namespace (it shows another one where /proc was
/// mounted for a parent namespace: `unshare --pid` without `--mount-proc`).
pub fn proc_is_ours() -> bool {
    static OURS: OnceLock<bool> = OnceLock::new();
    *OURS.get_or_init(|| {
        std::fs::read_link("/proc/self")
            .is_ok_and(|p| p.to_str() == Some(&std::process::id().to_string()))
    })
}

/// The pid namespace of process `pid` (a number, or `self`) as this process's `/proc` shows
/// it: the device and inode of `/proc/<pid>/ns/pid` (two processes share a namespace exactly
/// when these are equal). `None` when it cannot be read (the process is gone, or is not ours
/// to look at).
pub fn pid_namespace(pid: &str) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(format!("/proc/{pid}/ns/pid")).ok()?;
    Some((m.dev(), m.ino()))
}

/// 64 random bits from the kernel (`getrandom`), or why there are none: for secrets (keys),
/// which must not fall back to anything guessable.
pub fn random_bits() -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    loop {
        // SAFETY: `b` is writable for its length.
        let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
        if n == b.len() as isize {
            return Ok(u64::from_le_bytes(b));
        }
        let e = std::io::Error::last_os_error();
        if n >= 0 || e.kind() != std::io::ErrorKind::Interrupted {
            return Err(std::io::Error::other(format!(
                "no random bits from the kernel (getrandom: {e})"
            )));
        }
    }
}

/// 64 random bits ([`random_bits`]); without them (very old kernels), time and address bits,
/// still enough to tell two processes with the same pid and start time apart (a nonce is not a
/// secret).
pub fn random_u64() -> u64 {
    random_bits().unwrap_or_else(|_| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let here = 0u8;
        t ^ (&here as *const u8 as u64).rotate_left(32)
    })
}

/// Whether process `pid` (of this pid namespace) exists and has not exited: a zombie is dead,
/// pid 0 is no process. `pidfd_open` plus `poll` (a pidfd is readable once its process has
/// exited), or `/proc` before Linux 5.3.
pub fn alive(pid: u32) -> bool {
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if p <= 0 {
        return false;
    }
    // SAFETY: pidfd_open takes a pid and flags; the result is a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, p, 0) } as libc::c_int;
    if fd >= 0 {
        // SAFETY: a new fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no wait.
        return (unsafe { libc::poll(&mut pfd, 1, 0) }) <= 0;
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::ESRCH) => false,
        // No pidfd_open (before Linux 5.3): /proc says, where it shows our namespace.
        _ => proc_is_ours() && stat(&pid.to_string()).is_some_and(|(s, _)| !matches!(s, 'Z' | 'X')),
    }
}

/// Whether the process `i` is running: [`alive`], and still the process that started then
/// (where `/proc` shows this pid namespace), not a later one with its pid.
pub fn is_running(i: &Identity) -> bool {
    alive(i.pid) && (!proc_is_ours() || start_time(i.pid) == Some(i.start))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_running_and_a_later_start_time_is_another_process() {
        let me = me();
        assert_eq!(me.pid, std::process::id());
        assert_eq!(me, super::me(), "made once");
        assert!(me.start > 0);
        assert!(is_running(&me));
        let later = Identity {
            start: me.start + 1,
            ..me
        };
        assert!(!is_running(&later));
        assert!(!alive(0));
    }

    #[test]
    fn an_exited_child_is_dead_before_and_after_it_is_reaped() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let start = start_time(pid);
        // Wait for the exit without reaping: waitid with WNOWAIT.
        // SAFETY: zeroed siginfo is a valid out-parameter; P_PID with a child's pid.
        let r = unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            libc::waitid(libc::P_PID, pid, &mut info, libc::WEXITED | libc::WNOWAIT)
        };
        assert_eq!(r, 0);
        assert!(!alive(pid), "a zombie is dead");
        if let Some(start) = start {
            let id = Identity {
                pid,
                start,
                nonce: 1,
            };
            assert!(!is_running(&id));
        }
        child.wait().unwrap();
        assert!(!alive(pid), "reaped");
    }
}
