//! The first pause of a `cpu` tag that comes before its backups are prepared: it never waits
//! for pinning beyond the one step being registered, copies the steps not pinned yet as
//! pageable memory (through pinned staging buffers once the process has 1 GiB or more of
//! backups to prepare), and the rest of each backup is pinned in the background afterwards. On the
//! fake driver, by counts and ordering (`fakecuda_hold_pinning`, `fakecuda_pass_pinning`,
//! `fakecuda_host_copy_stats`), not time.

mod common;

use common::*;
use memsaver_allocator::Policy;
use memsaver_allocator::backup::PIN_CHUNK;

/// Three pinning steps: 16 + 16 + 8 MiB.
const SIZE: usize = 2 * PIN_CHUNK + 8 * MIB;

/// `after - before`, figure by figure.
fn delta<const N: usize>(before: [u64; N], after: [u64; N]) -> [u64; N] {
    std::array::from_fn(|i| after[i] - before[i])
}

/// Copies since `before`: (through registered memory, through pageable memory).
fn copies_since(before: [u64; 3]) -> (u64, u64) {
    let d = delta(before, fake_host_copies());
    (d[0], d[1])
}

/// A pause of allocations whose backups are still queued (the preparation thread is held in a
/// pinning call of another allocation's backup) completes while the hold lasts: it takes empty
/// reservations and copies into them as pageable memory, with no pinning call of its own. The
/// backup holds the contents (read through `backup_pointer` and after resume), and once the
/// thread is let go, the rest is pinned in the background: the next pause copies through
/// registered memory only.
#[test]
fn a_pause_before_preparation_started_never_waits_for_pinning() {
    let a = allocator();
    let held = HeldPinning::new(PinHold::AtEntry);
    let busy = a.malloc(SIZE, 0, "queued_busy", Policy::Cpu).unwrap();
    assert_eq!(
        wait_pinning_held(1),
        1,
        "the thread waits in its first step"
    );
    let p = a.malloc(SIZE, 0, "queued", Policy::Cpu).unwrap();
    let q = a.malloc(4 * MIB, 0, "queued", Policy::Cpu).unwrap();
    fill(p, SIZE, 1);
    fill(q, 4 * MIB, 2);
    assert_eq!(a.stats().backups_preparing, 3);

    let (calls, copies) = (a.driver().calls(), fake_host_copies());
    a.pause(&["queued"]).unwrap();
    assert_eq!(
        fake_pin_hold(),
        [1, 0],
        "the thread is still held, and the pause waited for no pinning call"
    );
    let d = delta(calls, a.driver().calls());
    assert_eq!(
        (kind(&d, "host_register"), kind(&d, "host_alloc")),
        (0, 0),
        "the pause pinned nothing"
    );
    assert_eq!(
        copies_since(copies),
        (0, 4),
        "every step copied as pageable memory: three of p, one of q"
    );
    let b = a.backup_pointer(p, SIZE).expect("paused: a backup");
    assert!(
        check(b as u64, SIZE, 1),
        "the backup is one range with p's contents"
    );
    let s = a.stats();
    let u = s.tag("queued").unwrap().usage;
    assert_eq!(
        (u.prepared_backup_bytes, u.pinned_backup_bytes),
        (0, (SIZE + 4 * MIB) as u64)
    );
    assert_eq!(
        s.backups_preparing, 3,
        "the busy buffer, and the rest of both backups to pin"
    );

    // The thread is still held: the resume copies out of pageable memory.
    let copies = fake_host_copies();
    a.resume(&["queued"]).unwrap();
    assert_eq!(copies_since(copies), (0, 4));
    assert!(
        check(p, SIZE, 1) && check(q, 4 * MIB, 2),
        "contents restored"
    );
    assert_eq!(fake_pin_hold(), [1, 0]);

    drop(held);
    a.wait_backups_prepared(std::time::Duration::from_secs(120))
        .expect("backups prepared within 120 s");
    assert_eq!(a.stats().backups_preparing, 0);
    fill(p, SIZE, 5);
    fill(q, 4 * MIB, 6);
    let (calls, copies) = (a.driver().calls(), fake_host_copies());
    a.pause(&["queued"]).unwrap();
    a.resume(&["queued"]).unwrap();
    assert_eq!(
        copies_since(copies),
        (8, 0),
        "pinned in the background: every copy through registered memory"
    );
    assert_eq!(kind(&delta(calls, a.driver().calls()), "host_register"), 0);
    assert!(check(p, SIZE, 5) && check(q, 4 * MIB, 6));
    for x in [busy, p, q] {
        a.free(x).unwrap();
    }
}

