//! Who a process is, whether it still runs, and whether it is in this pid namespace.
//!
//! A process's **identity** is (pid, start time, random nonce) (the core's
//! `memsaver_allocator::process`, which disk backups use too): unique across pid namespaces
//! and pid reuse, where a pid alone is not. Each process that serves its socket does so at
//! `<runtime dir>/g<group>/<pid>-<start>-<nonce>.sock` ([`socket_name`]).

use std::collections::HashMap;

use parking_lot::Mutex;

use memsaver_allocator::process;

/// A process, unique across pid namespaces and pid reuse (the core's `process::Identity`).
pub use memsaver_allocator::process::Identity;

/// This process's identity (made again in a forked child, whose pid differs).
pub fn me() -> Identity {
    process::me()
}

/// The start time of process `pid` of this pid namespace, where `/proc` shows it.
pub fn start_of(pid: u32) -> Option<u64> {
    process::proc_is_ours()
        .then(|| process::start_time(pid))
        .flatten()
}

/// Why a process is not known to be in this process's pid namespace.
pub enum Namespace {
    /// It is in another one.
    Other,
    /// This process cannot tell, and why (a reason fit for any process to read).
    Unknown(String),
}

/// Whether process `pid` (as this process sees it, from `SO_PEERCRED`) is in this process's
/// pid namespace. A pid is a process of this namespace only where `/proc` shows this
/// namespace; elsewhere (`unshare --pid` without a `/proc` of its own) nobody can tell.
pub fn same_pid_namespace(pid: u32) -> Result<(), Namespace> {
    if !process::proc_is_ours() {
        return Err(Namespace::Unknown(
            "the owner cannot tell which pid namespace (container) a process is in: its /proc \
             does not show its own pid namespace (mount a /proc for it, as containers do)"
                .into(),
        ));
    }
    let ours = process::pid_namespace("self").ok_or_else(|| {
        Namespace::Unknown("the owner cannot read its own /proc/self/ns/pid".into())
    })?;
    match process::pid_namespace(&pid.to_string()) {
        Some(theirs) if theirs == ours => Ok(()),
        Some(_) => Err(Namespace::Other),
        // Gone, or not ours to look at (a process that is not dumpable): not known to be in
        // this namespace, so not in it.
        None => Err(Namespace::Other),
    }
}

/// A new buffer key: 64 random bits, or an error (a key must not be guessable: without
/// random bits a buffer must not be handed out through a token).
pub fn new_key() -> std::io::Result<u64> {
    process::random_bits()
}

/// The start times of the processes this process deals with (owners named by tokens,
/// importers that connected), by pid: what tells a live process from a later one with the
/// same pid in [`alive`].
static STARTS: Mutex<Option<HashMap<u32, u64>>> = Mutex::new(None);

/// Records that process `pid` is the one that started at `start`.
pub fn remember_start(pid: u32, start: u64) {
    STARTS
        .lock()
        .get_or_insert_with(HashMap::new)
        .insert(pid, start);
}

/// Whether process `pid` (of this pid namespace) is alive: it exists and has not exited (a
/// zombie is dead), and, when this process knows its start time (an owner's token, an
/// importer's request), it is still the process that started then (a reused pid is dead).
/// Pid 0 is no process.
pub fn alive(pid: u32) -> bool {
    if !process::alive(pid) {
        return false;
    }
    let known = STARTS.lock().as_ref().and_then(|m| m.get(&pid).copied());
    match known {
        Some(start) if process::proc_is_ours() => process::start_time(pid) == Some(start),
        _ => true,
    }
}

/// Whether the process `i` is running: alive, and still the process that started then (where
/// `/proc` shows this pid namespace), not a later one with its pid. A socket left behind by a
/// process that exited without its exit handlers is not a process.
pub fn is_running(i: &Identity) -> bool {
    process::is_running(i)
}

/// The name of the socket process `i` serves: `<pid>-<start>-<nonce>.sock`.
pub fn socket_name(i: &Identity) -> String {
    format!("{}-{}-{:016x}.sock", i.pid, i.start, i.nonce)
}

/// The identity a socket's name gives (`<pid>-<start>-<nonce>.sock`), if it is one.
pub fn parse_socket_name(name: &str) -> Option<Identity> {
    let mut it = name.strip_suffix(".sock")?.split('-');
    let i = Identity {
        pid: it.next()?.parse().ok()?,
        start: it.next()?.parse().ok()?,
        nonce: u64::from_str_radix(it.next()?, 16).ok()?,
    };
    (it.next().is_none() && socket_name(&i) == name).then_some(i)
}

/// The group directory's sockets as processes (socket name, pid, whether that very process is
/// still running: see [`is_running`]), for diagnostics. Other entries are left out.
pub fn owners_in(entries: &[String]) -> Vec<(String, u32, bool)> {
    let mut out: Vec<(String, u32, bool)> = entries
        .iter()
        .filter_map(|name| {
            let i = parse_socket_name(name)?;
            Some((name.clone(), i.pid, is_running(&i)))
        })
        .collect();
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn socket_names_give_identities_back_exactly() {
        let me = me();
        assert_eq!(parse_socket_name(&socket_name(&me)), Some(me));
        assert!(is_running(&me));
        for bad in [
            "1-2-3.sock",
            "1-2-zz.sock",
            "1-2.sock",
            "x.sock",
            "1-2-0000000000000003",
        ] {
            assert_eq!(parse_socket_name(bad), None, "{bad}");
        }
        let later = Identity {
            start: me.start + 1,
            ..me
        };
        assert!(!is_running(&later), "another start time is another process");
    }

    #[test]
    fn liveness_knows_zombies_pid_0_and_reused_pids() {
        assert!(!alive(0));
        assert!(alive(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // Not reaped yet: a zombie once it exits.
        while process::stat(&pid.to_string()).is_some_and(|(s, _)| s != 'Z') {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!alive(pid), "a zombie is dead");
        child.wait().unwrap();
        assert!(!alive(pid));
        // This process, with a start time that is not its own: a later process on its pid.
        let me = me();
        remember_start(me.pid, me.start + 1);
        assert!(!alive(me.pid), "a reused pid is dead");
        remember_start(me.pid, me.start);
        assert!(alive(me.pid));
    }
}
