//! What a caller chooses at pause and resume time instead of the allocation's policy and the
//! retention setting: `pause_with_backup`, `discard`, `resume_keep_backups`; and the listing of
//! allocations. On the fake driver.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use common::*;
use memsaver_allocator::steps::Op;
use memsaver_allocator::{
    Allocator, BackupKind, DeviceUsage, Error, ExternalTag, Policy, Report, Result, State,
};

/// Bytes of host backups (pinned, mmap) of `tag`.
fn backups(a: &Allocator, tag: &str) -> (u64, u64) {
    let s = a.stats();
    let t = s.tag(tag).unwrap();
    (t.usage.pinned_backup_bytes, t.usage.mmap_backup_bytes)
}

#[test]
fn a_backup_chosen_at_pause_time_is_restored_by_resume() {
    let a = allocator();
    let p = a.malloc(3 * MIB, 0, "chosen_cpu", Policy::Discard).unwrap();
    fill(p, 4 * MIB, 1);
    a.pause_with_backup(&["chosen_cpu"], Some(Policy::Cpu))
        .unwrap();
    assert_eq!(a.state(p), Some(State::Paused));
    assert_eq!(backups(&a, "chosen_cpu"), (4 << 20, 0), "pinned, as chosen");
    a.resume(&["chosen_cpu"]).unwrap();
    assert!(
        check(p, 4 * MIB, 1),
        "restored although the policy is discard"
    );

    // The next pause without a choice follows the allocation's policy: the retained backup is
    // released and nothing is restored from it.
    fill(p, 4 * MIB, 2);
    a.pause(&["chosen_cpu"]).unwrap();
    assert_eq!(backups(&a, "chosen_cpu"), (0, 0), "discard keeps no backup");
    a.resume(&["chosen_cpu"]).unwrap();
    assert!(!check(p, 4 * MIB, 2) && !check(p, 4 * MIB, 1));
    a.free(p).unwrap();
}

#[test]
fn discard_chosen_at_pause_time_drops_contents_and_an_older_backup() {
    let a = allocator();
    let p = a.malloc(2 * MIB, 0, "chosen_discard", Policy::Cpu).unwrap();
    fill(p, 2 * MIB, 3);
    // A first cycle leaves a retained backup holding seed 3.
    a.pause(&["chosen_discard"]).unwrap();
    a.resume(&["chosen_discard"]).unwrap();
    assert!(check(p, 2 * MIB, 3));
    assert_eq!(backups(&a, "chosen_discard").0, 2 << 20, "retained");
    fill(p, 2 * MIB, 4);
    let copies = kind(&fake_calls(), "copy");
    let r = a
        .pause_with_backup(&["chosen_discard"], Some(Policy::Discard))
        .unwrap();
    assert_eq!((r.allocations, r.copied_bytes), (1, 0));
    assert_eq!(kind(&fake_calls(), "copy"), copies, "no copy");
    assert_eq!(
        backups(&a, "chosen_discard"),
        (0, 0),
        "the old backup is released"
    );
    a.resume(&["chosen_discard"]).unwrap();
    assert!(
        !check(p, 2 * MIB, 3) && !check(p, 2 * MIB, 4),
        "neither the old backup nor the contents come back"
    );
    // The allocation's own policy applies again at the next pause.
    fill(p, 2 * MIB, 5);
    a.pause(&["chosen_discard"]).unwrap();
    a.resume(&["chosen_discard"]).unwrap();
    assert!(check(p, 2 * MIB, 5));
    a.free(p).unwrap();
}

