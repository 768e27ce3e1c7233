//! Memory the application allocates through NCCL (`ncclMemAlloc`), across real processes on the
//! fake driver: it is the application's, never NCCL's scratch. Outside any region it stays
//! resident; inside a region (or in whole-process mode) it takes that tag and keeps every byte
//! across the tag's pause and resume, NCCL's registrations of it included (`ncclCommRegister`,
//! and `ncclCommWindowRegister`, whose own mapping of the buffer follows the tag too); a pause
//! of `nccl` never touches it, whatever `MEMSAVER_NCCL_BACKUP` says.
//!
//! Ranks are `nccl-rank` programs (one rank of an NCCL-like job, see its source); their
//! `ncclMemAlloc` and registrations are the fake NCCL's, which reach the driver as NCCL does.

mod common;

use common::{Dirs, Job, MIB};

const PATIENT_MS: u32 = 60_000;

/// The application's figures in rank `r`'s `nccl_stats()`.
fn application(job: &mut Job, r: usize) -> serde_json::Value {
    job.nccl_stats(r)["application"].clone()
}

/// Every rank reads seed = rank + `base` through its window's own mapping of its buffer.
fn wcheck_all(job: &mut Job, base: u64) {
    for r in job.live() {
        let seed = base + r as u64;
        assert_eq!(
            job.one(r, &format!("wcheck {seed}")),
            "ok",
            "rank {r}'s window"
        );
    }
}

/// NCCL's registration `how` (`ncclregister` or `window`) of every rank's buffer, which covers
/// the buffer's own range of `mib` MiB.
fn register_all(job: &mut Job, how: &str, mib: u64) {
    for r in job.live() {
        let a = job.one(r, how);
        assert!(
            a.starts_with("ok 0x") && a.ends_with(&format!(" {}", mib * MIB)),
            "rank {r}: {a}: the buffer's own range"
        );
    }
}

/// Every rank's buffer holds seed = rank + `base`, read at its own address.
fn mine_all(job: &mut Job, base: u64) {
    for r in job.live() {
        assert_eq!(
            job.one(r, &format!("mine {}", base + r as u64)),
            "ok",
            "rank {r}'s own buffer"
        );
    }
}

#[test]
fn memory_from_nccl_outside_a_region_is_the_applications_and_stays_resident() {
    let dirs = Dirs::new();
    let mut job = Job::start(2, 41, &dirs.fake, &dirs.rt, PATIENT_MS);
    // NCCL's own scratch, then the application's buffer, registered with NCCL and mapped by
    // the peer.
    job.all_ok("private 2 2");
    job.all_ok("memalloc 16");
    register_all(&mut job, "ncclregister", 16);
    job.all_ok("exchange");
    job.write_all(0);
    job.check_all();
    let app = application(&mut job, 0);
    assert_eq!(app["untagged_bytes"], 16 * MIB, "{app}");
    assert_eq!(app["allocations"], 1, "{app}");
    assert_eq!(
        job.nccl_stats(0)["owned_bytes"],
        4 * MIB,
        "NCCL's own memory: its scratch only"
    );
    let before = job.used();

    // A pause of `nccl` frees NCCL's scratch only; the application's buffers and the peers'
    // mappings of them stay, with their bytes.
    job.all_ok("pause");
    assert_eq!(job.used(), before - 2 * 4 * MIB);
    mine_all(&mut job, 0);
    job.check_all();
    job.all_ok("resume");
    mine_all(&mut job, 0);
    job.check_all();

    // Freed through NCCL, as allocated: nothing of it is left.
    job.all_ok("unimport");
    job.all_ok("memfree");
    assert_eq!(application(&mut job, 1)["bytes"], 0);
    assert_eq!(job.used(), 2 * 4 * MIB, "only NCCL's scratch is left");
}

/// NCCL calls `ncclMemAlloc` itself for its copy-engine collectives: that memory is NCCL's,
/// the tag `nccl`, even when the thread has a region open.
#[test]
fn ncclmemalloc_called_by_nccl_itself_is_nccls_memory() {
    let dirs = Dirs::new();
    let mut job = Job::start(1, 50, &dirs.fake, &dirs.rt, PATIENT_MS);
    job.ok(&[0], "ncclce 4");
    let s = job.nccl_stats(0);
    assert_eq!(s["owned_bytes"], 4 * MIB, "{s}");
    assert_eq!(s["application"]["allocations"], 0, "{s}");
    job.ok(&[0], "pause");
    assert_eq!(job.used(), 0, "the nccl tag frees it");
    job.ok(&[0], "resume");
    assert_eq!(job.used(), 4 * MIB);
}

