//! The owner's server: what a process answers on its memsaver socket (`peer` starts it before
//! it hands out its first token, `control` when it opts in to control requests).
//!
//! **Threads.** One thread (`memsaver-nccl`) accepts connections and reads every request
//! itself, from non-blocking sockets with `poll`: at most [`READING`] connections at a time
//! (more wait in the listener's backlog), each with one deadline ([`REQUEST_TIMEOUT`]) for its
//! whole request, however its bytes arrive. A connection that has not sent a whole request by then is closed, so a client that
//! trickles bytes occupies a slot of that thread for at most that long, and never a worker. A
//! request that came with an fd is refused at the first one (the read gives the kernel no room
//! for fds: none is ever installed here). Only whole requests go to the [`WORKERS`] worker
//! threads (at most [`QUEUED`] wait; more are refused at once, "retry later"), which decode,
//! admit and answer them, each write within its deadline.
//!
//! **Admission** ([`admit`]): a request is served only when its sender is a process of this
//! user (checked at accept) in this pid namespace (`/proc/<pid>/ns/pid` of the pid
//! `SO_PEERCRED` gives, against our own), that names itself as it is here (that pid, and its
//! start time), addresses this very process and names its group. A refusal says which
//! boundary the request crossed, never what this process sees of the sender (its pid or
//! start time here): a process of another namespace learns nothing to resend. An `Fds` item
//! must also carry the buffer's key, which only its token gives.
//!
//! **Logging.** Nothing here writes to stderr: lines go to a bounded queue ([`note`]) read by
//! one logging thread, which writes at most one line per [`LOG_INTERVAL`] and counts the rest
//! (and those dropped because the queue was full). A full stderr (a pipe nobody reads) stops
//! only that thread.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use memsaver_allocator::driver::Handle;

use crate::peer::{self, peer_cred, same_pid_namespace};
use crate::protocol::{self, FrameReader, Identity, Item, Reply, Request};
use crate::{registry, rundir};

/// Worker threads that answer whole requests, per owner process.
pub(crate) const WORKERS: usize = 4;
/// Whole requests waiting for a worker; more are refused at once.
pub(crate) const QUEUED: usize = 64;
/// Connections whose request is being read; more wait in the listener's backlog.
pub(crate) const READING: usize = 64;
/// How long a connection has to send its whole request.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a client has to take an answer that does not wait for anything (a refusal,
/// `Done`, a control request's answer).
pub(crate) const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// At most one line of the server's log per interval.
const LOG_INTERVAL: Duration = Duration::from_secs(1);
/// Lines waiting for the logging thread; more are counted, not kept.
const LOG_QUEUE: usize = 64;

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
pub(crate) fn start(listener: UnixListener, group: i64, me: Identity) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    let (tx, rx): (SyncSender<Arrived>, Receiver<Arrived>) = std::sync::mpsc::sync_channel(QUEUED);
    let rx = Arc::new(Mutex::new(rx));
    for n in 0..WORKERS {
        let rx = rx.clone();
        std::thread::Builder::new()
            .name(format!("memsaver-nccl-{n}"))
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
        .name("memsaver-nccl".into())
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
        let reason = format!("{QUEUED} requests are waiting for this process already: retry later");
        refuse(&a.stream, a.cred_pid, &reason);
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
            peer::Namespace::Unknown(reason) => Err(Refusal {
                reason: reason.clone(),
                detail: reason,
            }),
            peer::Namespace::Other => Err(not_who(format!(
                "pid {cred_pid} here is in another pid namespace"
            ))),
        };
    }
    let start = peer::start_of(cred_pid);
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
             share NCCL memory (MEMSAVER_GROUP, memsaver.set_group, ncclSetGroupID)",
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
    match request {
        Request::Fds { from, items, .. } => {
            peer::remember_start(from.pid, from.start);
            let _ = answer(&stream, from.pid, cred_pid, &items);
        }
        Request::Released { from, items, .. } => {
            peer::remember_start(from.pid, from.start);
            let mut reg = registry::lock();
            for i in &items {
                if let Some(p) = reg.physicals.get_mut(&i.vh)
                    && names(p, i)
                    && p.generation == i.generation
                {
                    p.importers.remove(&from.pid);
                }
            }
            drop(reg);
            let deadline = Instant::now() + WRITE_TIMEOUT;
            let _ = protocol::write_frame(stream.as_fd(), &Reply::Done.encode(), None, deadline);
        }
        // Run on the control thread, never on this worker (see `control`).
        Request::Control { from, op, .. } => {
            if let Err((stream, reason)) = crate::control::submit(stream, from.pid, op) {
                refuse(&stream, cred_pid, &reason);
            }
        }
    }
}

/// Whether item `i` names buffer `p`: `p` was exported with a token, whose key `i` carries.
/// The keys are compared without branching on their bits.
fn names(p: &registry::Physical, i: &Item) -> bool {
    p.key
        .is_some_and(|key| std::hint::black_box(key ^ i.key) == 0)
}