#[test]
fn a_chosen_mmap_backup_replaces_a_retained_pinned_one() {
    let a = allocator();
    let p = a.malloc(2 * MIB, 0, "chosen_mmap", Policy::Cpu).unwrap();
    fill(p, 2 * MIB, 6);
    a.pause(&["chosen_mmap"]).unwrap();
    a.resume(&["chosen_mmap"]).unwrap();
    assert_eq!(backups(&a, "chosen_mmap"), (2 << 20, 0));
    fill(p, 2 * MIB, 7);
    a.pause_with_backup(&["chosen_mmap"], Some(Policy::Mmap))
        .unwrap();
    assert_eq!(
        backups(&a, "chosen_mmap"),
        (0, 2 << 20),
        "pageable, as chosen"
    );
    a.resume(&["chosen_mmap"]).unwrap();
    assert!(check(p, 2 * MIB, 7));
    a.free(p).unwrap();
}

#[test]
fn a_chosen_disk_backup_needs_a_directory_and_otherwise_changes_nothing() {
    let a = allocator();
    let p = a
        .malloc(2 * MIB, 0, "chosen_disk", Policy::Discard)
        .unwrap();
    let e = a
        .pause_with_backup(&["chosen_disk"], Some(Policy::Disk))
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert_eq!(a.state(p), Some(State::Resident));
    assert!(!a.is_paused("chosen_disk"));

    let dir = std::env::temp_dir().join(format!("memsaver-chosen-disk-{}", std::process::id()));
    a.set_disk_dir(Some(&dir)).unwrap();
    fill(p, 2 * MIB, 8);
    a.pause_with_backup(&["chosen_disk"], Some(Policy::Disk))
        .unwrap();
    assert_eq!(
        a.allocations(&["chosen_disk"]).unwrap()[0].backup,
        Some(BackupKind::Disk)
    );
    a.resume(&["chosen_disk"]).unwrap();
    assert!(check(p, 2 * MIB, 8));
    a.free(p).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn discard_of_a_resident_tag_pauses_it_without_a_copy() {
    let a = allocator();
    let p = a
        .malloc(2 * MIB, 0, "discard_resident", Policy::Cpu)
        .unwrap();
    let q = a.malloc(2 * MIB, 0, "discard_other", Policy::Cpu).unwrap();
    fill(p, 2 * MIB, 9);
    fill(q, 2 * MIB, 9);
    let free = free_bytes(&a, 0);
    let r = a.discard(&["discard_resident"]).unwrap();
    assert_eq!((r.allocations, r.bytes, r.copied_bytes), (1, 2 << 20, 0));
    assert_eq!(
        free_bytes(&a, 0),
        free + (2 << 20),
        "its memory is released"
    );
    assert!(a.is_paused("discard_resident"));
    assert_eq!(
        a.state(q),
        Some(State::Resident),
        "other tags are untouched"
    );
    assert!(check(q, 2 * MIB, 9));
    assert_eq!(
        a.malloc(MIB, 0, "discard_resident", Policy::Cpu)
            .unwrap_err()
            .to_string(),
        Error::TagPaused {
            tag: "discard_resident".into()
        }
        .to_string(),
        "paused, as after a pause"
    );
    a.resume(&["discard_resident"]).unwrap();
    assert!(!check(p, 2 * MIB, 9));
    a.free(p).unwrap();
    a.free(q).unwrap();
}

#[test]
fn discard_of_a_paused_tag_releases_its_backups() {
    let a = allocator();
    let p = a
        .malloc(2 * MIB, 0, "discard_paused", Policy::Mmap)
        .unwrap();
    fill(p, 2 * MIB, 10);
    a.pause(&["discard_paused"]).unwrap();
    assert_eq!(backups(&a, "discard_paused"), (0, 2 << 20));
    let r = a.discard(&["discard_paused"]).unwrap();
    assert_eq!(r.allocations, 0, "nothing more to release on the device");
    assert_eq!(backups(&a, "discard_paused"), (0, 0), "the backup is gone");
    assert_eq!(a.state(p), Some(State::Paused));
    let info = &a.allocations(&["discard_paused"]).unwrap()[0];
    assert_eq!((info.backup, info.backup_bytes), (None, 0));
    a.resume(&["discard_paused"]).unwrap();
    assert!(
        !check(p, 2 * MIB, 10),
        "resume gives memory without the old contents"
    );
    // A discard twice is a no-op; the policy still applies to the next cycle.
    fill(p, 2 * MIB, 11);
    a.pause(&["discard_paused"]).unwrap();
    a.resume(&["discard_paused"]).unwrap();
    assert!(check(p, 2 * MIB, 11));
    a.free(p).unwrap();
}

#[test]
fn resume_chooses_to_keep_or_release_backups() {
    let a = allocator();
    assert!(a.retain_backups());
    let p = a.malloc(2 * MIB, 0, "keep_choice", Policy::Cpu).unwrap();
    fill(p, 2 * MIB, 12);
    a.pause(&["keep_choice"]).unwrap();
    a.resume_keep_backups(&["keep_choice"], Some(false))
        .unwrap();
    assert!(check(p, 2 * MIB, 12));
    assert_eq!(
        backups(&a, "keep_choice"),
        (0, 0),
        "released despite retention"
    );

    a.set_retain_backups(false);
    a.pause(&["keep_choice"]).unwrap();
    a.resume_keep_backups(&["keep_choice"], Some(true)).unwrap();
    assert_eq!(
        backups(&a, "keep_choice").0,
        2 << 20,
        "kept despite no retention"
    );
    a.pause(&["keep_choice"]).unwrap();
    a.resume_keep_backups(&["keep_choice"], None).unwrap();
    assert_eq!(
        backups(&a, "keep_choice"),
        (0, 0),
        "None follows the setting"
    );
    assert!(!a.retain_backups(), "the setting is unchanged");

    // Releasing also drops a backup retained by a resident allocation of the tag.
    a.set_retain_backups(true);
    a.pause(&["keep_choice"]).unwrap();
    a.resume(&["keep_choice"]).unwrap();
    assert_eq!(backups(&a, "keep_choice").0, 2 << 20);
    a.resume_keep_backups(&["keep_choice"], Some(false))
        .unwrap();
    assert_eq!(backups(&a, "keep_choice"), (0, 0));
    a.free(p).unwrap();
}

#[test]
fn resume_out_of_memory_with_a_choice_keeps_what_is_still_paused() {
    let a = allocator();
    let p = a.malloc(2 * MIB, 0, "keep_oom", Policy::Cpu).unwrap();
    fill(p, 2 * MIB, 13);
    a.pause(&["keep_oom"]).unwrap();
    inject("fakecuda_fail_create_at", 1);
    let e = a
        .resume_keep_backups(&["keep_oom"], Some(false))
        .unwrap_err();
    inject("fakecuda_reset_faults", 0);
    assert!(matches!(e, Error::ResumeOutOfMemory { .. }), "{e}");
    assert_eq!(a.state(p), Some(State::Paused));
    assert_eq!(
        backups(&a, "keep_oom").0,
        2 << 20,
        "a paused allocation keeps its backup"
    );
    a.resume_keep_backups(&["keep_oom"], Some(false)).unwrap();
    assert!(check(p, 2 * MIB, 13));
    a.free(p).unwrap();
}

#[test]
fn choices_refuse_unknown_tags_and_change_nothing() {
    let a = allocator();
    let p = a.malloc(2 * MIB, 0, "known_choice", Policy::Cpu).unwrap();
    for r in [
        a.pause_with_backup(&["known_choice", "nope"], Some(Policy::Discard)),
        a.discard(&["known_choice", "nope"]),
        a.resume_keep_backups(&["nope"], Some(false)),
    ] {
        assert!(
            matches!(r, Err(Error::UnknownTag { ref tag, .. }) if tag == "nope"),
            "{r:?}"
        );
    }
    assert!(matches!(
        a.allocations(&["nope"]),
        Err(Error::UnknownTag { .. })
    ));
    assert!(matches!(
        a.discard(&["bad tag"]),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(a.state(p), Some(State::Resident));
    assert!(!a.is_paused("known_choice"));
    a.free(p).unwrap();
}

#[test]
fn allocations_are_listed_by_tag() {
    let a = allocator();
    let p = a.malloc(MIB, 0, "listed_a", Policy::Cpu).unwrap();
    let q = a.malloc(3 * MIB, 0, "listed_b", Policy::Discard).unwrap();
    let all = a.allocations(&[]).unwrap();
    assert!(all.iter().any(|i| i.ptr == p) && all.iter().any(|i| i.ptr == q));
    let b = a.allocations(&["listed_b"]).unwrap();
    assert_eq!(b.len(), 1);
    assert_eq!(
        (b[0].ptr, b[0].size, b[0].device, b[0].policy, b[0].state),
        (q, 4 << 20, 0, Policy::Discard, State::Resident)
    );
    a.pause(&["listed_a"]).unwrap();
    let l = &a.allocations(&["listed_a"]).unwrap()[0];
    assert_eq!(
        (l.state, l.backup, l.backup_bytes),
        (State::Paused, Some(BackupKind::Pinned), 2 << 20)
    );
    let json = serde_json::to_value(l).unwrap();
    assert_eq!(json["state"], "paused");
    assert_eq!(json["backup"], "pinned");
    assert_eq!(json["policy"], "cpu");
    a.free(p).unwrap();
    a.free(q).unwrap();
}

/// An external tag that records whether the steps of its resume keep backups.
#[derive(Default)]
struct Recorder {
    allocator: AtomicUsize,
    paused: AtomicBool,
    kept: Arc<parking_lot::Mutex<Vec<bool>>>,
}

impl ExternalTag for Recorder {
    fn pause(&self) -> Result<Report> {
        self.paused.store(true, Ordering::SeqCst);
        Ok(Report::default())
    }
    fn resume(&self) -> Result<Report> {
        // SAFETY: set to the allocator that owns this tag, which outlives its calls.
        let a = unsafe { &*(self.allocator.load(Ordering::SeqCst) as *const Allocator) };
        self.kept.lock().push(a.steps(Op::Resume).plan.retain);
        self.paused.store(false, Ordering::SeqCst);
        Ok(Report::default())
    }
    fn paused(&self) -> bool {
        self.paused.load(Ordering::SeqCst)
    }
    fn usage(&self) -> Vec<DeviceUsage> {
        Vec::new()
    }
}

#[test]
fn external_tags_take_the_resume_choice_and_refuse_the_pause_choices() {
    let a = allocator();
    let ext = Arc::new(Recorder::default());
    ext.allocator
        .store(&*a as *const Allocator as usize, Ordering::SeqCst);
    a.register_external("recorder", ext.clone()).unwrap();
    let p = a.malloc(2 * MIB, 0, "beside_ext", Policy::Cpu).unwrap();

    for r in [
        a.pause_with_backup(&["recorder"], Some(Policy::Discard)),
        a.pause_with_backup(&["beside_ext", "recorder"], Some(Policy::Cpu)),
        a.discard(&["recorder"]),
    ] {
        let e = r.unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(ref m) if m.contains("'recorder'")),
            "{e}"
        );
    }
    assert!(
        !ext.paused() && a.state(p) == Some(State::Resident),
        "nothing changed"
    );

    // No tag named: the choice applies to the table, the external tag pauses as always.
    a.pause_with_backup(&[], Some(Policy::Discard)).unwrap();
    assert!(ext.paused());
    assert_eq!(a.state(p), Some(State::Paused));
    a.resume_keep_backups(&[], Some(false)).unwrap();
    a.resume(&["recorder"]).unwrap();
    // A discard of every tag leaves the external tag alone.
    a.discard(&[]).unwrap();
    assert!(!ext.paused() && a.state(p) == Some(State::Paused));
    a.pause(&["recorder"]).unwrap();
    a.resume_keep_backups(&["recorder"], Some(false)).unwrap();
    assert_eq!(*ext.kept.lock(), vec![false, true, false]);
    assert!(
        a.steps(Op::Resume).plan.retain,
        "the choice lasts for its call only"
    );
    a.resume(&[]).unwrap();
    a.free(p).unwrap();
}
