//! An owner's **epoch**, published where its importers read it without asking.
//!
//! The importers of a [`Delivery::Collective`](crate::shared::Delivery) export follow their
//! owner's pauses and resumes in pauses and resumes of their own. One that did not (it was
//! stopped across them, or did not pause with the others) still maps a generation the owner no
//! longer uses, and must catch up before NCCL touches it again; nothing the owner sends can
//! reach a stopped process in time, so the importer looks for itself, on its next NCCL call.
//!
//! The owner counts every change of its collective exports' state: each pause that marks
//! exported buffers paused and each resume that marks some resident again raises the epoch
//! (under the ledger's lock, [`crate::shared`]). It writes the epoch, and whether some
//! exported buffer is paused now, to a file of its own in the group's directory
//! (`<pid>-<start>-<nonce>.epoch`, mode 0600, made with the server's socket and removed with
//! it), as one 64-bit word mapped shared: `epoch << 1 | paused`. Every answer to an import
//! carries the epoch of the moment it was served ([`Reply::Export`](crate::protocol::Reply)).
//! While the owner's published epoch is no later than the one an importer's imports were
//! served at, they map the owner's current memory; a later one means the owner paused or
//! resumed since. Reading it is one load of shared memory: cheap enough for every NCCL call.
//!
//! The file is the owner's to write: an importer opens it read-only, without following a
//! link, and only if this user owns it (a process of the same user could write it anyway;
//! it would only make its peers ask the owner again, or miss a change, as a stopped peer
//! would: docs/security.md).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::identity::Identity;
use crate::rundir::{self, Dir};

/// What an owner published: its epoch, and whether some exported buffer is paused now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Word {
    pub epoch: u64,
    pub paused: bool,
}

impl Word {
    fn encode(self) -> u64 {
        self.epoch << 1 | u64::from(self.paused)
    }

    fn decode(w: u64) -> Self {
        Self {
            epoch: w >> 1,
            paused: w & 1 == 1,
        }
    }
}

/// The name of `who`'s epoch file in its group's directory.
pub fn file_name(who: &Identity) -> String {
    format!("{}-{}-{:016x}.epoch", who.pid, who.start, who.nonce)
}

/// One word of a file, mapped shared: the owner's for writing, an importer's for reading.
pub struct Page {
    word: *const AtomicU64,
}

// SAFETY: the word is only touched atomically; the mapping lives as long as the page.
unsafe impl Send for Page {}
// SAFETY: as above.
unsafe impl Sync for Page {}

const LEN: usize = std::mem::size_of::<u64>();

impl Page {
    fn map(file: &File, prot: libc::c_int) -> std::io::Result<Self> {
        // SAFETY: a fresh shared mapping of the first word of an open file at least that long.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                LEN,
                prot,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self {
            word: p.cast::<AtomicU64>(),
        })
    }

    pub fn read(&self) -> Word {
        // SAFETY: a live mapping of an aligned word (the start of a page).
        Word::decode(unsafe { &*self.word }.load(Ordering::Acquire))
    }

    fn write(&self, w: Word) {
        // SAFETY: as in `read`; only the owner maps it writable.
        unsafe { &*self.word }.store(w.encode(), Ordering::Release);
    }
}

impl Drop for Page {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, not used after this.
        unsafe { libc::munmap(self.word as *mut libc::c_void, LEN) };
    }
}

/// This process's own page, once its server made it ([`create`]).
static OWN: OnceLock<Page> = OnceLock::new();

/// Makes this process's epoch file in its group's directory `dir` (epoch 0, nothing paused);
/// returns its name, which the caller removes at exit.
pub(crate) fn create(dir: &Dir, me: &Identity) -> std::io::Result<String> {
    let name = file_name(me);
    let file = dir.create_file(&name, 0o600)?;
    file.set_len(LEN as u64)?;
    let page = Page::map(&file, libc::PROT_READ | libc::PROT_WRITE)?;
    let _ = OWN.set(page);
    Ok(name)
}

/// Publishes this process's epoch (nothing without a page: its importers cannot tell).
pub(crate) fn publish(w: Word) {
    if let Some(p) = OWN.get() {
        p.write(w);
    }
}

/// `owner`'s page in `group`, read-only: a regular file of this user, at least one word long.
pub fn open(group: i64, owner: &Identity) -> std::io::Result<Page> {
    let dir = rundir::group_dir(&rundir::runtime_dir(), group)?;
    let name = file_name(owner);
    open_page(
        &dir.entry(&name),
        &format!("{}/{name}", dir.path().display()),
    )
}

/// The page of the file at `path` (`shown` in messages), read-only, if it is a regular file of
/// this user at least one word long, reached without following a link.
fn open_page(path: &std::path::Path, shown: &str) -> std::io::Result<Page> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| std::io::Error::new(e.kind(), format!("{shown}: {e}")))?;
    let m = file.metadata()?;
    if !m.file_type().is_file() || m.uid() != rundir::euid() || m.len() < LEN as u64 {
        return Err(std::io::Error::other(format!(
            "{shown} is not a process's epoch file of this user"
        )));
    }
    Page::map(&file, libc::PROT_READ)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_word_gives_back_the_epoch_and_the_paused_bit() {
        for (epoch, paused) in [(0, false), (1, true), (7, false), (u64::MAX >> 1, true)] {
            let w = Word { epoch, paused };
            assert_eq!(Word::decode(w.encode()), w);
        }
    }

    /// An importer maps only a regular file of this user at least one word long, reached
    /// without following a link: a link to a good file, a short file and (as root) a file of
    /// another user are refused; the good file is read.
    #[test]
    fn only_a_real_epoch_file_of_this_user_is_read() {
        let dir = std::env::temp_dir().join(format!("memsaver-epoch-own-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good");
        std::fs::write(&good, 6u64.to_le_bytes()).unwrap();
        let link = dir.join("link");
        std::os::unix::fs::symlink(&good, &link).unwrap();
        let short = dir.join("short");
        std::fs::write(&short, [1u8]).unwrap();
        let theirs = dir.join("theirs");
        std::fs::write(&theirs, 6u64.to_le_bytes()).unwrap();
        let as_root = rundir::euid() == 0;
        if as_root {
            std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
        }
        let read = |p: &std::path::Path| open_page(p, "x").map(|page| page.read());
        let results = (read(&good), read(&link), read(&short), read(&theirs));
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            results.0.unwrap(),
            Word {
                epoch: 3,
                paused: false
            }
        );
        assert!(results.1.is_err(), "a link is not followed");
        assert!(results.2.is_err(), "a file shorter than a word");
        assert_eq!(
            results.3.is_err(),
            as_root,
            "another user's file (as root only)"
        );
    }

    #[test]
    fn an_importer_reads_what_the_owner_writes_through_the_file() {
        let dir = std::env::temp_dir().join(format!("memsaver-epoch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("page");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        file.set_len(LEN as u64).unwrap();
        let owner = Page::map(&file, libc::PROT_READ | libc::PROT_WRITE).unwrap();
        let reader = Page::map(&File::open(&path).unwrap(), libc::PROT_READ).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(reader.read(), Word::decode(0));
        let w = Word {
            epoch: 3,
            paused: true,
        };
        owner.write(w);
        assert_eq!(reader.read(), w);
    }
}
