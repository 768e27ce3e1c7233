//! The wire protocol between memsaver processes: typed messages in length-prefixed frames,
//! decoded strictly, and the socket I/O that carries them.
//!
//! A frame is a little-endian `u32` body length followed by the body, at most [`MAX_FRAME`]
//! bytes; the body is one kind byte and the kind's fields, little-endian, nothing after them.
//! A frame that is too long, too short, of an unknown kind, with a count that does not match
//! its length or with bytes left over is an error: the connection is closed, nothing is
//! guessed. One connection carries one request; the server answers it and closes.
//!
//! Three services share the wire ([`crate::server`] routes each request to the layer that
//! answers it): the **buffers** an owner exports to its peers (imports and their release),
//! **control** of one process by another ([`crate::control`]), and **shared** memory: any
//! tag's allocations opened by other processes through CUDA IPC handles ([`crate::shared`]),
//! whose owner makes the importers let go and map again around its pauses and resumes.
//!
//! | kind | message | fields | answer |
//! | --- | --- | --- | --- |
//! | 0x01 | [`Request::Import`] | from, to (identities), group, buffers (id, key, generation) | one [`Reply::Export`] (fd attached), `NotReady` or `Failed` per buffer, in order; or `Refused` (not admitted, or a buffer that the owner does not have with that key) |
//! | 0x02 | [`Request::Released`] | from, to, group, buffers | [`Reply::Done`], or `Refused` |
//! | 0x03 | [`Control::Pause`] | from, to, group, tags | `Done`, `Error` or `Refused` |
//! | 0x04 | [`Control::Resume`] | from, to, group, tags | `Done`, `Error` or `Refused` |
//! | 0x05 | [`Control::Stats`] | from, to, group | `Json`, `Error` or `Refused` |
//! | 0x06 | [`Control::Run`] | from, to, group, source, stage, profile text | `Json` (the stage's report), `Error` or `Refused` |
//! | 0x07 | [`Request::Shared`] [`Share::Open`] | from, to, group, buffers | one [`Reply::Shared`] (fd attached), `NotReady` or `Failed` per buffer, in order; or `Refused` |
//! | 0x08 | [`Request::Shared`] [`Share::Close`] | from, to, group, buffers | `Done`, or `Refused` |
//! | 0x09 | [`Request::Shared`] [`Share::Release`] (owner to importer) | from, to, group, buffers | `Done` once the importer unmapped and released them, or `Refused` |
//! | 0x0a | [`Request::Shared`] [`Share::Rebuild`] (owner to importer) | from, to, group, buffers (the new generation) | `Done` once the importer mapped them again (`Error` if it could not), or `Refused` |
//! | 0x81 | [`Reply::Export`] | id, generation; the fd by `SCM_RIGHTS` | |
//! | 0x83 | [`Reply::NotReady`] | id: not restored within the owner's wait | |
//! | 0x84 | [`Reply::Failed`] | id: the owner's export failed | |
//! | 0x85 | [`Reply::Done`] | | |
//! | 0x86 | [`Reply::Refused`] | reason (UTF-8, at most [`MAX_TEXT`] bytes) | |
//! | 0x87 | [`Reply::Json`] | `u32` length, UTF-8 JSON | |
//! | 0x89 | [`Reply::Shared`] | id, generation, size, offset, handle size; the fd by `SCM_RIGHTS` | |
//! | 0x88 | [`Reply::Error`] | status `u16` (a code of the C ABI), `u32` length, message (UTF-8, at most [`MAX_MESSAGE`] bytes) | |
//!
//! Control requests (0x03 to 0x06) share the head of the others (from, to, group). Tags: a
//! `u16` count (at most [`MAX_TAGS`]; 0 means every tag), then per tag a `u8` length (1 to
//! [`MAX_TAG`]) and its bytes. Source and stage: a `u16` length (at most [`MAX_TEXT`]) and
//! UTF-8; the profile text: a `u32` length and UTF-8, within the frame.
//!
//! An identity is (pid `u32`, start time `u64`, nonce `u64`): see [`crate::identity`]. A buffer
//! is (id `u64`, key `u64`, generation `u64`): the owner's id of the buffer (for NCCL's
//! buffers, the virtual handle), the buffer's **key** (64 random bits the owner drew when it
//! first exported the buffer, carried by its token and nowhere else: a process that was not
//! given the token cannot name the buffer, see [`crate::token`]), and a generation (the owner
//! counts the times it re-created the memory). A buffer that the owner does not have with that
//! key makes the owner refuse the whole request, saying nothing of which part was wrong.
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
/// Bytes of a request before its buffers: kind, two identities, group, count.
const REQUEST_HEAD: usize = 1 + 2 * 20 + 8 + 4;
/// Bytes of a buffer: id, key, generation.
const BUFFER: usize = 24;
/// The most buffers one request may name (callers split longer lists).
pub const MAX_BUFFERS: usize = (MAX_FRAME - REQUEST_HEAD) / BUFFER;
/// The longest reason text of a refusal, in bytes.
pub const MAX_TEXT: usize = 1024;
/// The longest error message of a control reply, in bytes.
pub const MAX_MESSAGE: usize = 16 << 10;
/// The most tags a control request names.
pub const MAX_TAGS: usize = 1024;
/// The longest tag, in bytes (as the allocator's tag rule).
pub const MAX_TAG: usize = 64;

