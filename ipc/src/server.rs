//! A process's server: what it answers on its memsaver socket,
//! `<runtime dir>/g<group>/<pid>-<start>-<nonce>.sock`. It is started once ([`ensure_server`]),
//! by the first layer that needs it: an owner before it hands out its first token, the control
//! service when the process opts in to control requests.
//!
//! **Threads.** One thread (`memsaver-server`) accepts connections and reads every request
//! itself, from non-blocking sockets with `poll`: at most [`READING`] connections at a time
//! (more wait in the listener's backlog), each with one deadline ([`REQUEST_TIMEOUT`]) for its
//! whole request, however its bytes arrive. A connection that has not sent a whole request by
//! then is closed, so a client that trickles bytes occupies a slot of that thread for at most
//! that long, and never a worker. A request that came with an fd is refused at the first one
//! (the read gives the kernel no room for fds: none is ever installed here). Only whole
//! requests go to the [`WORKERS`] worker threads (at most [`QUEUED`] wait; more are refused at
//! once, "retry later"), which decode, admit and route them, each write within its deadline.
//!
//! **Admission** ([`admit`]): a request is served only when its sender is a process of this
//! user (checked at accept) in this pid namespace (`/proc/<pid>/ns/pid` of the pid
//! `SO_PEERCRED` gives, against our own), that names itself as it is here (that pid, and its
//! start time), addresses this very process and names its group. A refusal says which
//! boundary the request crossed, never what this process sees of the sender (its pid or
//! start time here): a process of another namespace learns nothing to resend. What a request
//! asks is the business of the handler it is routed to (an import must also carry each
//! buffer's key, which only its token gives).
//!
//! **Routing.** The server knows no user by name: each [`Service`] of the protocol is answered
//! by the [`Handler`] that a layer above adds to [`ROUTES`] (a list the linker assembles, so a
//! handler is there before any request can come): the buffers a process exports (nccl-hook,
//! for NCCL's buffers) and control requests ([`crate::control`]). A service nobody handles is
//! answered as by a process that exports nothing, or refused.
//!
//! **Logging.** Nothing here writes to stderr: see [`crate::log`].

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use nix::sys::socket::{getsockopt, sockopt};
use parking_lot::Mutex;

use crate::group;
use crate::identity::{self, Identity, Namespace, same_pid_namespace};
use crate::log::note;
use crate::protocol::{self, FrameReader, Reply, Request};
use crate::rundir::{self, Dir};

/// Worker threads that answer whole requests, per process.
pub const WORKERS: usize = 4;
/// Whole requests waiting for a worker; more are refused at once.
pub const QUEUED: usize = 64;
/// The refusal of a request that arrived while [`QUEUED`] others wait.
pub use crate::error::BUSY;
/// Connections whose request is being read; more wait in the listener's backlog.
pub const READING: usize = 64;
/// How long a connection has to send its whole request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a client has to take an answer that does not wait for anything (a refusal,
/// `Done`, a control request's answer).
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// The services of the protocol, each answered by one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Service {
    /// The buffers this process exports: [`Request::Import`], [`Request::Released`] and
    /// [`Request::PauseFailed`].
    Buffers,
    /// [`Request::Control`]: this process's allocator, run for another process.
    Control,
    /// [`Request::Shared`]: allocations shared through CUDA IPC handles ([`crate::shared`]),
    /// their opens and closes (as owner) and their release and rebuild (as importer).
    Shared,
}

impl Service {
    /// The service a request is for.
    pub fn of(request: &Request) -> Self {
        match request {
            Request::Import { .. } | Request::Released { .. } | Request::PauseFailed { .. } => {
                Self::Buffers
            }
            Request::Control { .. } => Self::Control,
            Request::Shared { .. } => Self::Shared,
        }
    }
}

/// Answers the admitted requests of one service.
pub trait Handler: Sync {
    /// Answers `request` on `conn`. The request is admitted (its sender is a process of this
    /// user and pid namespace, who it says it is; it names this process and its group). Runs
    /// on one of the server's [`WORKERS`]: a handler that must wait long (an operation of the
    /// allocator) hands the connection to a thread of its own.
    fn handle(&self, conn: Connection, request: Request);
}

/// A service and its handler.
pub struct Route {
    pub service: Service,
    pub handler: &'static dyn Handler,
}

