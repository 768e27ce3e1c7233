//! NCCL's user-buffer registration of memsaver memory across real processes on the fake driver:
//! each rank allocates a tensor of the tag `weights` (memsaver_malloc, cpu backups), registers
//! it the way NCCL does (`cuMemGetAddressRange`, retain the handle, export a POSIX fd,
//! release; `fake_nccl_register`), sends the fd to its peer, which imports and maps it as
//! NCCL's proxy does. The import follows the owner's tag: the owner's pause releases it (the
//! memory is freed although the peer mapped it), the owner's resume maps the restored memory
//! at the same address, and NCCL calls on the paused buffer are refused.

mod common;

use common::{Dirs, Job, MIB};

const PATIENT_MS: u32 = 60_000;

/// The rank's `shared` stats: exports by tag, and imports.
fn shared(job: &mut Job, r: usize) -> serde_json::Value {
    // `stats` of nccl-rank is the nccl stats; the process's stats carry `shared`.
    let doc = job.one(r, "mstats");
    let doc: serde_json::Value = serde_json::from_str(doc.strip_prefix("ok ").unwrap()).unwrap();
    doc["shared"].clone()
}

/// Two ranks, each with a registered 4 MiB tensor of `weights` mapped by the other, rank r's
/// holding seed r.
fn registered_pair(group: u32, dirs: &Dirs) -> Job {
    let mut job = Job::start(2, group, &dirs.fake, &dirs.rt, PATIENT_MS);
    job.all_ok("tensor 4");
    for r in 0..2 {
        let a = job.one(r, "register");
        assert!(
            a.ends_with(&format!(" {}", 4 * MIB)),
            "{a}: the tensor's own range"
        );
    }
    job.all_ok("exchange");
    job.write_all(0);
    job.check_all();
    job
}

#[test]
fn a_registered_import_follows_its_owners_tag() {
    let dirs = Dirs::new();
    let mut job = registered_pair(31, &dirs);
    assert_eq!(job.used(), 8 * MIB, "two tensors; the imports map them");
    let s = shared(&mut job, 0);
    assert_eq!(s["exports"]["weights"]["importers"], 1, "{s}");
    let s = shared(&mut job, 1);
    assert_eq!(s["imports"][0]["via"], "nccl", "{s}");
    assert_eq!(s["imports"][0]["paused"], false, "{s}");
    // Rank 1's own `nccl` tag leaves the registered (mapped) import alone.
    job.ok(&[1], "pause");
    assert_eq!(shared(&mut job, 1)["imports"][0]["paused"], false);
    assert_eq!(job.one(1, "check 0 0"), "ok");
    job.ok(&[1], "resume");

    // Rank 0 pauses its tensor: rank 1's mapping goes first, so the memory is really freed.
    job.ok(&[0], "pause weights");
    assert_eq!(job.used(), 4 * MIB, "only rank 1's tensor is left");
    assert_eq!(shared(&mut job, 1)["imports"][0]["paused"], true);
    // NCCL on the paused buffer is refused in the owner; the peer's own buffer is usable.
    assert_eq!(job.one(0, "allreduce"), "ok 5", "ncclInvalidUsage");
    assert_eq!(job.one(1, "allreduce"), "ok 0");

    // Resume: the owner's contents at the same address in the peer, then the owner's writes.
    job.ok(&[0], "resume weights");
    assert_eq!(job.used(), 8 * MIB);
    assert_eq!(shared(&mut job, 1)["imports"][0]["paused"], false);
    job.check_all();
    job.ok(&[0], "write 10");
    assert_eq!(
        job.one(1, "check 0 10"),
        "ok",
        "the peer maps the owner's new memory"
    );
    assert_eq!(job.one(0, "allreduce"), "ok 0");

    // Three more cycles, both ranks pausing their tensors together.
    for cycle in 0..3 {
        job.all_ok("pause weights");
        assert_eq!(job.used(), 0, "cycle {cycle}: everything freed");
        job.all_ok("resume weights");
        assert_eq!(job.used(), 8 * MIB, "cycle {cycle}");
        assert_eq!(job.one(1, "check 0 10"), "ok", "cycle {cycle}");
        assert_eq!(job.one(0, "check 1 1"), "ok", "cycle {cycle}");
    }

    // Deregistration (NCCL's free path in the peer, which asks the ranges and handles of a
    // mapping it no longer has while paused) drops the reference: the owner's next pause frees
    // its memory without the peer.
    job.ok(&[0], "pause weights");
    job.ok(&[1], "unimport");
    job.ok(&[0], "resume weights");
    job.ok(&[0], "unimport");
    // The peers tell the owners (in the background): no importer is left.
    for r in 0..2 {
        wait_for_no_importer(&mut job, r);
        assert_eq!(shared(&mut job, r)["imports"], serde_json::json!([]));
    }
    job.ok(&[0], "pause weights");
    assert_eq!(job.used(), 4 * MIB);
    job.ok(&[0], "resume weights");
    // Freeing a registered tensor gives its memory back (nothing exported keeps it).
    job.ok(&[0], "tfree 0");
    job.ok(&[1], "tfree 0");
    assert_eq!(job.used(), 0);
}

