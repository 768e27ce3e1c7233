//! Directories held open by descriptor, and the entries in them reached through it.
//!
//! A directory others might write to (or swap for another one) is safe to use only if the
//! check of its owner and mode is made on the directory actually used, and every later use goes
//! through that same directory. So the primitives here never check by path and then use by
//! path:
//!
//! * a directory component is opened with `openat(parent, name, O_NOFOLLOW | O_DIRECTORY)`
//!   ([`open_dir_at`]): a symbolic link there is an error ([`is_symlink_at`] tells it from
//!   other failures, for the caller's message);
//! * a directory is created with `mkdirat(parent, name, mode)` ([`make_dir_at`]), then opened
//!   as above;
//! * owner and mode are read with `fstat` of the open descriptor ([`Ownership::of`],
//!   [`Dir::ownership`]), never with `stat` of a path;
//! * a [`Dir`] holds the descriptor for its life: files are created in it with
//!   `openat(dir, name, O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | O_RDWR, mode)`
//!   ([`Dir::create_file`]: an existing name, a planted file or link included, is an error,
//!   never opened or followed), removed with `unlinkat(dir, name)`, listed and reached at
//!   `/proc/self/fd/<dir fd>/<name>`, a path the kernel resolves through the held descriptor
//!   (for calls that have no `*at` form, such as `bind`).
//!
//! What is "private enough" is each user's policy: the runtime directory of the sockets
//! (`memsaver_ipc::rundir`) wants mode 0700 and no link anywhere in its path, the disk
//! backup directory (`disk`) wants this user as owner and no write access for group or others.

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// The effective uid: the owner of what this process creates, and what `SO_PEERCRED` reports.
pub fn euid() -> u32 {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}

fn cstr(name: &OsStr) -> std::io::Result<CString> {
    CString::new(name.as_bytes()).map_err(|_| std::io::Error::other("a path with a NUL byte"))
}

fn raw(parent: Option<BorrowedFd<'_>>) -> libc::c_int {
    parent.map_or(libc::AT_FDCWD, |f| f.as_raw_fd())
}