pub use crate::identity::Identity;

/// One buffer of an owner: its id there, its key (from its token) and a generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Buffer {
    pub id: u64,
    pub key: u64,
    pub generation: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// `from` imports `buffers` of the owner `to`: their fds, each once its generation is at
    /// least the one given; `from` becomes an importer of each. Every buffer must be one the
    /// owner has, with its key.
    Import {
        from: Identity,
        to: Identity,
        group: i64,
        buffers: Vec<Buffer>,
    },
    /// `from` let go of its imports of `buffers`.
    Released {
        from: Identity,
        to: Identity,
        group: i64,
        buffers: Vec<Buffer>,
    },
    /// About allocations of the owner shared with other processes ([`Share`]).
    Shared {
        from: Identity,
        to: Identity,
        group: i64,
        op: Share,
        buffers: Vec<Buffer>,
    },
    /// `from` asks the addressee, which must serve control requests, to do `op`.
    Control {
        from: Identity,
        to: Identity,
        group: i64,
        op: Control,
    },
}

/// What a request about shared allocations asks ([`crate::shared`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Share {
    /// Importer to owner: the fds of these allocations (each once its generation is at least
    /// the one given); the sender becomes an importer of each.
    Open,
    /// Importer to owner: the sender closed its imports of these allocations.
    Close,
    /// Owner to importer: unmap and release your imports of these allocations (the owner is
    /// pausing them); answered once done.
    Release,
    /// Owner to importer: these allocations are resident again at the generation given; map
    /// them again at the same addresses; answered once done.
    Rebuild,
}

/// What a control request asks of the process it is sent to (`control`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Control {
    /// Pause these tags (every tag when empty).
    Pause { tags: Vec<String> },
    /// Resume these tags (every tag when empty).
    Resume { tags: Vec<String> },
    /// Its stats, as JSON.
    Stats,
    /// Run `stage` of the profile `profile` (its text; `source` names it in messages).
    Run {
        source: String,
        stage: String,
        profile: String,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// The owner exports buffer `id` at `generation`: its fd comes with the frame.
    Export {
        id: u64,
        generation: u64,
    },
    /// Buffer `id` was not restored within the owner's wait.
    NotReady {
        id: u64,
    },
    /// The owner's export of buffer `id` failed.
    Failed {
        id: u64,
    },
    Done,
    Refused {
        reason: String,
    },
    /// The owner exports shared allocation `id` at `generation`: its fd comes with the frame,
    /// the allocation (`size` bytes: the owner's word, not the handle's) lies at `offset` in a
    /// physical allocation of `handle_size` bytes.
    Shared {
        id: u64,
        generation: u64,
        size: u64,
        offset: u64,
        handle_size: u64,
    },
    /// A control request's result.
    Json {
        text: String,
    },
    /// A control request's operation failed: a status code of the C ABI and the message.
    Error {
        status: u16,
        message: String,
    },
}

