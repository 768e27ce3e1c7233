//! The client: a process talking to another process's server ([`crate::server`]).
//!
//! [`connect`] talks only to a server of this user and pid namespace whose pid and start time
//! are the ones the caller expects (`SO_PEERCRED`, `/proc/<pid>/stat`); everything sent and
//! read goes through [`crate::protocol`], each exchange by one deadline.
//!
//! The importer's side of exported buffers: [`import`] trades a token ([`crate::token`]) for
//! the buffer's fd with its owner, [`request_fds`] asks an owner again for buffers this
//! process imported from it (a new generation, after the owner re-created them) and
//! [`notify_released`] tells an owner that this process let go of its imports. Each of them
//! takes `wait`, how long the owner itself may wait for a buffer still being restored (it
//! answers `NotReady` after that).

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::group;
use crate::identity::{self, Identity, Namespace, same_pid_namespace};
use crate::protocol::{self, Buffer, MAX_BUFFERS, Reply, Request};
use crate::rundir;
use crate::server::{self, peer_cred};
use crate::token::Token;

/// How long a client waits to hand over a request (and, on top of the owner's own wait, for
/// its answers).
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// Connects to the server of `owner` in `group`'s directory and checks who answers: a process
/// of this user, in this pid namespace, whose pid and start time are the owner's.
pub fn connect(group: i64, owner: &Identity) -> Result<UnixStream> {
    let dir = rundir::group_dir(&rundir::runtime_dir(), group)
        .map_err(|e| Error::Other(e.to_string()))?;
    let name = identity::socket_name(owner);
    let shown = || format!("{}/{name}", dir.path().display());
    let stream = loop {
        match UnixStream::connect(dir.entry(&name)) {
            Ok(s) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(source) => {
                return Err(Error::NotServed {
                    pid: owner.pid,
                    path: shown(),
                    source,
                });
            }
        }
    };
    let (uid, pid) = peer_cred(&stream).map_err(|e| Error::Other(format!("{}: {e}", shown())))?;
    if uid != rundir::euid() {
        return Err(Error::NotThatProcess(format!(
            "{} is served by uid {uid}, not this user ({}): refused",
            shown(),
            rundir::euid()
        )));
    }
    let namespace = match same_pid_namespace(pid) {
        Ok(()) if pid != 0 => None,
        Ok(()) | Err(Namespace::Other) => Some(
            "it runs in another pid namespace (container); memsaver shares memory and control \
             only within one"
                .to_owned(),
        ),
        Err(Namespace::Unknown(why)) => Some(why),
    };
    if let Some(why) = namespace {
        return Err(Error::NotThatProcess(format!(
            "{} is not served by process {} of this pid namespace: {why}",
            shown(),
            owner.pid
        )));
    }
    if pid != owner.pid || identity::start_of(pid) != Some(owner.start) {
        return Err(Error::NotThatProcess(format!(
            "{} is served by another process than process {} (started at {}) that the token \
             or socket names: refused",
            shown(),
            owner.pid,
            owner.start
        )));
    }
    Ok(stream)
}

/// The owners this process imports from: pid -> identity, learnt from their tokens.
static OWNERS: Mutex<Option<HashMap<u32, Identity>>> = Mutex::new(None);

pub(crate) fn owner_identity(pid: u32) -> Result<Identity> {
    OWNERS
        .lock()
        .as_ref()
        .and_then(|m| m.get(&pid).copied())
        .ok_or_else(|| Error::Other(format!("process {pid}: this process has no token of it")))
}

/// Records `t`'s owner as the process behind its pid. Refused while this process still holds
/// imports of another process with that pid (`holds_imports_of(pid)`: a reused pid, or a
/// process of another pid namespace; either way not the owner those imports came from).
fn bind_owner(t: &Token, holds_imports_of: impl FnOnce(u32) -> bool) -> Result<()> {
    let id = t.owner();
    let known = OWNERS.lock().as_ref().and_then(|m| m.get(&t.pid).copied());
    if let Some(old) = known.filter(|old| *old != id)
        && holds_imports_of(t.pid)
    {
        return Err(Error::NotThatProcess(format!(
            "the token names process {} started at {} (nonce {:016x}), but this process \
             holds imports of another process {} (started at {}, nonce {:016x}): the pid \
             was reused or belongs to another pid namespace (container); memsaver shares \
             memory only between processes of one pid namespace",
            t.pid, t.start, t.nonce, old.pid, old.start, old.nonce
        )));
    }
    OWNERS
        .lock()
        .get_or_insert_with(HashMap::new)
        .insert(t.pid, id);
    identity::remember_start(t.pid, t.start);
    Ok(())
}

/// Sends `request` (at most [`MAX_BUFFERS`] buffers) to `owner` and reads `n` replies, all by
/// one deadline: the owner's own `wait` for buffers still being restored, and [`IO_TIMEOUT`].
/// An owner too busy to admit the request ([`server::BUSY`]) is asked again, with backoff,
/// until that deadline.
pub fn exchange(
    group: i64,
    owner: &Identity,
    request: Request,
    n: usize,
    wait: Duration,
) -> Result<Vec<(Reply, Option<OwnedFd>)>> {
    let until = Instant::now() + wait + IO_TIMEOUT;
    let mut pause = Duration::from_millis(1);
    loop {
        match exchange_once(group, owner, &request, n, wait) {
            Ok(replies) => return Ok(replies),
            Err(Error::Busy { .. }) if Instant::now() + pause < until => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(100));
            }
            Err(e) => return Err(e),
        }
    }
}

