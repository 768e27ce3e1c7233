//! The backup reserve (`MEMSAVER_BACKUP_RESERVE_MB`, `Allocator::reserve_backups`): pinned host
//! memory made before any allocation, that `cpu` backups are carved from. On the fake driver,
//! by counts (`fakecuda_host_copy_stats`, the driver's call counts, held pinning), not time.

mod common;

use common::*;
use memsaver_allocator::backup::PIN_CHUNK;
use memsaver_allocator::{Options, Policy};

/// Three pinning steps: 16 + 16 + 8 MiB.
const SIZE: usize = 2 * PIN_CHUNK + 8 * MIB;
/// The reserve of these tests: four steps.
const RESERVE: usize = 4 * PIN_CHUNK;

fn with_reserve(bytes: usize, retain: bool) -> TestAllocator {
    allocator_with(&Options {
        backup_reserve: bytes as u64,
        retain_backups: retain,
        ..Options::default()
    })
}

/// `after - before`, figure by figure.
fn delta<const N: usize>(before: [u64; N], after: [u64; N]) -> [u64; N] {
    std::array::from_fn(|i| after[i] - before[i])
}

/// Copies since `before`: (through registered memory, through pageable memory).
fn copies_since(before: [u64; 3]) -> (u64, u64) {
    let d = delta(before, fake_host_copies());
    (d[0], d[1])
}

/// (asked for, pinned, used) of the reserve, from the stats.
fn reserve_figures(a: &TestAllocator) -> (u64, u64, u64) {
    let s = a.stats();
    (
        s.backup_reserve_bytes,
        s.backup_reserve_pinned_bytes,
        s.backup_reserve_used_bytes,
    )
}

/// Registrations over `bytes` fail in the fake driver until dropped.
struct RegisterLimit;

impl RegisterLimit {
    fn new(bytes: u64) -> Self {
        set_register_limit(bytes);
        Self
    }
}

impl Drop for RegisterLimit {
    fn drop(&mut self) {
        set_register_limit(0);
    }
}

fn set_register_limit(bytes: u64) {
    // SAFETY: the function's C signature.
    let f: extern "C" fn(u64) -> i32 =
        unsafe { std::mem::transmute(fake_fn("fakecuda_fail_registers_over")) };
    assert_eq!(f(bytes), 0);
}

/// With the reserve pinned before the allocations are made, the first pause right after
/// allocating copies into pinned memory only: every piece through a registration (none through
/// the pageable path or staging buffers, which would copy in 4 MiB parts), no pinning call from
/// malloc to the end of the pause, and nothing queued for the preparation thread, which is held
/// at its next pinning call meanwhile (without a reserve the pause would copy the backups as
/// pageable memory). Contents survive; the reserve reports what it lent.
#[test]
fn a_reserve_pinned_before_allocating_makes_the_first_pause_copy_into_pinned_memory_only() {
    let a = with_reserve(RESERVE, true);
    assert_eq!(reserve_figures(&a), (RESERVE as u64, 0, 0), "no device yet");
    a.device(0).unwrap();
    a.wait_backups_prepared(std::time::Duration::from_secs(120))
        .expect("backups prepared within 120 s");
    assert_eq!(
        reserve_figures(&a),
        (RESERVE as u64, RESERVE as u64, 0),
        "pinned once the process uses a device"
    );

    let held = HeldPinning::new(PinHold::AtEntry);
    let (calls, copies) = (a.driver().calls(), fake_host_copies());
    let p = a.malloc(SIZE, 0, "loaded", Policy::Cpu).unwrap();
    let q = a.malloc(4 * MIB, 0, "loaded", Policy::Cpu).unwrap();
    fill(p, SIZE, 1);
    fill(q, 4 * MIB, 2);
    let s = a.stats();
    assert_eq!(s.backups_preparing, 0, "carved from the reserve at malloc");
    assert_eq!(
        s.tag("loaded").unwrap().usage.prepared_backup_bytes,
        (SIZE + 4 * MIB) as u64
    );
    a.pause(&["loaded"]).unwrap();
    assert_eq!(
        copies_since(copies),
        (4, 0),
        "p's three steps and q (inside one step) through registrations, nothing pageable"
    );
    let d = delta(calls, a.driver().calls());
    assert_eq!(
        (kind(&d, "host_register"), kind(&d, "host_alloc")),
        (0, 0),
        "nothing pinned from malloc to the end of the pause"
    );
    assert_eq!(fake_pin_hold()[0], 0, "no pinning call was even started");
    let b = a.backup_pointer(p, SIZE).expect("paused: a backup");
    assert!(check(b as u64, SIZE, 1), "the backup holds p's contents");
    let s = a.stats();
    assert_eq!(
        s.tag("loaded").unwrap().usage.pinned_backup_bytes,
        (SIZE + 4 * MIB) as u64
    );
    assert_eq!(
        reserve_figures(&a),
        (RESERVE as u64, RESERVE as u64, (SIZE + 4 * MIB) as u64)
    );

    let copies = fake_host_copies();
    a.resume(&["loaded"]).unwrap();
    assert_eq!(copies_since(copies), (4, 0));
    assert!(
        check(p, SIZE, 1) && check(q, 4 * MIB, 2),
        "contents restored"
    );
    drop(held);
    a.free(p).unwrap();
    a.free(q).unwrap();
    assert_eq!(
        reserve_figures(&a).2,
        0,
        "freed allocations give their backups back"
    );
}

