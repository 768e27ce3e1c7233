//! The frames messages travel in between memsaver processes: a little-endian `u32` body
//! length followed by the body, at most [`MAX_FRAME`] bytes (what the body holds is
//! [`crate::protocol`]'s). A length of 0 or over [`MAX_FRAME`] is refused before anything is
//! allocated; the connection is then closed.
//!
//! Every read and write here retries `EINTR`, sends with `MSG_NOSIGNAL` (a peer that went away
//! is an error, not a `SIGPIPE` to the host process) and has a **deadline** that covers the
//! whole frame, however it is split (each `recvmsg`/`sendmsg` waits at most the time left:
//! `SO_RCVTIMEO`/`SO_SNDTIMEO`): a peer that is silent or trickles bytes is a `TimedOut`
//! error. A frame carries at most the fds its reader expects (one for a reply, none for a
//! request): one more is an error at once, and the fds that came with it are closed at once
//! (a reader that expects none gives the kernel no room for any: it never holds one).

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{
    ControlMessage, ControlMessageOwned, MsgFlags, UnixAddr, recvmsg, sendmsg, setsockopt, sockopt,
};
use nix::sys::time::TimeVal;

/// The largest frame body, in bytes.
pub const MAX_FRAME: usize = 256 << 10;

/// Why a body of `len` bytes cannot travel in a frame (empty, or longer than [`MAX_FRAME`]).
pub fn bad_length(len: usize) -> Option<String> {
    match len {
        0 => Some("an empty frame".to_owned()),
        n if n > MAX_FRAME => Some(format!("a frame of {n} bytes (at most {MAX_FRAME})")),
        _ => None,
    }
}

fn io(e: Errno) -> std::io::Error {
    std::io::Error::from(e)
}

/// The time left until `deadline`, or a `TimedOut` error naming `what` when none is.
fn left(deadline: Instant, what: &str) -> std::io::Result<Duration> {
    match deadline.checked_duration_since(Instant::now()) {
        // Below a microsecond a socket timeout would read as "none": no time left.
        Some(d) if d >= Duration::from_micros(1) => Ok(d),
        _ => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            what.to_owned(),
        )),
    }
}

/// Sets the socket's `SO_RCVTIMEO` (`receive`) or `SO_SNDTIMEO` to the time left until
/// `deadline`, so that the next call waits no longer.
fn wait_at_most(sock: BorrowedFd<'_>, receive: bool, deadline: Instant) -> std::io::Result<()> {
    let what = if receive {
        "the peer did not send its whole frame in time"
    } else {
        "the peer did not take the whole frame in time"
    };
    let d = left(deadline, what)?;
    let tv = TimeVal::new(
        libc::time_t::try_from(d.as_secs()).unwrap_or(libc::time_t::MAX),
        libc::suseconds_t::from(d.subsec_micros().max(1)),
    );
    if receive {
        setsockopt(&sock, sockopt::ReceiveTimeout, &tv)
    } else {
        setsockopt(&sock, sockopt::SendTimeout, &tv)
    }
    .map_err(io)
}

/// Writes one frame of `body` on `sock`, with `fd` attached (`SCM_RIGHTS`) if given, by
/// `deadline` (a non-blocking socket: what fits at once, else an error).
pub fn write_frame(
    sock: BorrowedFd<'_>,
    body: &[u8],
    fd: Option<BorrowedFd<'_>>,
    deadline: Instant,
) -> std::io::Result<()> {
    if let Some(e) = bad_length(body.len()) {
        return Err(std::io::Error::other(e));
    }
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(body);
    let fds = fd.map(|f| [f.as_raw_fd()]);
    let mut sent = 0;
    while sent < frame.len() {
        wait_at_most(sock, false, deadline)?;
        // The fd goes with the frame's first byte.
        let cmsg: Vec<ControlMessage> = match (&fds, sent) {
            (Some(f), 0) => vec![ControlMessage::ScmRights(f)],
            _ => Vec::new(),
        };
        match sendmsg::<UnixAddr>(
            sock.as_raw_fd(),
            &[IoSlice::new(&frame[sent..])],
            &cmsg,
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Ok(n) => sent += n,
            Err(Errno::EINTR) => continue,
            Err(Errno::EAGAIN) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the peer did not take the whole frame in time",
                ));
            }
            Err(e) => return Err(io(e)),
        }
    }
    Ok(())
}

/// A frame read in as many pieces as its bytes take to arrive: the server feeds it whatever a
/// non-blocking socket has, a client reads a whole frame by a deadline ([`read_frame`]).
pub struct FrameReader {
    head: [u8; 4],
    /// Bytes of the head received so far.
    got_head: usize,
    body: Vec<u8>,
    /// The body's length, once the head is complete.
    len: usize,
    /// How many fds the frame may carry: 0 (a request) or 1 (a reply).
    max_fds: usize,
    fd: Option<OwnedFd>,
}

