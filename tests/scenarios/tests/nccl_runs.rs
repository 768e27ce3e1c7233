//! Runs of NCCL's buffers: NCCL allocates its buffers one after another, memsaver asks the
//! driver for each one's addresses right after the previous one, and a resume backs adjacent
//! private buffers with one physical allocation (one `cuMemCreate`, `cuMemMap`,
//! `cuMemSetAccess`, and at the next pause one `cuMemUnmap`, `cuMemRelease`). NCCL's view of
//! each buffer stays its own: its address range (`cuMemGetAddressRange`, which NCCL's free path
//! asks), its handle, its free path. One rank on the fake driver and the fake libnccl.so.2.

mod common;

use std::collections::BTreeMap;

use common::{Dirs, Job};

const MIB: u64 = 1 << 20;

/// The fake driver's counts of rank 0's calls since the last `calls`, by kind.
fn calls(job: &mut Job) -> BTreeMap<String, u64> {
    let a = job.one(0, "calls");
    a.strip_prefix("ok ")
        .unwrap_or_else(|| panic!("calls: {a}"))
        .split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .filter(|(k, _)| *k != "us")
        .map(|(k, v)| (k.to_owned(), v.parse().unwrap()))
        .collect()
}

/// `nccl_stats()` of rank 0.
fn stats(job: &mut Job) -> serde_json::Value {
    job.nccl_stats(0)
}

/// A job of one rank with `n` private buffers of 2 MiB written with seed 5, through one
/// pause and resume (which makes the run); the call counts are reset.
fn one_rank_with_a_run(group: u32, n: u64, env: &[(&str, &str)]) -> (Dirs, Job) {
    let dirs = Dirs::new();
    let mut job = Job::start_with(1, group, &dirs.fake, &dirs.rt, 10_000, env);
    job.all_ok(&format!("private {n} 2"));
    job.all_ok("pwrite 5");
    job.all_ok("pause");
    job.all_ok("resume");
    job.all_ok("pcheck 5");
    calls(&mut job);
    (dirs, job)
}

/// A job of `world` ranks whose NCCL buffers are carved from chunks of 64 MiB
/// (`MEMSAVER_NCCL_CHUNK_MB`); fresh memory holds junk.
fn job_with_chunks(world: usize, group: u32) -> (Dirs, Job) {
    let dirs = Dirs::new();
    let env = [
        ("MEMSAVER_NCCL_CHUNK_MB", "64"),
        ("FAKE_CUDA_FRESH", "junk"),
    ];
    let job = Job::start_with(world, group, &dirs.fake, &dirs.rt, 10_000, &env);
    (dirs, job)
}

/// Each of two ranks allocates one shared buffer of 4 MiB and two more (which the other rank
/// imports) and three private ones of 2 MiB; they trade and import each other's, and write
/// their buffers (seed 1) and private buffers (seed 3).
fn two_ranks_sharing(job: &mut Job) {
    job.all_ok("alloc 4");
    job.all_ok("shared 2 4");
    job.all_ok("private 3 2");
    job.all_ok("exchange");
    job.write_all(1);
    job.all_ok("pwrite 3");
}

/// After NCCL's free path, every rank holds nothing: the device's memory is what it was
/// (`before`), and no run or mapping is left.
fn nothing_held(job: &mut Job, before: u64) {
    assert_eq!(job.used(), before, "nothing held");
    for r in job.live() {
        let s = job.nccl_stats(r);
        assert_eq!(
            (s["runs"].as_u64(), s["mappings"].as_u64()),
            (Some(0), Some(0)),
            "rank {r}"
        );
    }
}