/// A pause of an allocation whose backup is being pinned takes it as it stands: the steps not
/// pinned yet are copied as pageable memory while the step being registered is still held,
/// and that step once its registration ends. The rest is then pinned in the background, one
/// step at a time; a resume while a step is registered copies the registered steps as pinned
/// memory, the others as pageable, and the step in progress after it. Contents survive both,
/// and once everything is pinned, a pause and resume copy through registered memory only.
#[test]
fn a_pause_takes_a_partly_pinned_backup_as_it_stands() {
    let a = allocator();
    let held = HeldPinning::new(PinHold::AtEntry);
    let p = a.malloc(SIZE, 0, "partly", Policy::Cpu).unwrap();
    fill(p, SIZE, 3);
    assert_eq!(
        wait_pinning_held(1),
        1,
        "the thread waits to register p's first step"
    );

    let (calls, copies) = (a.driver().calls(), fake_host_copies());
    std::thread::scope(|sc| {
        let pause = sc.spawn(|| a.pause(&["partly"]));
        assert!(
            wait_until(|| copies_since(copies).1 == 2),
            "the pause copies the two steps not being pinned while the first is held"
        );
        assert!(
            !pause.is_finished(),
            "it waits for the step being registered"
        );
        assert_eq!(copies_since(copies), (0, 2));
        held.pass(1);
        pause.join().unwrap().unwrap();
    });
    assert_eq!(
        copies_since(copies),
        (1, 2),
        "the first step, once registered, as pinned memory"
    );
    assert_eq!(
        fake_pin_hold()[1],
        0,
        "nothing waited for the hold's deadline"
    );

    // The rest is pinned in the background: the second step waits at the entry.
    assert_eq!(wait_pinning_held(1), 1);
    assert_eq!(
        kind(&delta(calls, a.driver().calls()), "host_register"),
        1,
        "the pause pinned nothing: the one registration since is the thread's second step"
    );
    assert_eq!(a.stats().backups_preparing, 1);
    let copies = fake_host_copies();
    std::thread::scope(|sc| {
        let resume = sc.spawn(|| a.resume(&["partly"]));
        assert!(
            wait_until(|| copies_since(copies) == (1, 1)),
            "the first step as pinned memory, the third as pageable"
        );
        assert!(!resume.is_finished(), "the second step is being registered");
        held.pass(1);
        resume.join().unwrap().unwrap();
    });
    assert_eq!(copies_since(copies), (2, 1));
    assert!(
        check(p, SIZE, 3),
        "contents restored from a partly pinned backup"
    );

    assert_eq!(wait_pinning_held(1), 1, "the third step waits at the entry");
    drop(held);
    a.wait_backups_prepared(std::time::Duration::from_secs(120))
        .expect("backups prepared within 120 s");
    assert_eq!(a.stats().backups_preparing, 0);
    fill(p, SIZE, 4);
    let (calls, copies) = (a.driver().calls(), fake_host_copies());
    a.pause(&["partly"]).unwrap();
    a.resume(&["partly"]).unwrap();
    assert_eq!(copies_since(copies), (6, 0), "every step registered");
    assert_eq!(kind(&delta(calls, a.driver().calls()), "host_register"), 0);
    assert!(check(p, SIZE, 4));
    assert_eq!(fake_pin_hold()[1], 0);
    a.free(p).unwrap();
}