impl FrameReader {
    /// A reader of one frame that may carry at most `max_fds` (0 or 1) fds.
    pub fn new(max_fds: usize) -> Self {
        Self {
            head: [0; 4],
            got_head: 0,
            body: Vec::new(),
            len: 0,
            max_fds: max_fds.min(1),
            fd: None,
        }
    }

    /// Reads what `sock` has for this frame (never past its end), each `recvmsg` waiting at
    /// most until `deadline` when one is given: `Some` with the body and its fd once the frame
    /// is complete, `None` when the socket has nothing more now (a non-blocking socket, or the
    /// deadline passed). A length of 0 or over [`MAX_FRAME`] is refused before anything is
    /// allocated, an fd more than allowed at once, and the end of the connection is
    /// `UnexpectedEof`.
    pub fn advance(
        &mut self,
        sock: BorrowedFd<'_>,
        deadline: Option<Instant>,
    ) -> std::io::Result<Option<(Vec<u8>, Option<OwnedFd>)>> {
        let mut chunk = [0u8; 16 << 10];
        loop {
            if let Some(d) = deadline {
                wait_at_most(sock, true, d)?;
            }
            let in_head = self.got_head < 4;
            let buf = if in_head {
                &mut self.head[self.got_head..]
            } else {
                let n = (self.len - self.body.len()).min(chunk.len());
                &mut chunk[..n]
            };
            let Some(n) = recv_some(sock, buf, self.max_fds, &mut self.fd)? else {
                return Ok(None);
            };
            if in_head {
                self.got_head += n;
                if self.got_head < 4 {
                    continue;
                }
                self.len = u32::from_le_bytes(self.head) as usize;
                if let Some(e) = bad_length(self.len) {
                    return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, e));
                }
                // Grown as bytes arrive: a frame announced is not memory taken.
                self.body = Vec::with_capacity(self.len.min(chunk.len()));
            } else {
                self.body.extend_from_slice(&chunk[..n]);
            }
            if self.got_head == 4 && self.body.len() == self.len {
                return Ok(Some((std::mem::take(&mut self.body), self.fd.take())));
            }
        }
    }
}

/// One `recvmsg` into `buf`: `Some(bytes)`, or `None` when nothing is there now (`EAGAIN`: a
/// non-blocking socket, or its receive timeout passed). An fd beyond `max_fds` (counting the
/// one already in `fd`) is an error at once; with `max_fds` 0 the kernel gets no room for
/// fds, so none is ever installed here (it discards them and says so with `MSG_CTRUNC`).
fn recv_some(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    max_fds: usize,
    fd: &mut Option<OwnedFd>,
) -> std::io::Result<Option<usize>> {
    let refused = || {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            if max_fds == 0 {
                "a request came with an fd"
            } else {
                "a frame came with more than one fd"
            },
        )
    };
    let mut space = nix::cmsg_space!([RawFd; 1]);
    loop {
        let mut iov = [IoSliceMut::new(buf)];
        let cmsg = (max_fds > 0).then_some(&mut space[..]);
        let msg =
            match recvmsg::<UnixAddr>(sock.as_raw_fd(), &mut iov, cmsg, MsgFlags::MSG_CMSG_CLOEXEC)
            {
                Ok(m) => m,
                Err(Errno::EINTR) => continue,
                Err(Errno::EAGAIN) => return Ok(None),
                Err(e) => return Err(io(e)),
            };
        let mut extra = false;
        if let Ok(cmsgs) = msg.cmsgs() {
            for c in cmsgs {
                if let ControlMessageOwned::ScmRights(received) = c {
                    for f in received {
                        // SAFETY: fds received with SCM_RIGHTS are new descriptors we own
                        // (closed right here when there is no room for them).
                        let f = unsafe { OwnedFd::from_raw_fd(f) };
                        if fd.is_none() && max_fds > 0 {
                            *fd = Some(f);
                        } else {
                            extra = true;
                        }
                    }
                }
            }
        }
        if extra || msg.flags.contains(MsgFlags::MSG_CTRUNC) {
            *fd = None;
            return Err(refused());
        }
        return match msg.bytes {
            0 => Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the peer closed the connection",
            )),
            n => Ok(Some(n)),
        };
    }
}