#[test]
fn private_buffers_resume_as_one_run_and_keep_their_contents() {
    let dirs = Dirs::new();
    let mut job = Job::start(1, 71, &dirs.fake, &dirs.rt, 10_000);
    job.all_ok("private 6 2");
    job.all_ok("pwrite 5");
    calls(&mut job);
    job.all_ok("pause");
    let first = calls(&mut job);
    assert_eq!((first["unmap"], first["release"]), (6, 6), "{first:?}");
    job.all_ok("resume");
    let c = calls(&mut job);
    assert_eq!(
        (c["create"], c["map"], c["set_access"], c["copy"]),
        (1, 1, 1, 6),
        "one physical allocation for the six buffers, a copy into each: {c:?}"
    );
    job.all_ok("pcheck 5");
    let s = stats(&mut job);
    assert_eq!(s["runs"], 1);
    assert_eq!(s["owned_handles"], 6, "NCCL still sees six buffers");
    assert_eq!(s["mappings"], 6);
    // Later cycles: one unmap and one release, then one create, map and grant.
    for seed in 6..9 {
        job.all_ok(&format!("pwrite {seed}"));
        job.all_ok("pause");
        let p = calls(&mut job);
        assert_eq!((p["unmap"], p["release"], p["copy"]), (1, 1, 6), "{p:?}");
        job.all_ok("resume");
        let r = calls(&mut job);
        assert_eq!((r["create"], r["map"], r["set_access"]), (1, 1, 1), "{r:?}");
        job.all_ok(&format!("pcheck {seed}"));
    }
    // NCCL's free path asks each buffer's range of the driver: it gets the buffer's, not the
    // run's, and frees every buffer.
    let used = job.used();
    job.all_ok("free");
    assert_eq!(used - job.used(), 12 * MIB);
    let s = stats(&mut job);
    assert_eq!(
        (s["runs"].as_u64(), s["owned_bytes"].as_u64()),
        (Some(0), Some(0))
    );
}

#[test]
fn a_buffer_freed_inside_a_run_is_held_until_the_next_pause() {
    let (_dirs, mut job) = one_rank_with_a_run(72, 4, &[]);
    let used = job.used();
    job.all_ok("pfree 1");
    let s = stats(&mut job);
    assert_eq!(
        s["freed_held_bytes"],
        2 * MIB,
        "part of a mapping cannot be unmapped"
    );
    assert_eq!(s["owned_handles"], 3);
    assert_eq!(job.used(), used, "held until the run goes");
    let c = calls(&mut job);
    assert_eq!(
        (c["unmap"], c["release"], c["address_free"]),
        (0, 0, 0),
        "the run and the freed range stay: {c:?}"
    );
    job.all_ok("pcheck 5");
    job.all_ok("pause");
    let c = calls(&mut job);
    assert_eq!(
        (c["unmap"], c["release"], c["address_free"]),
        (1, 1, 0),
        "the run goes whole; the range NCCL freed goes back to memsaver's address space for \
         NCCL's buffers: {c:?}"
    );
    assert_eq!(
        used - job.used(),
        8 * MIB,
        "the freed buffer's memory went with the run"
    );
    job.all_ok("resume");
    // Buffers 0 | 2 3: the gap splits them.
    let c = calls(&mut job);
    assert_eq!(c["create"], 2, "{c:?}");
    let s = stats(&mut job);
    assert_eq!(
        (s["runs"].as_u64(), s["freed_held_bytes"].as_u64()),
        (Some(1), Some(0))
    );
    assert_eq!(used - job.used(), 2 * MIB);
    job.all_ok("pcheck 5");
}

#[test]
fn freeing_every_buffer_of_a_run_gives_its_memory_back_at_once() {
    let (_dirs, mut job) = one_rank_with_a_run(73, 3, &[]);
    let used = job.used();
    for i in 0..3 {
        job.all_ok(&format!("pfree {i}"));
    }
    assert_eq!(used - job.used(), 6 * MIB);
    let c = calls(&mut job);
    assert_eq!(
        (c["unmap"], c["release"], c["address_free"]),
        (1, 1, 0),
        "the run once its last buffer went; the ranges are memsaver's: {c:?}"
    );
    let s = stats(&mut job);
    assert_eq!(
        (s["runs"].as_u64(), s["freed_held_bytes"].as_u64()),
        (Some(0), Some(0))
    );
    // What NCCL allocates next gets fresh memory and pauses and resumes as ever.
    job.all_ok("private 2 2");
    job.all_ok("pwrite 9");
    job.all_ok("pause");
    job.all_ok("resume");
    job.all_ok("pcheck 9");
}

#[test]
fn a_buffer_inside_a_run_is_exported_through_a_token_only_and_the_merge_limit_turns_runs_off() {
    // A token: its importers are served the run and map it whole.
    let (_dirs, mut job) = one_rank_with_a_run(74, 2, &[]);
    job.all_ok("pexport 0");
    job.all_ok("pcheck 5");
    // A plain fd would be the whole run's.
    let (_dirs, mut job) = one_rank_with_a_run(76, 2, &[("MEMSAVER_NCCL_TOKENS", "0")]);
    assert_eq!(
        job.one(0, "pexport 0"),
        "err 801",
        "CUDA_ERROR_NOT_SUPPORTED: the driver cannot hand out part of an allocation"
    );
    job.all_ok("pcheck 5");
    // With runs off every buffer keeps its own physical allocation, and can be exported.
    let (_dirs, mut job) = one_rank_with_a_run(75, 2, &[("MEMSAVER_NCCL_MERGE_MB", "0")]);
    job.all_ok("pexport 0");
    assert_eq!(stats(&mut job)["runs"], 0);
    job.all_ok("pause");
    job.all_ok("resume");
    let c = calls(&mut job);
    assert_eq!(c["create"], 2, "{c:?}");
    job.all_ok("pcheck 5");
}

