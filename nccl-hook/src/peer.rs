//! Cross-process references of NCCL's memory: who imported what, and the messages that let
//! owners and importers release and rebuild them together.
//!
//! NCCL shares a P2P buffer by exporting its handle as a POSIX fd, sending the fd over its own
//! Unix socket and importing it in the peer. An exported fd does not say which buffer it is, so
//! the export wrapper hands NCCL a **token** instead: a sealed memfd holding (group, owner
//! identity, virtual handle, key, generation). The importer's wrapper recognises the token (a
//! memfd with exactly our seals), asks the owner's memsaver for the real fd over memsaver's own
//! socket, and imports that. So the owner knows every importer of each buffer, and every
//! importer knows the owner and buffer behind each import. The **key** is 64 random bits the
//! owner draws when it first exports a buffer: the owner hands out the buffer's fd only to a
//! request that carries it, so only a process that was given the token can get the memory.
//!
//! A process's **identity** is (pid, start time, random nonce): unique across pid namespaces
//! and pid reuse, where a pid alone is not. Each process that exports serves
//! `<runtime dir>/g<group>/<pid>-<start>-<nonce>.sock`, created exclusively and removed only by
//! the process that created it. The security model and what enforces each boundary are in
//! docs/security.md:
//!
//! * directories: [`crate::rundir`] (no symbolic links, owner and mode checked on the open
//!   descriptor, sockets reached through it);
//! * credentials (`SO_PEERCRED`) and pid namespaces, both ends: the server (`server`) serves
//!   this user's processes of its own pid namespace (`/proc/<pid>/ns/pid`) whose pid and start
//!   time are the ones they claim; the client ([`connect`]) talks only to a server of this user
//!   and pid namespace whose pid and start time are the owner's;
//! * keys: an `Fds` request must carry each buffer's key, which only its token gives;
//! * group: a token names its group; an importer refuses another group's token and a server
//!   refuses another group's requests;
//! * the wire: [`crate::protocol`] (framed, typed, bounded, one deadline per frame), read by
//!   the server's one reading thread and answered by a fixed pool of workers (`server`).

use std::collections::HashMap;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::sys::socket::{getsockopt, sockopt};
use parking_lot::Mutex;

use memsaver_allocator::process;

use crate::options;
use crate::protocol::{self, Identity, Item, MAX_ITEMS, Reply, Request};
use crate::registry;
use crate::rundir::{self, Dir};

const MAGIC: &[u8] = b"memsaver-token-v3";
const SEALS: libc::c_int =
    libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;

/// How long a client waits to hand over a request (and, on top of the owner's own wait, for
/// its answers).
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// What a token names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Token {
    pub group: i64,
    pub pid: u32,
    /// The owner's start time and nonce (with `pid`, its identity).
    pub start: u64,
    pub nonce: u64,
    pub vh: u64,
    /// The buffer's key: what the owner asks of whoever names the buffer (see `server`).
    pub key: u64,
    pub generation: u64,
}

impl Token {
    /// A token of this process for its buffer `vh`, whose key is `key`.
    pub(crate) fn own(group: i64, vh: u64, key: u64, generation: u64) -> Self {
        let me = me();
        Self {
            group,
            pid: me.pid,
            start: me.start,
            nonce: me.nonce,
            vh,
            key,
            generation,
        }
    }

    fn owner(&self) -> Identity {
        Identity {
            pid: self.pid,
            start: self.start,
            nonce: self.nonce,
        }
    }
}

/// Whether exports hand out tokens (every process of the job must then be preloaded).
/// `MEMSAVER_NCCL_TOKENS=0` turns them off: NCCL gets driver fds, and exported buffers and
/// imports stay resident on pause. An invalid value means the default here (an export cannot
/// fail on our account) and fails every pause.
pub(crate) fn tokens_enabled() -> bool {
    options::get().nccl_tokens
}

/// How long pause waits for importers to let go and resume for owners to come back
/// (`MEMSAVER_NCCL_TIMEOUT_MS`).
pub(crate) fn timeout() -> Duration {
    options::get().nccl_timeout
}

/// The start time of process `pid` of this pid namespace, where `/proc` shows it.
pub(crate) fn start_of(pid: u32) -> Option<u64> {
    process::proc_is_ours()
        .then(|| process::start_time(pid))
        .flatten()
}