/// The handlers of this process's server, one per service (a second one is ignored), added
/// by the layers above with `#[linkme::distributed_slice(memsaver_ipc::server::ROUTES)]`.
#[linkme::distributed_slice]
pub static ROUTES: [Route];

fn handler_of(service: Service) -> Option<&'static dyn Handler> {
    ROUTES
        .iter()
        .find(|r| r.service == service)
        .map(|r| r.handler)
}

/// An admitted request's connection: the handler answers on it.
pub struct Connection {
    stream: UnixStream,
    /// The sender's pid as `SO_PEERCRED` gave it at accept.
    cred_pid: u32,
}

impl Connection {
    /// Sends `reply`, with `fd` attached if given, by `deadline`.
    pub fn send(
        &self,
        reply: &Reply,
        fd: Option<BorrowedFd<'_>>,
        deadline: Instant,
    ) -> std::io::Result<()> {
        protocol::write_frame(self.stream.as_fd(), &reply.encode(), fd, deadline)
    }

    /// Answers `Refused` with `reason` (within [`WRITE_TIMEOUT`]) and notes it for the log.
    pub fn refuse(&self, reason: &str) {
        refuse(&self.stream, self.cred_pid, reason);
    }
}

impl AsFd for Connection {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.stream.as_fd()
    }
}

/// The peer's (uid, pid) as this process sees them; pid 0 for a process outside this pid
/// namespace.
pub fn peer_cred(s: &UnixStream) -> std::io::Result<(u32, u32)> {
    let c = getsockopt(s, sockopt::PeerCredentials).map_err(std::io::Error::from)?;
    Ok((c.uid(), u32::try_from(c.pid()).unwrap_or(0)))
}

/// This process's entries in its group's directory (the socket, the epoch file), removed at
/// exit, and the pid that made them (a child forked since does not remove them).
static SERVING: OnceLock<(Dir, Vec<String>, u32)> = OnceLock::new();

extern "C" fn remove_own_entries() {
    if let Some((dir, names, pid)) = SERVING.get()
        && *pid == std::process::id()
    {
        for name in names {
            dir.remove(name);
        }
    }
}

/// Starts this process's server (once), in its group's directory, which fixes the group
/// ([`group::fix`]). Later calls give the first one's result.
pub fn ensure_server() -> Result<(), Arc<std::io::Error>> {
    static STARTED: OnceLock<Result<(), Arc<std::io::Error>>> = OnceLock::new();
    STARTED
        .get_or_init(|| {
            let group = group::try_fix().map_err(std::io::Error::other)?;
            let dir = rundir::group_dir(&rundir::runtime_dir(), group)?;
            let me = identity::me();
            let name = identity::socket_name(&me);
            // bind creates the socket exclusively (EADDRINUSE if the name exists): never
            // another process's socket removed or taken over.
            let listener = UnixListener::bind(dir.entry(&name)).map_err(|e| {
                std::io::Error::new(e.kind(), format!("{}/{name}: {e}", dir.path().display()))
            })?;
            let mut names = vec![name];
            // Without it, this process's importers cannot see its pauses and resumes for
            // themselves: they follow them only in pauses and resumes of their own.
            match crate::epoch::create(&dir, &me) {
                Ok(page) => names.push(page),
                Err(e) => tracing::warn!(
                    "memsaver: cannot make this process's epoch file in {}: {e}",
                    dir.path().display()
                ),
            }
            let _ = SERVING.set((dir, names, me.pid));
            // SAFETY: registers a plain extern "C" function without arguments.
            unsafe { libc::atexit(remove_own_entries) };
            start(listener, group, me).map_err(Arc::new)
        })
        .clone()
}

/// A whole request, read, for a worker.
struct Arrived {
    stream: UnixStream,
    /// The sender's pid as `SO_PEERCRED` gave it at accept (0: not in this pid namespace).
    cred_pid: u32,
    body: Vec<u8>,
}

/// A connection whose request is being read.
struct Reading {
    stream: UnixStream,
    cred_pid: u32,
    frame: FrameReader,
    deadline: Instant,
}

/// Serves `listener` from now on: the reading thread and the workers.
fn start(listener: UnixListener, group: i64, me: Identity) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    let (tx, rx): (SyncSender<Arrived>, Receiver<Arrived>) = std::sync::mpsc::sync_channel(QUEUED);
    let rx = Arc::new(Mutex::new(rx));
    for n in 0..WORKERS {
        let rx = rx.clone();
        std::thread::Builder::new()
            .name(format!("memsaver-server-{n}"))
            .spawn(move || {
                loop {
                    let arrived = rx.lock().recv();
                    match arrived {
                        Ok(a) => serve(a, group, me),
                        Err(_) => return,
                    }
                }
            })?;
    }
    std::thread::Builder::new()
        .name("memsaver-server".into())
        .spawn(move || read_requests(&listener, &tx))?;
    Ok(())
}

