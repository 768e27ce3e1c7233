//! Disk backups: one file per `disk`-policy allocation in the disk backup directory
//! (`MEMSAVER_DISK_DIR`, `memsaver_set_disk_dir`). The rules, and what each one protects, are
//! in docs/security.md ("Backup files"):
//!
//! * **The directory** is opened once and held as a descriptor ([`open_dir`]): created with
//!   mode 0700 when missing, its last component opened without following a link, and `fstat`
//!   of the held descriptor must show this user (effective uid) as owner and no write access
//!   for group or others. Everything after that goes through the descriptor.
//! * **Files** are created with `openat(dir, name, O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC |
//!   O_RDWR, 0600)`: a name that exists (a planted file or link) is an error, never opened.
//!   Names are `memsaver-<pidns>-<pid>-<start>-<nonce>-<n>.bin`: this process's pid namespace
//!   and identity ([`crate::process`]) and a counter, so they cannot be predicted and never
//!   collide, and a process only ever judges files of its own pid namespace stale.
//! * **Integrity**: while a pause writes a file it computes the xxh3 checksum of the bytes
//!   written (on each staging chunk, as it is written); the size and checksum stay in this
//!   process's memory ([`DiskFile`]), never trusted from the file. Resume checks the size
//!   (`fstat`) and the checksum of the bytes it reads, and fails, leaving the allocation paused
//!   and the file in place, when they differ. The file is always read through the descriptor
//!   the pause wrote it through.
//! * **Cleanup**: a file is removed (`unlinkat` on the held directory) when its value is
//!   dropped (free, resume without retention, a failed pause), by an exit handler at normal
//!   exit (retention or not), and, for a process that died without it, by the next process
//!   that opens the directory: files whose name's identity is no longer running. Only the
//!   process that created a file removes it while it runs (not a forked child), and only if
//!   the name still refers to the file it created.
//!
//! A file is written and read through a bounded staging buffer (`MEMSAVER_DISK_CHUNK_MB`),
//! never through a host copy of the whole allocation. A retained file is overwritten in place
//! by the next pause, so disk usage does not grow across cycles.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use serde::Serialize;
use xxhash_rust::xxh3::Xxh3;

use crate::error::{Error, Result};
use crate::private_dir::{Dir, Found, Ownership, euid, file_id, is_symlink_at, make_dir_at};
use crate::process::{self, Identity};
use crate::units::human_bytes;

/// Permission bits a disk backup directory must not have: others could add, replace or
/// remove files in it.
const FORBIDDEN: u32 = 0o022;

/// The file holding one allocation's contents; removed on drop (by the process that created it).
pub struct DiskFile {
    dir: Arc<Dir>,
    name: String,
    file: File,
    len: usize,
    /// xxh3 of the contents the last completed write put in the file; `None` until a write
    /// completes.
    checksum: Option<u64>,
    /// The key of this file in [`LIVE`].
    key: u64,
}

/// A file of this process that still exists, for the exit handler.
struct Live {
    dir: Arc<Dir>,
    name: String,
    /// The process that created it: only it removes the file.
    pid: u32,
    /// (device, inode) of the file created, to remove the name only while it refers to it.
    id: (u64, u64),
}

/// Every disk backup file of this process, by key; taken for an insert or a removal only
/// (never across I/O), by [`DiskFile`] and by the exit handler.
static LIVE: Mutex<BTreeMap<u64, Live>> = Mutex::new(BTreeMap::new());
/// The key and per-file part of the next file's name.
static NEXT: AtomicU64 = AtomicU64::new(0);

