//! Running out of memory and failing driver calls during pause and resume: errors, consistent
//! state, and recovery when retried. Uses the fake driver's fault injection and its memory limit.

mod common;

use common::*;
use memsaver_allocator::{Error, Policy, State};

#[test]
fn resume_out_of_memory_reports_and_recovers() {
    let a = allocator();
    // One physical allocation per allocation, so that the second create is the second one.
    a.set_merge_limit(0);
    let ptrs: Vec<u64> = (0..3)
        .map(|_| a.malloc(2 * MIB, 0, "weights", Policy::Cpu).unwrap())
        .collect();
    for (i, p) in ptrs.iter().enumerate() {
        fill(*p, 2 * MIB, i as u8);
    }
    a.pause(&["weights"]).unwrap();

    inject("fakecuda_fail_create_at", 2); // the second cuMemCreate of the resume fails
    let e = a.resume(&["weights"]).unwrap_err();
    inject("fakecuda_reset_faults", 0);
    let Error::ResumeOutOfMemory {
        device,
        resumed,
        still_paused,
        bytes_still_paused,
        ref tags,
        margin: 0,
    } = e
    else {
        panic!("expected ResumeOutOfMemory, got {e}");
    };
    assert_eq!(
        (device, resumed, still_paused, bytes_still_paused),
        (0, 1, 2, 4 * MIB as u64)
    );
    assert_eq!(tags, &["weights".to_string()]);
    assert!(e.to_string().contains("call resume again"), "{e}");

    let states: Vec<_> = ptrs.iter().map(|p| a.state(*p).unwrap()).collect();
    assert_eq!(states.iter().filter(|s| **s == State::Resident).count(), 1);
    assert_eq!(states.iter().filter(|s| **s == State::Paused).count(), 2);
    let w = a.stats().tag("weights").unwrap().clone();
    assert!(w.paused, "the tag stays paused while part of it is");
    assert_eq!(w.usage.resident_bytes, 2 * MIB as u64);

    let r = a.resume(&["weights"]).unwrap();
    assert_eq!(r.allocations, 2, "the retry resumes only what was left");
    for (i, p) in ptrs.iter().enumerate() {
        assert_eq!(a.state(*p), Some(State::Resident));
        assert!(check(*p, 2 * MIB, i as u8), "allocation {i} restored");
    }
    for p in ptrs {
        a.free(p).unwrap();
    }
}

