//! Control of a process by another process of the same user and group: pause and resume its
//! tags, run a profile stage in it, read its stats.
//!
//! This is the transport only, on the same runtime directory, sockets, credentials and wire as
//! the sharing of buffers between processes ([`crate::rundir`], [`crate::server`],
//! [`crate::client`], [`crate::protocol`]; docs/security.md): a control request is a
//! [`Request::Control`] frame sent to a process's socket in `<runtime dir>/g<group>/`,
//! admitted by the server's checks (this user, this pid namespace, the pid `SO_PEERCRED`
//! shows and its start time are the ones the request names, the addressee's identity, the
//! group) and routed here ([`crate::server::Service::Control`]). What each request does is the
//! business of libmemsaver.so's C ABI layer, which installs an [`Executor`].
//!
//! A process serves control requests only once it opted in ([`serve`]: `MEMSAVER_CONTROL=1`
//! when its allocator starts, a start hook of this module, or `memsaver.serve_control()`); a
//! process that only shares buffers refuses them.
//!
//! **Threads.** The server's workers never run an operation: they admit a request and hand the
//! connection to the one control thread, which runs the operations one at a time and answers.
//! A control pause of memory shared with peers (the `nccl` tag) holds the allocator's
//! transition lock and waits for the peers to let go of this process's buffers, which they
//! announce to the server's workers: those stay free, so the pause can complete. At most
//! [`QUEUED`] requests wait for the control thread; more are refused at once.
//!
//! A client addresses one process (by pid) or every process of a group; it talks to all of
//! them at once (a group-wide pause of `nccl` completes only when every rank pauses), each on
//! a thread of its own, and collects every answer.

use std::os::fd::AsFd;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::time::{Duration, Instant};

use memsaver_allocator::{Allocator, LayerError, StartHook};

use crate::error::{Error, Result};
use crate::identity::{self, Identity};
use crate::log::note;
use crate::protocol::{self, Reply, Request};
use crate::server::{self, Connection, Handler, Route, Service, WRITE_TIMEOUT};
use crate::{client, group, rundir};

pub use crate::protocol::Control;

/// Control requests waiting for the control thread; more are refused.
const QUEUED: usize = 8;

/// What an operation gave.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Done (pause, resume).
    Done,
    /// Done, with this result (stats, a stage's report).
    Json(String),
    /// Failed: a status code of the C ABI, and the message.
    Error { status: u16, message: String },
}

/// Runs one control request's operation for the process `from` (pid), in this process.
pub type Executor = fn(op: &Control, from: u32) -> Outcome;

static EXECUTOR: OnceLock<Executor> = OnceLock::new();
/// Whether this process opted in.
static SERVING: AtomicBool = AtomicBool::new(false);

/// Installs what runs control operations (libmemsaver.so's C ABI layer does, at load).
pub fn set_executor(f: Executor) {
    let _ = EXECUTOR.set(f);
}

/// Opts this process in: it serves control requests from now on, on its memsaver socket
/// (started now if it was not).
pub fn serve() -> Result<()> {
    SERVING.store(true, Ordering::SeqCst);
    server::ensure_server().map_err(|source| Error::CannotServe {
        doing: "cannot serve control requests (docs/security.md says what memsaver needs)",
        source,
    })
}

/// Whether this process serves control requests.
pub fn serving() -> bool {
    SERVING.load(Ordering::SeqCst)
}

/// At the allocator's start: serve control requests if `MEMSAVER_CONTROL=1` (once the process
/// holds memory, other processes can reach it).
#[linkme::distributed_slice(memsaver_allocator::START_HOOKS)]
static AT_START: StartHook = StartHook {
    name: "control",
    order: 10,
    run: on_start,
};

/// A process that was asked to serve control requests and cannot gives the reason: every
/// operation done for the application fails with it (`memsaver_allocator::global`), as with
/// an invalid option; the hooks that answer NCCL's driver calls go on.
fn on_start(_: &'static Allocator) -> Result<(), LayerError> {
    if !crate::options::get().control {
        return Ok(());
    }
    SERVING.store(true, Ordering::SeqCst);
    server::ensure_server().map_err(|source| {
        let e = Error::CannotServe {
            doing: "MEMSAVER_CONTROL=1 is set, but this process cannot serve control requests \
                    (or unset MEMSAVER_CONTROL)",
            source,
        };
        tracing::warn!("memsaver: {e}");
        e.into()
    })
}

struct Job {
    conn: Connection,
    from: u32,
    op: Control,
}

