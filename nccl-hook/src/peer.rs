//! Cross-process references of NCCL's memory: who imported what, and the messages that let
//! owners and importers release and rebuild them together.
//!
//! NCCL shares a P2P buffer by exporting its handle as a POSIX fd, sending the fd over its own
//! Unix socket and importing it in the peer. An exported fd does not say which buffer it is, so
//! the export wrapper hands NCCL a **token** instead: a sealed memfd holding (group, owner
//! identity, virtual handle, generation). The importer's wrapper recognises the token (a memfd
//! with exactly our seals), asks the owner's memsaver for the real fd over memsaver's own
//! socket, and imports that. So the owner knows every importer of each buffer, and every
//! importer knows the owner and buffer behind each import.
//!
//! A process's **identity** is (pid, start time, random nonce): unique across pid namespaces
//! and pid reuse, where a pid alone is not. Each process that exports serves
//! `<runtime dir>/g<group>/<pid>-<start>-<nonce>.sock`, created exclusively and removed only by
//! the process that created it. The security model and what enforces each boundary are in
//! docs/security.md:
//!
//! * directories: [`crate::rundir`] (no symbolic links, owner and mode checked on the open
//!   descriptor, sockets reached through it);
//! * credentials (`SO_PEERCRED`), both ends: the server serves this user's processes whose
//!   pid (as it sees it) is the one they claim; the client talks only to a server of this user
//!   whose pid (as it sees it) is the one the token names; a process of another pid namespace
//!   shows another pid (or 0) and is refused;
//! * group: a token names its group; an importer refuses another group's token and a server
//!   refuses another group's requests;
//! * the wire: [`crate::protocol`] (framed, typed, bounded, with timeouts), served by a fixed
//!   pool of [`WORKERS`] threads with at most [`QUEUED`] connections waiting.

use std::collections::HashMap;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use nix::sys::socket::{getsockopt, sockopt};
use parking_lot::Mutex;

use memsaver_allocator::driver::Handle;
use memsaver_allocator::options;

use crate::protocol::{self, Identity, Item, MAX_ITEMS, Reply, Request};
use crate::registry;
use crate::rundir::{self, Dir};

const MAGIC: &[u8] = b"memsaver-token-v2";
const SEALS: libc::c_int =
    libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;

/// Threads serving peers, per owner process.
const WORKERS: usize = 4;
/// Connections accepted and waiting for a worker; more are closed at once (refused).
const QUEUED: usize = 64;
/// How long a server waits for a connection's request, and either end for a write.
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
    pub generation: u64,
}

impl Token {
    /// A token of this process for its buffer `vh`.
    pub(crate) fn own(group: i64, vh: u64, generation: u64) -> Self {
        let me = me();
        Self {
            group,
            pid: me.pid,
            start: me.start,
            nonce: me.nonce,
            vh,
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

/// The start time of process `pid` as this process's `/proc` shows it (field 22 of
/// `/proc/<pid>/stat`, clock ticks after boot), and its state letter.
fn proc_stat(pid: &str) -> Option<(char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold anything: parse after it.
    let rest = &text[text.rfind(')')? + 1..];
    let mut f = rest.split_whitespace();
    let state = f.next()?.chars().next()?;
    // Fields 4.. ; the start time is field 22, the 20th after the state.
    let start = f.nth(18)?.parse().ok()?;
    Some((state, start))
}

/// Whether `/proc` shows this process's pid namespace (it shows another one where /proc was
/// mounted for a parent namespace: `unshare --pid` without `--mount-proc`).
fn proc_is_ours() -> bool {
    static OURS: OnceLock<bool> = OnceLock::new();
    *OURS.get_or_init(|| {
        std::fs::read_link("/proc/self")
            .is_ok_and(|p| p.to_str() == Some(&std::process::id().to_string()))
    })
}

fn random_nonce() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: `b` is writable for its length.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        // No getrandom (very old kernel): time and address bits, still unique enough to tell
        // two processes with the same pid and start time apart.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        return t ^ (&b as *const _ as u64).rotate_left(32);
    }
    u64::from_le_bytes(b)
}

/// This process's identity (made again in a forked child, whose pid differs).
pub(crate) fn me() -> Identity {
    static ME: Mutex<Option<Identity>> = Mutex::new(None);
    let pid = std::process::id();
    let mut g = ME.lock();
    match *g {
        Some(i) if i.pid == pid => i,
        _ => {
            let i = Identity {
                pid,
                start: proc_stat("self").map_or(0, |(_, s)| s),
                nonce: random_nonce(),
            };
            *g = Some(i);
            i
        }
    }
}

/// The start times of the processes this process deals with (owners named by tokens,
/// importers that connected), by pid: what tells a live process from a later one with the
/// same pid in [`alive`].
static STARTS: Mutex<Option<HashMap<u32, u64>>> = Mutex::new(None);

fn remember_start(pid: u32, start: u64) {
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
        "{} {} {} {} {} {} {}\n",
        std::str::from_utf8(MAGIC).unwrap_or(""),
        t.group,
        t.pid,
        t.start,
        t.nonce,
        t.vh,
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
    alive(i.pid)
        && (!proc_is_ours() || proc_stat(&i.pid.to_string()).is_some_and(|(_, s)| s == i.start))
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
            start_workers(listener, group, me).map_err(|e| e.to_string())
        })
        .clone()
        .map_err(std::io::Error::other)
}

