//! Adjacent allocations of one tag resumed as one physical allocation (a run): fewer driver
//! calls, the same addresses and contents, and frees that hold nothing back for longer than
//! the run lives. On the fake driver, which maps across adjacent reservations as the real one
//! does (bench/vmm_runs.py).

mod common;

use common::*;
use memsaver_allocator::{Error, Policy, State};

/// `after - before` of the driver's counts, for one kind.
fn calls_of(a: &memsaver_allocator::Allocator, f: impl FnOnce(), kinds: &[&str]) -> Vec<u64> {
    let before = a.driver().calls();
    f();
    let after = a.driver().calls();
    kinds
        .iter()
        .map(|k| kind(&after, k) - kind(&before, k))
        .collect()
}

fn adjacent(ptrs: &[u64], size: usize) -> bool {
    ptrs.windows(2).all(|w| w[1] == w[0] + size as u64)
}

#[test]
fn adjacent_allocations_resume_with_one_physical_allocation_and_pause_with_one_unmap() {
    let a = allocator();
    let ptrs: Vec<u64> = (0..8)
        .map(|_| a.malloc(2 * MIB, 0, "kv", Policy::Discard).unwrap())
        .collect();
    assert!(
        adjacent(&ptrs, 2 * MIB),
        "allocations of a tag are placed one after the other: {ptrs:x?}"
    );
    let free0 = free_bytes(&a, 0);
    // The first pause releases what malloc made: one physical allocation each.
    let c = calls_of(
        &a,
        || drop(a.pause(&["kv"]).unwrap()),
        &["unmap", "release"],
    );
    assert_eq!(c, [8, 8]);
    assert_eq!(free_bytes(&a, 0), free0 + 16 * MIB);
    let c = calls_of(
        &a,
        || drop(a.resume(&["kv"]).unwrap()),
        &["create", "map", "set_access"],
    );
    assert_eq!(c, [1, 1, 1], "one run of 16 MiB");
    assert_eq!(free_bytes(&a, 0), free0);
    for p in &ptrs {
        assert_eq!(a.state(*p), Some(State::Resident));
    }
    let c = calls_of(
        &a,
        || drop(a.pause(&["kv"]).unwrap()),
        &["unmap", "release"],
    );
    assert_eq!(c, [1, 1]);
    assert_eq!(free_bytes(&a, 0), free0 + 16 * MIB);
    a.resume(&["kv"]).unwrap();
    for p in ptrs {
        a.free(p).unwrap();
    }
    assert_eq!(
        free_bytes(&a, 0),
        free0 + 16 * MIB,
        "every byte is back once all are freed"
    );
    assert_eq!(a.stats().freed_held_bytes, 0);
}

#[test]
fn contents_of_a_run_come_back_and_the_merge_limit_bounds_each_run() {
    let a = allocator();
    a.set_merge_limit(4 * MIB);
    let ptrs: Vec<u64> = (0..6)
        .map(|_| a.malloc(2 * MIB, 0, "w", Policy::Cpu).unwrap())
        .collect();
    for (i, p) in ptrs.iter().enumerate() {
        fill(*p, 2 * MIB, i as u8);
    }
    a.pause(&["w"]).unwrap();
    let c = calls_of(&a, || drop(a.resume(&["w"]).unwrap()), &["create", "copy"]);
    assert_eq!(c, [3, 6], "runs of at most 4 MiB; one copy per allocation");
    for cycle in 0..3 {
        a.pause(&["w"]).unwrap();
        a.resume(&["w"]).unwrap();
        for (i, p) in ptrs.iter().enumerate() {
            assert!(check(*p, 2 * MIB, i as u8), "cycle {cycle}, allocation {i}");
        }
    }
    a.set_merge_limit(0);
    a.pause(&["w"]).unwrap();
    let c = calls_of(&a, || drop(a.resume(&["w"]).unwrap()), &["create"]);
    assert_eq!(c, [6], "0 turns merging off");
}

#[test]
fn an_allocation_freed_inside_a_run_is_held_until_the_run_is_released() {
    let a = allocator();
    let ptrs: Vec<u64> = (0..4)
        .map(|_| a.malloc(2 * MIB, 0, "act", Policy::Cpu).unwrap())
        .collect();
    for (i, p) in ptrs.iter().enumerate() {
        fill(*p, 2 * MIB, i as u8);
    }
    a.pause(&["act"]).unwrap();
    a.resume(&["act"]).unwrap();
    let free0 = free_bytes(&a, 0);
    a.free(ptrs[1]).unwrap();
    assert_eq!(
        free_bytes(&a, 0),
        free0,
        "part of a mapping cannot be given back"
    );
    assert_eq!(a.stats().freed_held_bytes, 2 * MIB as u64);
    assert_eq!(
        a.stats().tag("act").unwrap().usage.resident_bytes,
        6 * MIB as u64
    );
    assert!(check(ptrs[2], 2 * MIB, 2), "the others are untouched");

    // The next pause releases the run, the freed part included; the resume maps only what is
    // left: two runs, on each side of the hole.
    a.pause(&["act"]).unwrap();
    assert_eq!(free_bytes(&a, 0), free0 + 8 * MIB);
    assert_eq!(a.stats().freed_held_bytes, 0);
    let c = calls_of(&a, || drop(a.resume(&["act"]).unwrap()), &["create"]);
    assert_eq!(c, [2]);
    for i in [0, 2, 3] {
        assert!(check(ptrs[i], 2 * MIB, i as u8), "allocation {i}");
    }
    // Freeing every allocation of a run releases it at once.
    a.free(ptrs[2]).unwrap();
    a.free(ptrs[3]).unwrap();
    a.free(ptrs[0]).unwrap();
    assert_eq!(a.stats().freed_held_bytes, 0);
    assert_eq!(free_bytes(&a, 0), free0 + 8 * MIB);
    // The freed address ranges are usable again.
    let again: Vec<u64> = (0..4)
        .map(|_| a.malloc(2 * MIB, 0, "act", Policy::Discard).unwrap())
        .collect();
    for p in again {
        a.free(p).unwrap();
    }
}