impl DiskFile {
    /// Creates a new file of `len` bytes' room in `dir` (see the module documentation).
    pub(crate) fn create(dir: &Arc<Dir>, len: usize) -> io::Result<Self> {
        let key = NEXT.fetch_add(1, Ordering::Relaxed);
        let name = file_name(own_namespace(), &process::me(), key);
        let file = dir.create_file(&name, 0o600)?;
        let id = file_id(file.as_fd())?;
        static EXIT_HANDLER: std::sync::Once = std::sync::Once::new();
        // SAFETY: registers a plain extern "C" function without arguments.
        EXIT_HANDLER.call_once(|| unsafe {
            libc::atexit(remove_own_files);
        });
        LIVE.lock().insert(
            key,
            Live {
                dir: dir.clone(),
                name: name.clone(),
                pid: std::process::id(),
                id,
            },
        );
        Ok(Self {
            dir: dir.clone(),
            name,
            file,
            len,
            checksum: None,
            key,
        })
    }

    #[allow(clippy::len_without_is_empty)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Where the file was created (for messages; it is only ever used through descriptors).
    pub(crate) fn path(&self) -> PathBuf {
        self.dir.path().join(&self.name)
    }

    /// Starts writing the contents from the beginning: the file gets exactly `len` bytes and
    /// its checksum is forgotten until [`Writer::finish`].
    pub(crate) fn writer(&mut self) -> io::Result<Writer<'_>> {
        self.checksum = None;
        self.file.set_len(self.len as u64)?;
        Ok(Writer {
            file: self,
            hasher: Xxh3::new(),
            offset: 0,
        })
    }

    /// Starts reading the contents back for the allocation at `ptr` of `tag` (named in
    /// errors): the file must still have the size the pause wrote.
    pub(crate) fn reader<'a>(&'a self, tag: &'a str, ptr: u64) -> Result<Reader<'a>> {
        let Some(expected) = self.checksum else {
            return Err(Error::Backup(format!(
                "the disk backup {} of tag '{tag}' (allocation {ptr:#x}) was never completely \
                 written; the allocation stays paused",
                self.path().display()
            )));
        };
        let r = Reader {
            file: self,
            tag,
            ptr,
            hasher: Xxh3::new(),
            offset: 0,
            expected,
        };
        let size = self.file.metadata().map_err(|e| r.io_error(e))?.len();
        if size != self.len as u64 {
            return Err(r.changed(format!(
                "it is {size} bytes long, the pause wrote {}",
                self.len
            )));
        }
        Ok(r)
    }
}

impl Drop for DiskFile {
    fn drop(&mut self) {
        if let Some(live) = LIVE.lock().remove(&self.key) {
            remove_own(&live);
        }
    }
}

/// Removes `live`'s name if this process created it and the name still refers to that file.
fn remove_own(live: &Live) {
    if live.pid != std::process::id() {
        return; // a forked child: the file is its parent's
    }
    match live.dir.stat_entry(&live.name) {
        Ok(st) if st.id == live.id => {
            if let Err(e) = live.dir.try_remove(&live.name) {
                tracing::warn!(path = %live.dir.path().join(&live.name).display(), error = %e, "could not remove a disk backup file");
            }
        }
        Ok(_) => {
            tracing::warn!(path = %live.dir.path().join(&live.name).display(), "a disk backup file was replaced by another file; that file is left alone");
        }
        Err(_) => {} // removed by someone else: nothing to do
    }
}

/// The exit handler: removes this process's backup files (its children's are theirs).
extern "C" fn remove_own_files() {
    let live = std::mem::take(&mut *LIVE.lock());
    for l in live.values() {
        remove_own(l);
    }
}

/// Writes a file's contents in order, computing their checksum on the way.
pub(crate) struct Writer<'a> {
    file: &'a mut DiskFile,
    hasher: Xxh3,
    offset: usize,
}

impl Writer<'_> {
    /// Appends `buf` to what was written so far.
    pub(crate) fn write(&mut self, buf: &[u8]) -> io::Result<()> {
        self.file.file.write_all_at(buf, self.offset as u64)?;
        self.hasher.update(buf);
        self.offset += buf.len();
        Ok(())
    }

    /// Records the checksum of what was written: the file now holds a backup.
    pub(crate) fn finish(self) {
        debug_assert_eq!(self.offset, self.file.len, "a backup is written whole");
        self.file.checksum = Some(self.hasher.digest());
    }
}