fn start_workers(listener: UnixListener, group: i64, me: Identity) -> std::io::Result<()> {
    let (tx, rx): (SyncSender<UnixStream>, Receiver<UnixStream>) =
        std::sync::mpsc::sync_channel(QUEUED);
    let rx = Arc::new(Mutex::new(rx));
    for n in 0..WORKERS {
        let rx = rx.clone();
        std::thread::Builder::new()
            .name(format!("memsaver-nccl-{n}"))
            .spawn(move || {
                loop {
                    let conn = rx.lock().recv();
                    match conn {
                        Ok(c) => serve(c, group, me),
                        Err(_) => return,
                    }
                }
            })?;
    }
    std::thread::Builder::new()
        .name("memsaver-nccl".into())
        .spawn(move || {
            // `accept` retries EINTR.
            for conn in listener.incoming() {
                match conn {
                    Ok(c) => match tx.try_send(c) {
                        Ok(()) => {}
                        Err(TrySendError::Full(_)) => {
                            // Said once: a flood of connections is not a flood of lines.
                            static SAID: std::sync::Once = std::sync::Once::new();
                            SAID.call_once(|| {
                                tracing::warn!(
                                    "memsaver: refusing peers' connections: {QUEUED} are already waiting"
                                )
                            });
                        }
                        Err(TrySendError::Disconnected(_)) => return,
                    },
                    // Out of fds and the like: do not spin.
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        })?;
    Ok(())
}

/// The peer's (uid, pid) as this process sees them; pid 0 for a process outside this pid
/// namespace.
fn peer_cred(s: &UnixStream) -> std::io::Result<(u32, u32)> {
    let c = getsockopt(s, sockopt::PeerCredentials).map_err(std::io::Error::from)?;
    Ok((c.uid(), u32::try_from(c.pid()).unwrap_or(0)))
}

/// Checks a request's sender and addressee; the refusal's reason otherwise.
fn admit(
    from: &Identity,
    to: &Identity,
    group: i64,
    me: Identity,
    my_group: i64,
    cred_pid: u32,
) -> Result<(), String> {
    if cred_pid == 0 || cred_pid != from.pid {
        return Err(format!(
            "process {} (as it says) is process {cred_pid} here: it runs in another pid \
             namespace (container); memsaver shares NCCL memory only within one",
            from.pid
        ));
    }
    if *to != me {
        return Err(format!(
            "this is process {} started at {} (nonce {:016x}), not the one the token names",
            me.pid, me.start, me.nonce
        ));
    }
    if group != my_group {
        return Err(format!(
            "process {} of group {group} asked for buffers of group {my_group}: groups do not \
             share NCCL memory (MEMSAVER_GROUP, memsaver.set_group, ncclSetGroupID)",
            from.pid
        ));
    }
    if proc_is_ours()
        && let Some((_, start)) = proc_stat(&cred_pid.to_string())
        && start != from.start
    {
        return Err(format!(
            "process {cred_pid} started at {start}, not at {} as it says",
            from.start
        ));
    }
    Ok(())
}

/// One connection from a peer: one request, answered, then closed.
fn serve(stream: UnixStream, my_group: i64, me: Identity) {
    let (uid, cred_pid) = match peer_cred(&stream) {
        Ok(c) => c,
        Err(_) => return,
    };
    if uid != rundir::euid() {
        tracing::warn!(uid, "memsaver: refused a connection from another user");
        return;
    }
    if stream.set_read_timeout(Some(IO_TIMEOUT)).is_err()
        || stream.set_write_timeout(Some(IO_TIMEOUT)).is_err()
    {
        return;
    }
    let refuse = |reason: String| {
        tracing::warn!(
            pid = cred_pid,
            "memsaver: refused a peer's request: {reason}"
        );
        let _ = protocol::write_frame(stream.as_fd(), &Reply::Refused { reason }.encode(), None);
    };
    let request = match protocol::read_frame(stream.as_fd()) {
        Ok((body, None)) => Request::decode(&body).map_err(|e| e.to_string()),
        Ok((_, Some(_))) => Err("a request came with an fd".to_owned()),
        Err(e) => {
            tracing::debug!(pid = cred_pid, error = %e, "memsaver: a peer's connection ended");
            return;
        }
    };
    let request = match request {
        Ok(r) => r,
        Err(e) => return refuse(format!("a malformed request: {e}")),
    };
    let (from, to, group) = request.head();
    if let Err(reason) = admit(from, to, group, me, my_group, cred_pid) {
        return refuse(reason);
    }
    let _ = match request {
        Request::Fds { from, items, .. } => {
            remember_start(from.pid, from.start);
            answer(&stream, from.pid, &items)
        }
        Request::Released { from, items, .. } => {
            remember_start(from.pid, from.start);
            let mut reg = registry::lock();
            for i in &items {
                if let Some(p) = reg.physicals.get_mut(&i.vh)
                    && p.generation == i.generation
                {
                    p.importers.remove(&from.pid);
                }
            }
            drop(reg);
            protocol::write_frame(stream.as_fd(), &Reply::Done.encode(), None)
        }
        // Run on the control thread, never on this worker (see `control`).
        Request::Control { from, op, .. } => match crate::control::submit(stream, from.pid, op) {
            Ok(()) => Ok(()),
            Err((stream, reason)) => {
                tracing::warn!(
                    pid = cred_pid,
                    "memsaver: refused a control request: {reason}"
                );
                protocol::write_frame(stream.as_fd(), &Reply::Refused { reason }.encode(), None)
            }
        },
    };
}

/// Answers `items` in order: the real fd of buffer `vh` once its generation is at least the
/// one asked for (waiting for an owner still resuming, up to the timeout), recording `pid` as
/// an importer. Every item already answerable is answered under one hold of the registry
/// lock, so that a process busy resuming serves a peer's hundreds of buffers in one go.
fn answer(stream: &UnixStream, pid: u32, items: &[Item]) -> std::io::Result<()> {
    let deadline = Instant::now() + timeout();
    // Before the registry lock: this may start the allocator. The driver whatever the options
    // say: a peer's import must be served.
    let driver = crate::driver();
    let mut next = 0;
    while next < items.len() {
        let mut replies: Vec<(Reply, Option<OwnedFd>)> = Vec::new();
        {
            let mut reg = registry::lock();
            for r in &items[next..] {
                let Some(p) = reg.physicals.get_mut(&r.vh) else {
                    replies.push((Reply::Unknown { vh: r.vh }, None));
                    continue;
                };
                // A buffer that stays resident through pauses (host memory, given to a NIC,
                // ...) keeps its generation: serve it as it is. Otherwise wait until the owner
                // has re-created the generation asked for.
                let stays = p.pausable().is_err();
                let Some(h) = p.real.filter(|_| stays || p.generation >= r.generation) else {
                    break; // not restored yet: answers go out in order, wait
                };
                match driver.clone().and_then(|d| Ok(d.export_fd(Handle(h))?)) {
                    Ok(fd) => {
                        p.importers.insert(pid);
                        let reply = Reply::Fd {
                            vh: r.vh,
                            generation: p.generation,
                        };
                        replies.push((reply, Some(fd)));
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "memsaver: cannot export an NCCL buffer to a peer");
                        replies.push((Reply::Failed { vh: r.vh }, None));
                    }
                }
            }
        }
        for (i, (reply, fd)) in replies.iter().enumerate() {
            let sent = protocol::write_frame(
                stream.as_fd(),
                &reply.encode(),
                fd.as_ref().map(|f| f.as_fd()),
            );
            if let Err(e) = sent {
                // The importer is gone (or gave up waiting): it holds none of the fds not
                // delivered, so it must not stay registered for them (its owner's next pause
                // would wait for it).
                unregister(pid, &replies[i..]);
                return Err(e);
            }
        }
        next += replies.len();
        if next < items.len() {
            if Instant::now() >= deadline {
                for r in &items[next..] {
                    protocol::write_frame(
                        stream.as_fd(),
                        &Reply::NotReady { vh: r.vh }.encode(),
                        None,
                    )?;
                }
                return Ok(());
            }
            std::thread::sleep(Duration::from_micros(500));
        }
    }
    Ok(())
}

/// Forgets `pid` as an importer of the buffers of `replies` that carried an fd.
fn unregister(pid: u32, replies: &[(Reply, Option<OwnedFd>)]) {
    let mut reg = registry::lock();
    for (reply, _) in replies {
        if let Reply::Fd { vh, generation } = reply
            && let Some(p) = reg.physicals.get_mut(vh)
            && p.generation == *generation
        {
            p.importers.remove(&pid);
        }
    }
}

/// Connects to the server of `owner` in `group`'s directory and checks who answers.
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
    if pid != owner.pid {
        return Err(format!(
            "{} is served by the process this process sees as pid {pid}, not the process {} the \
             token names: it runs in another pid namespace (container); memsaver shares NCCL \
             memory only within one",
            shown(),
            owner.pid
        ));
    }
    stream
        .set_read_timeout(Some(timeout() + IO_TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(IO_TIMEOUT)))
        .map_err(|e| e.to_string())?;
    Ok(stream)
}

