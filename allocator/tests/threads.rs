//! Allocation and free from many threads at once, also while another tag is being paused and
//! resumed.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};

use common::*;
use memsaver_allocator::{Policy, State};

#[test]
fn many_threads_allocate_and_free() {
    let a = allocator();
    std::thread::scope(|s| {
        for t in 0..8u8 {
            let a = &a;
            s.spawn(move || {
                let tag = format!("t{}", t % 3);
                for i in 0..40 {
                    let p = a
                        .malloc(MIB + i * 4096, t as i32 % 2, &tag, Policy::Cpu)
                        .unwrap();
                    fill(p, MIB, t);
                    assert!(check(p, MIB, t));
                    a.free(p).unwrap();
                }
            });
        }
    });
    assert_eq!(a.stats().total.allocations, 0);
}

#[test]
fn other_tags_allocate_while_one_is_paused_and_resumed() {
    let a = allocator();
    let big: Vec<u64> = (0..8)
        .map(|_| a.malloc(4 * MIB, 0, "weights", Policy::Cpu).unwrap())
        .collect();
    for (i, p) in big.iter().enumerate() {
        fill(*p, 4 * MIB, i as u8);
    }
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..3)
            .map(|t| {
                let (a, stop) = (&a, &stop);
                s.spawn(move || {
                    let mut n = 0;
                    while !stop.load(Ordering::Relaxed) || n < 20 {
                        let p = a
                            .malloc(2 * MIB, 0, "activations", Policy::Discard)
                            .unwrap();
                        fill(p, 2 * MIB, t);
                        assert!(
                            check(p, 2 * MIB, t),
                            "memory of another tag is never disturbed"
                        );
                        a.free(p).unwrap();
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        for _ in 0..10 {
            a.pause(&["weights"]).unwrap();
            assert!(big.iter().all(|p| a.state(*p) == Some(State::Paused)));
            a.resume(&["weights"]).unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        for w in workers {
            assert!(w.join().unwrap() >= 20);
        }
    });
    for (i, p) in big.iter().enumerate() {
        assert!(check(*p, 4 * MIB, i as u8));
        a.free(*p).unwrap();
    }
    assert_eq!(a.stats().total.allocations, 0);
}

#[test]
fn free_during_a_pause_is_completed_by_the_pause() {
    // Frees race with pauses of the same tag; whichever wins, nothing leaks and nothing is
    // freed twice.
    let a = allocator();
    for round in 0..20 {
        let ptrs: Vec<u64> = (0..16)
            .map(|_| a.malloc(2 * MIB, 0, "racy", Policy::Cpu).unwrap())
            .collect();
        std::thread::scope(|s| {
            let a = &a;
            s.spawn(move || {
                a.pause(&["racy"]).unwrap();
            });
            for p in &ptrs {
                a.free(*p).unwrap();
            }
        });
        a.resume(&["racy"]).unwrap();
        assert_eq!(
            a.stats().tag("racy").unwrap().usage.allocations,
            0,
            "round {round}"
        );
        assert_eq!(
            a.stats().tag("racy").unwrap().usage.backup_bytes,
            0,
            "round {round}"
        );
    }
}
