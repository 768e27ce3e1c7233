//! Cross-process references of NCCL's memory: who imported what, and the messages that let
//! owners and importers release and rebuild them together.
//!
//! NCCL shares a P2P buffer by exporting its handle as a POSIX fd, sending the fd over its own
//! Unix socket and importing it in the peer. An exported fd does not say which buffer it is, so
//! the export wrapper hands NCCL a **token** instead: a sealed memfd holding (group, owner pid,
//! virtual handle, generation). The importer's wrapper recognises the token (a memfd with
//! exactly our seals), asks the owner's memsaver for the real fd over memsaver's own socket, and
//! imports that. So the owner knows every importer of each buffer, and every importer knows the
//! owner and buffer behind each import.
//!
//! Each process that exports serves `<runtime dir>/g<group>/<pid>.sock` (directories mode
//! 0700, peers' uid checked with `SO_PEERCRED`). Requests are text lines, sent as one burst;
//! answers, in request order, a 16-byte record with the fd attached (`SCM_RIGHTS`):
//!
//! * `FD <vh> <generation> <pid>`: the real fd of buffer `vh` once its generation is at least `generation`
//!   (an owner still resuming is waited for, up to the timeout); records `pid` as an importer.
//! * `REL <vh> <generation> <pid>`: `pid` released its import of generation `generation`.

