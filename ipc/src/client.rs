//! The client: a process talking to another process's server ([`crate::server`]).
//!
//! [`connect`] talks only to a server of this user and pid namespace whose pid and start time
//! are the ones the caller expects (`SO_PEERCRED`, `/proc/<pid>/stat`); everything sent and
//! read goes through [`crate::protocol`], each exchange by one deadline.
//!
//! What an importer asks of owners with it is [`crate::shared::requests`].

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::identity::{self, Identity, Namespace, same_pid_namespace};
use crate::protocol::{self, Reply, Request};
use crate::rundir;
use crate::server::{self, peer_cred};

/// How long a client waits to hand over a request (and, on top of the owner's own wait, for
/// its answers).
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// Connects to the server of `owner` in `group`'s directory and checks who answers: a process
/// of this user, in this pid namespace, whose pid and start time are the owner's.
pub fn connect(group: i64, owner: &Identity) -> Result<UnixStream> {
    let dir = rundir::group_dir(&rundir::runtime_dir(), group).map_err(|source| Error::Io {
        what: format!("the directory of group {group}"),
        source,
    })?;
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
    let (uid, pid) = peer_cred(&stream).map_err(|source| Error::Io {
        what: shown(),
        source,
    })?;
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

/// One reply of an owner, with the fd that came with it.
pub type Answered = (Reply, Option<OwnedFd>);

/// Sends `request` (at most [`MAX_BUFFERS`](crate::protocol::MAX_BUFFERS) buffers) to `owner` and
/// reads `n` replies, all by one deadline: the owner's own `wait` for buffers still being restored,
/// and [`IO_TIMEOUT`]. An owner too busy to admit the request ([`server::BUSY`]) is asked again,
/// with backoff, until that deadline.
pub fn exchange(
    group: i64,
    owner: &Identity,
    request: Request,
    n: usize,
    wait: Duration,
) -> Result<Vec<Answered>> {
    match exchange_read(group, owner, &request, n, wait) {
        (replies, None) => Ok(replies),
        (_, Some(e)) => Err(e),
    }
}

/// [`exchange`], keeping what was read before a failure: the replies, in order, and the
/// failure (`None`: all `n` were read). An owner records what it served as delivered once it
/// is written, so an importer whose exchange failed still learns what the owner thinks it
/// holds.
pub(crate) fn exchange_read(
    group: i64,
    owner: &Identity,
    request: &Request,
    n: usize,
    wait: Duration,
) -> (Vec<Answered>, Option<Error>) {
    let until = Instant::now() + wait + IO_TIMEOUT;
    let mut pause = Duration::from_millis(1);
    loop {
        let mut out = Vec::with_capacity(n);
        match read_replies(group, owner, request, n, wait, &mut out) {
            // Busy is only ever the first answer: nothing was read.
            Err(Error::Busy { .. }) if Instant::now() + pause < until => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(100));
            }
            done => return (out, done.err()),
        }
    }
}

/// Sends `request` and reads up to `n` replies into `out`, up to the first failure.
fn read_replies(
    group: i64,
    owner: &Identity,
    request: &Request,
    n: usize,
    wait: Duration,
    out: &mut Vec<Answered>,
) -> Result<()> {
    let stream = connect(group, owner)?;
    let pid = owner.pid;
    let wire = |what: String| Error::Wire { pid, what };
    let sent_by = Instant::now() + IO_TIMEOUT;
    protocol::write_frame(stream.as_fd(), &request.encode(), None, sent_by)
        .map_err(|e| wire(e.to_string()))?;
    let answered_by = Instant::now() + wait + IO_TIMEOUT;
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
    Ok(())
}