#[test]
fn a_run_that_does_not_fit_is_resumed_one_allocation_at_a_time() {
    let a = allocator();
    let ptrs: Vec<u64> = (0..4)
        .map(|_| a.malloc(2 * MIB, 0, "big", Policy::Cpu).unwrap())
        .collect();
    for (i, p) in ptrs.iter().enumerate() {
        fill(*p, 2 * MIB, i as u8);
    }
    a.pause(&["big"]).unwrap();
    // Room for two of the four above the memory margin: the run of 8 MiB does not fit, so
    // the allocations are tried one by one; as much as fits is resumed, the rest stays paused
    // with its backup.
    a.set_memory_margin((free_bytes(&a, 0) - 5 * MIB) as u64);
    let e = a.resume(&["big"]).unwrap_err();
    a.set_memory_margin(0);
    assert!(
        matches!(
            e,
            Error::ResumeOutOfMemory {
                resumed: 2,
                still_paused: 2,
                ..
            }
        ),
        "{e}"
    );
    for (i, p) in ptrs.iter().enumerate() {
        let want = if i < 2 {
            State::Resident
        } else {
            State::Paused
        };
        assert_eq!(a.state(*p), Some(want), "allocation {i}");
    }
    let c = calls_of(&a, || drop(a.resume(&["big"]).unwrap()), &["create"]);
    assert_eq!(c, [1], "the retry backs the two left with one run");
    for (i, p) in ptrs.iter().enumerate() {
        assert!(check(*p, 2 * MIB, i as u8), "allocation {i}");
    }
}

#[test]
fn tags_never_share_a_run_and_pausing_one_leaves_the_other_resident() {
    let a = allocator();
    let mut ptrs = Vec::new();
    for i in 0..6u8 {
        let tag = if i % 2 == 0 { "even" } else { "odd" };
        let p = a.malloc(2 * MIB, 0, tag, Policy::Cpu).unwrap();
        fill(p, 2 * MIB, i);
        ptrs.push((p, tag, i));
    }
    for _ in 0..2 {
        a.pause(&["even", "odd"]).unwrap();
        a.resume(&["even", "odd"]).unwrap();
        a.pause(&["even"]).unwrap();
        for &(p, tag, i) in &ptrs {
            let want = if tag == "even" {
                State::Paused
            } else {
                State::Resident
            };
            assert_eq!(a.state(p), Some(want));
            if tag == "odd" {
                assert!(
                    check(p, 2 * MIB, i),
                    "odd allocation {i} while even is paused"
                );
            }
        }
        a.resume(&["even"]).unwrap();
        for &(p, _, i) in &ptrs {
            assert!(check(p, 2 * MIB, i), "allocation {i}");
        }
    }
}

#[test]
fn a_run_whose_unmap_fails_stays_resident_whole_and_pauses_later() {
    let a = allocator();
    let ptrs: Vec<u64> = (0..4)
        .map(|_| a.malloc(2 * MIB, 0, "stay", Policy::Cpu).unwrap())
        .collect();
    for (i, p) in ptrs.iter().enumerate() {
        fill(*p, 2 * MIB, i as u8);
    }
    a.pause(&["stay"]).unwrap();
    a.resume(&["stay"]).unwrap(); // now one run
    inject("fakecuda_fail_unmap_at", 1);
    let e = a.pause(&["stay"]).unwrap_err();
    inject("fakecuda_reset_faults", 0);
    assert!(matches!(e, Error::Incomplete { failed: 4, .. }), "{e}");
    for (i, p) in ptrs.iter().enumerate() {
        assert_eq!(a.state(*p), Some(State::Resident));
        assert!(check(*p, 2 * MIB, i as u8), "allocation {i} untouched");
    }
    a.pause(&["stay"]).unwrap();
    a.resume(&["stay"]).unwrap();
    for (i, p) in ptrs.iter().enumerate() {
        assert!(
            check(*p, 2 * MIB, i as u8),
            "allocation {i} after the retry"
        );
    }
}
