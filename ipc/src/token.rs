//! Tokens: what an owner hands out instead of an exported buffer's fd, so that the owner
//! learns who imports what.
//!
//! An exported fd does not say which buffer it is. So when a layer that exports a buffer
//! (nccl-hook, for NCCL's buffers and the allocations NCCL registers) would hand out an fd, it hands out a **token** instead: a
//! sealed memfd holding (group, owner identity, buffer id, key, generation, and where the
//! buffer lies in the owner: address and length, 0 when it says nothing). The importer's
//! layer recognises the token ([`read`]: a memfd with exactly these seals and the magic) and
//! trades it for the real fd with the owner's server ([`crate::shared::requests::import`]). So the owner
//! knows every importer of each buffer, and every importer knows the owner and buffer behind
//! each import. The **key** is 64 random bits the owner draws when it first exports a buffer
//! ([`crate::identity::new_key`]): the owner hands out the buffer's fd only to a request that
//! carries it, so only a process that was given the token can get the memory.
//!
//! A token names one of two things ([`Names`]): a buffer of a layer above, by that layer's id
//! (served by [`crate::server::Service::Buffers`]), or an allocation of the memsaver allocator
//! (by allocation id, served by the owner's ledger, [`crate::shared`], like a CUDA IPC handle of
//! it: its imports follow the owner's tag).
//!
//! The owner's address of a buffer lets an importer lay out its imports of one owner as the
//! owner lays them out (at the same distances from each other), so that memory the owner backs
//! with one allocation for several adjacent buffers can be mapped whole in the importer too.

use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::identity::{self, Identity};

const MAGIC: &[u8] = b"memsaver-token-v6";
const SEALS: libc::c_int =
    libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;

/// What kind of memory a token names, and so which service of the owner serves it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Names {
    /// A buffer a layer above exports by its own id (nccl-hook: a buffer NCCL created, by its
    /// virtual handle), served by that layer ([`crate::server::Service::Buffers`]).
    Buffer,
    /// An allocation of the owner's allocator (a tagged tensor, registered by NCCL for example),
    /// by its id, served by the owner's ledger ([`crate::shared`]).
    Allocation,
}

impl Names {
    fn word(self) -> &'static str {
        match self {
            Names::Buffer => "buffer",
            Names::Allocation => "allocation",
        }
    }

    fn parse(w: &str) -> Option<Self> {
        [Names::Buffer, Names::Allocation]
            .into_iter()
            .find(|n| n.word() == w)
    }
}

/// What a token names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Token {
    pub names: Names,
    pub group: i64,
    pub pid: u32,
    /// The owner's start time and nonce (with `pid`, its identity).
    pub start: u64,
    pub nonce: u64,
    /// The buffer's id at the owner (a virtual handle, or an allocation id).
    pub buffer: u64,
    /// The buffer's key: what the owner asks of whoever names the buffer.
    pub key: u64,
    pub generation: u64,
    /// Where the buffer lies in the owner: its address and length (0 and 0: not said).
    pub place: u64,
    pub len: u64,
}

impl Token {
    /// A token of this process for its buffer `buffer` (of kind `names`), whose key is `key`.
    pub fn own(names: Names, group: i64, buffer: u64, key: u64, generation: u64) -> Self {
        let me = identity::me();
        Self {
            names,
            group,
            pid: me.pid,
            start: me.start,
            nonce: me.nonce,
            buffer,
            key,
            generation,
            place: 0,
            len: 0,
        }
    }

    /// The same token, saying that the buffer lies at `place` for `len` bytes in the owner.
    pub fn at(self, place: u64, len: u64) -> Self {
        Self { place, len, ..self }
    }

    /// The owner's identity.
    pub fn owner(&self) -> Identity {
        Identity {
            pid: self.pid,
            start: self.start,
            nonce: self.nonce,
        }
    }
}

