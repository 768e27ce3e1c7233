//! The runtime directory and its group directories, opened without following symbolic links
//! and checked on the open descriptor.
//!
//! The processes' sockets live in `<runtime dir>/g<group>/` ([`crate::server`]). Whoever can
//! create entries there can pose as an owner, so the two directories memsaver creates must be
//! this user's alone, and the check must be on the directory actually used: a check by path
//! followed by a use by path races with anyone who can swap a component for a symbolic link in
//! between. So:
//!
//! * every component of the path is opened with `openat(parent, name, O_NOFOLLOW |
//!   O_DIRECTORY)`, from `/` (or the working directory for a relative path): a symbolic link
//!   anywhere in the path is refused, with the path named;
//! * the runtime directory and the group directory are created with `mkdirat(parent, name,
//!   0700)` when missing, then opened the same way, and `fstat` of the open descriptor must
//!   show this user as owner and no access for group or others;
//! * sockets are bound and connected at `/proc/self/fd/<dir fd>/<name>`, a path the kernel
//!   resolves through the held descriptor (Linux has no `bindat`/`connectat`), so a rename or
//!   swap of the directories after the check changes nothing. It also keeps the socket path
//!   short whatever the length of the runtime directory's path (`sun_path` holds 108 bytes).
//!
//! The primitives (the held [`Dir`], `openat` without following links, the `fstat` check of
//! owner and mode, [`euid`]) are the core's `memsaver_allocator::private_dir`, which the disk
//! backup directory uses too; this module is the runtime directory's stricter policy: mode
//! 0700 and no link anywhere in the path.

use std::ffi::OsStr;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

pub use memsaver_allocator::private_dir::{Dir, Found, euid};
use memsaver_allocator::private_dir::{Ownership, is_symlink_at, make_dir_at, open_dir_at};

/// The runtime directory (`MEMSAVER_RUNTIME_DIR`, else `$XDG_RUNTIME_DIR/memsaver`, else
/// `/tmp/memsaver-<uid>`); nothing is created.
pub fn runtime_dir() -> PathBuf {
    crate::options::get().runtime_dir.clone()
}

/// What to do about a directory memsaver cannot use, said in every refusal.
const ADVICE: &str = "set MEMSAVER_RUNTIME_DIR to a directory of your own (memsaver creates it \
                      mode 0700), or remove the offending entry";

/// `openat(parent, name, O_NOFOLLOW | O_DIRECTORY)`, with the path in the error.
fn open_at(parent: Option<&OwnedFd>, name: &OsStr, path: &Path) -> std::io::Result<OwnedFd> {
    let parent = parent.map(|p| p.as_fd());
    open_dir_at(parent, name).map_err(|e| match e.raw_os_error() {
        // O_NOFOLLOW on a link gives ELOOP; O_DIRECTORY on a link to a file, ENOTDIR.
        Some(libc::ELOOP) | Some(libc::ENOTDIR) if is_symlink_at(parent, name) => {
            std::io::Error::other(format!(
                "{} is a symbolic link: memsaver does not follow links in its runtime \
                 directory's path (another user could redirect it); {ADVICE}",
                path.display()
            ))
        }
        _ => std::io::Error::new(e.kind(), format!("{}: {e}", path.display())),
    })
}

/// Checks that `fd` (opened at `path`) is a directory of this user's with no access for
/// group or others.
fn check_private(fd: &OwnedFd, path: &Path) -> std::io::Result<()> {
    let o = Ownership::of(fd.as_fd())?;
    if !o.is_private(0o077) {
        return Err(std::io::Error::other(format!(
            "{} belongs to uid {} with mode {:04o}; memsaver needs it to belong to uid {} \
             with mode 0700 (others could pose as this job's processes); {ADVICE}",
            path.display(),
            o.uid,
            o.mode,
            euid()
        )));
    }
    Ok(())
}

/// Opens `path`'s parent directory component by component, refusing symbolic links.
fn open_parent(path: &Path) -> std::io::Result<(OwnedFd, PathBuf)> {
    let mut comps: Vec<Component> = path.components().collect();
    comps.pop();
    let mut at = PathBuf::new();
    let mut fd: Option<OwnedFd> = None;
    for c in comps {
        match c {
            Component::RootDir => {
                at.push("/");
                fd = Some(open_at(None, OsStr::new("/"), &at)?);
            }
            Component::CurDir => {}
            Component::Normal(name) => {
                at.push(name);
                fd = Some(open_at(fd.as_ref(), name, &at)?);
            }
            Component::ParentDir | Component::Prefix(_) => {
                return Err(std::io::Error::other(format!(
                    "{}: the runtime directory's path may not contain '..'; {ADVICE}",
                    path.display()
                )));
            }
        }
    }
    let fd = match fd {
        Some(fd) => fd,
        None => open_at(None, OsStr::new("."), Path::new("."))?,
    };
    Ok((fd, at))
}

/// Creates `name` in `parent` (mode 0700) unless it exists, opens it without following a
/// link and checks it is private to this user.
fn private_child(parent: &OwnedFd, name: &OsStr, path: &Path) -> std::io::Result<OwnedFd> {
    make_dir_at(Some(parent.as_fd()), name, 0o700).map_err(|e| {
        std::io::Error::new(e.kind(), format!("cannot create {}: {e}", path.display()))
    })?;
    let fd = open_at(Some(parent), name, path)?;
    check_private(&fd, path)?;
    Ok(fd)
}