/// Freeing allocations whose backups are still to be pinned leaks no pinned memory and never
/// waits for pinning: a backup whose finish job is queued (the job goes), one being prepared
/// (held in a pinning call), and one whose finish job is registering a step (its pinner
/// releases that step when the registration ends).
#[test]
fn freeing_backups_still_to_pin_leaks_nothing() {
    let a = allocator();
    let (ours, fakes, live) = (a.driver().calls(), fake_calls(), fake_host_copies()[2]);
    let held = HeldPinning::new(PinHold::AtEntry);
    let busy = a.malloc(SIZE, 0, "leak_busy", Policy::Cpu).unwrap();
    assert_eq!(wait_pinning_held(1), 1);
    let q = a.malloc(SIZE, 0, "leak", Policy::Cpu).unwrap();
    fill(q, SIZE, 7);
    a.pause(&["leak"]).unwrap();
    assert_eq!(a.stats().backups_preparing, 2, "busy, and q's rest to pin");
    a.free(q).unwrap();
    assert_eq!(a.stats().backups_preparing, 1, "q's finish job went");
    a.free(busy).unwrap();
    assert_eq!(
        fake_pin_hold(),
        [1, 0],
        "free did not wait for the held step"
    );

    // A finish job in progress: r's first step is registered while its pause runs, the second
    // is held when r is freed.
    held.pass(1);
    let r = a.malloc(SIZE, 0, "leak_finish", Policy::Cpu).unwrap();
    assert_eq!(
        wait_pinning_held(1),
        1,
        "the thread waits in r's first step"
    );
    let copies = fake_host_copies();
    std::thread::scope(|sc| {
        let pause = sc.spawn(|| a.pause(&["leak_finish"]));
        assert!(wait_until(|| copies_since(copies).1 == 2));
        held.pass(1);
        pause.join().unwrap().unwrap();
    });
    assert_eq!(
        wait_pinning_held(1),
        1,
        "r's second step is being registered"
    );
    a.free(r).unwrap();
    assert_eq!(fake_pin_hold(), [1, 0], "free did not wait for it");

    drop(held);
    a.wait_backups_prepared(std::time::Duration::from_secs(120))
        .expect("backups prepared within 120 s");
    let s = a.stats();
    assert_eq!(s.backups_preparing, 0);
    assert_eq!(
        (s.total.prepared_backup_bytes, s.total.backup_bytes),
        (0, 0)
    );
    let (ours, fakes) = (delta(ours, a.driver().calls()), delta(fakes, fake_calls()));
    assert!(kind(&ours, "host_register") >= 3);
    assert_eq!(kind(&ours, "host_register"), kind(&ours, "host_unregister"));
    assert_eq!(
        kind(&fakes, "host_register"),
        kind(&fakes, "host_unregister")
    );
    assert_eq!(fake_host_copies()[2], live, "no registration left");
}

/// A process with 1 GiB or more of backups to prepare gets pinned staging buffers, made before
/// its first backup: a pause that comes before that backup is pinned copies its steps not pinned
/// yet through them (as pinned memory, moved to and from the backup with `memcpy`), never
/// through the driver's pageable path, and a resume likewise; contents survive both.
#[test]
fn a_large_backlog_is_copied_through_staging_buffers() {
    const GIB: usize = 1 << 30;
    const STAGED_PER_STEP: u64 = (PIN_CHUNK / (4 * MIB)) as u64;
    let a = allocator();
    let held = HeldPinning::new(PinHold::AtEntry);
    let p = a.malloc(GIB, 0, "staged", Policy::Cpu).unwrap();
    held.pass(8);
    assert_eq!(
        wait_pinning_held(1),
        1,
        "after the eight staging buffers, the thread waits in p's first step"
    );
    fill(p, GIB, 9);
    let steps = (GIB / PIN_CHUNK) as u64;

    let copies = fake_host_copies();
    std::thread::scope(|sc| {
        let pause = sc.spawn(|| a.pause(&["staged"]));
        assert!(
            wait_until(|| copies_since(copies) == ((steps - 1) * STAGED_PER_STEP, 0)),
            "every step but the one being registered, through the staging buffers: {:?}",
            copies_since(copies)
        );
        held.pass(1);
        pause.join().unwrap().unwrap();
    });
    assert_eq!(
        copies_since(copies),
        ((steps - 1) * STAGED_PER_STEP + 1, 0),
        "and the first step, once registered, as pinned memory; nothing pageable"
    );
    let b = a.backup_pointer(p, GIB).expect("paused: a backup");
    assert!(check(b as u64, GIB, 9), "the backup holds p's contents");

    // The rest is pinned in the background, held at its first step: a resume copies the
    // registered step as pinned memory, the others through the staging buffers.
    assert_eq!(wait_pinning_held(1), 1);
    let copies = fake_host_copies();
    std::thread::scope(|sc| {
        let resume = sc.spawn(|| a.resume(&["staged"]));
        assert!(wait_until(
            || copies_since(copies) == (1 + (steps - 2) * STAGED_PER_STEP, 0)
        ));
        held.pass(1);
        resume.join().unwrap().unwrap();
    });
    assert_eq!(copies_since(copies), (2 + (steps - 2) * STAGED_PER_STEP, 0));
    assert!(check(p, GIB, 9), "contents restored");
    assert_eq!(
        fake_pin_hold()[1],
        0,
        "nothing waited for the hold's deadline"
    );
    drop(held);
    a.wait_backups_prepared(std::time::Duration::from_secs(120))
        .expect("backups prepared within 120 s");
    a.free(p).unwrap();
}