/// A backup that is released goes back to the reserve, and the next one is carved from it
/// again: with retention off every pause makes a backup and every resume releases it, and no
/// cycle pins anything. A backup larger than what the reserve has free is prepared or
/// allocated as without a reserve, and freeing gives the reserve's part back. A smaller reserve
/// releases its free segments.
#[test]
fn backups_released_go_back_to_the_reserve() {
    let a = with_reserve(RESERVE, false);
    a.device(0).unwrap();
    a.wait_backups_prepared(std::time::Duration::from_secs(120))
        .expect("backups prepared within 120 s");
    let p = a.malloc(SIZE, 0, "cycled", Policy::Cpu).unwrap();
    let calls = a.driver().calls();
    for seed in 1..4 {
        fill(p, SIZE, seed);
        let copies = fake_host_copies();
        a.pause(&["cycled"]).unwrap();
        assert_eq!(reserve_figures(&a).2, SIZE as u64, "carved at the pause");
        a.resume(&["cycled"]).unwrap();
        assert_eq!(copies_since(copies), (6, 0), "all through registrations");
        assert!(check(p, SIZE, seed));
        assert_eq!(
            reserve_figures(&a).2,
            0,
            "released at resume, back in the reserve"
        );
    }
    assert_eq!(
        kind(&delta(calls, a.driver().calls()), "host_register"),
        0,
        "three cycles pinned nothing"
    );

    // Two allocations that the reserve cannot both hold: the second pins its own backup.
    let q = a.malloc(SIZE, 0, "cycled", Policy::Cpu).unwrap();
    let calls = a.driver().calls();
    a.pause(&["cycled"]).unwrap();
    assert_eq!(reserve_figures(&a).2, SIZE as u64);
    assert_eq!(
        kind(&delta(calls, a.driver().calls()), "host_register"),
        3,
        "one backup from the reserve, the other pinned in three steps"
    );
    a.resume(&["cycled"]).unwrap();
    a.free(q).unwrap();

    // Shrinking releases the free segment; growing pins a new one.
    a.reserve_backups(0).unwrap();
    assert_eq!(reserve_figures(&a), (0, 0, 0));
    a.reserve_backups(SIZE as u64).unwrap();
    a.wait_backups_prepared(std::time::Duration::from_secs(120))
        .expect("backups prepared within 120 s");
    assert_eq!(reserve_figures(&a), (SIZE as u64, SIZE as u64, 0));
    a.pause(&["cycled"]).unwrap();
    assert_eq!(reserve_figures(&a).2, SIZE as u64);
    // Lent memory stays while it is lent.
    a.reserve_backups(0).unwrap();
    assert_eq!(reserve_figures(&a), (0, SIZE as u64, SIZE as u64));
    a.free(p).unwrap();
    a.reserve_backups(0).unwrap();
    assert_eq!(reserve_figures(&a), (0, 0, 0));
}

/// A reserve the host cannot pin whole keeps what it got: pinning stops at the first failed
/// step, the stats say how much is pinned, a backup that fits is carved from it, and the
/// process goes on (no error from any call). Asking again tries again.
#[test]
fn a_reserve_the_host_cannot_pin_whole_keeps_what_it_got() {
    let a = with_reserve(RESERVE, true);
    let limit = RegisterLimit::new(2 * PIN_CHUNK as u64);
    a.device(0).unwrap();
    a.wait_backups_prepared(std::time::Duration::from_secs(120))
        .expect("backups prepared within 120 s");
    assert_eq!(
        reserve_figures(&a),
        (RESERVE as u64, 2 * PIN_CHUNK as u64, 0),
        "two steps pinned, the third refused"
    );
    drop(limit);
    let calls = a.driver().calls();
    let p = a.malloc(PIN_CHUNK, 0, "partial", Policy::Cpu).unwrap();
    fill(p, PIN_CHUNK, 3);
    a.pause(&["partial"]).unwrap();
    a.resume(&["partial"]).unwrap();
    assert!(check(p, PIN_CHUNK, 3));
    assert_eq!(kind(&delta(calls, a.driver().calls()), "host_register"), 0);
    assert_eq!(reserve_figures(&a).2, PIN_CHUNK as u64);

    // Asked for again (the host has room now): the rest is pinned.
    a.reserve_backups(RESERVE as u64).unwrap();
    a.wait_backups_prepared(std::time::Duration::from_secs(120))
        .expect("backups prepared within 120 s");
    assert_eq!(
        reserve_figures(&a),
        (RESERVE as u64, RESERVE as u64, PIN_CHUNK as u64)
    );
    a.free(p).unwrap();
}