#[derive(Debug, PartialEq, Eq)]
pub enum DecodeError {
    Empty,
    TooLong(usize),
    UnknownKind(u8),
    Truncated,
    TrailingBytes(usize),
    TooManyBuffers(u64),
    TooManyTags(usize),
    BadText,
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Empty => write!(f, "an empty frame"),
            Self::TooLong(n) => write!(f, "a frame of {n} bytes (at most {MAX_FRAME})"),
            Self::UnknownKind(k) => write!(f, "an unknown message kind {k:#04x}"),
            Self::Truncated => write!(f, "a truncated message"),
            Self::TrailingBytes(n) => write!(f, "{n} bytes after the message"),
            Self::TooManyBuffers(n) => write!(f, "{n} buffers (at most {MAX_BUFFERS})"),
            Self::TooManyTags(n) => write!(f, "{n} tags (at most {MAX_TAGS})"),
            Self::BadText => write!(f, "a text that is not UTF-8 or too long"),
        }
    }
}

const IMPORT: u8 = 0x01;
const RELEASED: u8 = 0x02;
const R_EXPORT: u8 = 0x81;
const R_NOT_READY: u8 = 0x83;
const R_FAILED: u8 = 0x84;
const R_DONE: u8 = 0x85;
const R_REFUSED: u8 = 0x86;
const PAUSE: u8 = 0x03;
const RESUME: u8 = 0x04;
const STATS: u8 = 0x05;
const RUN: u8 = 0x06;
const R_JSON: u8 = 0x87;
const R_ERROR: u8 = 0x88;
const R_SHARED: u8 = 0x89;
const OPEN: u8 = 0x07;
const CLOSE: u8 = 0x08;
const RELEASE: u8 = 0x09;
const REBUILD: u8 = 0x0a;

/// Reads fields off a body, front to back.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.0.len() < n {
            return Err(DecodeError::Truncated);
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    /// UTF-8 text of `n` bytes, at most `max`.
    fn text(&mut self, n: usize, max: usize) -> Result<String, DecodeError> {
        if n > max {
            return Err(DecodeError::BadText);
        }
        std::str::from_utf8(self.take(n)?)
            .map(str::to_owned)
            .map_err(|_| DecodeError::BadText)
    }
    fn tags(&mut self) -> Result<Vec<String>, DecodeError> {
        let n = self.u16()? as usize;
        if n > MAX_TAGS {
            return Err(DecodeError::TooManyTags(n));
        }
        let mut tags = Vec::with_capacity(n);
        for _ in 0..n {
            let len = self.u8()? as usize;
            if len == 0 {
                return Err(DecodeError::BadText);
            }
            tags.push(self.text(len, MAX_TAG)?);
        }
        Ok(tags)
    }
    fn identity(&mut self) -> Result<Identity, DecodeError> {
        Ok(Identity {
            pid: self.u32()?,
            start: self.u64()?,
            nonce: self.u64()?,
        })
    }
    fn finish(self) -> Result<(), DecodeError> {
        match self.0.len() {
            0 => Ok(()),
            n => Err(DecodeError::TrailingBytes(n)),
        }
    }
}

fn put_identity(out: &mut Vec<u8>, i: &Identity) {
    out.extend_from_slice(&i.pid.to_le_bytes());
    out.extend_from_slice(&i.start.to_le_bytes());
    out.extend_from_slice(&i.nonce.to_le_bytes());
}

