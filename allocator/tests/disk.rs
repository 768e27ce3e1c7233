//! Disk backups on the fake driver: the directory's rules (owner, mode, links), the files'
//! names and modes, and the integrity check of resume against files changed after a pause.
//! Scenarios with several processes or users are in tests/python/test_disk_backups.py.

mod common;

use std::fs::OpenOptions;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use common::*;
use memsaver_allocator::{Error, Options, Policy, State};

/// A fresh, missing directory for one test's disk backups.
fn disk_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("memsaver-diskrules-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// An allocator with `opts` whose disk backups go to a fresh directory `name` (created by
/// memsaver).
fn allocator_in(name: &str, opts: &Options) -> (TestAllocator, PathBuf) {
    let a = allocator_with(opts);
    let d = disk_dir(name);
    a.set_disk_dir(Some(&d)).unwrap();
    (a, d)
}

/// The names of the files in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// This process's start time, field 22 of /proc/self/stat.
fn own_start_time() -> u64 {
    let text = std::fs::read_to_string("/proc/self/stat").unwrap();
    let rest = &text[text.rfind(')').unwrap() + 1..];
    rest.split_whitespace().nth(19).unwrap().parse().unwrap()
}

fn refusal(e: Error) -> String {
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    e.to_string()
}

#[test]
fn a_directory_others_can_write_is_refused_naming_its_owner_mode_and_the_fix() {
    let a = allocator();
    // /tmp: root's, mode 1777: everyone can add, replace and (for their own files) remove.
    let tmp = std::fs::metadata("/tmp").unwrap();
    let e = refusal(a.set_disk_dir(Some(Path::new("/tmp"))).unwrap_err());
    assert!(
        e.contains("/tmp")
            && e.contains(&format!("belongs to uid {}", tmp.uid()))
            && e.contains(&format!("mode {:04o}", tmp.mode() & 0o7777))
            && e.contains("MEMSAVER_DISK_DIR"),
        "{e}"
    );
    assert_eq!(a.disk_dir(), None, "unchanged by the refusal");

    // A directory of ours that others can write: refused, saying how to fix it.
    let d = disk_dir("modes");
    std::fs::create_dir(&d).unwrap();
    std::fs::set_permissions(&d, PermissionsExt::from_mode(0o777)).unwrap();
    let e = refusal(a.set_disk_dir(Some(&d)).unwrap_err());
    assert!(e.contains("mode 0777") && e.contains("chmod go-w"), "{e}");
    std::fs::set_permissions(&d, PermissionsExt::from_mode(0o775)).unwrap();
    let e = refusal(a.set_disk_dir(Some(&d)).unwrap_err());
    assert!(e.contains("mode 0775"), "group-writable: {e}");
    // Readable by others is fine: the files themselves are 0600.
    std::fs::set_permissions(&d, PermissionsExt::from_mode(0o755)).unwrap();
    a.set_disk_dir(Some(&d)).unwrap();
    let p = a.malloc(2 * MIB, 0, "modes", Policy::Disk).unwrap();
    fill(p, 2 * MIB, 1);
    a.pause(&["modes"]).unwrap();
    a.resume(&["modes"]).unwrap();
    assert!(check(p, 2 * MIB, 1));
    a.free(p).unwrap();
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_refused_directory_from_the_environment_fails_the_pause_and_changes_nothing() {
    let opts = Options {
        disk_dir: Some(PathBuf::from("/tmp")),
        ..Options::default()
    };
    let a = allocator_with(&opts);
    let p = a.malloc(2 * MIB, 0, "env_tmp", Policy::Disk).unwrap();
    fill(p, 2 * MIB, 2);
    let e = refusal(a.pause(&["env_tmp"]).unwrap_err());
    assert!(e.contains("MEMSAVER_DISK_DIR") && e.contains("/tmp"), "{e}");
    assert_eq!(a.state(p), Some(State::Resident));
    assert!(!a.is_paused("env_tmp"));
    assert!(check(p, 2 * MIB, 2));
    a.free(p).unwrap();
}

#[test]
fn another_users_directory_is_refused_even_when_open_to_all() {
    if !memsaver_test_support::is_root() {
        return memsaver_test_support::skip(
            "needs root to make a directory of another user (chown to 65534): run the tests as root",
        );
    }
    let a = allocator();
    let d = disk_dir("theirs");
    std::fs::create_dir(&d).unwrap();
    std::fs::set_permissions(&d, PermissionsExt::from_mode(0o777)).unwrap();
    std::os::unix::fs::chown(&d, Some(65534), Some(65534)).unwrap();
    let e = refusal(a.set_disk_dir(Some(&d)).unwrap_err());
    assert!(
        e.contains("belongs to uid 65534") && e.contains("mode 0777") && e.contains("uid 0"),
        "{e}"
    );
    // Not writable by others but still theirs: refused as well.
    std::fs::set_permissions(&d, PermissionsExt::from_mode(0o700)).unwrap();
    let e = refusal(a.set_disk_dir(Some(&d)).unwrap_err());
    assert!(e.contains("belongs to uid 65534"), "{e}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn the_directory_itself_is_never_a_link() {
    let a = allocator();
    let d = disk_dir("link");
    std::fs::create_dir_all(d.join("real")).unwrap();
    std::fs::set_permissions(d.join("real"), PermissionsExt::from_mode(0o700)).unwrap();
    std::os::unix::fs::symlink(d.join("real"), d.join("link")).unwrap();
    let e = refusal(a.set_disk_dir(Some(&d.join("link"))).unwrap_err());
    assert!(e.contains("link is a symbolic link"), "{e}");
    // A link in the parent's path is the user's layout: followed.
    a.set_disk_dir(Some(&d.join("link/sub"))).unwrap();
    assert!(d.join("real/sub").is_dir());
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn files_are_private_and_named_by_pid_namespace_pid_start_time_and_nonce() {
    let (a, d) = allocator_in("names", &Options::default());
    let mode = std::fs::metadata(&d).unwrap().mode() & 0o7777;
    assert_eq!(mode, 0o700, "created 0700");
    let ptrs: Vec<u64> = (0..2)
        .map(|_| a.malloc(2 * MIB, 0, "names", Policy::Disk).unwrap())
        .collect();
    a.pause(&["names"]).unwrap();
    let files = names(&d);
    assert_eq!(files.len(), 2, "{files:?}");
    let mut nonces = Vec::new();
    for name in &files {
        let m = std::fs::symlink_metadata(d.join(name)).unwrap();
        assert!(m.file_type().is_file());
        assert_eq!(m.mode() & 0o7777, 0o600, "{name}");
        let parts: Vec<&str> = name
            .strip_prefix("memsaver-")
            .and_then(|n| n.strip_suffix(".bin"))
            .unwrap_or_else(|| panic!("{name}"))
            .split('-')
            .collect();
        assert_eq!(parts.len(), 5, "pidns-pid-start-nonce-n: {name}");
        let ns = std::fs::read_link("/proc/self/ns/pid").unwrap();
        assert_eq!(
            format!("pid:[{}]", parts[0]),
            ns.to_str().unwrap(),
            "{name}"
        );
        assert_eq!(parts[1], std::process::id().to_string(), "{name}");
        assert_eq!(parts[2], own_start_time().to_string(), "{name}");
        assert!(
            parts[3].len() == 16 && u64::from_str_radix(parts[3], 16).is_ok(),
            "{name}"
        );
        nonces.push(parts[3].to_owned());
        for p in &ptrs {
            assert!(!name.contains(&format!("{p:x}")), "no address: {name}");
        }
    }
    assert_eq!(nonces[0], nonces[1], "one process, one nonce");
    a.resume(&["names"]).unwrap();
    for p in ptrs {
        a.free(p).unwrap();
    }
    assert!(names(&d).is_empty(), "free removes the files");
    let _ = std::fs::remove_dir_all(&d);
}

/// How a test changes a disk backup between pause and resume.
#[derive(Clone, Copy, Debug)]
enum Change {
    /// Truncated to nothing, then extended back to its size (zeros).
    Zeroed,
    /// Other bytes written over it in place, same size.
    Overwritten,
    /// Truncated to half its size.
    Shortened,
}

fn change(path: &Path, how: Change) {
    let f = OpenOptions::new().write(true).open(path).unwrap();
    let len = f.metadata().unwrap().len();
    match how {
        Change::Zeroed => {
            f.set_len(0).unwrap();
            f.set_len(len).unwrap();
        }
        Change::Overwritten => {
            use std::os::unix::fs::FileExt;
            f.write_all_at(&vec![0xA5; 4096], len / 2).unwrap();
        }
        Change::Shortened => f.set_len(len / 2).unwrap(),
    }
}

#[test]
fn a_backup_changed_after_the_pause_fails_resume_and_the_tag_stays_paused() {
    // A 1 MiB staging chunk: the check spans several chunks.
    let opts = Options {
        disk_chunk: MIB,
        ..Options::default()
    };
    let a = allocator_with(&opts);
    for how in [Change::Zeroed, Change::Overwritten, Change::Shortened] {
        let d = disk_dir(&format!("changed-{how:?}"));
        a.set_disk_dir(Some(&d)).unwrap();
        let tag = format!("weights_{how:?}");
        let p = a.malloc(4 * MIB, 0, &tag, Policy::Disk).unwrap();
        fill(p, 4 * MIB, 7);
        a.pause(&[&tag]).unwrap();
        let [name] = names(&d).try_into().unwrap();
        let path = d.join(&name);
        change(&path, how);
        let free_before = free_bytes(&a, 0);
        let mut messages = Vec::new();
        for attempt in 0..2 {
            let e = a.resume(&[&tag]).unwrap_err();
            let Error::Incomplete { failed, first, .. } = &e else {
                panic!("{how:?}: expected Incomplete, got {e}");
            };
            assert_eq!(*failed, 1);
            assert!(matches!(**first, Error::Backup(_)), "{how:?}: {first}");
            let msg = e.to_string();
            assert!(
                msg.contains(&path.display().to_string())
                    && msg.contains(&format!("tag '{tag}'"))
                    && msg.contains("changed after the pause")
                    && msg.contains("stays paused")
                    && msg.contains("kept for inspection"),
                "{how:?}, attempt {attempt}: {msg}"
            );
            match how {
                Change::Shortened => assert!(msg.contains("bytes long"), "{msg}"),
                _ => assert!(msg.contains("checksum"), "{msg}"),
            }
            messages.push(msg);
            assert_eq!(a.state(p), Some(State::Paused), "{how:?}");
            assert!(a.is_paused(&tag));
            assert_eq!(
                free_bytes(&a, 0),
                free_before,
                "the memory mapped for it went back"
            );
            assert_eq!(a.stats().tag(&tag).unwrap().usage.resident_bytes, 0);
            assert!(path.exists(), "the file is kept");
        }
        assert_eq!(
            messages[0], messages[1],
            "a second resume fails the same way"
        );
        // Refused for new allocations while paused, as any paused tag.
        assert!(matches!(
            a.malloc(MIB, 0, &tag, Policy::Disk),
            Err(Error::TagPaused { .. })
        ));
        a.free(p).unwrap();
        assert!(names(&d).is_empty(), "free removes it");
        let _ = std::fs::remove_dir_all(&d);
    }
}

#[test]
fn a_changed_backup_keeps_only_its_own_allocation_paused() {
    let (a, d) = allocator_in("one-of-two", &Options::default());
    // Adjacent allocations of one tag: the resume backs them with one physical allocation
    // (a run) unless one of them fails.
    let ptrs: Vec<u64> = (0..2)
        .map(|_| a.malloc(2 * MIB, 0, "pair", Policy::Disk).unwrap())
        .collect();
    assert_eq!(ptrs[1], ptrs[0] + 2 * MIB as u64, "adjacent");
    fill(ptrs[0], 2 * MIB, 10);
    fill(ptrs[1], 2 * MIB, 11);
    a.pause(&["pair"]).unwrap();
    let files = names(&d);
    change(&d.join(&files[0]), Change::Overwritten);
    let e = a.resume(&["pair"]).unwrap_err();
    assert!(e.to_string().contains(&files[0]), "{e}");
    let states: Vec<_> = ptrs.iter().map(|p| a.state(*p).unwrap()).collect();
    let good = states
        .iter()
        .position(|s| *s == State::Resident)
        .unwrap_or_else(|| panic!("{states:?}"));
    assert_eq!(states[1 - good], State::Paused);
    assert!(
        check(ptrs[good], 2 * MIB, 10 + good as u8),
        "restored bit for bit"
    );
    assert!(a.is_paused("pair"));
    for p in ptrs {
        a.free(p).unwrap();
    }
    assert!(names(&d).is_empty());
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_backup_replaced_by_another_file_is_neither_read_nor_removed() {
    let (a, d) = allocator_in("swap", &Options::default());
    let p = a.malloc(2 * MIB, 0, "swap", Policy::Disk).unwrap();
    fill(p, 2 * MIB, 12);
    a.pause(&["swap"]).unwrap();
    let [name] = names(&d).try_into().unwrap();
    // Another file of the same size renamed over the backup's name: memsaver reads the file
    // it wrote, through the descriptor it holds, never by name.
    let other = d.join("other");
    std::fs::write(&other, vec![0x5Au8; 2 * MIB]).unwrap();
    std::fs::rename(&other, d.join(&name)).unwrap();
    a.resume(&["swap"]).unwrap();
    assert!(check(p, 2 * MIB, 12), "the original contents, bit for bit");
    // Retained and written again in place by the next pause: still the file memsaver holds.
    fill(p, 2 * MIB, 13);
    a.pause(&["swap"]).unwrap();
    a.resume(&["swap"]).unwrap();
    assert!(check(p, 2 * MIB, 13));
    a.free(p).unwrap();
    assert_eq!(
        std::fs::read(d.join(&name)).unwrap(),
        vec![0x5Au8; 2 * MIB],
        "the file put there is not memsaver's: left alone"
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn an_intact_backup_resumes_bit_for_bit_across_cycles_and_chunks() {
    let opts = Options {
        disk_chunk: MIB,
        ..Options::default()
    };
    let (a, d) = allocator_in("intact", &opts);
    // 5 MiB (6 MiB rounded): a last chunk of 1 MiB; and an allocation smaller than a chunk
    // after a larger one.
    let p = a.malloc(5 * MIB, 0, "intact", Policy::Disk).unwrap();
    let q = a.malloc(2 * MIB, 0, "intact", Policy::Disk).unwrap();
    for seed in 0..3u8 {
        fill(p, 6 * MIB, seed);
        fill(q, 2 * MIB, seed + 50);
        a.pause(&["intact"]).unwrap();
        a.resume(&["intact"]).unwrap();
        assert!(check(p, 6 * MIB, seed) && check(q, 2 * MIB, seed + 50));
    }
    a.free(p).unwrap();
    a.free(q).unwrap();
    let _ = std::fs::remove_dir_all(&d);
}