/// Answers `items` in order: the real fd of buffer `vh` once its generation is at least the one
/// asked for (waiting for an owner still resuming, up to the timeout), recording `pid` as an
/// importer. Every item must name a buffer of this process with its key, or the whole request
/// is refused, saying nothing of which item or which part of it was wrong. Every item already
/// answerable is answered under one hold of the registry lock, so that a process busy resuming
/// serves a peer's hundreds of buffers in one go.
fn answer(stream: &UnixStream, pid: u32, cred_pid: u32, items: &[Item]) -> std::io::Result<()> {
    let deadline = Instant::now() + peer::timeout();
    let write_by = deadline + WRITE_TIMEOUT;
    let known = {
        let reg = registry::lock();
        // Every item looked at: the time taken does not say where the first wrong one is.
        items.iter().fold(true, |ok, i| {
            ok & reg.physicals.get(&i.vh).is_some_and(|p| names(p, i))
        })
    };
    if !known {
        refuse(
            stream,
            cred_pid,
            "the request names a buffer this process does not have, or not with that key \
             (only a process given the buffer's token can name it)",
        );
        return Ok(());
    }
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
                    // Freed by NCCL while this request waited.
                    replies.push((Reply::Failed { vh: r.vh }, None));
                    continue;
                };
                // A buffer that stays resident through pauses (host memory, given to a NIC,
                // ...) keeps its generation: serve it as it is. Otherwise wait until the owner
                // has re-created the generation asked for.
                let stays = p.pausable().is_err();
                let Some(h) = p.real().filter(|_| stays || p.generation >= r.generation) else {
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
                        note(format!(
                            "cannot export an NCCL buffer to process {pid}: {e}"
                        ));
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
                write_by,
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
                    let reply = Reply::NotReady { vh: r.vh };
                    protocol::write_frame(stream.as_fd(), &reply.encode(), None, write_by)?;
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

// ---------------------------------------------------------------------------------------------
// The server's log.
// ---------------------------------------------------------------------------------------------

/// Lines dropped because the logging thread's queue was full (counted in its next line).
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// Hands `line` to the logging thread without ever waiting: when its queue is full (stderr
/// does not take lines), the line is counted and dropped. Used by the server's threads and
/// the control thread, which must never block on stderr.
pub(crate) fn note(line: String) {
    static QUEUE: OnceLock<Option<SyncSender<String>>> = OnceLock::new();
    let tx = QUEUE.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<String>(LOG_QUEUE);
        std::thread::Builder::new()
            .name("memsaver-log".into())
            .spawn(move || write_log(&rx))
            .ok()
            .map(|_| tx)
    });
    let sent = tx.as_ref().is_some_and(|tx| tx.try_send(line).is_ok());
    if !sent {
        DROPPED.fetch_add(1, Ordering::Relaxed);
    }
}

/// The logging thread: at most one line per [`LOG_INTERVAL`].
fn write_log(rx: &Receiver<String>) {
    let mut quiet = Quiet::new(LOG_INTERVAL);
    loop {
        let got = match quiet.due() {
            Some(at) => rx.recv_timeout(at.saturating_duration_since(Instant::now())),
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        let now = Instant::now();
        let dropped = DROPPED.swap(0, Ordering::Relaxed);
        let line = match got {
            Ok(what) => quiet.line(now, what, dropped),
            Err(RecvTimeoutError::Timeout) => quiet.flush(now, dropped),
            Err(RecvTimeoutError::Disconnected) => return,
        };
        if let Some(line) = line {
            tracing::warn!("memsaver: {line}");
        }
    }
}

/// Rate limiting of the server's log: the first line at once, then at most one line per
/// interval, which says how many were held back meanwhile.
struct Quiet {
    interval: Duration,
    /// When the next line may be written.
    next: Option<Instant>,
    /// Lines held back since the last one written, and the last of them.
    held: u64,
    last: Option<String>,
}

impl Quiet {
    fn new(interval: Duration) -> Self {
        Self {
            interval,
            next: None,
            held: 0,
            last: None,
        }
    }

    /// When lines held back are due to be counted in a line of their own.
    fn due(&self) -> Option<Instant> {
        self.next.filter(|_| self.held > 0)
    }

    /// `what` happened at `now` (and `dropped` lines were lost before it): the line to write
    /// now, if one is due.
    fn line(&mut self, now: Instant, what: String, dropped: u64) -> Option<String> {
        self.held += dropped;
        if self.next.is_some_and(|n| now < n) {
            self.held += 1;
            self.last = Some(what);
            return None;
        }
        self.next = Some(now + self.interval);
        let held = std::mem::take(&mut self.held);
        self.last = None;
        Some(if held == 0 {
            what
        } else {
            format!("{what} (and {held} more line(s) of the peer server not shown one by one)")
        })
    }

    /// At `now`, with `dropped` more lines lost: the line counting what was held back, if its
    /// time came.
    fn flush(&mut self, now: Instant, dropped: u64) -> Option<String> {
        self.held += dropped;
        if self.held == 0 || self.next.is_some_and(|n| now < n) {
            return None;
        }
        self.next = Some(now + self.interval);
        let held = std::mem::take(&mut self.held);
        let last = self.last.take().unwrap_or_default();
        Some(format!(
            "{held} more line(s) of the peer server in the last {} s, not shown one by one; \
             the last: {last}",
            self.interval.as_secs_f64()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_says_one_line_per_interval_and_counts_the_rest() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut q = Quiet::new(s);
        assert_eq!(q.line(t0, "a".into(), 0).as_deref(), Some("a"));
        assert_eq!(q.due(), None);
        for i in 0..10 {
            assert_eq!(q.line(t0 + s / 20 * i, format!("b{i}"), 0), None);
        }
        assert_eq!(q.due(), Some(t0 + s));
        assert_eq!(q.flush(t0 + s / 2, 5), None, "not before the interval");
        let line = q.flush(t0 + s, 0).unwrap();
        assert!(
            line.starts_with("15 more line(s)") && line.ends_with("the last: b9"),
            "{line}"
        );
        assert_eq!(q.due(), None);
        // Within the next interval a line is held back, then told with the next one.
        assert_eq!(q.line(t0 + s + s / 2, "c".into(), 0), None);
        let line = q.line(t0 + 3 * s, "d".into(), 2).unwrap();
        assert!(line.starts_with("d (and 3 more"), "{line}");
    }
}