/// Two ranks, each with one shared buffer of 4 MiB and two more (which the other rank imports)
/// and three private ones of 2 MiB, through one pause and resume: each rank's buffers resume
/// as one run, and each rank maps its peer's run whole, once, where it laid out its imports as
/// the peer lays out the buffers.
#[test]
fn an_importer_maps_its_owners_run_whole_and_nccls_free_path_gives_everything_back() {
    let dirs = Dirs::new();
    let mut job = Job::start(2, 76, &dirs.fake, &dirs.rt, 10_000);
    let before = job.used();
    two_ranks_sharing(&mut job);
    let allocated = job.used();
    assert_eq!(allocated - before, 2 * (12 + 6) * MIB);
    job.all_ok("pause");
    assert_eq!(job.used(), before, "both ranks' buffers are free");
    calls(&mut job);
    job.all_ok("resume");
    let c = calls(&mut job);
    assert_eq!(
        (c["create"], c["export"], c["import"], c["map"]),
        (1, 1, 1, 2),
        "one run of its own, exported once, the peer's imported and mapped once: {c:?}"
    );
    job.check_all_seeded(1);
    job.all_ok("pcheck 3");
    assert_eq!(job.used(), allocated);
    for r in 0..2 {
        let s = job.nccl_stats(r);
        assert_eq!(s["runs"], 2, "rank {r}: {s}");
        assert_eq!(
            (s["imported_handles"].as_u64(), s["owned_handles"].as_u64()),
            (Some(3), Some(6))
        );
    }
    // A second cycle: one unmap and release per run, imports included.
    job.all_ok("pause");
    let c = calls(&mut job);
    assert_eq!((c["unmap"], c["release"]), (2, 2), "{c:?}");
    job.all_ok("resume");
    job.check_all_seeded(1);
    calls(&mut job);
    // NCCL's free path, imports first: every run goes back once its last buffer is freed;
    // the ranges are memsaver's (no driver call).
    job.all_ok("free");
    let c = calls(&mut job);
    assert_eq!(
        (c["unmap"], c["release"], c["address_free"]),
        (2, 2, 0),
        "{c:?}"
    );
    nothing_held(&mut job, before);
}

/// With chunks (`MEMSAVER_NCCL_CHUNK_MB`), NCCL's buffers are carved from one physical
/// allocation per rank as NCCL creates them, and each rank's first import of its peer's chunk
/// maps it whole: the first pause already takes one unmap and release per chunk (own and
/// imported), not one per buffer; every byte comes back (fresh memory holds junk), NCCL still
/// sees its own buffers, and its free path gives everything back.
#[test]
fn buffers_carved_from_a_chunk_at_creation_pause_at_the_first_time_in_one_release() {
    let (_dirs, mut job) = job_with_chunks(2, 79);
    let before = job.used();
    two_ranks_sharing(&mut job);
    let allocated = job.used();
    assert_eq!(
        allocated - before,
        2 * 64 * MIB,
        "one chunk per rank, made ahead"
    );
    let s = job.nccl_stats(0);
    assert_eq!(
        s["chunk_spare_bytes"].as_u64(),
        Some(64 * MIB - s["owned_bytes"].as_u64().unwrap()),
        "what the chunk holds ahead of NCCL: {s}"
    );
    let c = calls(&mut job);
    assert_eq!(
        (c["create"], c["map"], c["set_access"], c["import"]),
        (1, 2, 2, 3),
        "rank 0 made its chunk and mapped it (its own and the peer's run granted once each); \
         both imports of the peer's chunk map it once: {c:?}"
    );
    for r in 0..2 {
        let s = job.nccl_stats(r);
        assert_eq!(
            s["runs"], 2,
            "rank {r}: its chunk and its import of the peer's: {s}"
        );
        assert_eq!(
            (s["owned_handles"].as_u64(), s["imported_handles"].as_u64()),
            (Some(6), Some(3)),
            "rank {r}: NCCL sees its buffers"
        );
    }
    job.all_ok("pause");
    assert_eq!(job.used(), before, "both ranks' chunks are free");
    let c = calls(&mut job);
    assert_eq!(
        (c["unmap"], c["release"]),
        (2, 2),
        "the first pause: one unmap and release for the chunk and one for the import: {c:?}"
    );
    job.all_ok("resume");
    job.check_all_seeded(1);
    job.all_ok("pcheck 3");
    // NCCL's free path: every run goes back once its last buffer is freed.
    job.all_ok("free");
    nothing_held(&mut job, before);
}