/// `text` cut to at most `max` bytes, at a character boundary.
fn clip(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

impl Request {
    /// The sender, the addressee and the group every request names.
    pub fn head(&self) -> (&Identity, &Identity, i64) {
        match self {
            Self::Import {
                from, to, group, ..
            }
            | Self::Released {
                from, to, group, ..
            }
            | Self::Shared {
                from, to, group, ..
            }
            | Self::Control {
                from, to, group, ..
            } => (from, to, *group),
        }
    }

    /// The frame body. Panics if there are more than [`MAX_BUFFERS`] buffers (callers split);
    /// a control request's fields must be within their limits ([`Control::check`]).
    pub fn encode(&self) -> Vec<u8> {
        let kind = match self {
            Self::Import { .. } => IMPORT,
            Self::Released { .. } => RELEASED,
            Self::Shared { op, .. } => match op {
                Share::Open => OPEN,
                Share::Close => CLOSE,
                Share::Release => RELEASE,
                Share::Rebuild => REBUILD,
            },
            Self::Control { op, .. } => match op {
                Control::Pause { .. } => PAUSE,
                Control::Resume { .. } => RESUME,
                Control::Stats => STATS,
                Control::Run { .. } => RUN,
            },
        };
        let (from, to, group) = self.head();
        let mut out = Vec::with_capacity(REQUEST_HEAD);
        out.push(kind);
        put_identity(&mut out, from);
        put_identity(&mut out, to);
        out.extend_from_slice(&group.to_le_bytes());
        match self {
            Self::Import { buffers, .. }
            | Self::Released { buffers, .. }
            | Self::Shared { buffers, .. } => {
                assert!(buffers.len() <= MAX_BUFFERS, "callers split long requests");
                out.extend_from_slice(&(buffers.len() as u32).to_le_bytes());
                for i in buffers {
                    out.extend_from_slice(&i.id.to_le_bytes());
                    out.extend_from_slice(&i.key.to_le_bytes());
                    out.extend_from_slice(&i.generation.to_le_bytes());
                }
            }
            Self::Control { op, .. } => op.encode(&mut out),
        }
        out
    }

    pub fn decode(body: &[u8]) -> Result<Self, DecodeError> {
        check_len(body)?;
        let mut c = Cursor(body);
        let kind = c.u8()?;
        if !matches!(
            kind,
            IMPORT | RELEASED | PAUSE | RESUME | STATS | RUN | OPEN | CLOSE | RELEASE | REBUILD
        ) {
            return Err(DecodeError::UnknownKind(kind));
        }
        let from = c.identity()?;
        let to = c.identity()?;
        let group = c.u64()? as i64;
        let op = match kind {
            PAUSE => Some(Control::Pause { tags: c.tags()? }),
            RESUME => Some(Control::Resume { tags: c.tags()? }),
            STATS => Some(Control::Stats),
            RUN => {
                let n = c.u16()? as usize;
                let source = c.text(n, MAX_TEXT)?;
                let n = c.u16()? as usize;
                let stage = c.text(n, MAX_TEXT)?;
                let n = c.u32()? as usize;
                let profile = c.text(n, MAX_FRAME)?;
                Some(Control::Run {
                    source,
                    stage,
                    profile,
                })
            }
            _ => None,
        };
        if let Some(op) = op {
            c.finish()?;
            return Ok(Self::Control {
                from,
                to,
                group,
                op,
            });
        }
        let n = c.u32()? as u64;
        if n > MAX_BUFFERS as u64 {
            return Err(DecodeError::TooManyBuffers(n));
        }
        // Checked against what is there before anything is allocated.
        let want = n as usize * BUFFER;
        if c.0.len() < want {
            return Err(DecodeError::Truncated);
        }
        let mut buffers = Vec::with_capacity(n as usize);
        for _ in 0..n {
            buffers.push(Buffer {
                id: c.u64()?,
                key: c.u64()?,
                generation: c.u64()?,
            });
        }
        c.finish()?;
        let share = |op| Self::Shared {
            from,
            to,
            group,
            op,
            buffers: buffers.clone(),
        };
        Ok(match kind {
            IMPORT => Self::Import {
                from,
                to,
                group,
                buffers,
            },
            RELEASED => Self::Released {
                from,
                to,
                group,
                buffers,
            },
            OPEN => share(Share::Open),
            CLOSE => share(Share::Close),
            RELEASE => share(Share::Release),
            _ => share(Share::Rebuild),
        })
    }
}

impl Control {
    /// Whether the fields are within the protocol's limits (a client checks before sending:
    /// [`Request::encode`] would make a frame the server refuses).
    pub fn check(&self) -> Result<(), String> {
        match self {
            Self::Pause { tags } | Self::Resume { tags } => {
                if tags.len() > MAX_TAGS {
                    return Err(format!("{} tags (at most {MAX_TAGS})", tags.len()));
                }
                match tags.iter().find(|t| t.is_empty() || t.len() > MAX_TAG) {
                    Some(t) => Err(format!(
                        "invalid tag {t:?}: a tag has 1 to {MAX_TAG} characters"
                    )),
                    None => Ok(()),
                }
            }
            Self::Stats => Ok(()),
            Self::Run {
                source,
                stage,
                profile,
            } => {
                if source.len() > MAX_TEXT || stage.len() > MAX_TEXT {
                    return Err(format!(
                        "a profile name or stage name longer than {MAX_TEXT} bytes"
                    ));
                }
                let room = MAX_FRAME - REQUEST_HEAD - 8 - source.len() - stage.len();
                if profile.len() > room {
                    return Err(format!(
                        "{source}: the profile has {} bytes; a control request carries at most {room}",
                        profile.len()
                    ));
                }
                Ok(())
            }
        }
    }

    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Self::Pause { tags } | Self::Resume { tags } => {
                out.extend_from_slice(&(tags.len() as u16).to_le_bytes());
                for t in tags {
                    out.push(t.len() as u8);
                    out.extend_from_slice(t.as_bytes());
                }
            }
            Self::Stats => {}
            Self::Run {
                source,
                stage,
                profile,
            } => {
                out.extend_from_slice(&(source.len() as u16).to_le_bytes());
                out.extend_from_slice(source.as_bytes());
                out.extend_from_slice(&(stage.len() as u16).to_le_bytes());
                out.extend_from_slice(stage.as_bytes());
                out.extend_from_slice(&(profile.len() as u32).to_le_bytes());
                out.extend_from_slice(profile.as_bytes());
            }
        }
    }
}

