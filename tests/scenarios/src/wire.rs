//! memsaver's wire protocol spoken by hand (the table is in `ipc/src/protocol.rs`), for
//! tests that play a client an owner's server must refuse: frames built byte by byte, and
//! every reply read with the fds that came with it.

use std::io::{IoSlice, IoSliceMut, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, UnixAddr, recvmsg, sendmsg};

/// NCCL buffers' virtual handles are `VH_BASE | n` (the registry's recognisable prefix).
pub const VH_BASE: u64 = 0x6d73_0000_0000_0000;

/// `Request::Import` (the owner's fds of buffers it exports).
pub const FDS: u8 = 0x01;
pub const RELEASED: u8 = 0x02;
pub const PAUSE: u8 = 0x03;
pub const STATS: u8 = 0x05;
/// An owner asks an importer to release its imports of shared allocations.
pub const RELEASE: u8 = 0x09;
/// `Reply::Export` (an fd attached).
pub const R_FD: u8 = 0x81;
pub const R_DONE: u8 = 0x85;
pub const R_REFUSED: u8 = 0x86;
pub const R_JSON: u8 = 0x87;

/// A process as the wire names it: (pid, start time, nonce).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity {
    pub pid: u32,
    pub start: u64,
    pub nonce: u64,
}

impl Identity {
    /// The owner behind a socket named `<pid>-<start>-<nonce in hex>.sock`.
    pub fn of_socket(path: &Path) -> Identity {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let parts: Vec<&str> = name.trim_end_matches(".sock").split('-').collect();
        assert_eq!(parts.len(), 3, "{name}: <pid>-<start>-<nonce>.sock");
        Identity {
            pid: parts[0].parse().unwrap(),
            start: parts[1].parse().unwrap(),
            nonce: u64::from_str_radix(parts[2], 16).unwrap(),
        }
    }

    /// This process as the `/proc` it sees shows it (its pid in the namespace /proc was
    /// mounted for, which is the parent's under `unshare --pid` without `--mount-proc`), with
    /// nonce `nonce`.
    pub fn this_process(nonce: u64) -> Identity {
        let pid = std::fs::read_link("/proc/self").unwrap();
        Identity {
            pid: pid.to_str().unwrap().parse().unwrap(),
            start: start_time("self"),
            nonce,
        }
    }
}

/// The start time of process `pid` (`/proc/<pid>/stat` field 22, clock ticks after boot).
pub fn start_time(pid: &str) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    stat[stat.rfind(')').unwrap() + 2..]
        .split_whitespace()
        .nth(19)
        .unwrap()
        .parse()
        .unwrap()
}

/// The head every request starts with: kind, sender, addressee, group.
pub fn head(kind: u8, from: Identity, to: Identity, group: i64) -> Vec<u8> {
    let mut b = vec![kind];
    for i in [from, to] {
        b.extend_from_slice(&i.pid.to_le_bytes());
        b.extend_from_slice(&i.start.to_le_bytes());
        b.extend_from_slice(&i.nonce.to_le_bytes());
    }
    b.extend_from_slice(&group.to_le_bytes());
    b
}

/// An `Import` (or, with `kind` `RELEASED`, a `Released`) request for `items`: (vh, key,
/// generation) each.
pub fn items_request(
    kind: u8,
    from: Identity,
    to: Identity,
    group: i64,
    items: &[(u64, u64, u64)],
) -> Vec<u8> {
    let mut b = head(kind, from, to, group);
    b.extend_from_slice(&(items.len() as u32).to_le_bytes());
    for (vh, key, generation) in items {
        b.extend_from_slice(&vh.to_le_bytes());
        b.extend_from_slice(&key.to_le_bytes());
        b.extend_from_slice(&generation.to_le_bytes());
    }
    b
}

/// A control `Pause` of `tags`.
pub fn pause_request(from: Identity, to: Identity, group: i64, tags: &[&str]) -> Vec<u8> {
    let mut b = head(PAUSE, from, to, group);
    b.extend_from_slice(&(tags.len() as u16).to_le_bytes());
    for t in tags {
        b.push(t.len() as u8);
        b.extend_from_slice(t.as_bytes());
    }
    b
}

/// `body` with its length in front.
pub fn frame(body: &[u8]) -> Vec<u8> {
    let mut f = (body.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(body);
    f
}

/// One reply frame: its kind and its text (a refusal's reason, a JSON answer).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    pub kind: u8,
    pub text: String,
}

/// What came back on a connection: every reply frame, and how many fds came with them
/// (closed already: only counted).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Replies {
    pub frames: Vec<Reply>,
    pub fds: usize,
}

/// Sends `body` as one frame on a new connection to `path`, then reads replies until the
/// server closes the connection; an error if it does not within `wait` (a generous bound: the
/// outcome, not the time, is what tests check).
pub fn ask(path: &Path, body: &[u8], wait: Duration) -> std::io::Result<Replies> {
    let mut s = UnixStream::connect(path)?;
    s.set_read_timeout(Some(wait))?;
    s.write_all(&frame(body))?;
    read_replies(&s)
}

/// Every reply frame on `s` until the server closes it.
pub fn read_replies(s: &UnixStream) -> std::io::Result<Replies> {
    let mut bytes = Vec::new();
    let mut fds: Vec<OwnedFd> = Vec::new();
    loop {
        let mut buf = [0u8; 1 << 16];
        let mut space = nix::cmsg_space!([RawFd; 4]);
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = match recvmsg::<UnixAddr>(
            s.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Ok(m) => m,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(nix::errno::Errno::ECONNRESET) => break,
            Err(e) => return Err(std::io::Error::from(e)),
        };
        let n = msg.bytes;
        for c in msg.cmsgs().map_err(std::io::Error::from)? {
            if let ControlMessageOwned::ScmRights(got) = c {
                for f in got {
                    // SAFETY: fds received with SCM_RIGHTS are new descriptors of this process.
                    fds.push(unsafe { OwnedFd::from_raw_fd(f) });
                }
            }
        }
        if n == 0 {
            break;
        }
        bytes.extend_from_slice(&buf[..n]);
    }
    let mut out = Vec::new();
    let mut at = 0;
    while at + 4 <= bytes.len() {
        let len = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        let Some(body) = bytes.get(at + 4..at + 4 + len) else {
            break;
        };
        out.push(Reply {
            kind: body.first().copied().unwrap_or(0),
            text: reply_text(body),
        });
        at += 4 + len;
    }
    Ok(Replies {
        frames: out,
        fds: fds.len(),
    })
}

/// The text a reply body carries: a refusal's reason or a JSON answer; empty for the others.
fn reply_text(body: &[u8]) -> String {
    let text = match body.first() {
        Some(&R_REFUSED) if body.len() >= 3 => &body[3..],
        Some(&R_JSON) if body.len() >= 5 => &body[5..],
        _ => &[][..],
    };
    String::from_utf8_lossy(text).into_owned()
}

/// Sends `bytes` on `s` one byte per message, each with `fd` attached, until all are sent or
/// a send fails (the server closed the connection); how many were sent.
pub fn send_each_byte_with_fd(s: &UnixStream, bytes: &[u8], fd: RawFd) -> usize {
    let fds = [fd];
    bytes
        .iter()
        .take_while(|b| {
            sendmsg::<UnixAddr>(
                s.as_raw_fd(),
                &[IoSlice::new(std::slice::from_ref(*b))],
                &[ControlMessage::ScmRights(&fds)],
                MsgFlags::MSG_NOSIGNAL,
                None,
            )
            .is_ok()
        })
        .count()
}

/// The open fds of process `pid`.
pub fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}
