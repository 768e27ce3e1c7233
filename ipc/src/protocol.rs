//! The messages memsaver processes exchange: typed, encoded little-endian, decoded strictly.
//! They travel in the frames of [`crate::frame`] (length prefix, fd passing, bounds, one
//! deadline per frame), whose reading and writing are re-exported here.
//!
//! A frame's body is one kind byte and the kind's fields, little-endian, nothing after them.
//! A body that is too long (over [`MAX_FRAME`]), too short, of an unknown kind, with a count
//! that does not match its length or with bytes left over is an error: the connection is
//! closed, nothing is guessed. One connection carries one request; the server answers it and
//! closes.
//!
//! Three services share the wire ([`crate::server`] routes each request to the layer that
//! answers it): the **buffers** an owner exports to its peers (imports and their release),
//! **control** of one process by another ([`crate::control`]), and **shared** memory: any
//! tag's allocations opened by other processes through CUDA IPC handles ([`crate::shared`]),
//! whose owner makes the importers let go and map again around its pauses and resumes.
//!
//! | kind | message | fields | answer |
//! | --- | --- | --- | --- |
//! | 0x01 | [`Request::Import`] | from, to (identities), group, buffers (id, key, generation) | one [`Reply::Export`] (fd attached), `NotReady`, `Failed`, `Gone` or `Error` (the owner's resume failed and left the buffer paused: its message) per buffer, in order; or `Refused` (not admitted, or a buffer that the owner neither has nor freed with that key) |
//! | 0x02 | [`Request::Released`] | from, to, group, buffers | [`Reply::Done`], or `Refused` |
//! | 0x0b | [`Request::PauseFailed`] | from, to, group, message (`u16` length, UTF-8, at most [`MAX_TEXT`] bytes) | `Done`, or `Refused` |
//! | 0x03 | [`Control::Pause`] | from, to, group, tags | `Done`, `Error` or `Refused` |
//! | 0x04 | [`Control::Resume`] | from, to, group, tags | `Done`, `Error` or `Refused` |
//! | 0x05 | [`Control::Stats`] | from, to, group | `Json`, `Error` or `Refused` |
//! | 0x06 | [`Control::Run`] | from, to, group, source, stage, profile text | `Json` (the stage's report), `Error` or `Refused` |
//! | 0x07 | [`Request::Shared`] [`Share::Open`] | from, to, group, buffers | one [`Reply::Shared`] (fd attached), `NotReady` or `Failed` per buffer, in order; or `Refused` |
//! | 0x08 | [`Request::Shared`] [`Share::Close`] | from, to, group, buffers | `Done`, or `Refused` |
//! | 0x09 | [`Request::Shared`] [`Share::Release`] (owner to importer) | from, to, group, buffers | `Done` once the importer unmapped and released them, or `Refused` |
//! | 0x0a | [`Request::Shared`] [`Share::Rebuild`] (owner to importer) | from, to, group, buffers (the new generation) | `Done` once the importer mapped them again (`Error` if it could not), or `Refused` |
//! | 0x81 | [`Reply::Export`] | id, generation, offset, size (of the memory the fd is), epoch (the owner's, when served: [`crate::epoch`]); the fd by `SCM_RIGHTS` | |
//! | 0x83 | [`Reply::NotReady`] | id: not restored within the owner's wait | |
//! | 0x84 | [`Reply::Failed`] | id: the owner's export failed | |
//! | 0x8a | [`Reply::Gone`] | id: the owner freed the buffer, which the importer still held | |
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
//! key makes the owner refuse the whole request, saying nothing of which part was wrong; one it
//! had with that key and freed while importers held it is answered `Gone` (the owner keeps a
//! tombstone of it for as long as they may name it: [`crate::shared`]).

pub use crate::identity::Identity;