fn queue() -> Result<&'static SyncSender<Job>> {
    static QUEUE: OnceLock<std::result::Result<SyncSender<Job>, std::sync::Arc<std::io::Error>>> =
        OnceLock::new();
    QUEUE
        .get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::sync_channel::<Job>(QUEUED);
            std::thread::Builder::new()
                .name("memsaver-control".into())
                .spawn(move || {
                    for job in rx {
                        run(job);
                    }
                })
                .map(|_| tx)
                .map_err(std::sync::Arc::new)
        })
        .as_ref()
        .map_err(|source| Error::Thread {
            what: "the control thread",
            source: source.clone(),
        })
}

/// On the control thread: runs one job and answers.
fn run(job: Job) {
    let Job { conn, from, op } = job;
    tracing::info!(pid = from, "memsaver: control request: {}", describe(&op));
    let outcome = match EXECUTOR.get() {
        Some(f) => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&op, from)))
            .unwrap_or_else(|_| Outcome::Error {
                status: 99,
                message: "internal error in memsaver while serving a control request (a bug)"
                    .into(),
            }),
        None => Outcome::Error {
            status: 99,
            message: "this build of memsaver has no control operations".into(),
        },
    };
    let reply = match outcome {
        Outcome::Done => Reply::Done,
        Outcome::Json(text) => Reply::Json { text },
        Outcome::Error { status, message } => Reply::Error { status, message },
    };
    let mut body = reply.encode();
    if body.len() > protocol::MAX_FRAME {
        body = Reply::Error {
            status: 99,
            message: format!(
                "the answer has {} bytes, more than a frame holds",
                body.len()
            ),
        }
        .encode();
    }
    let deadline = Instant::now() + WRITE_TIMEOUT;
    if let Err(e) = protocol::write_frame(conn.as_fd(), &body, None, deadline) {
        // Through the server's log: this thread never waits on stderr.
        note(format!(
            "cannot answer a control request of process {from}: {e}"
        ));
    }
}

/// What `op` asks, for logs and messages.
pub fn describe(op: &Control) -> String {
    let list = |tags: &[String]| {
        if tags.is_empty() {
            "every tag".to_owned()
        } else {
            tags.join(", ")
        }
    };
    match op {
        Control::Pause { tags } => format!("pause {}", list(tags)),
        Control::Resume { tags } => format!("resume {}", list(tags)),
        Control::Stats => "stats".into(),
        Control::Run { source, stage, .. } => format!("run stage '{stage}' of {source}"),
    }
}

/// Control requests, routed here by the server.
struct Requests;

#[linkme::distributed_slice(server::ROUTES)]
static ROUTE: Route = Route {
    service: Service::Control,
    handler: &Requests,
};

impl Handler for Requests {
    /// On a server worker, once the request is admitted: hands it to the control thread, or
    /// refuses it.
    fn handle(&self, conn: Connection, request: Request) {
        let Request::Control { from, op, .. } = request else {
            return conn.refuse("not a control request");
        };
        if let Err((conn, reason)) = submit(conn, from.pid, op) {
            conn.refuse(&reason.to_string());
        }
    }
}

/// Hands a request to the control thread, or gives the reason to refuse it.
fn submit(conn: Connection, from: u32, op: Control) -> Result<(), (Connection, Error)> {
    let pid = std::process::id();
    if !serving() {
        return Err((conn, Error::NoControl { pid }));
    }
    let tx = match queue() {
        Ok(tx) => tx,
        Err(e) => return Err((conn, e)),
    };
    match tx.try_send(Job { conn, from, op }) {
        Ok(()) => Ok(()),
        Err(TrySendError::Full(j) | TrySendError::Disconnected(j)) => Err((
            j.conn,
            Error::ControlQueueFull {
                pid,
                queued: QUEUED,
            },
        )),
    }
}

// ---------------------------------------------------------------------------------------------
// The client.
// ---------------------------------------------------------------------------------------------

/// A process that serves a socket in a group's directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    pub pid: u32,
    pub group: i64,
    identity: Identity,
}

/// The live processes serving sockets in `group`'s directory (this process excluded).
fn in_group(group: i64) -> Result<Vec<Target>> {
    let dir = rundir::group_dir(&rundir::runtime_dir(), group).map_err(|source| Error::Io {
        what: format!("the directory of group {group}"),
        source,
    })?;
    let me = std::process::id();
    let mut out: Vec<Target> = dir
        .entries()
        .iter()
        .filter_map(|name| identity::parse_socket_name(name))
        .filter(|i| i.pid != me && identity::is_running(i))
        .map(|identity| Target {
            pid: identity.pid,
            group,
            identity,
        })
        .collect();
    out.sort_by_key(|t| t.pid);
    out.dedup_by_key(|t| t.pid);
    Ok(out)
}