/// One try of [`exchange`].
fn exchange_once(
    group: i64,
    owner: &Identity,
    request: &Request,
    n: usize,
    wait: Duration,
) -> Result<Vec<(Reply, Option<OwnedFd>)>> {
    let stream = connect(group, owner)?;
    let pid = owner.pid;
    let wire = |what: String| Error::Wire { pid, what };
    let sent_by = Instant::now() + IO_TIMEOUT;
    protocol::write_frame(stream.as_fd(), &request.encode(), None, sent_by)
        .map_err(|e| wire(e.to_string()))?;
    let answered_by = Instant::now() + wait + IO_TIMEOUT;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let (body, fd) =
            protocol::read_frame(stream.as_fd(), answered_by).map_err(|e| match e.kind() {
                std::io::ErrorKind::UnexpectedEof => {
                    wire("closed the connection (did it exit?)".into())
                }
                _ => wire(e.to_string()),
            })?;
        match Reply::decode(&body) {
            Ok(Reply::Refused { reason }) if reason == server::BUSY && out.is_empty() => {
                return Err(Error::Busy { pid });
            }
            Ok(Reply::Refused { reason }) => return Err(Error::Refused { pid, reason }),
            Ok(r) => out.push((r, fd)),
            Err(e) => return Err(wire(format!("sent {e}"))),
        }
    }
    Ok(out)
}

/// A buffer an owner served: the fd of its memory, the generation it is, and where the buffer
/// lies in that memory ([`Reply::Export`]).
#[derive(Debug)]
pub struct Served {
    pub fd: OwnedFd,
    pub generation: u64,
    pub offset: u64,
    /// The size of the memory the fd is.
    pub size: u64,
}

/// The fds of the buffers `wants` of `owner`, with the generation each one is.
fn fetch(group: i64, owner: &Identity, wants: &[Buffer], wait: Duration) -> Result<Vec<Served>> {
    let pid = owner.pid;
    let mut out = Vec::with_capacity(wants.len());
    for chunk in wants.chunks(MAX_BUFFERS) {
        let request = Request::Import {
            from: identity::me(),
            to: *owner,
            group,
            buffers: chunk.to_vec(),
        };
        for ((reply, fd), want) in exchange(group, owner, request, chunk.len(), wait)?
            .into_iter()
            .zip(chunk)
        {
            let id = want.id;
            out.push(match (reply, fd) {
                (
                    Reply::Export {
                        id: got,
                        generation,
                        offset,
                        size,
                    },
                    Some(fd),
                ) if got == id => Served {
                    fd,
                    generation,
                    offset,
                    size,
                },
                (Reply::NotReady { .. }, _) => {
                    return Err(Error::Other(format!(
                        "process {pid} did not restore buffer {id:#x} (generation {}) within {} \
                         ms; every process of the group must resume that memory too",
                        want.generation,
                        wait.as_millis()
                    )));
                }
                (Reply::Failed { .. }, _) => {
                    return Err(Error::Other(format!(
                        "process {pid} could not export buffer {id:#x} (its driver failed, or \
                         the buffer was freed there)"
                    )));
                }
                (r, _) => {
                    return Err(Error::Wire {
                        pid,
                        what: format!("answered {r:?} for buffer {id:#x}"),
                    });
                }
            });
        }
    }
    Ok(out)
}

/// The import of token `t`: checks its group (and fixes this process's, [`group::fix`]) and
/// its owner (`holds_imports_of`: see [`bind_owner`]), then the buffer's fd and its generation.
pub fn import(
    t: &Token,
    wait: Duration,
    holds_imports_of: impl FnOnce(u32) -> bool,
) -> Result<Served> {
    let mine = group::try_fix().map_err(Error::Option)?;
    if t.group != mine {
        return Err(Error::OtherGroup {
            pid: t.pid,
            theirs: t.group,
            mine,
        });
    }
    bind_owner(t, holds_imports_of)?;
    let want = Buffer {
        id: t.buffer,
        key: t.key,
        generation: t.generation,
    };
    fetch(t.group, &t.owner(), &[want], wait)?
        .pop()
        .ok_or_else(|| Error::Wire {
            pid: t.pid,
            what: "no answer".into(),
        })
}

/// The fds of buffers `wants` of `owner` (each at least the generation given), with the
/// generation each one is.
pub fn request_fds(
    group: i64,
    owner: u32,
    wants: &[Buffer],
    wait: Duration,
) -> Result<Vec<Served>> {
    fetch(group, &owner_identity(owner)?, wants, wait)
}

/// Tells `owner` that this process released its imports of `buffers`.
pub fn notify_released(group: i64, owner: u32, buffers: &[Buffer], wait: Duration) -> Result<()> {
    let owner = owner_identity(owner)?;
    for chunk in buffers.chunks(MAX_BUFFERS) {
        let request = Request::Released {
            from: identity::me(),
            to: owner,
            group,
            buffers: chunk.to_vec(),
        };
        exchange(group, &owner, request, 1, wait)?;
    }
    Ok(())
}