/// `world` ranks, each with a 16 MiB buffer of the tag `weights` from `ncclMemAlloc`, holding
/// seed = rank, registered with NCCL (`how`: `ncclregister` or `window`) and mapped by every
/// peer, plus NCCL's own scratch (two private buffers of 2 MiB per rank).
fn tagged_job(dirs: &Dirs, world: usize, group: u32, how: &str, env: &[(&str, &str)]) -> Job {
    let mut job = Job::start_with(world, group, &dirs.fake, &dirs.rt, PATIENT_MS, env);
    job.all_ok("private 2 2");
    job.all_ok("memalloc 16 weights");
    register_all(&mut job, how, 16);
    job.all_ok("exchange");
    job.write_all(0);
    job.check_all();
    job
}

/// The scenario of a tagged buffer NCCL registered: `nccl` leaves it alone, its tag pauses it
/// in every process that maps it, and every resume gives back every byte, over cycles.
fn tagged_buffers_follow_their_tag(world: usize, group: u32, how: &str, env: &[(&str, &str)]) {
    let dirs = Dirs::new();
    let mut job = tagged_job(&dirs, world, group, how, env);
    let app = application(&mut job, 0);
    assert_eq!(app["tagged_bytes"]["weights"], 16 * MIB, "{app}");
    assert_eq!(app["untagged_bytes"], 0, "{app}");
    assert_eq!(
        job.nccl_stats(0)["owned_bytes"],
        4 * MIB,
        "NCCL's scratch only"
    );
    let scratch = world as u64 * 4 * MIB;
    let full = world as u64 * 16 * MIB + scratch;
    assert_eq!(job.used(), full);

    // `nccl` frees its scratch and nothing of the application's.
    job.all_ok("pause");
    assert_eq!(job.used(), full - scratch);
    mine_all(&mut job, 0);
    job.check_all();
    job.all_ok("resume");
    mine_all(&mut job, 0);

    for cycle in 0..3u64 {
        // Every rank pauses `weights` (and `nccl`): all of it is freed, the peers' mappings
        // (and a window's own mapping) included.
        job.all_ok("pause weights,nccl");
        assert_eq!(job.used(), 0, "cycle {cycle}: everything is freed");
        job.all_ok("resume nccl,weights");
        assert_eq!(job.used(), full, "cycle {cycle}");
        mine_all(&mut job, cycle * 10);
        job.check_all_seeded(cycle * 10);
        if how == "window" {
            wcheck_all(&mut job, cycle * 10);
        }
        // New contents after the resume: every mapping shows the same memory, none a stale copy.
        job.write_all((cycle + 1) * 10);
        job.check_all_seeded((cycle + 1) * 10);
        if how == "window" {
            wcheck_all(&mut job, (cycle + 1) * 10);
        }
    }
}

#[test]
fn a_registered_buffer_from_nccl_follows_its_region_tag_at_2_ranks() {
    tagged_buffers_follow_their_tag(2, 42, "ncclregister", &[]);
}

#[test]
fn a_registered_buffer_from_nccl_follows_its_region_tag_at_4_ranks() {
    tagged_buffers_follow_their_tag(4, 43, "ncclregister", &[]);
}

#[test]
fn a_window_buffer_from_nccl_follows_its_region_tag_at_2_ranks() {
    tagged_buffers_follow_their_tag(2, 44, "window", &[]);
}

#[test]
fn a_window_buffer_from_nccl_follows_its_region_tag_at_4_ranks() {
    tagged_buffers_follow_their_tag(4, 45, "window", &[]);
}

/// NCCL's default backup (`headers`) keeps only the start of NCCL's own exported buffers; it
/// never trims the application's memory, even exported by a window, on junk-filled memory.
#[test]
fn headers_never_trim_the_applications_memory() {
    tagged_buffers_follow_their_tag(
        2,
        46,
        "window",
        &[
            ("MEMSAVER_NCCL_BACKUP", "headers"),
            ("FAKE_CUDA_FRESH", "junk"),
        ],
    );
}