/// Reads one frame by `deadline`, the whole frame however it is split: its body and the fd
/// that came with it, if any (a reply carries at most one).
pub fn read_frame(
    sock: BorrowedFd<'_>,
    deadline: Instant,
) -> std::io::Result<(Vec<u8>, Option<OwnedFd>)> {
    let mut reader = FrameReader::new(1);
    loop {
        if let Some(frame) = reader.advance(sock, Some(deadline))? {
            return Ok(frame);
        }
        // The receive timeout passed, maybe a moment early: the deadline decides.
        left(deadline, "the peer sent nothing within the timeout")?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(10)
    }

    #[test]
    fn frames_carry_an_fd_and_refuse_oversized_lengths() {
        use std::io::Write;
        use std::os::fd::AsFd;
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let f = std::fs::File::open("/dev/null").unwrap();
        write_frame(a.as_fd(), b"first", Some(f.as_fd()), soon()).unwrap();
        write_frame(a.as_fd(), &[0x84, 3], None, soon()).unwrap();
        let (body, fd) = read_frame(b.as_fd(), soon()).unwrap();
        assert_eq!(body, b"first");
        assert!(fd.is_some());
        let (body, fd) = read_frame(b.as_fd(), soon()).unwrap();
        assert_eq!(body, [0x84, 3]);
        assert!(fd.is_none());
        (&a).write_all(&u32::MAX.to_le_bytes()).unwrap();
        let e = read_frame(b.as_fd(), soon()).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        drop(a);
        let e = read_frame(b.as_fd(), soon()).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    }

    /// Writes `body` as a frame on one end of a pair, by a thread (it does not fit the
    /// socket's buffer), and reads it back on the other.
    fn through_a_socket(body: Vec<u8>) -> std::io::Result<Vec<u8>> {
        use std::os::fd::AsFd;
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let writer = std::thread::spawn(move || write_frame(a.as_fd(), &body, None, soon()));
        let read = read_frame(b.as_fd(), soon()).map(|(body, _)| body);
        writer.join().unwrap()?;
        read
    }

    /// The bound is inclusive: a body of exactly `MAX_FRAME` bytes is written and read; one
    /// byte more is refused by the writer, and a head announcing it by the reader, before it
    /// reads or allocates the body.
    #[test]
    fn a_frame_of_exactly_the_maximum_passes_and_one_byte_more_does_not() {
        use std::io::Write;
        use std::os::fd::AsFd;
        let full: Vec<u8> = (0..MAX_FRAME).map(|i| (i % 251) as u8).collect();
        assert_eq!(through_a_socket(full.clone()).unwrap(), full);
        assert_eq!(bad_length(MAX_FRAME), None);

        let e = write_frame(
            std::os::unix::net::UnixStream::pair().unwrap().0.as_fd(),
            &vec![0; MAX_FRAME + 1],
            None,
            soon(),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("a frame of {} bytes (at most {MAX_FRAME})", MAX_FRAME + 1)
        );
        assert!(
            write_frame(
                std::os::unix::net::UnixStream::pair().unwrap().0.as_fd(),
                &[],
                None,
                soon()
            )
            .is_err()
        );

        for (len, ok) in [(MAX_FRAME, true), (MAX_FRAME + 1, false), (0, false)] {
            let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
            b.set_nonblocking(true).unwrap();
            (&a).write_all(&(len as u32).to_le_bytes()).unwrap();
            let mut r = FrameReader::new(0);
            match r.advance(b.as_fd(), None) {
                // A head that announces an acceptable length: the reader waits for the body.
                Ok(None) => assert!(ok, "{len} bytes announced were accepted"),
                Ok(Some(_)) => panic!("{len}: a frame without its body"),
                Err(e) => {
                    assert!(!ok, "{len} bytes announced were refused: {e}");
                    assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
                }
            }
        }
    }

    /// Sends `bytes` one per message, each with `fd` attached.
    fn each_byte_with(sock: &std::os::unix::net::UnixStream, bytes: &[u8], fd: RawFd) {
        for b in bytes {
            sendmsg::<UnixAddr>(
                sock.as_raw_fd(),
                &[IoSlice::new(std::slice::from_ref(b))],
                &[ControlMessage::ScmRights(&[fd])],
                MsgFlags::empty(),
                None,
            )
            .unwrap();
        }
    }

    #[test]
    fn an_fd_where_none_is_expected_is_refused_at_the_first_one() {
        use std::os::fd::AsFd;
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        let f = std::fs::File::open("/dev/null").unwrap();
        let mut frame = 100u32.to_le_bytes().to_vec();
        frame.resize(4 + 100, 0);
        each_byte_with(&a, &frame, f.as_raw_fd());
        // (That the owner holds none of them is checked on a real owner, whose fds can be
        // counted: tests/scenarios/tests/nccl_security.rs.)
        let mut r = FrameReader::new(0);
        let e = r.advance(b.as_fd(), None).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        assert_eq!(e.to_string(), "a request came with an fd");
        // A reply may carry one: the second is refused when it arrives, and closed.
        let mut r = FrameReader::new(1);
        let e = r.advance(b.as_fd(), None).unwrap_err();
        assert_eq!(e.to_string(), "a frame came with more than one fd");
    }

    #[test]
    fn one_deadline_covers_every_read_of_a_frame() {
        use std::io::Write;
        use std::os::fd::AsFd;
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        // A peer that sends a byte every 20 ms: each read gets one in time, the frame never
        // comes whole within the 300 ms it is given.
        let trickle = std::thread::spawn(move || {
            let mut a = a;
            a.write_all(&1000u32.to_le_bytes()).unwrap();
            for _ in 0..1000 {
                if a.write_all(b"x").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let start = Instant::now();
        let e = read_frame(b.as_fd(), start + Duration::from_millis(300)).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
        drop(b);
        trickle.join().unwrap();
    }
}