/// Reads a file's contents in order, checking their checksum at the end.
pub(crate) struct Reader<'a> {
    file: &'a DiskFile,
    tag: &'a str,
    ptr: u64,
    hasher: Xxh3,
    offset: usize,
    expected: u64,
}

impl Reader<'_> {
    /// Reads the next `buf.len()` bytes.
    pub(crate) fn read(&mut self, buf: &mut [u8]) -> Result<()> {
        self.file
            .file
            .read_exact_at(buf, self.offset as u64)
            .map_err(|e| self.io_error(e))?;
        self.hasher.update(buf);
        self.offset += buf.len();
        Ok(())
    }

    /// Checks that what was read is what the pause wrote.
    pub(crate) fn finish(self) -> Result<()> {
        let found = self.hasher.digest();
        if self.offset != self.file.len || found != self.expected {
            return Err(self.changed(format!(
                "xxh3 checksum {found:016x}, the pause wrote {:016x}",
                self.expected
            )));
        }
        Ok(())
    }

    fn changed(&self, what: String) -> Error {
        Error::Backup(format!(
            "the disk backup {} of tag '{}' (allocation {:#x}, {}) changed after the pause \
             ({what}); its contents cannot be trusted: the tag stays paused and the file is \
             kept for inspection (free the allocation to give its contents up and remove the \
             file)",
            self.file.path().display(),
            self.tag,
            self.ptr,
            human_bytes(self.file.len as u64)
        ))
    }

    fn io_error(&self, e: io::Error) -> Error {
        Error::Backup(format!(
            "reading the disk backup {} of tag '{}' (allocation {:#x}) failed: {e}; the \
             allocation stays paused",
            self.file.path().display(),
            self.tag,
            self.ptr
        ))
    }
}

/// The name of backup file `n` of process `who` of pid namespace `ns` (0: unknown).
fn file_name(ns: u64, who: &Identity, n: u64) -> String {
    format!(
        "memsaver-{ns}-{}-{}-{:016x}-{n}.bin",
        who.pid, who.start, who.nonce
    )
}

/// The pid namespace and identity of the process that created the backup file `name`, if it
/// is one.
fn parse_file_name(name: &str) -> Option<(u64, Identity)> {
    let mut it = name
        .strip_prefix("memsaver-")?
        .strip_suffix(".bin")?
        .split('-');
    let ns = it.next()?.parse().ok()?;
    let who = Identity {
        pid: it.next()?.parse().ok()?,
        start: it.next()?.parse().ok()?,
        nonce: u64::from_str_radix(it.next()?, 16).ok()?,
    };
    let n = it.next()?.parse().ok()?;
    (it.next().is_none() && file_name(ns, &who, n) == name).then_some((ns, who))
}

/// This process's pid namespace: the inode of `/proc/self/ns/pid` (0 where `/proc` does not
/// tell).
fn own_namespace() -> u64 {
    process::pid_namespace("self").map_or(0, |(_, ino)| ino)
}

/// Whether the file of `(ns, who)` belongs to a process of this pid namespace that is no
/// longer running. A file of another namespace (a container sharing the directory) is never
/// stale here: its pid means nothing in this one.
fn is_stale(ns: u64, who: &Identity) -> bool {
    let ours = own_namespace();
    ours != 0 && ns == ours && !process::is_running(who)
}

/// What to do about a disk backup directory memsaver refuses, said in every refusal.
const ADVICE: &str = "set MEMSAVER_DISK_DIR (or memsaver.set_disk_dir) to a directory of your \
                      own that others cannot write (memsaver creates a missing one with mode \
                      0700)";