/// Why a process is not known to be in this process's pid namespace.
pub(crate) enum Namespace {
    /// It is in another one.
    Other,
    /// This process cannot tell, and why (a reason fit for any process to read).
    Unknown(String),
}

/// Whether process `pid` (as this process sees it, from `SO_PEERCRED`) is in this process's
/// pid namespace. A pid is a process of this namespace only where `/proc` shows this
/// namespace; elsewhere (`unshare --pid` without a `/proc` of its own) nobody can tell.
pub(crate) fn same_pid_namespace(pid: u32) -> Result<(), Namespace> {
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
/// random bits the buffer is exported as a plain fd instead, and that is recorded).
pub(crate) fn new_key() -> std::io::Result<u64> {
    process::random_bits()
}

/// This process's identity (made again in a forked child, whose pid differs).
pub(crate) fn me() -> Identity {
    process::me()
}

/// The start times of the processes this process deals with (owners named by tokens,
/// importers that connected), by pid: what tells a live process from a later one with the
/// same pid in [`alive`].
static STARTS: Mutex<Option<HashMap<u32, u64>>> = Mutex::new(None);

pub(crate) fn remember_start(pid: u32, start: u64) {
    STARTS
        .lock()
        .get_or_insert_with(HashMap::new)
        .insert(pid, start);
}

/// The owners this process imports from: pid -> identity, learnt from their tokens.
static OWNERS: Mutex<Option<HashMap<u32, Identity>>> = Mutex::new(None);

fn owner_identity(pid: u32) -> Result<Identity, String> {
    OWNERS
        .lock()
        .as_ref()
        .and_then(|m| m.get(&pid).copied())
        .ok_or_else(|| format!("process {pid}: this process has no token of it"))
}

/// Records `t`'s owner as the process behind its pid. Refused while this process still holds
/// imports of another process with that pid (a reused pid, or a process of another pid
/// namespace: either way not the owner those imports came from).
fn bind_owner(t: &Token) -> Result<(), String> {
    let id = t.owner();
    let known = OWNERS.lock().as_ref().and_then(|m| m.get(&t.pid).copied());
    if let Some(old) = known.filter(|old| *old != id) {
        let holds = registry::lock()
            .physicals
            .values()
            .any(|p| p.source.is_some_and(|s| s.owner == t.pid));
        if holds {
            return Err(format!(
                "the token names process {} started at {} (nonce {:016x}), but this process \
                 holds imports of another process {} (started at {}, nonce {:016x}): the pid \
                 was reused or belongs to another pid namespace (container); memsaver shares \
                 NCCL memory only between processes of one pid namespace",
                t.pid, t.start, t.nonce, old.pid, old.start, old.nonce
            ));
        }
    }
    OWNERS
        .lock()
        .get_or_insert_with(HashMap::new)
        .insert(t.pid, id);
    remember_start(t.pid, t.start);
    Ok(())
}

/// A sealed memfd holding `t`.
pub(crate) fn make_token(t: Token) -> std::io::Result<OwnedFd> {
    // SAFETY: NUL-terminated name; flags are valid.
    let fd = unsafe {
        libc::memfd_create(
            c"memsaver-token".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new fd we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let text = format!(
        "{} {} {} {} {} {} {} {}\n",
        std::str::from_utf8(MAGIC).unwrap_or(""),
        t.group,
        t.pid,
        t.start,
        t.nonce,
        t.vh,
        t.key,
        t.generation
    );
    let mut f = std::fs::File::from(fd);
    f.write_all(text.as_bytes())?;
    let fd = OwnedFd::from(f);
    // SAFETY: a valid fd; F_ADD_SEALS takes an int.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(fd)
}

/// The token behind `fd`, if it is one (a memfd sealed exactly as ours, with our magic).
pub(crate) fn read_token(fd: RawFd) -> Option<Token> {
    // SAFETY: F_GET_SEALS on any fd is harmless: it fails with EINVAL for non-memfds.
    if unsafe { libc::fcntl(fd, libc::F_GET_SEALS) } != SEALS {
        return None;
    }
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its length; pread does not move the shared offset.
    let n = unsafe { libc::pread(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
    let text = std::str::from_utf8(buf.get(..usize::try_from(n).ok()?)?).ok()?;
    let mut it = text.split_whitespace();
    if it.next()?.as_bytes() != MAGIC {
        return None;
    }
    let t = Token {
        group: it.next()?.parse().ok()?,
        pid: it.next()?.parse().ok()?,
        start: it.next()?.parse().ok()?,
        nonce: it.next()?.parse().ok()?,
        vh: it.next()?.parse().ok()?,
        key: it.next()?.parse().ok()?,
        generation: it.next()?.parse().ok()?,
    };
    it.next().is_none().then_some(t)
}

/// The runtime directory (`MEMSAVER_RUNTIME_DIR`, else `$XDG_RUNTIME_DIR/memsaver`, else
/// `/tmp/memsaver-<uid>`); nothing is created.
pub(crate) fn runtime_dir() -> PathBuf {
    options::get().runtime_dir.clone()
}

fn socket_name(i: &Identity) -> String {
    format!("{}-{}-{:016x}.sock", i.pid, i.start, i.nonce)
}

/// The identity a socket's name gives (`<pid>-<start>-<nonce>.sock`), if it is one.
pub(crate) fn parse_socket_name(name: &str) -> Option<Identity> {
    let mut it = name.strip_suffix(".sock")?.split('-');
    let i = Identity {
        pid: it.next()?.parse().ok()?,
        start: it.next()?.parse().ok()?,
        nonce: u64::from_str_radix(it.next()?, 16).ok()?,
    };
    (it.next().is_none() && socket_name(&i) == name).then_some(i)
}

/// Whether the process `i` is running: alive, and still the process that started then (where
/// `/proc` shows this pid namespace), not a later one with its pid. A socket left behind by a
/// process that exited without its exit handlers is not a process.
pub(crate) fn is_running(i: &Identity) -> bool {
    process::is_running(i)
}

/// The group directory's sockets as owners (socket name, pid, whether that very process is
/// still running: see [`is_running`]), for diagnostics. Other entries are left out.
pub(crate) fn owners_in(entries: &[String]) -> Vec<(String, u32, bool)> {
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

/// Why NCCL exports of this process are plain fds instead of tokens, and how many: set by the
/// first export that could not get a token (the server could not start: a runtime directory
/// that is not private, a link in its path, ...).
static FALLBACK: Mutex<Option<String>> = Mutex::new(None);
static FALLBACK_EXPORTS: AtomicU64 = AtomicU64::new(0);

/// Records that an export fell back to a plain fd because of `why`.
pub(crate) fn record_fallback(why: &str) {
    FALLBACK_EXPORTS.fetch_add(1, Ordering::Relaxed);
    FALLBACK.lock().get_or_insert_with(|| why.to_owned());
}

/// Exports that fell back to plain fds (they and their imports stay resident on pause).
pub(crate) fn fallback_exports() -> u64 {
    FALLBACK_EXPORTS.load(Ordering::Relaxed)
}

/// Why NCCL's exports could not be shared through memsaver, and what to do, when at least
/// one fell back: pause('nccl') cannot free those buffers and should fail with this.
pub(crate) fn fallback_reason() -> Option<String> {
    let why = FALLBACK.lock().clone()?;
    Some(format!(
        "{} NCCL buffer(s) of this process were exported as plain fds, which stay resident on \
         pause (as do the peers' imports of them), because memsaver could not serve its \
         peers: {why}. Fix that, then restart the job",
        fallback_exports()
    ))
}

/// The group this process's server serves, once it has started (its socket lives in that
/// group's directory, and the tokens handed out name it), or once it imported a token.
static SERVER_GROUP: OnceLock<i64> = OnceLock::new();

pub(crate) fn server_group() -> Option<i64> {
    SERVER_GROUP.get().copied()
}

/// The socket this process serves, removed at exit by this process only.
static SERVING: OnceLock<(Dir, String, u32)> = OnceLock::new();

extern "C" fn remove_own_socket() {
    if let Some((dir, name, pid)) = SERVING.get()
        && *pid == std::process::id()
    {
        dir.remove(name);
    }
}

/// Starts this process's server (once). Called before the first token is handed out.
pub(crate) fn ensure_server() -> std::io::Result<()> {
    static STARTED: OnceLock<Result<(), String>> = OnceLock::new();
    STARTED
        .get_or_init(|| {
            let group = *SERVER_GROUP.get_or_init(crate::amem::group_id);
            let dir = rundir::group_dir(&runtime_dir(), group).map_err(|e| e.to_string())?;
            let me = me();
            let name = socket_name(&me);
            // bind creates the socket exclusively (EADDRINUSE if the name exists): never
            // another process's socket removed or taken over.
            let listener = UnixListener::bind(dir.entry(&name))
                .map_err(|e| format!("{}/{name}: {e}", dir.path().display()))?;
            let _ = SERVING.set((dir, name, me.pid));
            // SAFETY: registers a plain extern "C" function without arguments.
            unsafe { libc::atexit(remove_own_socket) };
            crate::server::start(listener, group, me).map_err(|e| e.to_string())
        })
        .clone()
        .map_err(std::io::Error::other)
}

/// The peer's (uid, pid) as this process sees them; pid 0 for a process outside this pid
/// namespace.
pub(crate) fn peer_cred(s: &UnixStream) -> std::io::Result<(u32, u32)> {
    let c = getsockopt(s, sockopt::PeerCredentials).map_err(std::io::Error::from)?;
    Ok((c.uid(), u32::try_from(c.pid()).unwrap_or(0)))
}

/// Connects to the server of `owner` in `group`'s directory and checks who answers: a process
/// of this user, in this pid namespace, whose pid and start time are the owner's.
pub(crate) fn connect(group: i64, owner: &Identity) -> Result<UnixStream, String> {
    let dir = rundir::group_dir(&runtime_dir(), group).map_err(|e| e.to_string())?;
    let name = socket_name(owner);
    let shown = || format!("{}/{name}", dir.path().display());
    let stream = loop {
        match UnixStream::connect(dir.entry(&name)) {
            Ok(s) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(format!(
                    "process {} does not serve {} ({e}): it exited, or runs with another \
                     MEMSAVER_RUNTIME_DIR or group",
                    owner.pid,
                    shown()
                ));
            }
        }
    };
    let (uid, pid) = peer_cred(&stream).map_err(|e| format!("{}: {e}", shown()))?;
    if uid != rundir::euid() {
        return Err(format!(
            "{} is served by uid {uid}, not this user ({}): refused",
            shown(),
            rundir::euid()
        ));
    }
    let namespace = match same_pid_namespace(pid) {
        Ok(()) if pid != 0 => None,
        Ok(()) | Err(Namespace::Other) => Some(
            "it runs in another pid namespace (container); memsaver shares NCCL memory and \
             control only within one"
                .to_owned(),
        ),
        Err(Namespace::Unknown(why)) => Some(why),
    };
    if let Some(why) = namespace {
        return Err(format!(
            "{} is not served by process {} of this pid namespace: {why}",
            shown(),
            owner.pid
        ));
    }
    if pid != owner.pid || start_of(pid) != Some(owner.start) {
        return Err(format!(
            "{} is served by another process than process {} (started at {}) that the token \
             or socket names: refused",
            shown(),
            owner.pid,
            owner.start
        ));
    }
    Ok(stream)
}

/// Sends `request` (at most [`MAX_ITEMS`] items) to `owner` and reads `n` replies, all by one
/// deadline: the owner's own wait for buffers still resuming, and [`IO_TIMEOUT`].
fn exchange(
    group: i64,
    owner: &Identity,
    request: Request,
    n: usize,
) -> Result<Vec<(Reply, Option<OwnedFd>)>, String> {
    let stream = connect(group, owner)?;
    let pid = owner.pid;
    let sent_by = Instant::now() + IO_TIMEOUT;
    protocol::write_frame(stream.as_fd(), &request.encode(), None, sent_by)
        .map_err(|e| format!("process {pid}: {e}"))?;
    let answered_by = Instant::now() + timeout() + IO_TIMEOUT;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let (body, fd) =
            protocol::read_frame(stream.as_fd(), answered_by).map_err(|e| match e.kind() {
                std::io::ErrorKind::UnexpectedEof => {
                    format!("process {pid} closed the connection (did it exit?)")
                }
                _ => format!("process {pid}: {e}"),
            })?;
        match Reply::decode(&body) {
            Ok(Reply::Refused { reason }) => {
                return Err(format!("process {pid} refused: {reason}"));
            }
            Ok(r) => out.push((r, fd)),
            Err(e) => return Err(format!("process {pid} sent {e}")),
        }
    }
    Ok(out)
}

/// The real fds of the buffers `wants` of `owner`, with the generation each one is.
fn fetch(group: i64, owner: &Identity, wants: &[Item]) -> Result<Vec<(OwnedFd, u64)>, String> {
    let pid = owner.pid;
    let mut out = Vec::with_capacity(wants.len());
    for chunk in wants.chunks(MAX_ITEMS) {
        let request = Request::Fds {
            from: me(),
            to: *owner,
            group,
            items: chunk.to_vec(),
        };
        for ((reply, fd), want) in exchange(group, owner, request, chunk.len())?
            .into_iter()
            .zip(chunk)
        {
            let vh = want.vh;
            out.push(match (reply, fd) {
                (Reply::Fd { vh: got, generation }, Some(fd)) if got == vh => (fd, generation),
                (Reply::NotReady { .. }, _) => {
                    return Err(format!(
                        "process {pid} did not resume buffer {vh:#x} (generation {}) within {} ms; it must resume 'nccl' too",
                        want.generation,
                        timeout().as_millis()
                    ));
                }
                (Reply::Failed { .. }, _) => {
                    return Err(format!(
                        "process {pid} could not export buffer {vh:#x} (its driver failed, or \
                         NCCL freed the buffer there)"
                    ));
                }
                (r, _) => {
                    return Err(format!(
                        "process {pid} answered {r:?} for buffer {vh:#x}"
                    ));
                }
            });
        }
    }
    Ok(out)
}

/// The import of token `t`: checks its group and owner, then the real fd and its generation.
pub(crate) fn import(t: &Token) -> Result<(OwnedFd, u64), String> {
    let mine = *SERVER_GROUP.get_or_init(crate::amem::group_id);
    if t.group != mine {
        return Err(format!(
            "the buffer belongs to process {} of group {}, this process is in group {mine}: \
             groups do not share NCCL memory; give every process of one job the same group \
             (MEMSAVER_GROUP, memsaver.set_group or ncclSetGroupID)",
            t.pid, t.group
        ));
    }
    bind_owner(t)?;
    let want = Item {
        vh: t.vh,
        key: t.key,
        generation: t.generation,
    };
    fetch(t.group, &t.owner(), &[want])?
        .pop()
        .ok_or_else(|| format!("process {}: no answer", t.pid))
}

/// The real fds of buffers `wants` of `owner` (each at least the generation given), with the
/// generation each one is.
pub(crate) fn request_fds(
    group: i64,
    owner: u32,
    wants: &[Item],
) -> Result<Vec<(OwnedFd, u64)>, String> {
    fetch(group, &owner_identity(owner)?, wants)
}

/// Tells `owner` that this process released its imports `items`.
pub(crate) fn notify_released(group: i64, owner: u32, items: &[Item]) -> Result<(), String> {
    let owner = owner_identity(owner)?;
    for chunk in items.chunks(MAX_ITEMS) {
        let request = Request::Released {
            from: me(),
            to: owner,
            group,
            items: chunk.to_vec(),
        };
        exchange(group, &owner, request, 1)?;
    }
    Ok(())
}

/// Whether process `pid` (of this pid namespace) is alive: it exists and has not exited (a
/// zombie is dead), and, when this process knows its start time (an owner's token, an
/// importer's request), it is still the process that started then (a reused pid is dead).
/// Pid 0 is no process.
pub(crate) fn alive(pid: u32) -> bool {
    if !process::alive(pid) {
        return false;
    }
    let known = STARTS.lock().as_ref().and_then(|m| m.get(&pid).copied());
    match known {
        Some(start) if process::proc_is_ours() => process::start_time(pid) == Some(start),
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_reject_extra_fields() {
        let t = Token::own(-3, 0x6d73_0000_0000_0007, new_key().unwrap(), 2);
        assert_eq!(t.pid, std::process::id());
        let fd = make_token(t).unwrap();
        assert_eq!(read_token(fd.as_raw_fd()), Some(t));
        let f = std::fs::File::open("/dev/null").unwrap();
        assert_eq!(read_token(f.as_raw_fd()), None);
    }

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