impl Reply {
    /// The frame body (a refusal's reason is cut to [`MAX_TEXT`] bytes and an error's message
    /// to [`MAX_MESSAGE`], at a character).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(17);
        match self {
            Self::Export { id, generation } => {
                out.push(R_EXPORT);
                out.extend_from_slice(&id.to_le_bytes());
                out.extend_from_slice(&generation.to_le_bytes());
            }
            Self::NotReady { id } | Self::Failed { id } => {
                out.push(match self {
                    Self::NotReady { .. } => R_NOT_READY,
                    _ => R_FAILED,
                });
                out.extend_from_slice(&id.to_le_bytes());
            }
            Self::Done => out.push(R_DONE),
            Self::Shared {
                id,
                generation,
                size,
                offset,
                handle_size,
            } => {
                out.push(R_SHARED);
                for v in [id, generation, size, offset, handle_size] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
            Self::Refused { reason } => {
                let reason = clip(reason, MAX_TEXT);
                out.push(R_REFUSED);
                out.extend_from_slice(&(reason.len() as u16).to_le_bytes());
                out.extend_from_slice(reason.as_bytes());
            }
            Self::Json { text } => {
                out.push(R_JSON);
                out.extend_from_slice(&(text.len() as u32).to_le_bytes());
                out.extend_from_slice(text.as_bytes());
            }
            Self::Error { status, message } => {
                let message = clip(message, MAX_MESSAGE);
                out.push(R_ERROR);
                out.extend_from_slice(&status.to_le_bytes());
                out.extend_from_slice(&(message.len() as u32).to_le_bytes());
                out.extend_from_slice(message.as_bytes());
            }
        }
        out
    }