/// `openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)`; `parent` `None` is
/// the working directory. A symbolic link at `name` fails (`ELOOP`, or `ENOTDIR` for a link to
/// a file): see [`is_symlink_at`].
pub fn open_dir_at(parent: Option<BorrowedFd<'_>>, name: &OsStr) -> std::io::Result<OwnedFd> {
    let c = cstr(name)?;
    // SAFETY: `raw(parent)` is AT_FDCWD or a borrowed, open directory fd; `c` is
    // NUL-terminated.
    let fd = unsafe {
        libc::openat(
            raw(parent),
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new fd we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether `name` in `parent` is a symbolic link (`fstatat(…, AT_SYMLINK_NOFOLLOW)`).
pub fn is_symlink_at(parent: Option<BorrowedFd<'_>>, name: &OsStr) -> bool {
    let Ok(c) = cstr(name) else { return false };
    // SAFETY: zeroed stat is a valid out-parameter.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: AT_FDCWD or a borrowed dir fd, NUL-terminated name, valid out-pointer.
    let r = unsafe { libc::fstatat(raw(parent), c.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) };
    r == 0 && st.st_mode & libc::S_IFMT == libc::S_IFLNK
}

/// `mkdirat(parent, name, mode)`; an existing entry is not an error (open it and check it).
pub fn make_dir_at(parent: Option<BorrowedFd<'_>>, name: &OsStr, mode: u32) -> std::io::Result<()> {
    let c = cstr(name)?;
    // SAFETY: AT_FDCWD or a borrowed dir fd and a NUL-terminated name.
    if unsafe { libc::mkdirat(raw(parent), c.as_ptr(), mode as libc::mode_t) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EEXIST) {
            return Err(e);
        }
    }
    Ok(())
}

/// Owner, permission bits and type of an open file, from `fstat` of its descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ownership {
    pub uid: u32,
    /// The permission bits (`st_mode & 0o7777`: sticky, setgid and setuid included).
    pub mode: u32,
    pub is_dir: bool,
}

impl Ownership {
    pub fn of(fd: BorrowedFd<'_>) -> std::io::Result<Self> {
        let st = fstat(fd)?;
        Ok(Self {
            uid: st.st_uid,
            mode: st.st_mode & 0o7777,
            is_dir: st.st_mode & libc::S_IFMT == libc::S_IFDIR,
        })
    }

    /// A directory of this user's (effective uid) without any of the permission bits in
    /// `forbidden` (e.g. `0o077`: no access for others; `0o022`: others cannot write).
    pub fn is_private(&self, forbidden: u32) -> bool {
        self.is_dir && self.uid == euid() && self.mode & forbidden == 0
    }
}

fn fstat(fd: BorrowedFd<'_>) -> std::io::Result<libc::stat> {
    // SAFETY: zeroed stat is a valid out-parameter.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a borrowed open fd and a valid out-pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st)
}

/// The identity of a file (device, inode), to tell whether a name still refers to it.
pub fn file_id(fd: BorrowedFd<'_>) -> std::io::Result<(u64, u64)> {
    fstat(fd).map(|st| (st.st_dev, st.st_ino))
}

/// A directory held open, with the path it was opened at (for messages).
#[derive(Debug)]
pub struct Dir {
    fd: OwnedFd,
    path: PathBuf,
}

impl Dir {
    /// Holds `fd`, a directory its caller opened (and checked) at `path`.
    pub fn new(fd: OwnedFd, path: PathBuf) -> Self {
        Self { fd, path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Owner and mode of this very directory (`fstat` of the held descriptor).
    pub fn ownership(&self) -> std::io::Result<Ownership> {
        Ownership::of(self.fd.as_fd())
    }

    /// The path through which the kernel reaches `name` in this very directory.
    pub fn entry(&self, name: &str) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}/{name}", self.fd.as_raw_fd()))
    }

    /// The names of the entries of this directory (read through the held descriptor).
    pub fn entries(&self) -> Vec<String> {
        std::fs::read_dir(format!("/proc/self/fd/{}", self.fd.as_raw_fd()))
            .map(|it| {
                it.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Creates the file `name` with `mode` and opens it read-write:
    /// `openat(dir, name, O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | O_RDWR, mode)`. An
    /// existing entry of that name (a file, a symbolic link, anything) fails with
    /// `AlreadyExists` and is neither opened nor followed.
    pub fn create_file(&self, name: &str, mode: u32) -> std::io::Result<File> {
        let c = cstr(OsStr::new(name))?;
        // SAFETY: a held dir fd, a NUL-terminated name; O_CREAT takes the mode argument.
        let fd = unsafe {
            libc::openat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_RDWR,
                mode as libc::c_uint,
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a new fd we own.
        Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Size and identity (device, inode) of the entry `name`, not following a link, and
    /// whether it is a regular file.
    pub fn stat_entry(&self, name: &str) -> std::io::Result<EntryStat> {
        let c = cstr(OsStr::new(name))?;
        // SAFETY: zeroed stat is a valid out-parameter.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a held dir fd, a NUL-terminated name, a valid out-pointer.
        let r = unsafe {
            libc::fstatat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                &mut st,
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(EntryStat {
            bytes: st.st_size as u64,
            id: (st.st_dev, st.st_ino),
            is_file: st.st_mode & libc::S_IFMT == libc::S_IFREG,
        })
    }

    /// Removes `name` from this directory (`unlinkat`), ignoring a missing entry.
    pub fn remove(&self, name: &str) {
        let _ = self.try_remove(name);
    }

    /// Removes `name` from this directory (`unlinkat`).
    pub fn try_remove(&self, name: &str) -> std::io::Result<()> {
        let c = cstr(OsStr::new(name))?;
        // SAFETY: a held directory fd and a NUL-terminated name.
        if unsafe { libc::unlinkat(self.fd.as_raw_fd(), c.as_ptr(), 0) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

/// What [`Dir::stat_entry`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryStat {
    pub bytes: u64,
    /// (device, inode): compare with [`file_id`] of an open file.
    pub id: (u64, u64),
    pub is_file: bool,
}

/// What a diagnosis found at a directory, without creating anything.
#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "state", content = "detail")]
pub enum Found {
    /// Private enough for its use: usable.
    Ok,
    /// Not created yet (memsaver creates it, mode 0700, when it first needs it).
    Missing,
    /// Unusable, and why (with what to do).
    Problem(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::fs::{PermissionsExt, symlink};

    fn scratch(what: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "memsaver-private-dir-{what}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::set_permissions(&d, PermissionsExt::from_mode(0o700)).unwrap();
        d
    }

    fn held(path: &Path) -> Dir {
        let fd = open_dir_at(None, path.as_os_str()).unwrap();
        Dir::new(fd, path.to_owned())
    }

    #[test]
    fn create_file_is_exclusive_private_and_never_follows_a_link() {
        let s = scratch("create");
        let d = held(&s);
        let mut f = d.create_file("new", 0o600).unwrap();
        f.write_all(b"ours").unwrap();
        let m = std::fs::metadata(s.join("new")).unwrap();
        assert_eq!(m.permissions().mode() & 0o777, 0o600);

        // A name someone created first: refused, the file neither opened nor truncated.
        std::fs::write(s.join("planted"), b"theirs").unwrap();
        let e = d.create_file("planted", 0o600).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AlreadyExists, "{e}");
        assert_eq!(std::fs::read(s.join("planted")).unwrap(), b"theirs");

        // A planted link, to an existing file and to a missing one: never followed.
        let victim = s.join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        symlink(&victim, s.join("link")).unwrap();
        symlink(s.join("nowhere"), s.join("dangling")).unwrap();
        for name in ["link", "dangling"] {
            let e = d.create_file(name, 0o600).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::AlreadyExists, "{name}: {e}");
        }
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert!(
            !s.join("nowhere").exists(),
            "the link's target was not created"
        );

        // Entries are reached, listed and removed through the held descriptor.
        let mut text = String::new();
        File::open(d.entry("new"))
            .unwrap()
            .read_to_string(&mut text)
            .unwrap();
        assert_eq!(text, "ours");
        let st = d.stat_entry("new").unwrap();
        assert!(st.is_file && st.bytes == 4);
        assert_eq!(st.id, file_id(f.as_fd()).unwrap());
        assert!(!d.stat_entry("link").unwrap().is_file);
        let mut names = d.entries();
        names.sort();
        assert_eq!(names, ["dangling", "link", "new", "planted", "victim"]);
        d.remove("new");
        assert!(!s.join("new").exists());
        assert!(d.try_remove("new").is_err());
        let _ = std::fs::remove_dir_all(&s);
    }

    #[test]
    fn ownership_is_read_from_the_descriptor() {
        let s = scratch("owner");
        let d = held(&s);
        let o = d.ownership().unwrap();
        assert_eq!((o.uid, o.mode, o.is_dir), (euid(), 0o700, true));
        assert!(o.is_private(0o077));
        std::fs::set_permissions(&s, PermissionsExt::from_mode(0o755)).unwrap();
        let o = d.ownership().unwrap();
        assert!(o.is_private(0o022) && !o.is_private(0o077));
        // Renaming the path away changes nothing for the held directory.
        let moved = s.with_extension("moved");
        std::fs::rename(&s, &moved).unwrap();
        std::fs::create_dir(&s).unwrap();
        std::fs::set_permissions(&s, PermissionsExt::from_mode(0o777)).unwrap();
        assert_eq!(d.ownership().unwrap().mode, 0o755);
        d.create_file("x", 0o600).unwrap();
        assert!(moved.join("x").exists() && !s.join("x").exists());
        // A link is not opened as a directory.
        symlink(&moved, s.join("link")).unwrap();
        let parent = open_dir_at(None, s.as_os_str()).unwrap();
        assert!(open_dir_at(Some(parent.as_fd()), OsStr::new("link")).is_err());
        assert!(is_symlink_at(Some(parent.as_fd()), OsStr::new("link")));
        make_dir_at(Some(parent.as_fd()), OsStr::new("sub"), 0o700).unwrap();
        make_dir_at(Some(parent.as_fd()), OsStr::new("sub"), 0o700).unwrap();
        let _ = std::fs::remove_dir_all(&s);
        let _ = std::fs::remove_dir_all(&moved);
    }
}