#[test]
fn a_registered_import_stopped_across_its_owners_pause_and_resume_catches_up() {
    let dirs = Dirs::new();
    let mut job = Job::start_per_rank(2, 34, &dirs.fake, &dirs.rt, PATIENT_MS, |r| {
        (r == 0).then_some(("MEMSAVER_IPC_TIMEOUT_MS", "300"))
    });
    job.all_ok("tensor 4");
    for r in 0..2 {
        job.one(r, "register");
    }
    job.all_ok("exchange");
    job.write_all(0);
    job.check_all();
    job.signal(1, libc::SIGSTOP);
    // Both calls do rank 0's part and name rank 1, which did not follow.
    let pid = job.pid(1);
    for op in ["pause weights", "resume weights"] {
        let a = job.one(0, op);
        assert!(
            a.starts_with("err 11 ") && a.contains(&format!("process {pid} ")),
            "{op}: {a}"
        );
    }
    job.ok(&[0], "write 30");
    job.signal(1, libc::SIGCONT);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while shared(&mut job, 0)["exports"]["weights"]["imports_behind"] != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "rank 1 never caught up"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(shared(&mut job, 1)["imports"][0]["paused"], false);
    assert_eq!(
        job.one(1, "check 0 30"),
        "ok",
        "the owner's new memory, same address"
    );
    assert_eq!(job.used(), 8 * MIB, "no old memory left behind");
}

#[test]
fn a_dead_importer_releases_and_a_dead_owners_memory_stays_with_its_importer() {
    let dirs = Dirs::new();
    let mut job = registered_pair(32, &dirs);
    job.kill(1, true);
    // Rank 1 died holding rank 0's tensor: rank 0's pause frees it all the same. What is left
    // is the dead rank's tensor, which rank 0's import of it keeps.
    job.ok(&[0], "pause weights");
    assert_eq!(job.used(), 4 * MIB);
    assert_eq!(job.one(0, "check 1 1"), "ok");
    job.ok(&[0], "resume weights");
    assert_eq!(job.used(), 8 * MIB);
    job.ok(&[0], "unimport");
    assert_eq!(
        job.used(),
        4 * MIB,
        "the dead rank's memory goes with the last mapping"
    );

    let mut job = registered_pair(33, &dirs);
    job.kill(0, true);
    // Rank 0 died: rank 1's mapping keeps rank 0's memory (as NCCL's own imports do), and
    // rank 1's tensor pauses and resumes.
    assert_eq!(job.one(1, "check 0 0"), "ok");
    job.ok(&[1], "pause weights");
    job.ok(&[1], "resume weights");
}

#[test]
fn a_tensor_first_registered_inside_a_run_stays_at_its_place_across_cycles() {
    let dirs = Dirs::new();
    let mut job = Job::start(2, 34, &dirs.fake, &dirs.rt, PATIENT_MS);
    // Two adjacent tensors of one tag: a resume backs them with one physical allocation.
    job.ok(&[0], "tensor 4");
    job.ok(&[0], "tensor 4");
    job.ok(&[0], "pause weights");
    job.ok(&[0], "resume weights");
    job.ok(&[1], "tensor 4");
    // NCCL registers the second: the driver's range is the run, 8 MiB, the tensor 4 MiB in.
    assert_eq!(job.one(0, "register 1").split(' ').nth(2), Some("8388608"));
    assert!(job.one(1, "register").starts_with("ok "));
    job.all_ok("exchange");
    job.ok(&[0], "write 5");
    let window = format!("check 0 5 {} {}", 4 * MIB, 4 * MIB);
    assert_eq!(job.one(1, "check 0 5"), "ok", "the whole run is mapped");
    for cycle in 0..2 {
        job.ok(&[0], "pause weights");
        // Both tensors of rank 0 are freed: the run goes once nobody maps it.
        assert_eq!(job.used(), 4 * MIB, "cycle {cycle}");
        job.ok(&[0], "resume weights");
        // The tensor has memory of its own now, mapped at its place in the peer's mapping.
        assert_eq!(job.one(1, &window), "ok", "cycle {cycle}");
    }
    // NCCL's deregistration asks the range of its mapping, whose start holds nothing now:
    // answered from the record, it unmaps the window and frees the range.
    job.ok(&[1], "unimport");
    wait_for_no_importer(&mut job, 0);
    job.ok(&[0], "pause weights");
    assert_eq!(job.used(), 4 * MIB);
}