/// `<runtime dir>/g<group>`, created when missing, held open and checked (see the module).
pub fn group_dir(runtime_dir: &Path, group: i64) -> std::io::Result<Dir> {
    let name = runtime_dir.file_name().ok_or_else(|| {
        std::io::Error::other(format!(
            "{}: not a usable runtime directory; {ADVICE}",
            runtime_dir.display()
        ))
    })?;
    let (parent, _) = open_parent(runtime_dir)?;
    let base = private_child(&parent, name, runtime_dir)?;
    let path = runtime_dir.join(format!("g{group}"));
    let fd = private_child(&base, OsStr::new(&format!("g{group}")), &path)?;
    Ok(Dir::new(fd, path))
}

/// The groups whose directories the runtime directory holds (`g<group>`), if it is usable
/// (checked as [`group_dir`] checks it; nothing is created).
pub fn group_names(runtime_dir: &Path) -> Vec<i64> {
    let Some(name) = runtime_dir.file_name() else {
        return Vec::new();
    };
    let Ok((parent, _)) = open_parent(runtime_dir) else {
        return Vec::new();
    };
    let Ok(fd) = open_at(Some(&parent), name, runtime_dir) else {
        return Vec::new();
    };
    if check_private(&fd, runtime_dir).is_err() {
        return Vec::new();
    }
    let dir = Dir::new(fd, runtime_dir.to_owned());
    let mut groups: Vec<i64> = dir
        .entries()
        .iter()
        .filter_map(|n| n.strip_prefix('g')?.parse().ok())
        .collect();
    groups.sort_unstable();
    groups
}

/// The runtime directory and `g<group>` in it as [`group_dir`] would find them, without
/// creating anything, and the names of the entries of the group directory.
pub fn inspect(runtime_dir: &Path, group: i64) -> (Found, Found, Vec<String>) {
    let open = |parent: &OwnedFd, name: &OsStr, path: &Path| -> std::io::Result<Option<OwnedFd>> {
        match open_at(Some(parent), name, path) {
            Ok(fd) => check_private(&fd, path).map(|()| Some(fd)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    };
    let Some(name) = runtime_dir.file_name() else {
        let why = format!(
            "{}: not a usable runtime directory; {ADVICE}",
            runtime_dir.display()
        );
        return (Found::Problem(why), Found::Missing, Vec::new());
    };
    let base =
        match open_parent(runtime_dir).and_then(|(parent, _)| open(&parent, name, runtime_dir)) {
            Ok(Some(fd)) => fd,
            Ok(None) => return (Found::Missing, Found::Missing, Vec::new()),
            Err(e) => return (Found::Problem(e.to_string()), Found::Missing, Vec::new()),
        };
    let path = runtime_dir.join(format!("g{group}"));
    match open(&base, OsStr::new(&format!("g{group}")), &path) {
        Ok(Some(fd)) => (Found::Ok, Found::Ok, Dir::new(fd, path).entries()),
        Ok(None) => (Found::Ok, Found::Missing, Vec::new()),
        Err(e) => (Found::Ok, Found::Problem(e.to_string()), Vec::new()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{PermissionsExt, symlink};

    fn scratch(what: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("memsaver-rundir-{what}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn creates_private_directories_and_reaches_them_through_the_descriptor() {
        let s = scratch("ok");
        let rt = s.join("rt");
        let g = group_dir(&rt, 5).unwrap();
        assert_eq!(g.path(), rt.join("g5"));
        let m = std::fs::metadata(rt.join("g5")).unwrap();
        assert_eq!(m.permissions().mode() & 0o777, 0o700);
        std::fs::write(g.entry("x"), b"1").unwrap();
        assert!(rt.join("g5/x").exists());
        g.remove("x");
        assert!(!rt.join("g5/x").exists());
        let _ = std::fs::remove_dir_all(&s);
    }

    #[test]
    fn refuses_links_anywhere_and_open_directories() {
        let s = scratch("bad");
        let real = s.join("real");
        std::fs::create_dir(&real).unwrap();
        std::fs::set_permissions(&real, PermissionsExt::from_mode(0o700)).unwrap();
        symlink(&real, s.join("link")).unwrap();
        let e = group_dir(&s.join("link"), 1).unwrap_err().to_string();
        assert!(e.contains("link is a symbolic link"), "{e}");
        let e = group_dir(&s.join("link/rt"), 1).unwrap_err().to_string();
        assert!(e.contains("link is a symbolic link"), "{e}");
        // The group directory itself a link (to a directory someone else controls).
        std::fs::create_dir(s.join("rt")).unwrap();
        std::fs::set_permissions(s.join("rt"), PermissionsExt::from_mode(0o700)).unwrap();
        symlink(&real, s.join("rt/g3")).unwrap();
        let e = group_dir(&s.join("rt"), 3).unwrap_err().to_string();
        assert!(e.contains("g3 is a symbolic link"), "{e}");
        // Readable by others.
        std::fs::set_permissions(s.join("rt"), PermissionsExt::from_mode(0o755)).unwrap();
        let e = group_dir(&s.join("rt"), 4).unwrap_err().to_string();
        assert!(
            e.contains("mode 0755") && e.contains("MEMSAVER_RUNTIME_DIR"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&s);
    }
}