/// The reading thread: accepts connections and reads their requests, handing whole ones to
/// the workers.
fn read_requests(listener: &UnixListener, tx: &SyncSender<Arrived>) {
    let mut reading: Vec<Reading> = Vec::new();
    loop {
        let now = Instant::now();
        reading.retain(|c| {
            let in_time = c.deadline > now;
            if !in_time {
                note(format!(
                    "refused a peer's connection (pid {}): no whole request within {} s",
                    c.cred_pid,
                    REQUEST_TIMEOUT.as_secs()
                ));
            }
            in_time
        });
        // The listener only while there is room: further connections wait in its backlog.
        let room = reading.len() < READING;
        let mut polled: Vec<libc::pollfd> =
            std::iter::once(if room { listener.as_raw_fd() } else { -1 })
                .chain(reading.iter().map(|c| c.stream.as_raw_fd()))
                .map(|fd| libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                })
                .collect();
        // Until the first deadline (rounded up, so that it has passed when poll returns).
        let wait_ms = reading.iter().map(|c| c.deadline).min().map_or(-1, |d| {
            let ms = d.saturating_duration_since(now).as_micros().div_ceil(1000);
            libc::c_int::try_from(ms).unwrap_or(libc::c_int::MAX)
        });
        // SAFETY: `polled` is an array of valid pollfds of its length.
        let n = unsafe { libc::poll(polled.as_mut_ptr(), polled.len() as libc::nfds_t, wait_ms) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                std::thread::sleep(Duration::from_millis(10)); // do not spin
            }
            continue;
        }
        // From the end, so that `swap_remove` only moves connections already looked at.
        for i in (0..reading.len()).rev() {
            if polled[i + 1].revents == 0 {
                continue;
            }
            let c = &mut reading[i];
            match c.frame.advance(c.stream.as_fd(), None) {
                Ok(None) => {}
                Ok(Some((body, _))) => hand_over(tx, reading.swap_remove(i), body),
                Err(e) => {
                    let c = reading.swap_remove(i);
                    if e.kind() != std::io::ErrorKind::UnexpectedEof {
                        refuse(&c.stream, c.cred_pid, &format!("a malformed request: {e}"));
                    }
                }
            }
        }
        if polled[0].revents != 0 {
            accept_all(listener, &mut reading);
        }
    }
}

/// Accepts waiting connections (this user's) while fewer than [`READING`] are being read; the
/// others stay in the listener's backlog.
fn accept_all(listener: &UnixListener, reading: &mut Vec<Reading>) {
    while reading.len() < READING {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
            Err(_) => {
                // Out of fds and the like: do not spin.
                std::thread::sleep(Duration::from_millis(10));
                return;
            }
        };
        let Ok((uid, cred_pid)) = peer_cred(&stream) else {
            continue;
        };
        if uid != rundir::euid() {
            note(format!(
                "refused a connection from another user (uid {uid})"
            ));
            continue;
        }
        if stream.set_nonblocking(true).is_ok() {
            reading.push(Reading {
                stream,
                cred_pid,
                frame: FrameReader::new(0),
                deadline: Instant::now() + REQUEST_TIMEOUT,
            });
        }
    }
}

/// Gives a whole request to the workers, or refuses it when [`QUEUED`] are waiting.
fn hand_over(tx: &SyncSender<Arrived>, c: Reading, body: Vec<u8>) {
    if c.stream.set_nonblocking(false).is_err() {
        return;
    }
    let arrived = Arrived {
        stream: c.stream,
        cred_pid: c.cred_pid,
        body,
    };
    if let Err(TrySendError::Full(a) | TrySendError::Disconnected(a)) = tx.try_send(arrived) {
        // Never wait on this thread: the refusal fits in the socket's buffer or is dropped.
        let _ = a.stream.set_nonblocking(true);
        refuse(&a.stream, a.cred_pid, BUSY);
    }
}