pub use crate::frame::{FrameReader, MAX_FRAME, read_frame, write_frame};
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
    /// `from`'s own pause failed and left some of its imports of the addressee's buffers
    /// mapped: its error (at most [`MAX_TEXT`] bytes). The owner waiting for those stops
    /// waiting for `from`, and names it with that error.
    PauseFailed {
        from: Identity,
        to: Identity,
        group: i64,
        message: String,
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
    /// The owner exports buffer `id` at `generation`: its fd comes with the frame. The fd is
    /// of memory of `size` bytes in which the buffer starts at `offset`: the buffer's own
    /// (0 and the buffer's size) or one the owner shares between adjacent buffers, which an
    /// importer maps whole, `offset` bytes before where it maps the buffer. `epoch`: the
    /// owner's epoch when it served it ([`crate::epoch`]): while the owner's published epoch is
    /// no later, the generation served is the owner's current one.
    Export {
        id: u64,
        generation: u64,
        offset: u64,
        size: u64,
        epoch: u64,
    },
    /// Buffer `id` was not restored within the owner's wait.
    NotReady {
        id: u64,
    },
    /// The owner's export of buffer `id` failed.
    Failed {
        id: u64,
    },
    /// The owner freed buffer `id` (its NCCL did, say) while the importer held it: there is
    /// nothing to map any more, and the importer lets go of its import. Distinct from a
    /// refusal, which says the asker has no right to the id and key it named.
    Gone {
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
const R_GONE: u8 = 0x8a;
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
const PAUSE_FAILED: u8 = 0x0b;

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
            | Self::PauseFailed {
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
            Self::PauseFailed { .. } => PAUSE_FAILED,
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
            Self::PauseFailed { message, .. } => {
                let message = clip(message, MAX_TEXT);
                out.extend_from_slice(&(message.len() as u16).to_le_bytes());
                out.extend_from_slice(message.as_bytes());
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
            IMPORT
                | RELEASED
                | PAUSE_FAILED
                | PAUSE
                | RESUME
                | STATS
                | RUN
                | OPEN
                | CLOSE
                | RELEASE
                | REBUILD
        ) {
            return Err(DecodeError::UnknownKind(kind));
        }
        let from = c.identity()?;
        let to = c.identity()?;
        let group = c.u64()? as i64;
        if kind == PAUSE_FAILED {
            let n = c.u16()? as usize;
            let message = c.text(n, MAX_TEXT)?;
            c.finish()?;
            return Ok(Self::PauseFailed {
                from,
                to,
                group,
                message,
            });
        }
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

/// What of a control request is beyond the protocol's limits ([`Control::check`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Beyond {
    #[error("{0} tags (at most {MAX_TAGS})")]
    Tags(usize),
    #[error("invalid tag {0:?}: a tag has 1 to {MAX_TAG} characters")]
    Tag(String),
    #[error("a profile name or stage name longer than {MAX_TEXT} bytes")]
    Name,
    #[error("{name}: the profile has {bytes} bytes; a control request carries at most {room}")]
    Profile {
        name: String,
        bytes: usize,
        room: usize,
    },
}

impl Control {
    /// Whether the fields are within the protocol's limits (a client checks before sending:
    /// [`Request::encode`] would make a frame the server refuses); else what is beyond them.
    pub fn check(&self) -> Result<(), Beyond> {
        match self {
            Self::Pause { tags } | Self::Resume { tags } => {
                if tags.len() > MAX_TAGS {
                    return Err(Beyond::Tags(tags.len()));
                }
                match tags.iter().find(|t| t.is_empty() || t.len() > MAX_TAG) {
                    Some(t) => Err(Beyond::Tag(t.clone())),
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
                    return Err(Beyond::Name);
                }
                let room = MAX_FRAME - REQUEST_HEAD - 8 - source.len() - stage.len();
                if profile.len() > room {
                    return Err(Beyond::Profile {
                        name: source.clone(),
                        bytes: profile.len(),
                        room,
                    });
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
            Self::Export {
                id,
                generation,
                offset,
                size,
                epoch,
            } => {
                out.push(R_EXPORT);
                for v in [id, generation, offset, size, epoch] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
            Self::NotReady { id } | Self::Failed { id } | Self::Gone { id } => {
                out.push(match self {
                    Self::NotReady { .. } => R_NOT_READY,
                    Self::Failed { .. } => R_FAILED,
                    _ => R_GONE,
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
                offset: c.u64()?,
                size: c.u64()?,
                epoch: c.u64()?,
            },
            R_NOT_READY => Self::NotReady { id: c.u64()? },
            R_FAILED => Self::Failed { id: c.u64()? },
            R_GONE => Self::Gone { id: c.u64()? },
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
            0u8..5,
            identity(),
            identity(),
            any::<i64>(),
            buffers(),
            control(),
            share(),
            "\\PC{0,64}",
        )
            .prop_map(
                |(kind, from, to, group, buffers, op, share, message)| match kind {
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
                    3 => Request::PauseFailed {
                        from,
                        to,
                        group,
                        message,
                    },
                    _ => Request::Control {
                        from,
                        to,
                        group,
                        op,
                    },
                },
            )
    }

    fn reply() -> impl Strategy<Value = Reply> {
        prop_oneof![
            (
                any::<u64>(),
                any::<u64>(),
                any::<u64>(),
                any::<u64>(),
                any::<u64>()
            )
                .prop_map(|(id, generation, offset, size, epoch)| Reply::Export {
                    id,
                    generation,
                    offset,
                    size,
                    epoch,
                }),
            any::<u64>().prop_map(|id| Reply::NotReady { id }),
            any::<u64>().prop_map(|id| Reply::Failed { id }),
            any::<u64>().prop_map(|id| Reply::Gone { id }),
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
                Ok(Request::Control { .. } | Request::PauseFailed { .. }) => {
                    prop_assert!(false, "kinds with buffers only")
                }
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

    /// `Gone` is its kind byte and the id, little-endian: a byte fewer or more does not decode,
    /// and it is not mistaken for `Failed` (an importer drops an import on the one, and
    /// reports the other).
    #[test]
    fn a_gone_reply_is_its_kind_and_an_id() {
        let b = Reply::Gone { id: 0x0102 }.encode();
        assert_eq!(b, [R_GONE, 2, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(Reply::decode(&b), Ok(Reply::Gone { id: 0x0102 }));
        assert_eq!(Reply::decode(&b[..8]), Err(DecodeError::Truncated));
        let mut longer = b.clone();
        longer.push(0);
        assert_eq!(Reply::decode(&longer), Err(DecodeError::TrailingBytes(1)));
        assert_ne!(Reply::Failed { id: 0x0102 }.encode(), b);
    }

    /// A message of exactly `MAX_FRAME` bytes decodes; one byte more is refused as too long
    /// (and a request of `MAX_BUFFERS` buffers fits in a frame).
    #[test]
    fn a_message_of_exactly_the_maximum_decodes_and_one_byte_more_does_not() {
        let r = Reply::Json {
            text: "j".repeat(MAX_FRAME - 5),
        };
        let mut b = r.encode();
        assert_eq!(b.len(), MAX_FRAME);
        assert_eq!(Reply::decode(&b), Ok(r));
        b.push(b'j');
        b[1..5].copy_from_slice(&((MAX_FRAME - 4) as u32).to_le_bytes());
        assert_eq!(Reply::decode(&b), Err(DecodeError::TooLong(MAX_FRAME + 1)));
        let id = Identity {
            pid: 1,
            start: 2,
            nonce: 3,
        };
        let full = Request::Import {
            from: id,
            to: id,
            group: 0,
            buffers: vec![
                Buffer {
                    id: 1,
                    key: 2,
                    generation: 3
                };
                MAX_BUFFERS
            ],
        };
        let b = full.encode();
        assert!(b.len() <= MAX_FRAME && b.len() + BUFFER > MAX_FRAME);
        assert_eq!(Request::decode(&b), Ok(full));
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
        assert!(
            run.check()
                .unwrap_err()
                .to_string()
                .contains("carries at most")
        );
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
}
