//! Backup policies (cpu, mmap, disk, discard), retention, backup pointers and the memory
//! margin, on the fake driver.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use memsaver_allocator::{Error, Options, Policy, State};

/// A fresh directory for one test's disk backups.
fn disk_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("memsaver-disk-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// The files in `dir` and their total size.
fn files(dir: &Path) -> (usize, u64) {
    std::fs::read_dir(dir).map_or((0, 0), |rd| {
        rd.map(|e| e.unwrap().metadata().unwrap().len())
            .fold((0, 0), |(n, b), len| (n + 1, b + len))
    })
}

#[test]
fn every_keeping_policy_restores_contents_across_cycles() {
    let dir = disk_dir("cycles");
    // A 1 MiB staging chunk, so a 5 MiB allocation (6 MiB rounded) takes several chunks.
    let opts = Options {
        disk_chunk: MIB,
        ..Options::default()
    };
    let a = allocator_with(&opts);
    a.set_disk_dir(Some(&dir)).unwrap();
    for policy in [Policy::Cpu, Policy::Mmap, Policy::Disk] {
        let tag = format!("keep_{policy}");
        let p = a.malloc(5 * MIB, 0, &tag, policy).unwrap();
        for seed in 0..3u8 {
            fill(p, 6 * MIB, seed);
            a.pause(&[&tag]).unwrap();
            assert_eq!(a.state(p), Some(State::Paused));
            a.resume(&[&tag]).unwrap();
            assert!(check(p, 6 * MIB, seed), "{policy}, cycle {seed}");
        }
        a.free(p).unwrap();
    }
    assert_eq!(files(&dir), (0, 0), "free removes the disk file");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn stats_count_backup_bytes_by_kind() {
    let dir = disk_dir("stats");
    let a = allocator();
    a.set_disk_dir(Some(&dir)).unwrap();
    let p = a.malloc(2 * MIB, 0, "k_cpu", Policy::Cpu).unwrap();
    let q = a.malloc(4 * MIB, 0, "k_mmap", Policy::Mmap).unwrap();
    let r = a.malloc(6 * MIB, 0, "k_disk", Policy::Disk).unwrap();
    let d = a.malloc(2 * MIB, 0, "k_discard", Policy::Discard).unwrap();
    a.pause(&[]).unwrap();
    let s = a.stats();
    let u = |t: &str| s.tag(t).unwrap().usage;
    assert_eq!(
        (u("k_cpu").pinned_backup_bytes, u("k_cpu").backup_bytes),
        (2 * MIB as u64, 2 * MIB as u64)
    );
    assert_eq!(
        (u("k_mmap").mmap_backup_bytes, u("k_mmap").backup_bytes),
        (4 * MIB as u64, 4 * MIB as u64)
    );
    // Disk files are not host memory: counted apart from backup_bytes.
    assert_eq!(
        (u("k_disk").disk_backup_bytes, u("k_disk").backup_bytes),
        (6 * MIB as u64, 0)
    );
    assert_eq!(u("k_discard").backup_bytes, 0);
    assert_eq!(s.total.backup_bytes, 6 * MIB as u64);
    assert_eq!(s.total.disk_backup_bytes, 6 * MIB as u64);
    assert_eq!(files(&dir), (1, 6 * MIB as u64));
    a.resume(&[]).unwrap();
    for x in [p, q, r, d] {
        a.free(x).unwrap();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn retained_backups_keep_their_address_across_cycles() {
    let a = allocator();
    assert!(a.retain_backups(), "retention is on by default");
    for policy in [Policy::Cpu, Policy::Mmap] {
        let tag = format!("stable_{policy}");
        let p = a.malloc(4 * MIB, 0, &tag, policy).unwrap();
        assert!(a.backup_pointer(p, 4 * MIB).is_none(), "never paused");
        fill(p, 4 * MIB, 3);
        a.pause(&[&tag]).unwrap();
        let b = a.backup_pointer(p, 4 * MIB).expect("paused: backup exists");
        // SAFETY: the backup holds 4 MiB and stays alive while the allocation is paused.
        assert!(
            check(b as u64, 4 * MIB, 3),
            "{policy}: the backup holds the contents"
        );
        a.resume(&[&tag]).unwrap();
        assert_eq!(
            a.backup_pointer(p, 4 * MIB),
            Some(b),
            "retained after resume"
        );
        a.pause(&[&tag]).unwrap();
        assert_eq!(
            a.backup_pointer(p, 4 * MIB),
            Some(b),
            "reused by the next pause"
        );
        a.resume(&[&tag]).unwrap();
        a.free(p).unwrap();
        assert!(a.backup_pointer(p, 4 * MIB).is_none(), "freed");
    }
}

#[test]
fn backups_are_released_at_resume_without_retention() {
    let dir = disk_dir("noretain");
    let a = allocator();
    a.set_disk_dir(Some(&dir)).unwrap();
    a.set_retain_backups(false);
    assert!(!a.retain_backups());
    let p = a.malloc(4 * MIB, 0, "nr_cpu", Policy::Cpu).unwrap();
    let q = a.malloc(4 * MIB, 0, "nr_mmap", Policy::Mmap).unwrap();
    let r = a.malloc(4 * MIB, 0, "nr_disk", Policy::Disk).unwrap();
    for seed in 0..2u8 {
        for x in [p, q, r] {
            fill(x, 4 * MIB, seed);
        }
        a.pause(&[]).unwrap();
        assert!(a.backup_pointer(p, MIB).is_some() && a.backup_pointer(q, MIB).is_some());
        assert!(
            a.backup_pointer(r, MIB).is_none(),
            "disk backups have no host pointer"
        );
        assert_eq!(files(&dir), (1, 4 * MIB as u64));
        a.resume(&[]).unwrap();
        for x in [p, q, r] {
            assert!(check(x, 4 * MIB, seed));
            assert!(a.backup_pointer(x, MIB).is_none(), "released at resume");
        }
        let t = a.stats().total;
        assert_eq!((t.backup_bytes, t.disk_backup_bytes), (0, 0));
        assert_eq!(files(&dir), (0, 0), "the disk file is gone after resume");
    }
    for x in [p, q, r] {
        a.free(x).unwrap();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn turning_retention_off_releases_at_the_next_resume() {
    let a = allocator();
    let p = a.malloc(2 * MIB, 0, "toggle", Policy::Cpu).unwrap();
    let q = a.malloc(2 * MIB, 0, "toggle_other", Policy::Mmap).unwrap();
    a.pause(&[]).unwrap();
    a.resume(&[]).unwrap();
    assert!(a.backup_pointer(p, 1).is_some() && a.backup_pointer(q, 1).is_some());
    // Off: the next resume releases retained backups of resident allocations of its tags.
    a.set_retain_backups(false);
    a.resume(&["toggle"]).unwrap();
    assert!(a.backup_pointer(p, 1).is_none());
    assert!(
        a.backup_pointer(q, 1).is_some(),
        "a tag the resume did not name keeps it"
    );
    a.resume(&[]).unwrap();
    assert!(a.backup_pointer(q, 1).is_none());
    assert_eq!(a.stats().total.backup_bytes, 0);
    // On again: the next cycle keeps its backup.
    a.set_retain_backups(true);
    a.pause(&["toggle"]).unwrap();
    a.resume(&["toggle"]).unwrap();
    assert!(a.backup_pointer(p, 1).is_some());
    a.free(p).unwrap();
    a.free(q).unwrap();
}

#[test]
fn free_while_paused_releases_every_kind_of_backup() {
    let dir = disk_dir("freepaused");
    let a = allocator();
    a.set_disk_dir(Some(&dir)).unwrap();
    let ptrs: Vec<u64> = [Policy::Cpu, Policy::Mmap, Policy::Disk]
        .into_iter()
        .map(|p| a.malloc(2 * MIB, 0, "fp", p).unwrap())
        .collect();
    a.pause(&["fp"]).unwrap();
    assert_eq!(files(&dir).0, 1);
    for p in ptrs {
        a.free(p).unwrap();
    }
    let t = a.stats().total;
    assert_eq!((t.backup_bytes, t.disk_backup_bytes), (0, 0));
    assert_eq!(files(&dir), (0, 0));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn disk_usage_stays_constant_over_cycles() {
    let dir = disk_dir("constant");
    let a = allocator();
    a.set_disk_dir(Some(&dir)).unwrap();
    let p = a.malloc(8 * MIB, 0, "disk_cycles", Policy::Disk).unwrap();
    let mut seen = Vec::new();
    for seed in 0..3u8 {
        fill(p, 8 * MIB, seed);
        a.pause(&["disk_cycles"]).unwrap();
        seen.push(files(&dir));
        a.resume(&["disk_cycles"]).unwrap();
        assert!(check(p, 8 * MIB, seed));
        seen.push(files(&dir));
    }
    assert!(seen.iter().all(|f| *f == (1, 8 * MIB as u64)), "{seen:?}");
    // The file is named by the process's identity (tests/disk.rs checks the whole name).
    let name = std::fs::read_dir(&dir)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .file_name();
    let name = name.to_string_lossy();
    assert_eq!(
        name.split('-').nth(2),
        Some(std::process::id().to_string().as_str()),
        "memsaver-<pidns>-<pid>-...: {name}"
    );
    a.free(p).unwrap();
    assert_eq!(files(&dir), (0, 0));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn disk_pause_without_a_directory_is_refused_and_changes_nothing() {
    let a = allocator();
    let p = a.malloc(2 * MIB, 0, "nodir", Policy::Disk).unwrap();
    fill(p, 2 * MIB, 9);
    let e = a.pause(&["nodir"]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("MEMSAVER_DISK_DIR") && msg.contains("memsaver.set_disk_dir"),
        "{msg}"
    );
    assert_eq!(a.state(p), Some(State::Resident));
    assert!(!a.is_paused("nodir"));
    assert!(check(p, 2 * MIB, 9));
    // New allocations with the tag are still accepted: the pause did not happen.
    let q = a.malloc(MIB, 0, "nodir", Policy::Discard).unwrap();
    let dir = disk_dir("late");
    a.set_disk_dir(Some(&dir)).unwrap();
    a.pause(&["nodir"]).unwrap();
    a.resume(&["nodir"]).unwrap();
    assert!(check(p, 2 * MIB, 9));
    a.free(p).unwrap();
    a.free(q).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn set_disk_dir_creates_a_private_directory_and_refuses_files() {
    use std::os::unix::fs::PermissionsExt;
    let a = allocator();
    let dir = disk_dir("mkdir").join("nested");
    a.set_disk_dir(Some(&dir)).unwrap();
    let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700);
    assert_eq!(a.disk_dir(), Some(dir.clone()));
    let file = dir.join("plain");
    std::fs::write(&file, b"x").unwrap();
    let e = a.set_disk_dir(Some(&file)).unwrap_err().to_string();
    assert!(e.contains("not a directory"), "{e}");
    assert_eq!(a.disk_dir(), Some(dir.clone()), "unchanged by the failure");
    a.set_disk_dir(None).unwrap();
    assert_eq!(a.disk_dir(), None);
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn memory_margin_stops_resume_until_lowered() {
    let a = allocator();
    let p = a.malloc(4 * MIB, 0, "margin", Policy::Cpu).unwrap();
    let q = a.malloc(4 * MIB, 0, "margin", Policy::Cpu).unwrap();
    fill(p, 4 * MIB, 1);
    fill(q, 4 * MIB, 2);
    a.pause(&["margin"]).unwrap();
    // Room for exactly one allocation above the margin.
    let margin = (free_bytes(&a, 0) - 6 * MIB) as u64;
    a.set_memory_margin(margin);
    assert_eq!(a.memory_margin(), margin);
    let e = a.resume(&["margin"]).unwrap_err();
    let Error::ResumeOutOfMemory {
        resumed,
        still_paused,
        margin: m,
        ..
    } = e
    else {
        panic!("expected ResumeOutOfMemory, got {e}");
    };
    assert_eq!((resumed, still_paused, m), (1, 1, margin));
    assert!(e.to_string().contains("memory margin"), "{e}");
    assert!(a.is_paused("margin"));
    a.set_memory_margin(0);
    a.resume(&["margin"]).unwrap();
    assert!(check(p, 4 * MIB, 1) && check(q, 4 * MIB, 2));
    a.free(p).unwrap();
    a.free(q).unwrap();
}

#[test]
fn backup_pointer_takes_interior_pointers_and_checks_the_range() {
    let a = allocator();
    let p = a.malloc(4 * MIB, 0, "interior", Policy::Mmap).unwrap();
    let d = a
        .malloc(2 * MIB, 0, "interior_discard", Policy::Discard)
        .unwrap();
    fill(p, 4 * MIB, 5);
    a.pause(&[]).unwrap();
    let base = a.backup_pointer(p, 4 * MIB).unwrap();
    // SAFETY: offsets inside the 4 MiB backup.
    unsafe {
        assert_eq!(a.backup_pointer(p + 4096, 100), Some(base.add(4096)));
        assert_eq!(
            a.backup_pointer(p + (4 * MIB - 1) as u64, 1),
            Some(base.add(4 * MIB - 1))
        );
    }
    assert_eq!(
        a.backup_pointer(p + 4096, 4 * MIB),
        None,
        "runs past the end"
    );
    assert_eq!(
        a.backup_pointer(p + (4 * MIB) as u64, 1),
        None,
        "one past the end"
    );
    assert_eq!(a.backup_pointer(p - 1, 1), None, "before the start");
    assert_eq!(a.backup_pointer(p, usize::MAX), None, "overflowing size");
    assert_eq!(a.backup_pointer(d, 1), None, "discard has no backup");
    assert_eq!(a.backup_pointer(0x10, 1), None, "not ours");
    a.resume(&[]).unwrap();
    a.free(p).unwrap();
    a.free(d).unwrap();
}

#[test]
fn discard_makes_no_backup_and_no_promise() {
    let a = allocator();
    let p = a.malloc(2 * MIB, 0, "no_promise", Policy::Discard).unwrap();
    fill(p, 2 * MIB, 4);
    a.pause(&["no_promise"]).unwrap();
    let r = a.resume(&["no_promise"]).unwrap();
    assert_eq!(r.copied_bytes, 0);
    let t = a.stats().tag("no_promise").unwrap().usage;
    assert_eq!(
        (t.backup_bytes, t.disk_backup_bytes, t.resident_bytes),
        (0, 0, 2 * MIB as u64)
    );
    fill(p, 2 * MIB, 6); // usable; its old contents are not promised
    assert!(check(p, 2 * MIB, 6));
    a.free(p).unwrap();
}

#[test]
fn invalid_environment_values_are_errors_naming_the_variable() {
    let opts = Options::from_lookup(|n| match n {
        "MEMSAVER_RETAIN_BACKUP" => Some("sometimes".into()),
        "MEMSAVER_DISK_CHUNK_MB" => Some("big".into()),
        _ => None,
    });
    let e = opts.check().unwrap_err().to_string();
    assert!(
        e.contains("MEMSAVER_RETAIN_BACKUP='sometimes': expected 0 or 1")
            && e.contains("MEMSAVER_DISK_CHUNK_MB='big': expected a whole number from 1"),
        "{e}"
    );
    // The defaults stand in meanwhile (for the hooks that cannot fail).
    assert!(opts.retain_backups);
    assert_eq!(opts.disk_chunk, 64 << 20);
}

#[test]
fn a_whole_process_tag_allocates_while_paused_and_resume_skips_those() {
    let a = allocator();
    a.allow_malloc_while_paused("process").unwrap();
    let p = a.malloc(2 * MIB, 0, "process", Policy::Cpu).unwrap();
    fill(p, 2 * MIB, 8);
    a.pause(&["process"]).unwrap();
    let q = a.malloc(2 * MIB, 0, "process", Policy::Cpu).unwrap();
    assert_eq!(a.state(q), Some(State::Resident));
    fill(q, 2 * MIB, 9);
    let r = a.resume(&["process"]).unwrap();
    assert_eq!(r.allocations, 1, "only the paused one was resumed");
    assert!(check(p, 2 * MIB, 8) && check(q, 2 * MIB, 9));
    // An ordinary tag still refuses.
    a.malloc(MIB, 0, "ordinary", Policy::Discard).unwrap();
    a.pause(&["ordinary"]).unwrap();
    assert!(matches!(
        a.malloc(MIB, 0, "ordinary", Policy::Discard),
        Err(Error::TagPaused { .. })
    ));
    a.free(p).unwrap();
    a.free(q).unwrap();
}

/// `after - before`, kind by kind.
fn delta(before: &[u64], after: &[u64]) -> Vec<u64> {
    before.iter().zip(after).map(|(b, a)| a - b).collect()
}

#[test]
fn first_pause_of_a_cpu_tag_takes_the_backups_prepared_in_the_background() {
    let a = allocator();
    let ptrs: Vec<u64> = (0..3)
        .map(|_| a.malloc(4 * MIB, 0, "prep", Policy::Cpu).unwrap())
        .collect();
    for (i, p) in ptrs.iter().enumerate() {
        fill(*p, 4 * MIB, i as u8);
    }
    a.wait_backups_prepared(std::time::Duration::from_secs(120))
        .expect("backups prepared within 120 s");
    let s = a.stats();
    let u = s.tag("prep").unwrap().usage;
    assert_eq!(s.backups_preparing, 0);
    assert_eq!(
        (u.prepared_backup_bytes, u.backup_bytes),
        (12 * MIB as u64, 0)
    );

    let (ours, fakes, time) = (a.driver().calls(), fake_calls(), a.driver().call_time());
    let t0 = std::time::Instant::now();
    a.pause(&["prep"]).unwrap();
    let elapsed = t0.elapsed().as_nanos() as u64;
    let time: Vec<u64> = (a.driver().call_time().iter().zip(&time))
        .map(|(after, before)| after - before)
        .collect();
    let (ours, fakes) = (
        delta(&ours, &a.driver().calls()),
        delta(&fakes, &fake_calls()),
    );
    // The time in the driver is counted by kind: only the kinds called took any, and all of
    // it lies within the pause.
    let kinds = memsaver_allocator::driver::TIMED_KINDS;
    for (i, k) in kinds
        .iter()
        .enumerate()
        .take(memsaver_allocator::driver::CALL_KINDS.len())
    {
        assert_eq!(time[i] > 0, kind(&ours, k) > 0, "{k}: {} ns", time[i]);
    }
    assert!(time[kinds.len() - 2] > 0, "the pause waited for its copies");
    assert!(time.iter().sum::<u64>() <= elapsed);
    for pin in ["host_alloc", "host_register"] {
        assert_eq!(kind(&ours, pin), 0, "the pause pinned no memory ({pin})");
        assert_eq!(
            kind(&fakes, pin),
            0,
            "the driver saw no pinning either ({pin})"
        );
    }
    assert_eq!(kind(&ours, "copy"), 3);
    assert_eq!(ours, fakes, "memsaver counts the calls the driver receives");

    let u = a.stats().tag("prep").unwrap().usage;
    assert_eq!(
        (u.prepared_backup_bytes, u.backup_bytes),
        (0, 12 * MIB as u64)
    );
    a.resume(&["prep"]).unwrap();
    for (i, p) in ptrs.iter().enumerate() {
        assert!(check(*p, 4 * MIB, i as u8), "allocation {i} restored");
    }
}

#[test]
fn prepared_backups_stay_within_the_limit_and_the_rest_is_allocated_by_the_pause() {
    let opts = Options {
        backup_prepare_limit: 4 * MIB as u64,
        ..Options::default()
    };
    let a = allocator_with(&opts);
    for _ in 0..3 {
        a.malloc(4 * MIB, 0, "lim", Policy::Cpu).unwrap();
    }
    a.wait_backups_prepared(std::time::Duration::from_secs(120))
        .expect("backups prepared within 120 s");
    assert_eq!(a.stats().total.prepared_backup_bytes, 4 * MIB as u64);
    let before = a.driver().calls();
    a.pause(&["lim"]).unwrap();
    assert_eq!(
        kind(&delta(&before, &a.driver().calls()), "host_register"),
        2
    );
    assert_eq!(a.stats().total.pinned_backup_bytes, 12 * MIB as u64);

    // 0 turns it off for new allocations.
    a.set_backup_prepare_limit(0);
    a.malloc(4 * MIB, 0, "lim2", Policy::Cpu).unwrap();
    a.wait_backups_prepared(std::time::Duration::from_secs(120))
        .expect("backups prepared within 120 s");
    assert_eq!(a.stats().total.prepared_backup_bytes, 0);
}

#[test]
fn nothing_is_prepared_without_retention_or_for_other_policies() {
    let a = allocator();
    a.malloc(2 * MIB, 0, "mm", Policy::Mmap).unwrap();
    a.malloc(2 * MIB, 0, "dd", Policy::Discard).unwrap();
    a.set_retain_backups(false);
    a.malloc(2 * MIB, 0, "cc", Policy::Cpu).unwrap();
    a.wait_backups_prepared(std::time::Duration::from_secs(120))
        .expect("backups prepared within 120 s");
    assert_eq!(a.stats().total.prepared_backup_bytes, 0);
}

#[test]
fn freeing_allocations_while_their_backups_are_prepared_leaks_no_pinned_memory() {
    let a = allocator();
    let (ours, fakes) = (a.driver().calls(), fake_calls());
    for round in 0..20 {
        let ptrs: Vec<u64> = (0..8)
            .map(|_| a.malloc(2 * MIB, 0, "churn", Policy::Cpu).unwrap())
            .collect();
        // Free some at once (queued or in flight), the rest once prepared.
        if round % 2 == 1 {
            a.wait_backups_prepared(std::time::Duration::from_secs(120))
                .expect("backups prepared within 120 s");
        }
        for p in ptrs {
            a.free(p).unwrap();
        }
    }
    a.wait_backups_prepared(std::time::Duration::from_secs(120))
        .expect("backups prepared within 120 s");
    assert_eq!(a.stats().total.prepared_backup_bytes, 0);
    let (ours, fakes) = (
        delta(&ours, &a.driver().calls()),
        delta(&fakes, &fake_calls()),
    );
    assert!(
        kind(&ours, "host_register") > 0,
        "some buffers were prepared"
    );
    assert_eq!(kind(&ours, "host_register"), kind(&ours, "host_unregister"));
    assert_eq!(
        kind(&fakes, "host_register"),
        kind(&fakes, "host_unregister")
    );
}

#[test]
fn a_reused_address_never_receives_the_previous_allocations_buffer() {
    let a = allocator();
    let p = a.malloc(4 * MIB, 0, "reuse", Policy::Cpu).unwrap();
    a.wait_backups_prepared(std::time::Duration::from_secs(120))
        .expect("backups prepared within 120 s");
    a.free(p).unwrap();
    // Not prepared: the next allocation's first pause allocates, whatever its address.
    a.set_backup_prepare_limit(0);
    let q = a.malloc(2 * MIB, 0, "reuse", Policy::Cpu).unwrap();
    fill(q, 2 * MIB, 9);
    let before = a.driver().calls();
    a.pause(&["reuse"]).unwrap();
    assert_eq!(
        kind(&delta(&before, &a.driver().calls()), "host_register"),
        1
    );
    a.resume(&["reuse"]).unwrap();
    assert!(check(q, 2 * MIB, 9));
    assert_eq!(a.stats().total.pinned_backup_bytes, 2 * MIB as u64);
}

/// Pinning holds up every other driver call of the process while it runs (the fake models it:
/// `fakecuda_pin_stats`), so backups are pinned in steps of at most `PIN_CHUNK`: preparing the
/// backups of allocations larger than a step while this thread keeps allocating never makes a
/// pinning call larger than a step, and nothing waits behind a larger one. The fake holds each
/// pinning step until this thread's next driver call runs into it, so the application's calls
/// do wait behind the steps, every time, whatever the machine's speed. The driver refuses
/// copies that cross from one pinned step into the next, so a pause and resume of those
/// allocations also shows that copies are split where the steps meet.
#[test]
fn backups_are_pinned_in_bounded_steps_and_copies_split_at_them() {
    use memsaver_allocator::backup::PIN_CHUNK;
    let a = allocator();
    let size = 2 * PIN_CHUNK + 8 * MIB; // three steps: 16 + 16 + 8 MiB
    let before = a.driver().calls();
    // Nothing is pinned until the application's loop below runs.
    let held = HeldPinning::new(PinHold::AtEntry);
    let ptrs: Vec<u64> = (0..3)
        .map(|i| {
            let p = a.malloc(size, 0, "steps", Policy::Cpu).unwrap();
            fill(p, size, i as u8);
            p
        })
        .collect();
    assert_eq!(wait_pinning_held(1), 1, "the first step waits to be let go");
    assert_eq!(a.stats().backups_preparing, 3, "nothing prepared yet");
    let pins_before = fake_pinning();
    // The application goes on allocating while the backups are prepared, and runs into every
    // step: a step keeps the driver lock until a call of this thread waits behind it.
    held.switch(PinHold::UntilWaited);
    let mut rounds = 0;
    loop {
        let q = a.malloc(2 * MIB, 0, "steps_app", Policy::Discard).unwrap();
        a.free(q).unwrap();
        rounds += 1;
        if a.stats().backups_preparing == 0 {
            break;
        }
    }
    drop(held);
    a.wait_backups_prepared(std::time::Duration::from_secs(120))
        .expect("backups prepared within 120 s");
    let calls = delta(&before, &a.driver().calls());
    assert_eq!(kind(&calls, "host_alloc"), 0, "no cuMemHostAlloc");
    assert_eq!(kind(&calls, "host_register"), 9, "three steps per backup");
    let after = fake_pinning();
    let d = delta(&pins_before, &after);
    let (pins, waits) = (d[0], d[2]);
    let [_, largest, _, largest_waited_behind] = after;
    assert_eq!(pins, 9, "every step was pinned while the loop ran");
    // One application thread, which waited behind some of the 9 steps: at least one (every
    // step holds the lock until it does), at most one per step.
    assert!(
        (1..=9).contains(&waits),
        "{waits} waits behind a pinning call in {rounds} rounds"
    );
    assert_eq!(
        fake_pin_hold(),
        [0, 0],
        "no step was let go by the deadline"
    );
    assert!(
        largest <= PIN_CHUNK as u64,
        "a pinning call of {largest} bytes"
    );
    assert!(
        largest_waited_behind > 0 && largest_waited_behind <= PIN_CHUNK as u64,
        "a call waited behind a pinning call of {largest_waited_behind} bytes"
    );

    let before = a.driver().calls();
    a.pause(&["steps"]).unwrap();
    a.resume(&["steps"]).unwrap();
    let calls = delta(&before, &a.driver().calls());
    assert_eq!(
        kind(&calls, "host_register"),
        0,
        "the pause used the prepared backups"
    );
    assert_eq!(
        kind(&calls, "copy"),
        3 * 3 * 2,
        "one copy per step, each way"
    );
    for (i, p) in ptrs.iter().enumerate() {
        assert!(check(*p, size, i as u8), "allocation {i} restored");
    }
}

/// Malloc never waits for the preparation of backups. With every pinning call held at its
/// entry (the preparation thread waits there holding nothing, and only the hold's end or its
/// 60 s deadline lets it go), this thread allocates in a cpu tag and a discard tag: every
/// allocation returns while no backup is prepared, also those made once the preparation thread
/// is known to wait in its first pinning call. A malloc that waited for a backup (or pinned one
/// itself) would stay until the deadline, which the fake counts. Once let go, the backups are
/// prepared and the first pause takes them (no pinning call in it).
#[test]
fn malloc_never_waits_for_backups_being_prepared() {
    let a = allocator();
    let held = HeldPinning::new(PinHold::AtEntry);
    let (ours, pins) = (a.driver().calls(), fake_pinning());
    let mut ptrs = Vec::new();
    let allocate = |ptrs: &mut Vec<u64>| {
        let p = a.malloc(4 * MIB, 0, "held", Policy::Cpu).unwrap();
        fill(p, 4 * MIB, ptrs.len() as u8);
        ptrs.push(p);
        let q = a.malloc(2 * MIB, 0, "held_app", Policy::Discard).unwrap();
        fill(q, 2 * MIB, 7);
        a.free(q).unwrap();
    };
    for _ in 0..3 {
        allocate(&mut ptrs);
    }
    // Every one returned, and no pinning call has been let go: none of them waited for one.
    assert_eq!(
        fake_pin_hold()[1],
        0,
        "a malloc waited until the hold's deadline let a pinning call go"
    );
    assert_eq!(fake_pinning()[0], pins[0], "no pinning call went through");
    // The preparation thread is (or gets) stuck in its first pinning call.
    assert_eq!(
        wait_pinning_held(1),
        1,
        "preparation waits in a pinning call"
    );
    for _ in 0..2 {
        allocate(&mut ptrs);
    }
    let s = a.stats();
    assert_eq!(s.backups_preparing, 5, "every backup still to prepare");
    assert_eq!(s.tag("held").unwrap().usage.prepared_backup_bytes, 0);
    assert_eq!(
        fake_pin_hold(),
        [1, 0],
        "one held, none let go by the deadline"
    );
    let pinned = delta(&pins, &fake_pinning());
    assert_eq!(pinned[0], 0, "no pinning call went through");
    assert_eq!(pinned[2], 0, "no call waited behind a pinning call");
    let ours_now = delta(&ours, &a.driver().calls());
    assert_eq!(
        (
            kind(&ours_now, "host_alloc"),
            kind(&ours_now, "host_register")
        ),
        (0, 1),
        "malloc pinned nothing itself: one registration entered, the preparation thread's"
    );
    assert_eq!(
        kind(&ours_now, "create"),
        10,
        "5 cpu and 5 discard allocations"
    );

    drop(held);
    a.wait_backups_prepared(std::time::Duration::from_secs(120))
        .expect("backups prepared within 120 s");
    let s = a.stats();
    assert_eq!(s.backups_preparing, 0);
    assert_eq!(
        s.tag("held").unwrap().usage.prepared_backup_bytes,
        20 * MIB as u64
    );
    assert_eq!(fake_pin_hold(), [0, 0], "let go by the hold's end");
    let (ours, fakes) = (a.driver().calls(), fake_calls());
    a.pause(&["held"]).unwrap();
    let (ours, fakes) = (
        delta(&ours, &a.driver().calls()),
        delta(&fakes, &fake_calls()),
    );
    for pin in ["host_alloc", "host_register"] {
        assert_eq!(kind(&ours, pin), 0, "the pause pinned no memory ({pin})");
        assert_eq!(
            kind(&fakes, pin),
            0,
            "the driver saw no pinning either ({pin})"
        );
    }
    assert_eq!(kind(&ours, "copy"), 5);
    a.resume(&["held"]).unwrap();
    for (i, p) in ptrs.iter().enumerate() {
        assert!(check(*p, 4 * MIB, i as u8), "allocation {i} restored");
    }
}