/// Sends `request` (at most [`MAX_ITEMS`] items) to `owner` and reads `n` replies.
fn exchange(
    group: i64,
    owner: &Identity,
    request: Request,
    n: usize,
) -> Result<Vec<(Reply, Option<OwnedFd>)>, String> {
    let stream = connect(group, owner)?;
    let pid = owner.pid;
    protocol::write_frame(stream.as_fd(), &request.encode(), None)
        .map_err(|e| format!("process {pid}: {e}"))?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let (body, fd) = protocol::read_frame(stream.as_fd()).map_err(|e| match e.kind() {
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

fn fetch(
    group: i64,
    owner: &Identity,
    wants: &[(u64, u64)],
) -> Result<Vec<(OwnedFd, u64)>, String> {
    let pid = owner.pid;
    let mut out = Vec::with_capacity(wants.len());
    for chunk in wants.chunks(MAX_ITEMS) {
        let items: Vec<Item> = chunk
            .iter()
            .map(|(vh, generation)| Item {
                vh: *vh,
                generation: *generation,
            })
            .collect();
        let request = Request::Fds {
            from: me(),
            to: *owner,
            group,
            items,
        };
        for ((reply, fd), (vh, want)) in exchange(group, owner, request, chunk.len())?
            .into_iter()
            .zip(chunk)
        {
            out.push(match (reply, fd) {
                (Reply::Fd { vh: got, generation }, Some(fd)) if got == *vh => (fd, generation),
                (Reply::NotReady { .. }, _) => {
                    return Err(format!(
                        "process {pid} did not resume buffer {vh:#x} (generation {want}) within {} ms; it must resume 'nccl' too",
                        timeout().as_millis()
                    ));
                }
                (Reply::Unknown { .. }, _) => {
                    return Err(format!("process {pid} no longer has buffer {vh:#x}"));
                }
                (Reply::Failed { .. }, _) => {
                    return Err(format!("process {pid} could not export buffer {vh:#x}"));
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
    fetch(t.group, &t.owner(), &[(t.vh, t.generation)])?
        .pop()
        .ok_or_else(|| format!("process {}: no answer", t.pid))
}

/// The real fds of buffers `(vh, generation)` of `owner`, with the generation each one is.
pub(crate) fn request_fds(
    group: i64,
    owner: u32,
    wants: &[(u64, u64)],
) -> Result<Vec<(OwnedFd, u64)>, String> {
    fetch(group, &owner_identity(owner)?, wants)
}

/// Tells `owner` that this process released its imports `(vh, generation)`.
pub(crate) fn notify_released(group: i64, owner: u32, items: &[(u64, u64)]) -> Result<(), String> {
    let owner = owner_identity(owner)?;
    for chunk in items.chunks(MAX_ITEMS) {
        let items = chunk
            .iter()
            .map(|(vh, generation)| Item {
                vh: *vh,
                generation: *generation,
            })
            .collect();
        let request = Request::Released {
            from: me(),
            to: owner,
            group,
            items,
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
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if p <= 0 {
        return false;
    }
    // SAFETY: pidfd_open takes a pid and flags; the result is a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, p, 0) } as libc::c_int;
    let exited = if fd >= 0 {
        // SAFETY: a new fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // A pidfd is readable once the process has exited (zombies included).
        // SAFETY: one valid pollfd, no wait.
        (unsafe { libc::poll(&mut pfd, 1, 0) }) > 0
    } else {
        match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::ESRCH) => return false,
            // No pidfd_open (before Linux 5.3): /proc says.
            _ => {
                !proc_is_ours()
                    || proc_stat(&pid.to_string()).is_none_or(|(s, _)| matches!(s, 'Z' | 'X'))
            }
        }
    };
    if exited {
        return false;
    }
    let known = STARTS.lock().as_ref().and_then(|m| m.get(&pid).copied());
    match known {
        Some(start) if proc_is_ours() => {
            proc_stat(&pid.to_string()).is_some_and(|(_, s)| s == start)
        }
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_reject_extra_fields() {
        let t = Token::own(-3, 0x6d73_0000_0000_0007, 2);
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
        while proc_stat(&pid.to_string()).is_some_and(|(s, _)| s != 'Z') {
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