/// A reserve larger than the host's memory is refused with a message naming the range.
#[test]
fn a_reserve_larger_than_the_host_is_refused() {
    let a = allocator();
    let e = a.reserve_backups(u64::MAX).unwrap_err().to_string();
    assert!(
        e.contains("more than this host's memory: expected 0 to"),
        "{e}"
    );
    assert_eq!(reserve_figures(&a), (0, 0, 0));
}

/// A pause never waits for the reserve: while its pinning is held (one step pinned, the next
/// held at its entry), a backup that fits in the pinned part is carved from it, and one that
/// does not is copied as pageable memory into an empty reservation, as without a reserve; the
/// pause completes while the hold lasts. Once let go, the reserve is pinned whole.
#[test]
fn a_pause_while_the_reserve_is_being_pinned_never_waits_for_it() {
    let a = with_reserve(RESERVE, true);
    let held = HeldPinning::new(PinHold::AtEntry);
    a.device(0).unwrap();
    assert_eq!(wait_pinning_held(1), 1, "the reserve's first step waits");
    held.pass(1);
    assert!(
        wait_until(|| reserve_figures(&a).1 == PIN_CHUNK as u64),
        "one step pinned"
    );
    assert_eq!(wait_pinning_held(1), 1, "the second step waits");

    let p = a.malloc(SIZE, 0, "early", Policy::Cpu).unwrap();
    let q = a.malloc(4 * MIB, 0, "early", Policy::Cpu).unwrap();
    fill(p, SIZE, 4);
    fill(q, 4 * MIB, 5);
    assert_eq!(
        reserve_figures(&a).2,
        4 * MIB as u64,
        "q carved from the pinned step"
    );
    let copies = fake_host_copies();
    a.pause(&["early"]).unwrap();
    assert_eq!(
        copies_since(copies),
        (1, 3),
        "q through its registration, p's three steps as pageable memory"
    );
    assert_eq!(
        fake_pin_hold(),
        [1, 0],
        "still held: the pause waited for no pinning"
    );
    drop(held);
    a.wait_backups_prepared(std::time::Duration::from_secs(120))
        .expect("backups prepared within 120 s");
    assert_eq!(
        reserve_figures(&a),
        (RESERVE as u64, RESERVE as u64, 4 * MIB as u64)
    );
    a.resume(&["early"]).unwrap();
    assert!(check(p, SIZE, 4) && check(q, 4 * MIB, 5));
    a.free(p).unwrap();
    a.free(q).unwrap();
}

/// A backup a pause took partly pinned while the reserve was still being pinned is pinned
/// before the reserve grows further: the cycles after that pause copy at pinned speed without
/// waiting for the whole reserve (which may take seconds), as they do with no reserve.
#[test]
fn a_backup_taken_before_the_reserve_is_pinned_goes_first() {
    let a = with_reserve(RESERVE, true);
    let held = HeldPinning::new(PinHold::AtEntry);
    a.device(0).unwrap();
    assert_eq!(wait_pinning_held(1), 1, "the reserve's first step waits");
    let p = a.malloc(SIZE, 0, "first", Policy::Cpu).unwrap();
    fill(p, SIZE, 6);
    a.pause(&["first"]).unwrap();
    // The reserve's held step, then the next piece of work: p's steps come before the
    // reserve's next one.
    held.pass(1);
    assert_eq!(wait_pinning_held(1), 1);
    held.pass(3);
    assert_eq!(wait_pinning_held(1), 1);
    assert_eq!(
        reserve_figures(&a).1,
        PIN_CHUNK as u64,
        "the reserve did not grow while p was pinned"
    );
    a.resume(&["first"]).unwrap();
    let copies = fake_host_copies();
    a.pause(&["first"]).unwrap();
    assert_eq!(
        copies_since(copies),
        (3, 0),
        "p's three steps copied pinned"
    );
    drop(held);
    a.resume(&["first"]).unwrap();
    assert!(check(p, SIZE, 6));
    a.free(p).unwrap();
}