/// Answers `Refused` with `reason` (within [`WRITE_TIMEOUT`]) and notes it for the log.
fn refuse(stream: &UnixStream, cred_pid: u32, reason: &str) {
    note(format!(
        "refused a peer's request (pid {cred_pid}): {reason}"
    ));
    let reply = Reply::Refused {
        reason: reason.to_owned(),
    };
    let _ = protocol::write_frame(
        stream.as_fd(),
        &reply.encode(),
        None,
        Instant::now() + WRITE_TIMEOUT,
    );
}

/// Why a request is not admitted: `reason` goes to the sender, `detail` only to our log.
struct Refusal {
    reason: String,
    detail: String,
}

/// Checks a request's sender and addressee (see the module doc).
fn admit(
    from: &Identity,
    to: &Identity,
    group: i64,
    me: Identity,
    my_group: i64,
    cred_pid: u32,
) -> Result<(), Refusal> {
    // One reason for every way a sender can fail to be who it says: none tells it what to
    // claim instead.
    let not_who = |detail: String| Refusal {
        reason: "memsaver serves only processes of its own user and pid namespace (container), \
                 each naming itself as it is: this request's sender is not one"
            .to_owned(),
        detail,
    };
    if cred_pid == 0 {
        return Err(not_who("the sender is outside this pid namespace".into()));
    }
    if let Err(why) = same_pid_namespace(cred_pid) {
        return match why {
            Namespace::Unknown(reason) => Err(Refusal {
                reason: reason.clone(),
                detail: reason,
            }),
            Namespace::Other => Err(not_who(format!(
                "pid {cred_pid} here is in another pid namespace"
            ))),
        };
    }
    let start = identity::start_of(cred_pid);
    if cred_pid != from.pid || start != Some(from.start) {
        return Err(not_who(format!(
            "it says it is pid {} started at {}; it is pid {cred_pid} started at {start:?}",
            from.pid, from.start
        )));
    }
    if *to != me {
        return Err(Refusal {
            reason: "the request is addressed to another process: the socket's name says which \
                     process it is"
                .to_owned(),
            detail: format!("addressed to {to:?}"),
        });
    }
    if group != my_group {
        let reason = format!(
            "process {} of group {group} asked for buffers of group {my_group}: groups do not \
             share memory (MEMSAVER_GROUP, memsaver.set_group, ncclSetGroupID)",
            from.pid
        );
        return Err(Refusal {
            detail: reason.clone(),
            reason,
        });
    }
    Ok(())
}

/// On a worker: one whole request, answered.
fn serve(a: Arrived, my_group: i64, me: Identity) {
    let Arrived {
        stream,
        cred_pid,
        body,
    } = a;
    let request = match Request::decode(&body) {
        Ok(r) => r,
        Err(e) => return refuse(&stream, cred_pid, &format!("a malformed request: {e}")),
    };
    let (from, to, group) = request.head();
    if let Err(r) = admit(from, to, group, me, my_group, cred_pid) {
        note(format!(
            "refused a peer's request (pid {cred_pid}): {}",
            r.detail
        ));
        let reply = Reply::Refused { reason: r.reason };
        let _ = protocol::write_frame(
            stream.as_fd(),
            &reply.encode(),
            None,
            Instant::now() + WRITE_TIMEOUT,
        );
        return;
    }
    if let Request::Import { from, .. }
    | Request::Released { from, .. }
    | Request::PauseFailed { from, .. }
    | Request::Shared { from, .. } = &request
    {
        identity::remember_start(from.pid, from.start);
    }
    let conn = Connection { stream, cred_pid };
    let service = Service::of(&request);
    match (handler_of(service), request) {
        (Some(h), request) => h.handle(conn, request),
        // A process that exports nothing: no buffer is named with its key, none is imported.
        (None, Request::Import { .. }) => conn.refuse(NO_BUFFER),
        (None, Request::Released { .. } | Request::PauseFailed { .. }) => {
            let _ = conn.send(&Reply::Done, None, Instant::now() + WRITE_TIMEOUT);
        }
        (None, Request::Control { .. }) => {
            conn.refuse("this build of memsaver serves no control requests");
        }
        (None, Request::Shared { .. }) => conn.refuse(NO_BUFFER),
    }
}

/// The refusal of an import that names a buffer the owner does not have (or not with that
/// key): it says nothing of which buffer or which part of it was wrong.
pub const NO_BUFFER: &str = "the request names a buffer this process does not have, or not \
                             with that key (only a process given the buffer's token can name it)";