/// A sealed memfd holding `t`.
pub fn make(t: Token) -> std::io::Result<OwnedFd> {
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
        "{} {} {} {} {} {} {} {} {} {} {}\n",
        std::str::from_utf8(MAGIC).unwrap_or(""),
        t.names.word(),
        t.group,
        t.pid,
        t.start,
        t.nonce,
        t.buffer,
        t.key,
        t.generation,
        t.place,
        t.len
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
pub fn read(fd: RawFd) -> Option<Token> {
    // SAFETY: F_GET_SEALS on any fd is harmless: it fails with EINVAL for non-memfds.
    if unsafe { libc::fcntl(fd, libc::F_GET_SEALS) } != SEALS {
        return None;
    }
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its length; pread does not move the shared offset.
    let n = unsafe { libc::pread(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
    let text = std::str::from_utf8(buf.get(..usize::try_from(n).ok()?)?).ok()?;
    let mut it = text.split_whitespace();
    if it.next()?.as_bytes() != MAGIC {
        return None;
    }
    let t = Token {
        names: Names::parse(it.next()?)?,
        group: it.next()?.parse().ok()?,
        pid: it.next()?.parse().ok()?,
        start: it.next()?.parse().ok()?,
        nonce: it.next()?.parse().ok()?,
        buffer: it.next()?.parse().ok()?,
        key: it.next()?.parse().ok()?,
        generation: it.next()?.parse().ok()?,
        place: it.next()?.parse().ok()?,
        len: it.next()?.parse().ok()?,
    };
    it.next().is_none().then_some(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_reject_extra_fields() {
        for names in [Names::Buffer, Names::Allocation] {
            let t = Token::own(
                names,
                -3,
                0x6d73_0000_0000_0007,
                identity::new_key().unwrap(),
                2,
            )
            .at(0x7f00_0020_0000, 4 << 20);
            assert_eq!(t.pid, std::process::id());
            let fd = make(t).unwrap();
            assert_eq!(read(fd.as_raw_fd()), Some(t));
        }
        let f = std::fs::File::open("/dev/null").unwrap();
        assert_eq!(read(f.as_raw_fd()), None);
    }

    /// A memfd holding `text`, with `seals` added (none when 0).
    fn memfd_with(text: &str, seals: libc::c_int) -> OwnedFd {
        // SAFETY: NUL-terminated name; valid flags.
        let fd = unsafe { libc::memfd_create(c"forged".as_ptr(), libc::MFD_ALLOW_SEALING) };
        assert!(fd >= 0, "{}", std::io::Error::last_os_error());
        // SAFETY: a new fd we own.
        let mut f = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        f.write_all(text.as_bytes()).unwrap();
        let fd = OwnedFd::from(f);
        if seals != 0 {
            // SAFETY: a valid fd; F_ADD_SEALS takes an int.
            let rc = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) };
            assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        }
        fd
    }

    /// The text of a genuine token is not enough: an fd is a token only when it is sealed
    /// exactly as `make` seals it (so its text can never change after the owner wrote it).
    #[test]
    fn the_text_of_a_token_without_its_seals_is_no_token() {
        let t = Token::own(Names::Allocation, 2, 7, 0x1234_5678_9abc_def0, 1);
        let genuine = make(t).unwrap();
        let mut buf = [0u8; 256];
        let n = std::os::unix::fs::FileExt::read_at(
            &std::fs::File::from(genuine.try_clone().unwrap()),
            &mut buf,
            0,
        )
        .unwrap();
        let text = String::from_utf8(buf[..n].to_vec()).unwrap();
        assert!(
            text.starts_with("memsaver-token-v6 allocation 2 "),
            "{text}"
        );
        assert_eq!(read(genuine.as_raw_fd()), Some(t));
        // The same bytes, sealed exactly as a token: taken.
        assert_eq!(read(memfd_with(&text, SEALS).as_raw_fd()), Some(t));
        // Unsealed: still writable by whoever holds it.
        assert_eq!(read(memfd_with(&text, 0).as_raw_fd()), None);
        // Each seal of the set missing (the sealing left open, or a write, shrink or grow
        // still allowed), and one seal too many: all refused.
        for seal in [
            libc::F_SEAL_SEAL,
            libc::F_SEAL_SHRINK,
            libc::F_SEAL_GROW,
            libc::F_SEAL_WRITE,
        ] {
            let fd = memfd_with(&text, SEALS & !seal);
            assert_eq!(read(fd.as_raw_fd()), None, "without seal {seal:#x}");
        }
        let fd = memfd_with(&text, SEALS | libc::F_SEAL_FUTURE_WRITE);
        assert_eq!(read(fd.as_raw_fd()), None, "with F_SEAL_FUTURE_WRITE");
        // A file that is no memfd, holding the same text.
        let dir = std::env::temp_dir().join(format!("memsaver-token-{}", std::process::id()));
        std::fs::write(&dir, &text).unwrap();
        let f = std::fs::File::open(&dir).unwrap();
        let _ = std::fs::remove_file(&dir);
        assert_eq!(read(f.as_raw_fd()), None, "a plain file");
    }
}
