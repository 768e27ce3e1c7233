//! Every state transition of an allocation, on the fake driver.

mod common;

use common::*;
use memsaver_allocator::{Error, Policy, State};

#[test]
fn malloc_rounds_to_granularity_and_is_resident() {
    let a = allocator();
    let g = a.granularity(0).unwrap();
    let p = a.malloc(g + 1, 0, "weights", Policy::Cpu).unwrap();
    assert_eq!(p % g as u64, 0, "address aligned to the granularity");
    assert_eq!(a.state(p), Some(State::Resident));
    let s = a.stats();
    let w = s.tag("weights").unwrap();
    assert_eq!(w.usage.allocations, 1);
    assert_eq!(w.usage.reserved_bytes, 2 * g as u64);
    assert_eq!(w.usage.resident_bytes, 2 * g as u64);
    assert_eq!(w.devices[0].device, 0);
    a.free(p).unwrap();
    assert_eq!(a.state(p), None);
    assert_eq!(a.stats().total.allocations, 0);
}

#[test]
fn cpu_policy_survives_pause_and_resume_at_the_same_address() {
    let a = allocator();
    let len = 6 * MIB;
    let p = a.malloc(len, 0, "weights", Policy::Cpu).unwrap();
    fill(p, len, 7);
    let before = free_bytes(&a, 0);

    let r = a.pause(&["weights"]).unwrap();
    assert_eq!(
        (r.allocations, r.bytes, r.copied_bytes),
        (1, len as u64, len as u64)
    );
    assert_eq!(a.state(p), Some(State::Paused));
    assert_eq!(
        free_bytes(&a, 0) - before,
        len,
        "pause gave the physical memory back"
    );
    let w = a.stats().tag("weights").unwrap().clone();
    assert!(w.paused);
    assert_eq!(
        (
            w.usage.resident_bytes,
            w.usage.backup_bytes,
            w.usage.reserved_bytes
        ),
        (0, len as u64, len as u64)
    );

    let r = a.resume(&["weights"]).unwrap();
    assert_eq!(r.allocations, 1);
    assert_eq!(a.state(p), Some(State::Resident));
    assert_eq!(free_bytes(&a, 0), before);
    assert!(check(p, len, 7), "contents restored bit for bit");
    assert!(!a.stats().tag("weights").unwrap().paused);
    a.free(p).unwrap();
}

#[test]
fn discard_policy_frees_without_backup() {
    let a = allocator();
    let p = a.malloc(8 * MIB, 0, "kv_cache", Policy::Discard).unwrap();
    let before = free_bytes(&a, 0);
    let r = a.pause(&["kv_cache"]).unwrap();
    assert_eq!(r.copied_bytes, 0);
    assert_eq!(free_bytes(&a, 0) - before, 8 * MIB);
    assert_eq!(a.stats().tag("kv_cache").unwrap().usage.backup_bytes, 0);
    a.resume(&["kv_cache"]).unwrap();
    // Resumed discard memory is usable (contents unspecified).
    fill(p, 8 * MIB, 1);
    assert!(check(p, 8 * MIB, 1));
    a.free(p).unwrap();
}

#[test]
fn pause_and_resume_are_idempotent() {
    let a = allocator();
    let p = a.malloc(2 * MIB, 0, "graph", Policy::Cpu).unwrap();
    fill(p, 2 * MIB, 3);
    assert_eq!(a.pause(&["graph"]).unwrap().allocations, 1);
    assert_eq!(
        a.pause(&["graph"]).unwrap().allocations,
        0,
        "second pause is a no-op"
    );
    assert_eq!(a.state(p), Some(State::Paused));
    assert_eq!(a.resume(&["graph"]).unwrap().allocations, 1);
    assert_eq!(
        a.resume(&["graph"]).unwrap().allocations,
        0,
        "second resume is a no-op"
    );
    assert!(check(p, 2 * MIB, 3));
    a.free(p).unwrap();
}

#[test]
fn backups_are_reused_across_cycles() {
    let a = allocator();
    let p = a.malloc(4 * MIB, 0, "reuse", Policy::Cpu).unwrap();
    for seed in 0..4u8 {
        fill(p, 4 * MIB, seed);
        a.pause(&["reuse"]).unwrap();
        assert_eq!(
            a.stats().tag("reuse").unwrap().usage.backup_bytes,
            4 * MIB as u64
        );
        a.resume(&["reuse"]).unwrap();
        assert!(check(p, 4 * MIB, seed), "cycle {seed}");
        // The backup stays attached (and is overwritten by the next pause).
        assert_eq!(
            a.stats().tag("reuse").unwrap().usage.backup_bytes,
            4 * MIB as u64
        );
    }
    a.free(p).unwrap();
    assert_eq!(a.stats().total.backup_bytes, 0);
}