    pub fn decode(body: &[u8]) -> Result<Self, DecodeError> {
        check_len(body)?;
        let mut c = Cursor(body);
        let r = match c.u8()? {
            R_EXPORT => Self::Export {
                id: c.u64()?,
                generation: c.u64()?,
            },
            R_NOT_READY => Self::NotReady { id: c.u64()? },
            R_FAILED => Self::Failed { id: c.u64()? },
            R_DONE => Self::Done,
            R_SHARED => Self::Shared {
                id: c.u64()?,
                generation: c.u64()?,
                size: c.u64()?,
                offset: c.u64()?,
                handle_size: c.u64()?,
            },
            R_REFUSED => {
                let n = c.u16()? as usize;
                Self::Refused {
                    reason: c.text(n, MAX_TEXT)?,
                }
            }
            R_JSON => {
                let n = c.u32()? as usize;
                Self::Json {
                    text: c.text(n, MAX_FRAME)?,
                }
            }
            R_ERROR => {
                let status = c.u16()?;
                let n = c.u32()? as usize;
                Self::Error {
                    status,
                    message: c.text(n, MAX_MESSAGE)?,
                }
            }
            k => return Err(DecodeError::UnknownKind(k)),
        };
        c.finish()?;
        Ok(r)
    }
}

fn check_len(body: &[u8]) -> Result<(), DecodeError> {
    match body.len() {
        0 => Err(DecodeError::Empty),
        n if n > MAX_FRAME => Err(DecodeError::TooLong(n)),
        _ => Ok(()),
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
    if body.is_empty() || body.len() > MAX_FRAME {
        return Err(std::io::Error::other(
            DecodeError::TooLong(body.len()).to_string(),
        ));
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
                if self.len == 0 || self.len > MAX_FRAME {
                    let e = if self.len == 0 {
                        DecodeError::Empty
                    } else {
                        DecodeError::TooLong(self.len)
                    };
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        e.to_string(),
                    ));
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
    use proptest::prelude::*;

    fn identity() -> impl Strategy<Value = Identity> {
        (any::<u32>(), any::<u64>(), any::<u64>()).prop_map(|(pid, start, nonce)| Identity {
            pid,
            start,
            nonce,
        })
    }

    fn buffers() -> impl Strategy<Value = Vec<Buffer>> {
        proptest::collection::vec(
            (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(id, key, generation)| Buffer {
                id,
                key,
                generation,
            }),
            0..64,
        )
    }

    fn control() -> impl Strategy<Value = Control> {
        let tags = proptest::collection::vec("[A-Za-z0-9_.-]{1,64}", 0..8);
        prop_oneof![
            tags.clone().prop_map(|tags| Control::Pause { tags }),
            tags.prop_map(|tags| Control::Resume { tags }),
            Just(Control::Stats),
            ("\\PC{0,40}", "\\PC{0,20}", "\\PC{0,400}").prop_map(|(source, stage, profile)| {
                Control::Run {
                    source,
                    stage,
                    profile,
                }
            }),
        ]
    }

    fn share() -> impl Strategy<Value = Share> {
        prop_oneof![
            Just(Share::Open),
            Just(Share::Close),
            Just(Share::Release),
            Just(Share::Rebuild),
        ]
    }

    fn request() -> impl Strategy<Value = Request> {
        (
            0u8..4,
            identity(),
            identity(),
            any::<i64>(),
            buffers(),
            control(),
            share(),
        )
            .prop_map(|(kind, from, to, group, buffers, op, share)| match kind {
                0 => Request::Import {
                    from,
                    to,
                    group,
                    buffers,
                },
                1 => Request::Released {
                    from,
                    to,
                    group,
                    buffers,
                },
                2 => Request::Shared {
                    from,
                    to,
                    group,
                    op: share,
                    buffers,
                },
                _ => Request::Control {
                    from,
                    to,
                    group,
                    op,
                },
            })
    }

    fn reply() -> impl Strategy<Value = Reply> {
        prop_oneof![
            (any::<u64>(), any::<u64>())
                .prop_map(|(id, generation)| Reply::Export { id, generation }),
            any::<u64>().prop_map(|id| Reply::NotReady { id }),
            any::<u64>().prop_map(|id| Reply::Failed { id }),
            Just(Reply::Done),
            (
                any::<u64>(),
                any::<u64>(),
                any::<u64>(),
                any::<u64>(),
                any::<u64>()
            )
                .prop_map(|(id, generation, size, offset, handle_size)| {
                    Reply::Shared {
                        id,
                        generation,
                        size,
                        offset,
                        handle_size,
                    }
                }),
            "\\PC{0,300}".prop_map(|reason| Reply::Refused { reason }),
            "\\PC{0,300}".prop_map(|text| Reply::Json { text }),
            (any::<u16>(), "\\PC{0,300}")
                .prop_map(|(status, message)| Reply::Error { status, message }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        #[test]
        fn requests_round_trip(r in request()) {
            prop_assert_eq!(Request::decode(&r.encode()), Ok(r));
        }

        #[test]
        fn replies_round_trip(r in reply()) {
            prop_assert_eq!(Reply::decode(&r.encode()), Ok(r));
        }

        /// Arbitrary bytes never panic, and whatever decodes re-encodes to the same bytes
        /// (strict: no second spelling of a message, nothing ignored).
        #[test]
        fn arbitrary_bytes_decode_strictly(body in proptest::collection::vec(any::<u8>(), 0..2048)) {
            if let Ok(r) = Request::decode(&body) {
                prop_assert_eq!(r.encode(), body.clone());
            }
            if let Ok(r) = Reply::decode(&body) {
                prop_assert_eq!(r.encode(), body);
            }
        }

        /// Bytes that look like a request (a valid kind and head) with any count: the count
        /// is checked against the bytes there before anything is allocated.
        #[test]
        fn a_request_head_with_any_count(kind in prop_oneof![1u8..=2, 7u8..=10], count in any::<u32>(),
                                         tail in proptest::collection::vec(any::<u8>(), 0..256)) {
            let mut body = vec![kind];
            body.extend_from_slice(&[0u8; 48]);
            body.extend_from_slice(&count.to_le_bytes());
            body.extend_from_slice(&tail);
            match Request::decode(&body) {
                Ok(Request::Import { buffers, .. } | Request::Released { buffers, .. }
                   | Request::Shared { buffers, .. }) => {
                    prop_assert_eq!(buffers.len() * BUFFER, tail.len());
                }
                Ok(Request::Control { .. }) => prop_assert!(false, "kinds with buffers only"),
                Err(e) => prop_assert!(matches!(e, DecodeError::Truncated
                    | DecodeError::TrailingBytes(_) | DecodeError::TooManyBuffers(_))),
            }
        }
    }

    #[test]
    fn strict_decoding() {
        let r = Request::Released {
            from: Identity {
                pid: 1,
                start: 2,
                nonce: 3,
            },
            to: Identity {
                pid: 4,
                start: 5,
                nonce: 6,
            },
            group: -7,
            buffers: vec![Buffer {
                id: 8,
                key: 10,
                generation: 9,
            }],
        };
        let mut b = r.encode();
        b.push(0);
        assert_eq!(Request::decode(&b), Err(DecodeError::TrailingBytes(1)));
        b.truncate(b.len() - 2);
        assert_eq!(Request::decode(&b), Err(DecodeError::Truncated));
        assert_eq!(
            Request::decode(&[0x7f]),
            Err(DecodeError::UnknownKind(0x7f))
        );
        assert_eq!(Request::decode(&[]), Err(DecodeError::Empty));
        assert_eq!(
            Request::decode(&vec![1u8; MAX_FRAME + 1]),
            Err(DecodeError::TooLong(MAX_FRAME + 1))
        );
        assert_eq!(
            Reply::decode(&[R_DONE, 0]),
            Err(DecodeError::TrailingBytes(1))
        );
        assert_eq!(
            Reply::decode(&[R_REFUSED, 2, 0, 0xff, 0xfe]),
            Err(DecodeError::BadText)
        );
        let long = Reply::Refused {
            reason: "é".repeat(MAX_TEXT),
        };
        assert!(
            matches!(Reply::decode(&long.encode()), Ok(Reply::Refused { reason }) if reason.len() <= MAX_TEXT)
        );
    }

    #[test]
    fn control_requests_are_bounded() {
        let id = Identity {
            pid: 1,
            start: 2,
            nonce: 3,
        };
        let pause = |tags: Vec<String>| Request::Control {
            from: id,
            to: id,
            group: 4,
            op: Control::Pause { tags },
        };
        // A tag of length 0, or of 65 bytes, is refused by the decoder and by `check`.
        let mut b = pause(vec!["a".into()]).encode();
        let n = b.len();
        b[n - 2] = 0;
        b.truncate(n - 1);
        assert_eq!(Request::decode(&b), Err(DecodeError::BadText));
        let long = Control::Pause {
            tags: vec!["x".repeat(MAX_TAG + 1)],
        };
        assert!(long.check().is_err());
        let mut b = pause(vec!["x".repeat(MAX_TAG)]).encode();
        let n = b.len();
        b[n - MAX_TAG - 1] = (MAX_TAG + 1) as u8;
        b.push(b'x');
        assert_eq!(Request::decode(&b), Err(DecodeError::BadText));
        // A profile larger than a frame holds is refused before anything is sent.
        let run = Control::Run {
            source: "p.yaml".into(),
            stage: "wake".into(),
            profile: "#".repeat(MAX_FRAME),
        };
        assert!(run.check().unwrap_err().contains("carries at most"));
        assert!(Control::Stats.check().is_ok());
        assert_eq!(
            Reply::decode(
                &Reply::Error {
                    status: 2,
                    message: "é".repeat(MAX_MESSAGE)
                }
                .encode()
            )
            .map(|r| matches!(r, Reply::Error { message, .. } if message.len() <= MAX_MESSAGE)),
            Ok(true)
        );
    }

    #[test]
    fn a_request_naming_too_many_tags_names_the_tag_limit() {
        let id = Identity {
            pid: 1,
            start: 2,
            nonce: 3,
        };
        let tags: Vec<String> = (0..2000).map(|i| format!("t{i}")).collect();
        let mut body = vec![PAUSE];
        put_identity(&mut body, &id);
        put_identity(&mut body, &id);
        body.extend_from_slice(&4i64.to_le_bytes());
        body.extend_from_slice(&(tags.len() as u16).to_le_bytes());
        for t in &tags {
            body.push(t.len() as u8);
            body.extend_from_slice(t.as_bytes());
        }
        let e = Request::decode(&body).unwrap_err();
        assert_eq!(e.to_string(), "2000 tags (at most 1024)");
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(10)
    }

    #[test]
    fn frames_carry_an_fd_and_refuse_oversized_lengths() {
        use std::io::Write;
        use std::os::fd::AsFd;
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let f = std::fs::File::open("/dev/null").unwrap();
        write_frame(a.as_fd(), &Reply::Done.encode(), Some(f.as_fd()), soon()).unwrap();
        write_frame(a.as_fd(), &Reply::Failed { id: 3 }.encode(), None, soon()).unwrap();
        let (body, fd) = read_frame(b.as_fd(), soon()).unwrap();
        assert_eq!(Reply::decode(&body), Ok(Reply::Done));
        assert!(fd.is_some());
        let (body, fd) = read_frame(b.as_fd(), soon()).unwrap();
        assert_eq!(Reply::decode(&body), Ok(Reply::Failed { id: 3 }));
        assert!(fd.is_none());
        (&a).write_all(&u32::MAX.to_le_bytes()).unwrap();
        let e = read_frame(b.as_fd(), soon()).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        drop(a);
        let e = read_frame(b.as_fd(), soon()).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
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