/// A buffer NCCL has created but not mapped yet when a pause comes (NCCL between its
/// `cuMemCreate` and its `cuMemMap`, on another thread) is carved from its chunk, so the pause
/// releases it with the chunk. The resume gives it fresh memory of its own, not mapped, and
/// NCCL maps it afterwards; the buffers of the chunk that NCCL mapped keep their contents.
/// (The resume indexed the unmapped buffer's places and panicked.)
#[test]
fn a_buffer_created_and_not_mapped_yet_when_its_chunk_pauses_is_mapped_after_the_resume() {
    let (_dirs, mut job) = job_with_chunks(1, 81);
    job.all_ok("private 2 2");
    let carved = job.used();
    job.all_ok("hold 2");
    job.all_ok("pwrite 3");
    assert_eq!(
        job.used(),
        carved,
        "the held buffer is carved from the same chunk"
    );
    job.all_ok("pause");
    let floor = job.used();
    assert_eq!(carved - floor, 64 * MIB, "the chunk is released whole");
    job.all_ok("resume");
    assert_eq!(
        job.used() - floor,
        3 * 2 * MIB,
        "the two mapped buffers as one run, the held one alone"
    );
    job.all_ok("pcheck 3");
    job.all_ok("mapheld");
    job.all_ok("pwrite 4");
    job.all_ok("pause");
    job.all_ok("resume");
    job.all_ok("pcheck 4");
    job.all_ok("free");
    nothing_held(&mut job, floor);
}

/// A chunk none of whose buffers NCCL has mapped yet (its only buffer made on one thread when
/// a pause comes on another) is released by the pause like any other: the memory it holds
/// goes back to the device, and the buffer comes back as fresh memory NCCL then maps.
#[test]
fn a_chunk_whose_buffers_are_all_unmapped_is_released_by_a_pause() {
    let (_dirs, mut job) = job_with_chunks(1, 84);
    let before = job.used();
    job.all_ok("hold 2");
    assert_eq!(job.used() - before, 64 * MIB, "a chunk made for it");
    job.all_ok("pause");
    assert_eq!(job.used(), before, "the chunk is released");
    job.all_ok("resume");
    assert_eq!(job.used() - before, 2 * MIB, "the buffer alone, fresh");
    job.all_ok("mapheld");
    job.all_ok("pwrite 6");
    job.all_ok("pause");
    job.all_ok("resume");
    job.all_ok("pcheck 6");
    job.all_ok("free");
    nothing_held(&mut job, before);
}

/// A chunk the driver cannot make (out of memory here; a size it refuses alike) leaves
/// NCCL's buffers their own memory, and turns chunks off for the process: the next small
/// buffer does not try again (a chunk of 64 MiB would then be made).
#[test]
fn a_chunk_the_driver_cannot_make_turns_chunks_off_and_buffers_are_made_alone() {
    let (_dirs, mut job) = job_with_chunks(1, 82);
    let before = job.used();
    job.all_ok("failcreate 1");
    job.all_ok("private 3 2");
    let s = stats(&mut job);
    assert_eq!(
        (s["runs"].as_u64(), s["owned_handles"].as_u64()),
        (Some(0), Some(3)),
        "no chunk; three buffers of their own: {s}"
    );
    assert!(job.used() - before < 64 * MIB, "no chunk made");
    job.all_ok("pwrite 2");
    job.all_ok("pause");
    job.all_ok("resume");
    job.all_ok("pcheck 2");
}