use std::io::{BufRead, BufReader, IoSlice, IoSliceMut, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use nix::sys::socket::{
    ControlMessage, ControlMessageOwned, MsgFlags, UnixAddr, getsockopt, recvmsg, sendmsg, sockopt,
};

use memsaver_allocator::driver::Handle;
use memsaver_allocator::options;

use crate::registry;

const MAGIC: &[u8] = b"memsaver-token-v1";
const SEALS: libc::c_int =
    libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;

const OK: u32 = 0;
const UNKNOWN: u32 = 1;
const NOT_READY: u32 = 2;
const FAILED: u32 = 3;

/// What a token names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Token {
    pub group: i64,
    pub pid: u32,
    pub vh: u64,
    pub generation: u64,
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
        "{} {} {} {} {}\n",
        std::str::from_utf8(MAGIC).unwrap_or(""),
        t.group,
        t.pid,
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
    let mut buf = [0u8; 160];
    // SAFETY: `buf` is writable for its length; pread does not move the shared offset.
    let n = unsafe { libc::pread(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
    let text = std::str::from_utf8(buf.get(..usize::try_from(n).ok()?)?).ok()?;
    let mut it = text.split_whitespace();
    if it.next()?.as_bytes() != MAGIC {
        return None;
    }
    Some(Token {
        group: it.next()?.parse().ok()?,
        pid: it.next()?.parse().ok()?,
        vh: it.next()?.parse().ok()?,
        generation: it.next()?.parse().ok()?,
    })
}

/// The runtime directory (`MEMSAVER_RUNTIME_DIR`, else `$XDG_RUNTIME_DIR/memsaver`, else
/// `/tmp/memsaver-<uid>`); nothing is created.
pub(crate) fn runtime_dir() -> PathBuf {
    options::get().runtime_dir.clone()
}

/// `<base>/g<group>`, created mode 0700 and checked to be ours.
fn group_dir(group: i64) -> std::io::Result<PathBuf> {
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    let base = runtime_dir();
    let dir = base.join(format!("g{group}"));
    for d in [&base, &dir] {
        match std::fs::DirBuilder::new().mode(0o700).create(d) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        let m = std::fs::metadata(d)?;
        if m.uid() != uid || m.permissions().mode() & 0o077 != 0 {
            return Err(std::io::Error::other(format!(
                "{} must belong to uid {uid} with mode 0700 (set MEMSAVER_RUNTIME_DIR to a private directory)",
                d.display()
            )));
        }
    }
    Ok(dir)
}

fn socket_path(group: i64, pid: u32) -> std::io::Result<PathBuf> {
    Ok(group_dir(group)?.join(format!("{pid}.sock")))
}

/// The group this process's server serves, once it has started (its socket lives in that
/// group's directory, and the tokens handed out name it).
static SERVER_GROUP: OnceLock<i64> = OnceLock::new();

pub(crate) fn server_group() -> Option<i64> {
    SERVER_GROUP.get().copied()
}

/// Starts this process's server (once). Called before the first token is handed out.
pub(crate) fn ensure_server() -> std::io::Result<()> {
    static STARTED: OnceLock<Result<(), String>> = OnceLock::new();
    STARTED
        .get_or_init(|| {
            let group = *SERVER_GROUP.get_or_init(crate::amem::group_id);
            let path = socket_path(group, std::process::id()).map_err(|e| e.to_string())?;
            // Only our own pid's file: a leftover of an earlier process with our pid.
            let _ = std::fs::remove_file(&path);
            let listener =
                UnixListener::bind(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            std::thread::Builder::new()
                .name("memsaver-nccl".into())
                .spawn(move || {
                    for conn in listener.incoming().flatten() {
                        let _ = std::thread::Builder::new()
                            .name("memsaver-nccl-conn".into())
                            .spawn(move || serve(conn));
                    }
                })
                .map_err(|e| e.to_string())?;
            Ok(())
        })
        .clone()
        .map_err(std::io::Error::other)
}

fn reply(
    stream: &UnixStream,
    status: u32,
    generation: u64,
    fd: Option<&OwnedFd>,
) -> nix::Result<usize> {
    let mut rec = [0u8; 16];
    rec[..4].copy_from_slice(&status.to_le_bytes());
    rec[8..].copy_from_slice(&generation.to_le_bytes());
    let fds = fd.map(|f| [f.as_raw_fd()]);
    let cmsg: Vec<ControlMessage> = fds
        .as_ref()
        .map(|f| vec![ControlMessage::ScmRights(f)])
        .unwrap_or_default();
    sendmsg::<UnixAddr>(
        stream.as_raw_fd(),
        &[IoSlice::new(&rec)],
        &cmsg,
        MsgFlags::empty(),
        None,
    )
}

/// A request line: `FD|REL <vh> <generation> <pid>`.
#[derive(Clone, Copy)]
struct Request {
    fd: bool,
    vh: u64,
    generation: u64,
    pid: u32,
}

fn parse_request(line: &str) -> Option<Request> {
    let f: Vec<&str> = line.split_whitespace().collect();
    let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok());
    Some(Request {
        fd: match *f.first()? {
            "FD" => true,
            "REL" => false,
            _ => return None,
        },
        vh: num(1)?,
        generation: num(2)?,
        pid: u32::try_from(num(3)?).ok()?,
    })
}

/// One connection from a peer: requests until it closes. A peer sends its requests as one
/// burst; every line already received is answered together, under one hold of the registry
/// lock per pass, so that a process busy resuming serves a peer's hundreds of buffers in one
/// go instead of one per turn of the lock.
fn serve(stream: UnixStream) {
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    match getsockopt(&stream, sockopt::PeerCredentials) {
        Ok(c) if c.uid() == uid => {}
        _ => {
            tracing::warn!("memsaver: refused a connection from another user");
            return;
        }
    }
    let Ok(read_half) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::with_capacity(1 << 16, read_half);
    loop {
        let mut batch = Vec::new();
        loop {
            let mut line = String::new();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) if batch.is_empty() => return,
                Ok(0) | Err(_) => break,
                Ok(_) => match parse_request(&line) {
                    Some(r) => batch.push(r),
                    None => return,
                },
            }
            if reader.buffer().is_empty() {
                break;
            }
        }
        if answer(&stream, &batch).is_err() {
            return;
        }
    }
}

/// Answers `batch` in order. `FD`: the real fd of buffer `vh` once its generation is at
/// least `generation` (waiting for an owner still resuming, up to the timeout), recording
/// `pid` as an importer. `REL`: `pid` let go of its import of that generation.
fn answer(stream: &UnixStream, batch: &[Request]) -> nix::Result<()> {
    let deadline = Instant::now() + timeout();
    // Before the registry lock: this may start the allocator. The driver whatever the options
    // say: a peer's import must be served.
    let driver = crate::driver();
    let mut next = 0;
    while next < batch.len() {
        let mut replies: Vec<(u32, u64, Option<OwnedFd>)> = Vec::new();
        {
            let mut reg = registry::lock();
            for r in &batch[next..] {
                let Some(p) = reg.physicals.get_mut(&r.vh) else {
                    replies.push((if r.fd { UNKNOWN } else { OK }, r.generation, None));
                    continue;
                };
                if !r.fd {
                    if p.generation == r.generation {
                        p.importers.remove(&r.pid);
                    }
                    replies.push((OK, r.generation, None));
                    continue;
                }
                // A buffer that stays resident through pauses (host memory, given to a NIC,
                // ...) keeps its generation: serve it as it is. Otherwise wait until the owner
                // has re-created the generation asked for.
                let stays = p.pausable().is_err();
                let Some(h) = p.real.filter(|_| stays || p.generation >= r.generation) else {
                    break; // not restored yet: answers go out in order, wait
                };
                match driver.clone().and_then(|d| Ok(d.export_fd(Handle(h))?)) {
                    Ok(fd) => {
                        p.importers.insert(r.pid);
                        replies.push((OK, p.generation, Some(fd)));
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "memsaver: cannot export an NCCL buffer to a peer");
                        replies.push((FAILED, 0, None));
                    }
                }
            }
        }
        for (status, generation, fd) in &replies {
            reply(stream, *status, *generation, fd.as_ref())?;
        }
        next += replies.len();
        if next < batch.len() {
            if Instant::now() >= deadline {
                for _ in next..batch.len() {
                    reply(stream, NOT_READY, 0, None)?;
                }
                return Ok(());
            }
            std::thread::sleep(Duration::from_micros(500));
        }
    }
    Ok(())
}