#[test]
fn free_while_paused_releases_everything() {
    let a = allocator();
    let before = free_bytes(&a, 0);
    let p = a.malloc(4 * MIB, 0, "weights", Policy::Cpu).unwrap();
    a.pause(&["weights"]).unwrap();
    assert_eq!(a.stats().total.backup_bytes, 4 * MIB as u64);
    a.free(p).unwrap();
    let s = a.stats();
    assert_eq!(
        (
            s.total.allocations,
            s.total.backup_bytes,
            s.total.reserved_bytes
        ),
        (0, 0, 0)
    );
    assert_eq!(free_bytes(&a, 0), before);
    // The tag stays paused (and known) until resumed.
    assert!(matches!(
        a.malloc(MIB, 0, "weights", Policy::Cpu),
        Err(Error::TagPaused { .. })
    ));
    a.resume(&["weights"]).unwrap();
    let q = a.malloc(MIB, 0, "weights", Policy::Cpu).unwrap();
    a.free(q).unwrap();
}

#[test]
fn pause_selects_tags_and_all() {
    let a = allocator();
    let w = a.malloc(2 * MIB, 0, "weights", Policy::Cpu).unwrap();
    let k = a.malloc(2 * MIB, 0, "kv_cache", Policy::Discard).unwrap();
    let g = a.malloc(2 * MIB, 0, "cuda_graph", Policy::Cpu).unwrap();
    a.pause(&["kv_cache", "cuda_graph"]).unwrap();
    assert_eq!(
        [a.state(w), a.state(k), a.state(g)],
        [
            Some(State::Resident),
            Some(State::Paused),
            Some(State::Paused)
        ]
    );
    a.pause(&[]).unwrap();
    assert_eq!(a.state(w), Some(State::Paused));
    a.resume(&["weights"]).unwrap();
    assert_eq!(
        [a.state(w), a.state(k)],
        [Some(State::Resident), Some(State::Paused)]
    );
    a.resume(&[]).unwrap();
    assert!(
        [w, k, g]
            .iter()
            .all(|p| a.state(*p) == Some(State::Resident))
    );
    for p in [w, k, g] {
        a.free(p).unwrap();
    }
}

#[test]
fn bad_input_gives_clear_errors_and_changes_nothing() {
    let a = allocator();
    let p = a.malloc(2 * MIB, 0, "weights", Policy::Cpu).unwrap();
    let e = a.pause(&["weights", "kv"]).unwrap_err();
    assert!(matches!(e, Error::UnknownTag { .. }));
    let msg = e.to_string();
    assert!(msg.contains("'kv'") && msg.contains("weights"), "{msg}");
    assert_eq!(
        a.state(p),
        Some(State::Resident),
        "an invalid call pauses nothing"
    );
    assert!(
        a.resume(&["nope"])
            .unwrap_err()
            .to_string()
            .contains("unknown tag 'nope'")
    );

    assert!(matches!(
        a.free(0xdead_0000),
        Err(Error::UnknownPointer { .. })
    ));
    assert!(matches!(
        a.malloc(0, 0, "weights", Policy::Cpu),
        Err(Error::InvalidArgument(_))
    ));
    assert!(
        a.malloc(MIB, 0, "bad tag!", Policy::Cpu)
            .unwrap_err()
            .to_string()
            .contains("invalid tag")
    );
    let e = a
        .malloc(MIB, 99, "weights", Policy::Cpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("device 99 does not exist"), "{e}");

    a.pause(&["weights"]).unwrap();
    let e = a.malloc(MIB, 0, "weights", Policy::Cpu).unwrap_err();
    assert!(e.to_string().contains("tag 'weights' is paused"), "{e}");
    a.resume(&["weights"]).unwrap();
    a.free(p).unwrap();
}

#[test]
fn register_tag_allows_pausing_before_allocating() {
    let a = allocator();
    a.register_tag("later").unwrap();
    assert_eq!(a.pause(&["later"]).unwrap().allocations, 0);
    assert!(a.stats().tag("later").unwrap().paused);
    a.resume(&["later"]).unwrap();
    let p = a.malloc(MIB, 0, "later", Policy::Discard).unwrap();
    a.free(p).unwrap();
}

#[test]
fn allocations_on_several_devices() {
    let a = allocator();
    let p0 = a.malloc(2 * MIB, 0, "multi", Policy::Cpu).unwrap();
    let p1 = a.malloc(4 * MIB, 1, "multi", Policy::Cpu).unwrap();
    fill(p0, 2 * MIB, 10);
    fill(p1, 4 * MIB, 11);
    a.pause(&["multi"]).unwrap();
    let s = a.stats();
    let t = s.tag("multi").unwrap();
    assert_eq!(t.devices.len(), 2);
    assert_eq!(t.devices[1].usage.backup_bytes, 4 * MIB as u64);
    a.resume(&["multi"]).unwrap();
    assert!(check(p0, 2 * MIB, 10) && check(p1, 4 * MIB, 11));
    a.free(p0).unwrap();
    a.free(p1).unwrap();
}

#[test]
fn missing_driver_is_an_error_not_a_panic() {
    let e = memsaver_allocator::driver::Driver::load("/nonexistent/libcuda.so.1").unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("MEMSAVER_CUDA_LIB") && msg.contains("/nonexistent"),
        "{msg}"
    );
}
