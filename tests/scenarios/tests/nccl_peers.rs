//! The `nccl` tag across real processes on the fake driver: ranks exchange exported buffers the
//! way NCCL's P2P setup does (fd over a Unix socket, import, map), then pause and resume
//! together. Checks that pause frees everything in every process (importers included), resume
//! restores contents at the same addresses, a peer that does not pause gives an error naming
//! it, and two groups on the same devices stay apart.

mod common;

use common::{Dirs, Job, MIB};

/// The timeout of ranks whose peers all answer: far above any delay a live peer can have on a
/// loaded machine, so that "ok" never turns into a Peer error there; it costs nothing, since a
/// pause or resume ends as soon as the peers have answered.
const PATIENT_MS: u32 = 60_000;

fn pause_resume_cycles(world: usize) {
    let dirs = Dirs::new();
    let (fake, rt) = (&dirs.fake, &dirs.rt);
    let mut job = Job::start(world, 7, fake, rt, PATIENT_MS);
    job.setup(4);
    let resident = job.used();
    assert_eq!(
        resident,
        world as u64 * 4 * MIB,
        "one buffer per rank, imports share it"
    );
    for cycle in 0..3 {
        job.all_ok("pause");
        assert_eq!(
            job.used(),
            0,
            "cycle {cycle}: every process let go, nothing is left"
        );
        job.all_ok("resume");
        assert_eq!(job.used(), resident, "cycle {cycle}");
        job.check_all();
    }
    job.all_ok("free");
    assert_eq!(job.used(), 0);
}

#[test]
fn two_ranks_pause_and_resume_together() {
    pause_resume_cycles(2);
}

#[test]
fn four_ranks_pause_and_resume_together() {
    pause_resume_cycles(4);
}

#[test]
fn eight_ranks_pause_and_resume_together() {
    pause_resume_cycles(8);
}

#[test]
fn a_peer_that_does_not_pause_is_named_and_a_dead_one_releases() {
    let dirs = Dirs::new();
    let (fake, rt) = (&dirs.fake, &dirs.rt);
    // A short timeout: rank 0 waits for it once, and nothing in this test depends on a live
    // peer answering within it (rank 1 never pauses, then is dead).
    let mut job = Job::start(2, 9, fake, rt, 300);
    job.setup(4);
    // Rank 1 keeps running and does not pause: rank 0's pause releases its side, then fails
    // after the timeout naming rank 1, whose import still holds rank 0's buffer.
    let a = job.on(&[0], "pause").remove(0);
    assert!(a.starts_with("err 11 "), "{a}");
    assert!(
        a.contains(&job.pid(1).to_string()) && a.contains("must pause"),
        "{a}"
    );
    assert_eq!(
        job.used(),
        8 * MIB,
        "rank 1's buffer and its import of rank 0's are alive"
    );
    // Rank 1 dies: its imports die with it, and a retried pause of rank 0 completes.
    job.kill(1, true);
    assert_eq!(job.on(&[0], "pause"), ["ok"]);
    assert_eq!(job.used(), 0);
    // Resuming rank 0: its own buffer comes back; the import of the dead rank's buffer cannot.
    let a = job.on(&[0], "resume").remove(0);
    assert!(
        a.starts_with("err 11 ") && a.contains(&job.pid(1).to_string()),
        "{a}"
    );
    assert_eq!(job.used(), 4 * MIB);
}

#[test]
fn an_importer_whose_resume_overtakes_its_owners_pause_maps_the_owners_new_memory() {
    let dirs = Dirs::new();
    let (fake, rt) = (&dirs.fake, &dirs.rt);
    // Rank 1 pauses and resumes before rank 0 pauses at all: its pause waits for rank 0 (which
    // does not pause) only its short timeout; rank 0 answers rank 1's resume as soon as it has
    // the new memory, however long that takes (its own timeout).
    let mut job = Job::start_per_rank(2, 10, fake, rt, PATIENT_MS, |r| {
        (r == 1).then_some(("MEMSAVER_NCCL_TIMEOUT_MS", "2000"))
    });
    job.setup(4);
    let a = job.one(1, "pause");
    assert!(
        a.starts_with("err 11 "),
        "rank 0 still maps rank 1's buffer: {a}"
    );
    // Rank 1's resume asks rank 0 for the memory rank 0 will have after its own cycle, not the
    // memory it has now: it waits while rank 0 pauses and resumes. (Given a moment to reach
    // rank 0 first; on a machine too slow for that, rank 0 pauses first and the test checks
    // the ordinary order.)
    job.send(&[1], "resume");
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert_eq!(
        job.one(0, "pause"),
        "ok",
        "rank 1 released its import of rank 0's buffer and holds no other"
    );
    assert_eq!(job.one(0, "resume"), "ok");
    assert_eq!(job.answers(&[1], "resume"), ["ok"]);
    job.write_all(20);
    job.check_all_seeded(20);
}