/// Sends `lines` to the server of `owner` and reads one answer per line.
fn exchange(
    group: i64,
    owner: u32,
    lines: &[String],
) -> Result<Vec<(u32, u64, Option<OwnedFd>)>, String> {
    let path = socket_path(group, owner).map_err(|e| e.to_string())?;
    let mut stream = UnixStream::connect(&path)
        .map_err(|e| format!("process {owner} ({}): {e}", path.display()))?;
    stream
        .set_read_timeout(Some(timeout() + Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    let mut text = lines.join("\n");
    text.push('\n');
    stream
        .write_all(text.as_bytes())
        .map_err(|e| format!("process {owner}: {e}"))?;
    let mut out = Vec::with_capacity(lines.len());
    for _ in lines {
        let mut rec = [0u8; 16];
        let mut space = nix::cmsg_space!([RawFd; 1]);
        let mut iov = [IoSliceMut::new(&mut rec)];
        let msg = recvmsg::<UnixAddr>(
            stream.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(|e| format!("process {owner}: {e}"))?;
        if msg.bytes != 16 {
            return Err(format!(
                "process {owner} closed the connection (did it exit?)"
            ));
        }
        let mut fd = None;
        for c in msg.cmsgs().map_err(|e| e.to_string())? {
            if let ControlMessageOwned::ScmRights(fds) = c {
                // SAFETY: fds received with SCM_RIGHTS are new descriptors we own.
                fd = fds.first().map(|f| unsafe { OwnedFd::from_raw_fd(*f) });
            }
        }
        let status = u32::from_le_bytes(rec[..4].try_into().expect("4 bytes"));
        let generation = u64::from_le_bytes(rec[8..].try_into().expect("8 bytes"));
        out.push((status, generation, fd));
    }
    Ok(out)
}

/// The real fds of buffers `(vh, generation)` of `owner`, with the generation each one is.
pub(crate) fn request_fds(
    group: i64,
    owner: u32,
    wants: &[(u64, u64)],
) -> Result<Vec<(OwnedFd, u64)>, String> {
    let me = std::process::id();
    let lines: Vec<String> = wants
        .iter()
        .map(|(vh, generation)| format!("FD {vh} {generation} {me}"))
        .collect();
    exchange(group, owner, &lines)?
        .into_iter()
        .zip(wants)
        .map(|((status, generation, fd), (vh, want))| match (status, fd) {
            (OK, Some(fd)) => Ok((fd, generation)),
            (NOT_READY, _) => Err(format!(
                "process {owner} did not resume buffer {vh:#x} (generation {want}) within {} ms; it must resume 'nccl' too",
                timeout().as_millis()
            )),
            (UNKNOWN, _) => Err(format!("process {owner} no longer has buffer {vh:#x}")),
            _ => Err(format!("process {owner} could not export buffer {vh:#x}")),
        })
        .collect()
}

/// Tells `owner` that this process released its imports `(vh, generation)`.
pub(crate) fn notify_released(group: i64, owner: u32, items: &[(u64, u64)]) -> Result<(), String> {
    let me = std::process::id();
    let lines: Vec<String> = items
        .iter()
        .map(|(vh, generation)| format!("REL {vh} {generation} {me}"))
        .collect();
    exchange(group, owner, &lines).map(drop)
}

/// Whether process `pid` is alive.
pub(crate) fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks existence and permission.
    unsafe { libc::kill(pid as libc::pid_t, 0) == 0 }
}