/// An owner frees every buffer of a chunk while a peer still holds its imports of them (the
/// communicator destroyed on the owner first), then makes new buffers: their chunk may lie at
/// the same address, and a new buffer that the peer imports where it imported nothing of the
/// old chunk must be mapped from the new chunk, not joined to the peer's mapping of the old
/// one (which would read and write memory the owner freed).
#[test]
fn an_import_of_a_new_chunk_at_an_old_chunks_address_does_not_join_the_old_mapping() {
    let (_dirs, mut job) = job_with_chunks(2, 83);
    two_ranks_sharing(&mut job);
    // Rank 1 lets go of everything (its imports of rank 0's chunk too); rank 0 keeps its
    // imports of rank 1's old chunk.
    job.ok(&[1], "free");
    // Rank 1's new buffers, past where rank 0 imported anything of the old chunk; rank 0's
    // buffers exported again (the exchange sends each rank's own and shared buffers).
    job.ok(&[1], "private 9 2");
    job.ok(&[1], "alloc 4");
    job.ok(&[0], "ofree");
    job.ok(&[0], "sfree 0");
    job.ok(&[0], "sfree 1");
    job.ok(&[0], "alloc 4");
    job.ok(&[0], "write 1");
    job.all_ok("exchange");
    job.ok(&[1], "write 9");
    job.ok(&[0], "check 1 9");
    job.ok(&[1], "check 0 1");
    job.all_ok("pause");
    job.all_ok("resume");
    job.ok(&[0], "check 1 9");
}

/// A buffer given to a NIC after it joined a run (NCCL's network transport connecting after a
/// resume) must stay resident, and with it the whole run: the next pause keeps the run, its
/// peers still pause and resume, and a peer that asks for the buffers of that run again is
/// served them as they are, at once (not after its timeout), reading the same contents.
#[test]
fn a_run_with_a_buffer_given_to_a_nic_stays_whole_and_its_peers_are_served_as_it_is() {
    let dirs = Dirs::new();
    let mut job = Job::start(2, 77, &dirs.fake, &dirs.rt, 10_000);
    job.all_ok("alloc 4");
    job.all_ok("shared 1 4");
    job.all_ok("private 2 2");
    job.all_ok("exchange");
    job.write_all(1);
    job.all_ok("pwrite 3");
    job.all_ok("pause");
    job.all_ok("resume");
    job.one(0, "calls");
    job.ok(&[0], "pnic 1");
    let used = job.used();
    job.all_ok("pause");
    let c = calls(&mut job);
    assert_eq!(
        (c["unmap"], c["release"]),
        (1, 1),
        "rank 0 keeps its run; it lets go of its import of rank 1's: {c:?}"
    );
    assert_eq!(
        used - job.used(),
        12 * MIB,
        "rank 1's 12 MiB freed, rank 0's kept"
    );
    // Rank 1 asks for rank 0's buffers again: served as they are, its resume succeeds (it
    // failed at its timeout when the serve path waited for a generation that never comes).
    job.all_ok("resume");
    job.check_all_seeded(1);
    job.all_ok("pcheck 3");
    let s = stats(&mut job);
    assert!(s["resident_pinned_bytes"].as_u64().unwrap() > 0, "{s}");
}

/// An import NCCL placed elsewhere than its owner's layout (here: the range memsaver reserves
/// for that layout could not be had when NCCL imported it) still maps its owner's run whole:
/// the addresses around it are reserved at resume, and freed with the run.
#[test]
fn an_import_placed_elsewhere_maps_its_owners_run_with_the_addresses_around_it() {
    let dirs = Dirs::new();
    let mut job = Job::start(2, 78, &dirs.fake, &dirs.rt, 10_000);
    job.all_ok("alloc 4");
    job.all_ok("shared 1 4");
    job.all_ok("private 2 2");
    // Rank 1's first import: its owner's layout cannot be reserved, NCCL's driver reservation
    // stays; its second import is placed as usual.
    job.ok(&[1], "failreserve 1");
    job.all_ok("exchange");
    job.write_all(1);
    job.all_ok("pwrite 3");
    let used = job.used();
    job.all_ok("pause");
    job.all_ok("resume");
    job.check_all_seeded(1);
    job.all_ok("pcheck 3");
    assert_eq!(job.used(), used);
    let s = job.nccl_stats(1);
    assert_eq!(s["runs"], 3, "its own, and rank 0's run mapped twice: {s}");
    for _ in 0..2 {
        job.all_ok("pause");
        job.all_ok("resume");
        job.check_all_seeded(1);
    }
    job.all("calls");
    job.all_ok("free");
    assert_eq!(job.used(), used - 2 * 12 * MIB, "nothing held");
    let c = job.one(1, "calls");
    assert!(c.contains("unmap=3 release=3"), "{c}");
}