/// Waits until rank `r` counts no importer of `weights` (closes are sent in the background).
fn wait_for_no_importer(job: &mut Job, r: usize) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while shared(job, r)["exports"]["weights"]["importers"] != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "rank {r} still counts an importer"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

#[test]
fn one_process_with_two_registrations_of_a_buffer_keeps_following_it_after_one_goes() {
    let dirs = Dirs::new();
    let mut job = registered_pair(38, &dirs);
    // Rank 0 registers its tensor again (another communicator): rank 1 imports it twice.
    assert!(job.one(0, "register").starts_with("ok "));
    assert!(job.one(1, "register").starts_with("ok "));
    job.all_ok("exchange");
    assert_eq!(shared(&mut job, 1)["imports"].as_array().unwrap().len(), 2);
    // One registration goes: rank 0 must still release the other before its pause.
    job.ok(&[1], "unimport-extra");
    job.ok(&[0], "pause weights");
    assert_eq!(
        job.used(),
        4 * MIB,
        "rank 0's tensor freed: rank 1's second import let go"
    );
    job.ok(&[0], "resume weights");
    job.ok(&[0], "write 3");
    assert_eq!(
        job.one(1, "check 0 3"),
        "ok",
        "the remaining import maps the new memory"
    );
    job.ok(&[1], "unimport");
    wait_for_no_importer(&mut job, 0);
}

#[test]
fn eight_ranks_registering_with_each_other_pause_and_resume_together() {
    let dirs = Dirs::new();
    // Every process imports from seven owners and is asked to release and rebuild by seven at
    // once: answered off the server's four workers, none waits for another (a stall would
    // last this timeout, then fail the rebuilds).
    let mut job = Job::start_with(
        8,
        39,
        &dirs.fake,
        &dirs.rt,
        PATIENT_MS,
        &[("MEMSAVER_IPC_TIMEOUT_MS", "20000")],
    );
    job.all_ok("tensor 2");
    for r in 0..8 {
        assert!(job.one(r, "register").starts_with("ok "));
    }
    job.all_ok("exchange");
    job.write_all(0);
    job.check_all();
    for cycle in 0..2 {
        job.all_ok("pause weights");
        assert_eq!(job.used(), 0, "cycle {cycle}");
        job.all_ok("resume weights");
        assert_eq!(job.used(), 16 * MIB, "cycle {cycle}");
        job.check_all();
    }
}

#[test]
fn registration_without_tokens_is_refused_rather_than_left_to_map_stale_memory() {
    let dirs = Dirs::new();
    let mut job = Job::start_with(
        1,
        35,
        &dirs.fake,
        &dirs.rt,
        PATIENT_MS,
        &[("MEMSAVER_NCCL_TOKENS", "0")],
    );
    job.ok(&[0], "tensor 4");
    // cuMemExportToShareableHandle fails (CUDA_ERROR_NOT_SUPPORTED): NCCL fails the
    // registration and says so; memsaver logs why and what to do.
    assert_eq!(job.one(0, "register"), "err register 801");
    job.ok(&[0], "pause weights");
    job.ok(&[0], "resume weights");
}

#[test]
fn a_registered_buffer_is_not_imported_across_groups() {
    let dirs = Dirs::new();
    // Two ranks of one job whose memsaver groups differ (a misconfigured job, or a process of
    // another job handed the fd): the import is refused and nothing is mapped.
    let mut job = Job::start_per_rank(2, 36, &dirs.fake, &dirs.rt, PATIENT_MS, |r| {
        [("MEMSAVER_GROUP", if r == 0 { "36" } else { "37" })]
    });
    job.all_ok("tensor 4");
    for r in 0..2 {
        assert!(job.one(r, "register").starts_with("ok "));
    }
    for (r, a) in job.all("exchange").into_iter().enumerate() {
        assert!(a.starts_with("err import from rank"), "rank {r}: {a}");
    }
    for r in 0..2 {
        assert_eq!(shared(&mut job, r)["imports"], serde_json::json!([]));
        assert_eq!(shared(&mut job, r)["exports"]["weights"]["importers"], 0);
    }
}