#[test]
fn two_groups_on_the_same_devices_stay_apart() {
    let dirs = Dirs::new();
    let (fake, rt) = (&dirs.fake, &dirs.rt);
    let mut train = Job::start(2, 100, fake, rt, PATIENT_MS);
    let mut infer = Job::start(2, 200, fake, rt, PATIENT_MS);
    train.setup(4);
    infer.setup(6);
    assert_eq!(train.used(), 20 * MIB);
    train.all_ok("pause");
    assert_eq!(
        train.used(),
        12 * MIB,
        "only the training group's 8 MiB went"
    );
    infer.check_all();
    infer.all_ok("pause");
    assert_eq!(infer.used(), 0);
    infer.all_ok("resume");
    train.all_ok("resume");
    train.check_all();
    infer.check_all();
    assert_eq!(train.used(), 20 * MIB);
}

#[test]
fn shared_host_memory_stays_and_does_not_block_resume() {
    // NCCL's shared-memory transport (NCCL_P2P_DISABLE=1) exchanges host memory (HOST_NUMA)
    // through the same export/import path. Its owner keeps it on pause (it is not device
    // memory); the importers must keep their imports too, and resume must not wait for a new
    // generation that never comes.
    let dirs = Dirs::new();
    let (fake, rt) = (&dirs.fake, &dirs.rt);
    let mut job = Job::start(2, 15, fake, rt, PATIENT_MS);
    job.all_ok("alloc 4 host");
    job.all_ok("exchange");
    for r in 0..2 {
        assert_eq!(job.on(&[r], &format!("write {r}")), ["ok"]);
    }
    for cycle in 0..2 {
        job.all_ok("pause");
        // Still readable while paused: nothing was unmapped.
        job.check_all();
        job.all_ok("resume");
        job.check_all();
        assert_eq!(
            job.used(),
            0,
            "cycle {cycle}: host memory is not device memory"
        );
    }
}

#[test]
fn the_group_is_fixed_once_nccl_shared_memory() {
    let dirs = Dirs::new();
    let (fake, rt) = (&dirs.fake, &dirs.rt);
    let mut job = Job::start(2, 13, fake, rt, PATIENT_MS);
    // Before anything is shared, a process may move to another group (and back).
    assert_eq!(job.on(&[0], "group 14"), ["ok"]);
    assert_eq!(job.on(&[0], "group 13"), ["ok"]);
    job.setup(4);
    let a = job.on(&[0], "group 14").remove(0);
    assert!(
        a.starts_with("err 1 ") && a.contains("already 13") && a.contains("before NCCL"),
        "{a}"
    );
    assert_eq!(job.on(&[0], "group 13"), ["ok"], "the same group is fine");
    job.all_ok("pause");
    assert_eq!(job.used(), 0);
    job.all_ok("resume");
    job.check_all();
}