#[test]
fn resume_beyond_device_memory_fails_then_succeeds_after_free() {
    let a = allocator();
    let p = a.malloc(16 * MIB, 0, "weights", Policy::Cpu).unwrap();
    fill(p, 16 * MIB, 42);
    a.pause(&["weights"]).unwrap();
    // Take everything the paused tag gave back (and more), as another process would.
    let g = a.granularity(0).unwrap();
    let free = free_bytes(&a, 0) / g * g;
    let hog = a.malloc(free - 8 * MIB, 0, "hog", Policy::Discard).unwrap();

    let e = a.resume(&["weights"]).unwrap_err();
    assert!(
        matches!(
            e,
            Error::ResumeOutOfMemory {
                still_paused: 1,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(a.state(p), Some(State::Paused));
    assert_eq!(
        a.stats().tag("weights").unwrap().usage.backup_bytes,
        16 * MIB as u64,
        "backup kept"
    );

    a.free(hog).unwrap();
    a.resume(&["weights"]).unwrap();
    assert!(check(p, 16 * MIB, 42));
    a.free(p).unwrap();
}

#[test]
fn failing_map_leaves_the_allocation_paused() {
    let a = allocator();
    let p = a.malloc(2 * MIB, 0, "graph", Policy::Cpu).unwrap();
    fill(p, 2 * MIB, 5);
    a.pause(&["graph"]).unwrap();
    let before = free_bytes(&a, 0);
    inject("fakecuda_fail_map_at", 1);
    let e = a.resume(&["graph"]).unwrap_err();
    inject("fakecuda_reset_faults", 0);
    assert!(
        matches!(
            e,
            Error::Incomplete {
                op: "resume",
                failed: 1,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("cuMemMap: CUDA_ERROR_UNKNOWN"),
        "{e}"
    );
    assert_eq!(a.state(p), Some(State::Paused));
    assert_eq!(
        free_bytes(&a, 0),
        before,
        "the handle created for the failed map was released"
    );
    a.resume(&["graph"]).unwrap();
    assert!(check(p, 2 * MIB, 5));
    a.free(p).unwrap();
}

#[test]
fn out_of_memory_on_malloc_is_an_error() {
    let a = allocator();
    let (_, total) = a.device_memory(0).unwrap();
    let e = a
        .malloc(total + 2 * MIB, 0, "huge", Policy::Discard)
        .unwrap_err();
    assert!(matches!(e, Error::OutOfMemory { .. }), "{e}");
    assert!(e.to_string().contains("out of device memory"), "{e}");
    assert_eq!(a.stats().total.allocations, 0);
}

#[test]
fn failing_unmap_during_pause_leaves_the_allocation_resident() {
    let a = allocator();
    let ptrs: Vec<u64> = (0..2)
        .map(|_| a.malloc(2 * MIB, 0, "weights", Policy::Cpu).unwrap())
        .collect();
    for (i, p) in ptrs.iter().enumerate() {
        fill(*p, 2 * MIB, 20 + i as u8);
    }
    inject("fakecuda_fail_unmap_at", 1);
    let e = a.pause(&["weights"]).unwrap_err();
    inject("fakecuda_reset_faults", 0);
    assert!(
        matches!(
            e,
            Error::Incomplete {
                op: "pause",
                failed: 1,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("cuMemUnmap"), "{e}");
    let states: Vec<_> = ptrs.iter().map(|p| a.state(*p).unwrap()).collect();
    assert!(
        states.contains(&State::Resident) && states.contains(&State::Paused),
        "{states:?}"
    );
    // The one still resident is intact and usable; pausing again completes the job.
    let resident = ptrs
        .iter()
        .position(|p| a.state(*p) == Some(State::Resident))
        .unwrap();
    assert!(check(ptrs[resident], 2 * MIB, 20 + resident as u8));
    assert_eq!(a.pause(&["weights"]).unwrap().allocations, 1);
    a.resume(&["weights"]).unwrap();
    for (i, p) in ptrs.iter().enumerate() {
        assert!(check(*p, 2 * MIB, 20 + i as u8), "allocation {i}");
        a.free(*p).unwrap();
    }
}

#[test]
fn a_pause_that_fails_for_every_allocation_leaves_the_tag_unpaused_and_usable() {
    let a = allocator();
    let p = a.malloc(2 * MIB, 0, "all_fail", Policy::Cpu).unwrap();
    let other = a
        .malloc(2 * MIB, 0, "all_fail_other", Policy::Discard)
        .unwrap();
    fill(p, 2 * MIB, 30);
    // A pause unmaps discard allocations first: the second unmap is the cpu allocation's.
    inject("fakecuda_fail_unmap_at", 2);
    let e = a.pause(&["all_fail", "all_fail_other"]).unwrap_err();
    inject("fakecuda_reset_faults", 0);
    assert!(
        matches!(e, Error::Incomplete { failed: 1, .. }) && e.to_string().contains("cuMemUnmap"),
        "{e}"
    );
    assert_eq!(a.state(p), Some(State::Resident));
    assert!(check(p, 2 * MIB, 30), "resident and intact");
    assert!(
        !a.is_paused("all_fail"),
        "nothing of the tag is paused: the tag is not either"
    );
    assert!(!a.stats().tag("all_fail").unwrap().paused);
    assert_eq!(a.state(other), Some(State::Paused));
    assert!(
        a.is_paused("all_fail_other"),
        "the pause of the other tag stands"
    );
    // The tag takes new allocations, and pausing it again works.
    let q = a.malloc(2 * MIB, 0, "all_fail", Policy::Cpu).unwrap();
    fill(q, 2 * MIB, 31);
    a.pause(&["all_fail"]).unwrap();
    assert!(a.is_paused("all_fail"));
    a.resume(&[]).unwrap();
    assert!(check(p, 2 * MIB, 30) && check(q, 2 * MIB, 31));
    for x in [p, q, other] {
        a.free(x).unwrap();
    }
}

#[test]
fn a_pause_that_fails_for_some_allocations_keeps_the_tag_paused() {
    let a = allocator();
    let ptrs: Vec<u64> = (0..2)
        .map(|_| a.malloc(2 * MIB, 0, "some_fail", Policy::Discard).unwrap())
        .collect();
    inject("fakecuda_fail_unmap_at", 1);
    a.pause(&["some_fail"]).unwrap_err();
    inject("fakecuda_reset_faults", 0);
    let states: Vec<_> = ptrs.iter().map(|p| a.state(*p).unwrap()).collect();
    assert!(
        states.contains(&State::Resident) && states.contains(&State::Paused),
        "{states:?}"
    );
    assert!(a.is_paused("some_fail"), "part of it is paused");
    assert!(matches!(
        a.malloc(MIB, 0, "some_fail", Policy::Discard),
        Err(Error::TagPaused { .. })
    ));
    a.resume(&["some_fail"]).unwrap();
    for p in ptrs {
        a.free(p).unwrap();
    }
}

#[test]
fn a_size_past_the_address_space_is_refused_not_wrapped_and_leaves_no_tag() {
    let a = allocator();
    for size in [usize::MAX, usize::MAX - 1, usize::MAX - (2 << 20) + 2] {
        let e = a
            .malloc(size, 0, "huge_request", Policy::Discard)
            .unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("does not fit")),
            "{size}: {e}"
        );
    }
    assert!(
        a.stats().tag("huge_request").is_none(),
        "a refused malloc must not register its tag"
    );
}

#[test]
fn a_failed_allocation_leaves_no_tag_behind() {
    let a = allocator();
    inject("fakecuda_fail_create_at", 1); // the next cuMemCreate runs out of memory
    let e = a
        .malloc(2 * MIB, 0, "never_allocated", Policy::Cpu)
        .unwrap_err();
    inject("fakecuda_reset_faults", 0);
    assert!(matches!(e, Error::OutOfMemory { .. }), "{e}");
    assert!(a.stats().tag("never_allocated").is_none(), "{:?}", a.tags());
    let p = a
        .malloc(2 * MIB, 0, "never_allocated", Policy::Cpu)
        .unwrap();
    assert!(a.stats().tag("never_allocated").is_some());
    a.free(p).unwrap();
}

/// The driver may refuse a reservation at the hint (next to the tag's last allocation) with
/// CUDA_ERROR_OUT_OF_MEMORY instead of placing it elsewhere (seen on a two-GPU H100 host):
/// malloc asks again without the hint. A refusal without a hint is the caller's error.
#[test]
fn a_reservation_refused_at_the_hint_is_made_elsewhere() {
    let a = allocator();
    let first = a.malloc(2 * MIB, 0, "weights", Policy::Cpu).unwrap();
    inject("fakecuda_fail_reserve_at", 1); // the next one: at the hint after `first`
    let second = a.malloc(4 * MIB, 0, "weights", Policy::Cpu);
    inject("fakecuda_reset_faults", 0);
    let second = second.expect("reserved again without the hint");
    fill(second, 4 * MIB, 7);
    assert_eq!(a.state(second), Some(State::Resident));

    inject("fakecuda_fail_reserve_at", 1); // a tag with no allocation yet: no hint
    let e = a.malloc(2 * MIB, 0, "kv_cache", Policy::Cpu).unwrap_err();
    inject("fakecuda_reset_faults", 0);
    assert!(matches!(e, Error::OutOfMemory { .. }), "{e}");
    a.free(first).unwrap();
    a.free(second).unwrap();
}