#[test]
fn whole_process_mode_gives_memory_from_nccl_the_process_tag() {
    let dirs = Dirs::new();
    let env = [
        ("MEMSAVER_PROCESS_TAG", "trainer"),
        ("MEMSAVER_PROCESS_BACKUP", "cpu"),
    ];
    let mut job = Job::start_with(2, 47, &dirs.fake, &dirs.rt, PATIENT_MS, &env);
    job.all_ok("memalloc 8");
    register_all(&mut job, "window", 8);
    job.all_ok("exchange");
    job.write_all(3);
    job.check_all_seeded(3);
    let app = application(&mut job, 1);
    assert_eq!(app["tagged_bytes"]["trainer"], 8 * MIB, "{app}");
    job.all_ok("pause trainer");
    assert_eq!(job.used(), 0);
    job.all_ok("resume trainer");
    mine_all(&mut job, 3);
    job.check_all_seeded(3);
    wcheck_all(&mut job, 3);
    // Torn down through NCCL: the window, the peers' mappings, the buffer.
    job.all_ok("unwindow");
    job.all_ok("unimport");
    job.all_ok("memfree");
    assert_eq!(job.used(), 0);
    assert_eq!(application(&mut job, 0)["allocations"], 0);
}

#[test]
fn a_buffer_freed_through_nccl_while_paused_is_gone_and_the_resume_succeeds() {
    let dirs = Dirs::new();
    let mut job = Job::start(1, 48, &dirs.fake, &dirs.rt, PATIENT_MS);
    job.ok(&[0], "memalloc 8 weights");
    job.ok(&[0], "write 5");
    register_all(&mut job, "window", 8);
    job.ok(&[0], "pause weights");
    assert_eq!(job.used(), 0, "the window's own mapping is released too");
    job.ok(&[0], "unwindow");
    job.ok(&[0], "memfree");
    job.ok(&[0], "resume weights");
    assert_eq!(job.used(), 0);
    assert_eq!(application(&mut job, 0)["bytes"], 0);
}

/// The device is full when one rank resumes (another process took the memory): the resume
/// says so and what is still paused, nothing is lost, and a resume once the memory is free
/// again brings back every byte, in that rank and in the peer that maps its buffer.
#[test]
fn a_resume_on_a_full_device_fails_cleanly_and_the_retry_restores_every_byte() {
    let dirs = Dirs::new();
    let env = [("FAKE_CUDA_MEM_BYTES", (64 * MIB).to_string())];
    let mut job = Job::start_per_rank(2, 49, &dirs.fake, &dirs.rt, PATIENT_MS, |_| env.clone());
    job.all_ok("memalloc 16 weights");
    register_all(&mut job, "ncclregister", 16);
    job.all_ok("exchange");
    job.write_all(7);
    job.check_all_seeded(7);
    job.all_ok("pause weights");
    assert_eq!(job.used(), 0);
    // Rank 1 takes most of the device while both are paused (as a rollout engine would): both
    // resumes, together, fail at once, each saying what is short and what is still paused.
    job.ok(&[1], "tensor 56 rollout");
    for (r, a) in job.on(&[0, 1], "resume weights").iter().enumerate() {
        assert!(a.starts_with("err "), "rank {r}: {a}");
        assert!(a.contains("out of device memory"), "rank {r}: {a}");
        assert!(
            a.contains("weights"),
            "rank {r} names the tag still paused: {a}"
        );
    }
    for r in 0..2 {
        let us = job.last_call_us(r);
        assert!(
            us < u64::from(PATIENT_MS) * 1000 / 6,
            "rank {r}'s resume took {us} us: it waited for the other"
        );
    }
    // The memory is given back; the retry, together again, restores everything.
    job.ok(&[1], "tfree 0");
    job.ok(&[0, 1], "resume weights");
    mine_all(&mut job, 7);
    job.check_all_seeded(7);
}

/// One rank's resume fails on a driver error (its 3rd `cuMemMap`: its buffer's allocation, its
/// import of the peer's, then its buffer again at the resume): that rank is told which call
/// failed, the peer's resume returns at once, and a second resume restores every byte in both.
#[test]
fn a_rank_whose_resume_fails_is_told_and_its_retry_restores_every_byte() {
    let dirs = Dirs::new();
    let mut job = Job::start_per_rank(2, 51, &dirs.fake, &dirs.rt, PATIENT_MS, |r| {
        (r == 0).then_some(("FAKE_CUDA_FAIL_MAP_AT", "3"))
    });
    job.all_ok("memalloc 8 weights");
    register_all(&mut job, "ncclregister", 8);
    job.all_ok("exchange");
    job.write_all(9);
    job.check_all_seeded(9);
    job.all_ok("pause weights");
    let answers = job.on(&[0, 1], "resume weights");
    assert!(
        answers[0].starts_with("err ") && answers[0].contains("cuMemMap"),
        "{answers:?}"
    );
    assert_eq!(answers[1], "ok", "the peer's own memory comes back");
    assert_eq!(
        job.one(1, "mine 10"),
        "ok",
        "rank 1's buffer holds its bytes"
    );
    job.ok(&[0], "resume weights");
    mine_all(&mut job, 9);
    job.check_all_seeded(9);
}