/// Opens the disk backup directory at `path` for this process: created (mode 0700, parents
/// included) when missing, opened and checked (see the module documentation), held. Stale
/// backup files of processes that are no longer running are removed. `source` names where the
/// path came from in messages.
pub(crate) fn open_dir(path: &Path, source: &str) -> Result<Arc<Dir>> {
    let refuse = |why: String| Error::InvalidArgument(format!("{source}: {why}"));
    let (parent, name) = parent_and_name(path).map_err(refuse)?;
    if let Some(p) = parent.as_deref().filter(|p| !p.exists()) {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(p)
            .map_err(|e| refuse(format!("cannot create {}: {e}", p.display())))?;
    }
    let parent_fd = open_parent(parent.as_deref()).map_err(refuse)?;
    make_dir_at(parent_fd.as_ref().map(|f| f.as_fd()), name, 0o700).map_err(|e| {
        refuse(format!(
            "cannot create the disk backup directory {}: {e}",
            path.display()
        ))
    })?;
    let dir = match open_checked(parent_fd.as_ref(), name, path) {
        Ok(Some(dir)) => dir,
        Ok(None) => {
            return Err(refuse(format!(
                "{} disappeared while it was opened",
                path.display()
            )));
        }
        Err(why) => return Err(refuse(why)),
    };
    remove_stale(&dir);
    Ok(Arc::new(dir))
}

/// `path` split into its parent (None: the working directory) and last component.
fn parent_and_name(path: &Path) -> std::result::Result<(Option<PathBuf>, &OsStr), String> {
    if path.as_os_str().is_empty() {
        return Err("the disk backup directory is an empty path".into());
    }
    let name = path.file_name().ok_or_else(|| {
        format!(
            "{} does not name a directory by its own name (it ends in '..' or is '/'); {ADVICE}",
            path.display()
        )
    })?;
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .map(Path::to_path_buf);
    Ok((parent, name))
}

/// The parent directory, opened (following links: only the last component is memsaver's).
fn open_parent(parent: Option<&Path>) -> std::result::Result<Option<OwnedFd>, String> {
    let Some(p) = parent else { return Ok(None) };
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(p)
        .map(|f| Some(OwnedFd::from(f)))
        .map_err(|e| format!("cannot open {}: {e}", p.display()))
}

/// Opens `name` in `parent` without following a link and checks the held directory: this
/// user's, no write access for group or others. `None` when it does not exist.
fn open_checked(
    parent: Option<&OwnedFd>,
    name: &OsStr,
    path: &Path,
) -> std::result::Result<Option<Dir>, String> {
    let parent = parent.map(|f| f.as_fd());
    let fd = match crate::private_dir::open_dir_at(parent, name) {
        Ok(fd) => fd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(match e.raw_os_error() {
                Some(libc::ELOOP) | Some(libc::ENOTDIR) if is_symlink_at(parent, name) => {
                    format!(
                        "{} is a symbolic link: memsaver holds the disk backup directory itself, \
                         never through a link (it could be redirected); set the directory the \
                         link points to",
                        path.display()
                    )
                }
                Some(libc::ENOTDIR) => format!(
                    "{} is not a directory; the disk backup directory must be one",
                    path.display()
                ),
                _ => format!("cannot open {}: {e}", path.display()),
            });
        }
    };
    let o = Ownership::of(fd.as_fd()).map_err(|e| format!("{}: {e}", path.display()))?;
    if !o.is_private(FORBIDDEN) {
        let fix = if o.uid == euid() && o.is_dir {
            format!("`chmod go-w {}`, or {ADVICE}", path.display())
        } else {
            ADVICE.to_owned()
        };
        return Err(format!(
            "the disk backup directory {} belongs to uid {} with mode {:04o}; memsaver keeps \
             backups only in a directory of this user's (uid {}) that group and others cannot \
             write (they could read, replace or remove the backups): {fix}",
            path.display(),
            o.uid,
            o.mode,
            euid()
        ));
    }
    Ok(Some(Dir::new(fd, path.to_owned())))
}

/// Removes the backup files of processes that are no longer running (they exited without
/// their exit handler: killed, or crashed). Files of running processes are never touched.
fn remove_stale(dir: &Dir) {
    let mut removed = (0usize, 0u64);
    for name in dir.entries() {
        let Some((ns, who)) = parse_file_name(&name) else {
            continue;
        };
        if !is_stale(ns, &who) {
            continue;
        }
        let Ok(st) = dir.stat_entry(&name) else {
            continue;
        };
        if st.is_file && dir.try_remove(&name).is_ok() {
            removed.0 += 1;
            removed.1 += st.bytes;
        }
    }
    if removed.0 > 0 {
        tracing::info!(dir = %dir.path().display(), files = removed.0, bytes = removed.1, "removed disk backup files of processes no longer running");
    }
}