/// Lowering the reserve below what it holds releases the free memory beyond the new size,
/// also when the reserve is one segment (made from the environment): the segment goes, and
/// the new size is pinned again in the background.
#[test]
fn lowering_the_reserve_releases_the_free_part_beyond_it() {
    let a = with_reserve(4 * PIN_CHUNK, true);
    a.device(0).unwrap();
    a.wait_backups_prepared(std::time::Duration::from_secs(120))
        .expect("backups prepared within 120 s");
    assert_eq!(reserve_figures(&a).1, 4 * PIN_CHUNK as u64);
    a.reserve_backups(PIN_CHUNK as u64).unwrap();
    a.wait_backups_prepared(std::time::Duration::from_secs(120))
        .expect("backups prepared within 120 s");
    assert_eq!(
        reserve_figures(&a),
        (PIN_CHUNK as u64, PIN_CHUNK as u64, 0),
        "(asked, pinned, used) after lowering 64 MiB to 16 MiB with nothing lent"
    );
}

/// A backup carved at an offset that is not a step's start, crossing two of the reserve's
/// 16 MiB registrations, is copied in one piece per registration, each through pinned memory
/// (the driver refuses a copy across registrations), and comes back whole.
#[test]
fn a_backup_carved_across_the_reserves_steps_is_copied_step_by_step() {
    let a = with_reserve(4 * PIN_CHUNK, true);
    a.device(0).unwrap();
    a.wait_backups_prepared(std::time::Duration::from_secs(120))
        .expect("backups prepared within 120 s");
    let q = a.malloc(4 * MIB, 0, "t", Policy::Cpu).unwrap(); // the reserve's first 4 MiB
    let size = 2 * PIN_CHUNK + 8 * MIB; // then [4, 44) MiB: across 16 and 32
    let p = a.malloc(size, 0, "t", Policy::Cpu).unwrap();
    fill(q, 4 * MIB, 7);
    fill(p, size, 8);
    let before = fake_host_copies();
    a.pause(&["t"]).unwrap();
    assert_eq!(
        copies_since(before),
        (4, 0),
        "q in one piece, p in three ([4,16) [16,32) [32,44) MiB), none pageable"
    );
    a.resume(&["t"]).unwrap();
    assert!(check(p, size, 8) && check(q, 4 * MIB, 7));
    a.free(p).unwrap();
    a.free(q).unwrap();
}

/// A wait for the background work has a deadline: while the fake driver holds every pinning
/// call, `wait_backups_prepared` returns an error at its deadline saying what is still to do
/// (a pinning regression fails the tests that wait, instead of hanging them); once pinning goes
/// on, the same wait succeeds.
#[test]
fn a_wait_for_prepared_backups_ends_at_its_deadline_with_what_is_left() {
    let a = with_reserve(RESERVE, true);
    let held = HeldPinning::new(PinHold::AtEntry);
    a.device(0).unwrap();
    let e = a
        .wait_backups_prepared(std::time::Duration::from_millis(200))
        .expect_err("pinning is held: the wait cannot complete");
    let e = e.to_string();
    assert!(
        e.contains("still being prepared after 200 ms") && e.contains("reserve still being pinned"),
        "{e}"
    );
    drop(held);
    a.wait_backups_prepared(std::time::Duration::from_secs(120))
        .expect("backups prepared once pinning goes on");
    assert_eq!(
        reserve_figures(&a).1,
        RESERVE as u64,
        "the reserve is pinned"
    );
}

/// Resizing the reserve pins only what is missing and releases only what is too much, counted
/// in the driver's registration calls: growing pins the difference (a new segment), asking
/// for the same size again does nothing, and shrinking back releases exactly the newer segment
/// and pins nothing again.
#[test]
fn resizing_the_reserve_pins_only_the_difference_and_releases_only_the_excess() {
    let a = with_reserve(2 * PIN_CHUNK, true);
    a.device(0).unwrap();
    let wait = |a: &TestAllocator| {
        a.wait_backups_prepared(std::time::Duration::from_secs(120))
            .expect("the reserve pinned within 120 s")
    };
    wait(&a);
    assert_eq!(
        reserve_figures(&a),
        (2 * PIN_CHUNK as u64, 2 * PIN_CHUNK as u64, 0)
    );
    // Sets the reserve to `chunks` steps and waits: (registrations, unregistrations) it made.
    let resize = |chunks: usize| {
        let before = a.driver().calls();
        a.reserve_backups((chunks * PIN_CHUNK) as u64).unwrap();
        wait(&a);
        let d = delta(before, a.driver().calls());
        (kind(&d, "host_register"), kind(&d, "host_unregister"))
    };
    assert_eq!(resize(4), (2, 0), "growing pins the difference only");
    assert_eq!(reserve_figures(&a).1, 4 * PIN_CHUNK as u64);
    assert_eq!(resize(4), (0, 0), "the same size again changes nothing");
    assert_eq!(
        resize(2),
        (0, 2),
        "shrinking releases the newer segment's two steps and pins nothing again"
    );
    assert_eq!(
        reserve_figures(&a),
        (2 * PIN_CHUNK as u64, 2 * PIN_CHUNK as u64, 0)
    );
}