/// The groups of the runtime directory in which process `pid` serves a socket.
fn groups_of(pid: u32) -> Vec<i64> {
    let mut groups = Vec::new();
    for g in rundir::group_names(&rundir::runtime_dir()) {
        if let Ok(t) = in_group(g)
            && t.iter().any(|t| t.pid == pid)
        {
            groups.push(g);
        }
    }
    groups
}

/// The processes a request is for: every live process serving `group` (this process's group
/// when `None`), or only `pid` among them. The group is never guessed: a pid that serves
/// another group is an error naming it.
pub fn targets(pid: Option<u32>, group: Option<i64>) -> Result<Vec<Target>> {
    let named = group.is_some();
    let group = group.unwrap_or_else(group::id);
    let all = in_group(group)?;
    let rt = rundir::runtime_dir();
    let Some(pid) = pid else {
        if all.is_empty() {
            return Err(Error::NoTarget(format!(
                "no process of group {group} serves {}/g{group}: are they running with this \
                 MEMSAVER_RUNTIME_DIR, and did they opt in (MEMSAVER_CONTROL=1 or \
                 memsaver.serve_control())?",
                rt.display()
            )));
        }
        return Ok(all);
    };
    if pid == std::process::id() {
        return Err(Error::NoTarget(format!(
            "process {pid} is this process: call memsaver.pause/resume/stats directly"
        )));
    }
    if let Some(t) = all.iter().find(|t| t.pid == pid) {
        return Ok(vec![*t]);
    }
    let elsewhere = groups_of(pid);
    let how = if named {
        format!("group {group} (as asked)")
    } else {
        format!("group {group} (this process's: MEMSAVER_GROUP, memsaver.set_group)")
    };
    Err(Error::NoTarget(match elsewhere.as_slice() {
        [] => format!(
            "process {pid} serves no memsaver socket in {}: it is not running, runs with \
             another MEMSAVER_RUNTIME_DIR or user, has not opted in (MEMSAVER_CONTROL=1 or \
             memsaver.serve_control()), or has not started memsaver yet",
            rt.display()
        ),
        gs => format!(
            "process {pid} is in group {}, not {how}: name its group (--group {} or group={})",
            gs[0], gs[0], gs[0]
        ),
    }))
}

/// Sends `op` to one target and waits up to `timeout` for the answer. `Err` when it was not
/// reached, refused the request or did not answer.
fn send(t: &Target, op: &Control, timeout: Duration) -> Result<Outcome> {
    let pid = t.pid;
    let stream = client::connect(t.group, &t.identity)?;
    let request = Request::Control {
        from: identity::me(),
        to: t.identity,
        group: t.group,
        op: op.clone(),
    };
    let sent_by = Instant::now() + WRITE_TIMEOUT;
    let wire = |what: String| Error::Wire { pid, what };
    protocol::write_frame(stream.as_fd(), &request.encode(), None, sent_by)
        .map_err(|e| wire(e.to_string()))?;
    let answered_by = Instant::now() + timeout;
    let (body, _) =
        protocol::read_frame(stream.as_fd(), answered_by).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => {
                wire("closed the connection without an answer (did it exit?)".into())
            }
            std::io::ErrorKind::TimedOut => wire(format!(
                "no answer within {:.0} s (it may still complete the request)",
                timeout.as_secs_f64()
            )),
            _ => wire(e.to_string()),
        })?;
    match Reply::decode(&body) {
        Ok(Reply::Done) => Ok(Outcome::Done),
        Ok(Reply::Json { text }) => Ok(Outcome::Json(text)),
        Ok(Reply::Error { status, message }) => Ok(Outcome::Error { status, message }),
        Ok(Reply::Refused { reason }) => Err(Error::Refused { pid, reason }),
        Ok(r) => Err(wire(format!("answered {r:?}"))),
        Err(e) => Err(wire(format!("sent {e}"))),
    }
}

/// Sends `op` to every target at once; every answer, in the order of `targets`.
pub fn send_all(
    targets: &[Target],
    op: &Control,
    timeout: Duration,
) -> Result<Vec<Result<Outcome>>> {
    op.check()?;
    let out = std::thread::scope(|s| {
        let handles: Vec<_> = targets
            .iter()
            .map(|t| s.spawn(move || send(t, op, timeout)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or(Err(Error::Panicked {
                    what: "sending a control request",
                }))
            })
            .collect()
    });
    Ok(out)
}