/// One backup file found in the disk backup directory, for diagnostics.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BackupFile {
    pub name: String,
    /// The pid of the process that wrote it (in that process's pid namespace).
    pub pid: u32,
    pub bytes: u64,
    /// Its process is running (false: a stale file, removed by the next process that opens
    /// the directory, unless it is of another pid namespace).
    pub running: bool,
    /// Written by a process of another pid namespace (a container sharing the directory):
    /// never taken for stale here.
    pub other_namespace: bool,
    /// It belongs to this very process.
    pub own: bool,
}

/// What [`disk_backups`] found.
#[derive(Debug, Serialize)]
pub struct DiskBackups {
    /// The directory examined (None: no disk backup directory is set).
    pub dir: Option<PathBuf>,
    /// Whether it is usable, as a pause would find it.
    pub state: Found,
    /// The backup files in it (other entries are left out), by name.
    pub files: Vec<BackupFile>,
}

/// The disk backup directory `dir` as a pause would find it, without creating or removing
/// anything, and the backup files in it: whose, how big, running or stale.
pub fn disk_backups(dir: Option<&Path>) -> DiskBackups {
    let Some(path) = dir else {
        return DiskBackups {
            dir: None,
            state: Found::Missing,
            files: Vec::new(),
        };
    };
    let opened =
        parent_and_name(path).and_then(|(parent, name)| match open_parent(parent.as_deref()) {
            Ok(p) => open_checked(p.as_ref(), name, path),
            Err(_) if parent.as_deref().is_some_and(|p| !p.exists()) => Ok(None),
            Err(e) => Err(e),
        });
    let (state, files) = match opened {
        Ok(Some(d)) => (Found::Ok, backup_files(&d)),
        Ok(None) => (Found::Missing, Vec::new()),
        Err(why) => (Found::Problem(format!("{why}; {ADVICE}")), Vec::new()),
    };
    DiskBackups {
        dir: Some(path.to_owned()),
        state,
        files,
    }
}

fn backup_files(dir: &Dir) -> Vec<BackupFile> {
    let me = process::me();
    let mut files: Vec<BackupFile> = dir
        .entries()
        .into_iter()
        .filter_map(|name| {
            let (ns, who) = parse_file_name(&name)?;
            let st = dir.stat_entry(&name).ok().filter(|s| s.is_file)?;
            Some(BackupFile {
                pid: who.pid,
                bytes: st.bytes,
                running: ns == own_namespace() && process::is_running(&who),
                other_namespace: ns != own_namespace(),
                own: who == me,
                name,
            })
        })
        .collect();
    files.sort_by(|a, b| a.name.cmp(&b.name));
    files
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_carry_the_identity_and_give_it_back_exactly() {
        let me = process::me();
        let ns = own_namespace();
        assert_ne!(ns, 0, "/proc shows this process's pid namespace");
        let name = file_name(ns, &me, 7);
        assert_eq!(
            name,
            format!(
                "memsaver-{ns}-{}-{}-{:016x}-7.bin",
                me.pid, me.start, me.nonce
            )
        );
        assert_eq!(parse_file_name(&name), Some((ns, me)));
        for bad in [
            "memsaver-9-1-2-3-4.bin",
            "memsaver-1-2-3-4.bin",
            "memsaver-1-2-0000000000000003.bin",
            "memsaver-1-2-000000000000000z-4.bin",
            "memsaver-1-2-0000000000000003-4-5.bin",
            "memsaver-1-2-0000000000000003-4.sock",
            "memsaver-x-1-2-0000000000000003-4.bin",
            "other-1-2-0000000000000003-4.bin",
            "memsaver-1-7fff.bin",
        ] {
            assert_eq!(parse_file_name(bad), None, "{bad}");
        }
    }
}