/// With `headers`, a shared buffer's first 64 KiB come back and the rest holds zeros, as
/// NCCL's own zeroed allocation did, even where the driver's fresh memory holds junk
/// (`FAKE_CUDA_FRESH=junk`): stale bytes there could pass for a flag NCCL waits for. NCCL's
/// private buffers, allocated right after the shared one, come back with it in one physical
/// allocation (a run): every byte of theirs, and zeros only behind the shared one's header.
#[test]
fn backup_headers_keeps_the_control_blocks_of_shared_buffers_only() {
    let dirs = Dirs::new();
    let (fake, rt) = (&dirs.fake, &dirs.rt);
    let mut job = Job::start_with(
        2,
        11,
        fake,
        rt,
        PATIENT_MS,
        &[
            ("MEMSAVER_NCCL_BACKUP", "headers"),
            ("FAKE_CUDA_FRESH", "junk"),
        ],
    );
    job.setup(4);
    // Private buffers (NCCL's structures) beside the shared ones: every byte of them comes back.
    job.all_ok("private 2 2");
    job.all_ok("pwrite 5");
    for cycle in 0..2 {
        job.all_ok("pause");
        assert_eq!(job.used(), 0, "cycle {cycle}");
        job.all_ok("resume");
        assert_eq!(job.used(), 16 * MIB, "cycle {cycle}");
        job.all_ok("pcheck 5");
        for (r, peer) in [(0, 1), (1, 0)] {
            // The first 64 KiB (NCCL's 4 KiB control block and margin) came back ...
            assert_eq!(
                job.on(&[r], &format!("check {peer} {peer} 65536")),
                ["ok"],
                "cycle {cycle}: rank {r} reads rank {peer}'s header"
            );
            // ... the staging area behind it did not: it holds zeros, not the fresh junk.
            let a = job.on(&[r], &format!("check {peer} {peer}")).remove(0);
            assert!(a.contains("mismatch"), "cycle {cycle}: {a}");
            assert_eq!(
                job.on(&[r], &format!("zeros {peer} {} 65536", 4 * MIB - 65536)),
                ["ok"],
                "cycle {cycle}: rank {r} reads rank {peer}'s staging area"
            );
        }
        // Rewrite the patterns for the next cycle.
        for r in 0..2 {
            assert_eq!(job.on(&[r], &format!("write {r}")), ["ok"]);
        }
    }
}

/// On an NCCL newer than the last one whose buffers were checked, `headers` (the default) backs
/// shared buffers up whole: every byte comes back, on junk-filled memory too. The user may opt
/// in to headers there (`MEMSAVER_NCCL_HEADERS_UNCHECKED=1`): then only the header does.
#[test]
fn headers_back_up_whole_on_an_nccl_nobody_checked_unless_the_user_opts_in() {
    for opt_in in ["0", "1"] {
        let dirs = Dirs::new();
        let (fake, rt) = (&dirs.fake, &dirs.rt);
        let env = [
            ("MEMSAVER_NCCL_BACKUP", "headers"),
            ("FAKE_CUDA_FRESH", "junk"),
            ("FAKE_NCCL_VERSION", "23101"),
            ("MEMSAVER_NCCL_HEADERS_UNCHECKED", opt_in),
        ];
        let mut job = Job::start_with(2, 13, fake, rt, PATIENT_MS, &env);
        job.setup(4);
        job.all_ok("pause");
        assert_eq!(job.used(), 0);
        job.all_ok("resume");
        for (r, peer) in [(0, 1), (1, 0)] {
            let whole = job.one(r, &format!("check {peer} {peer}"));
            if opt_in == "0" {
                assert_eq!(
                    whole, "ok",
                    "rank {r} reads every byte of rank {peer}'s buffer"
                );
            } else {
                assert!(
                    whole.contains("mismatch"),
                    "opted in: headers only: {whole}"
                );
                assert_eq!(job.one(r, &format!("check {peer} {peer} 65536")), "ok");
            }
        }
    }
}

/// An invalid NCCL option is the error of the first pause, naming the variable and what it
/// accepts, where it used to be read as the default in silence (tokens, timeout); NCCL's own
/// set-up goes on with the default.
#[test]
fn a_bad_nccl_setting_is_named_and_nothing_is_paused() {
    let cases = [
        (
            "MEMSAVER_NCCL_BACKUP",
            "some",
            "expected cpu, mmap, disk, discard, headers or all",
        ),
        ("MEMSAVER_NCCL_TOKENS", "maybe", "expected 0 or 1"),
        (
            "MEMSAVER_NCCL_TIMEOUT_MS",
            "soon",
            "expected a whole number from 1 to 86400000 (ms)",
        ),
    ];
    for (var, value, accepted) in cases {
        let dirs = Dirs::new();
        let (fake, rt) = (&dirs.fake, &dirs.rt);
        let mut job = Job::start_with(2, 12, fake, rt, PATIENT_MS, &[(var, value)]);
        job.setup(4);
        let want = format!("{var}='{value}': {accepted}");
        for (r, a) in job.all("pause").iter().enumerate() {
            assert!(a.contains(&want), "rank {r}: {a} (wanted {want})");
        }
        assert_eq!(job.used(), 8 * MIB, "{var}: nothing was released");
        job.check_all();
    }
}
