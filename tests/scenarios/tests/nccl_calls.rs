//! How many driver calls a pause and a resume of `nccl` make, by kind: the machine-independent
//! figure of their cost (on a real GPU the time is bounded by the driver's cost per VMM call).
//! The fake driver counts the calls per process (`fakecuda_call_counts`); `nccl-rank`'s `calls`
//! command reads and resets them.
//!
//! `the_counts_are_what_the_design_implies` pins the current design (`nccl-hook/src/tag/`
//! `release.rs` and `restore.rs` on `allocator/src/steps.rs`): a change that makes fewer (or
//! more) calls must update it knowingly.
//! `table` is the benchmark (docs/benchmarks.md), ignored by default:
//!
//! ```text
//! NCCL_CALLS_RANKS=4 cargo test --release -p memsaver-scenarios --test nccl_calls -- \
//!     --ignored --nocapture table
//! ```
//!
//! with `NCCL_CALLS_PRIVATE` (default 64) buffers of 2 MiB per rank that are never shared
//! (NCCL's metadata), `NCCL_CALLS_SHARED` (default 8) buffers of `NCCL_CALLS_SHARED_MIB`
//! (default 4) MiB that every peer imports (P2P buffers) and `NCCL_CALLS_CYCLES` (default 3).

mod common;

use std::collections::BTreeMap;

use common::{Dirs, Job};
use memsaver_scenarios::CALL_KINDS;

/// A job's layout: per rank, `private` unshared buffers of 2 MiB and `shared` buffers of
/// `shared_mib` that every other rank imports.
struct Layout {
    ranks: usize,
    private: u64,
    shared: u64,
    shared_mib: u64,
}

/// One rank's answer to `calls`: the counts by kind and the wall time of the last call (us).
fn parse(answer: &str) -> (BTreeMap<String, u64>, u64) {
    let rest = answer
        .strip_prefix("ok ")
        .unwrap_or_else(|| panic!("calls: {answer}"));
    let mut m: BTreeMap<String, u64> = rest
        .split_whitespace()
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap();
            (k.to_owned(), v.parse().unwrap())
        })
        .collect();
    let us = m.remove("us").unwrap();
    (m, us)
}

/// Counts of the named kinds, 0 for the others.
fn counts(nonzero: &[(&str, u64)]) -> BTreeMap<String, u64> {
    CALL_KINDS
        .iter()
        .map(|k| {
            let n = nonzero.iter().find(|(n, _)| n == k).map_or(0, |(_, v)| *v);
            ((*k).to_owned(), n)
        })
        .collect()
}

/// Per cycle, per rank: the (pause, resume) counts and wall times (us).
type Cycle = Vec<((BTreeMap<String, u64>, u64), (BTreeMap<String, u64>, u64))>;

/// Starts the job, sets it up, then runs `cycles` pauses and resumes of every rank at once.
fn measure(l: &Layout, group: u32, cycles: usize) -> Vec<Cycle> {
    let dirs = Dirs::new();
    // Whole copies (packed backups, the default, are counted by tests/packed.rs and the bench).
    let env = [("MEMSAVER_PACK", "off")];
    let mut job = Job::start_with(l.ranks, group, &dirs.fake, &dirs.rt, 30_000, &env);
    // The main buffer is one of the shared ones.
    job.all_ok(&format!("alloc {}", l.shared_mib));
    if l.shared > 1 {
        job.all_ok(&format!("shared {} {}", l.shared - 1, l.shared_mib));
    }
    if l.private > 0 {
        job.all_ok(&format!("private {} 2", l.private));
    }
    job.all_ok("exchange");
    job.write_all(1);
    // The pinned backups prepared for NCCL's buffers are ready before the first pause, as a
    // training step or a rollout would leave them.
    let own_bytes = (l.shared * l.shared_mib + l.private * 2) << 20;
    for (r, a) in job.all("prepared").iter().enumerate() {
        assert_eq!(*a, format!("ok {own_bytes}"), "rank {r}: bytes prepared");
    }
    job.all("calls"); // the set-up's calls
    let mut out = Vec::new();
    for _ in 0..cycles {
        job.all_ok("pause");
        let pause: Vec<_> = job.all("calls").iter().map(|a| parse(a)).collect();
        job.all_ok("resume");
        let resume: Vec<_> = job.all("calls").iter().map(|a| parse(a)).collect();
        job.check_all_seeded(1);
        out.push(pause.into_iter().zip(resume).collect());
    }
    out
}

/// Per rank, with P private and S shared buffers, W ranks, and I = S x (W - 1) imports. NCCL's
/// buffers, allocated one after another, sit side by side (memsaver asks the driver for each
/// one's addresses right after the previous one), and each importer lays out its imports of
/// an owner as the owner does. So a resume backs all of a rank's buffers with one physical
/// allocation (a run), and each importer maps an owner's run whole, once. Before the first
/// resume every buffer has its own: P + S own and I imported physical allocations; after it,
/// 1 and W - 1.
///
/// * pause: a D2H copy of each own buffer (full backup, the default) into the pinned buffer
///   prepared for it in the background (no pinning call, also in the first pause), then
///   one `cuMemUnmap` and one `cuMemRelease` per physical allocation, own and imported;
/// * resume: one `cuMemCreate`, `cuMemMap` and `cuMemSetAccess` for the own run, one H2D copy
///   per buffer; one `cuMemExportToShareableHandle` per importer, as each peer fetches its
///   buffers; per owner imported from one
///   `cuMemImportFromShareableHandle`, `cuMemMap`, `cuMemSetAccess`. No reservation is made
///   or freed: the addresses stay NCCL's.
#[test]
fn the_counts_are_what_the_design_implies() {
    for (ranks, group) in [(2, 61), (3, 62)] {
        let l = Layout {
            ranks,
            private: 5,
            shared: 3,
            shared_mib: 4,
        };
        let (p, s, w) = (l.private, l.shared, ranks as u64);
        let own = p + s;
        let pause =
            |physical: u64| counts(&[("copy", own), ("unmap", physical), ("release", physical)]);
        let resume = counts(&[
            ("create", 1),
            ("map", 1 + (w - 1)),
            ("set_access", 1 + (w - 1)),
            ("copy", own),
            ("export", w - 1),
            ("import", w - 1),
        ]);
        for (c, cycle) in measure(&l, group, 3).into_iter().enumerate() {
            let physical = if c == 0 { own + s * (w - 1) } else { w };
            for (r, ((pc, _), (rc, _))) in cycle.into_iter().enumerate() {
                assert_eq!(
                    pc,
                    pause(physical),
                    "{ranks} ranks, cycle {c}, rank {r}: pause"
                );
                assert_eq!(rc, resume, "{ranks} ranks, cycle {c}, rank {r}: resume");
            }
        }
    }
}

/// The steady calls of a job of `ranks` ranks with `comms` communicators laid out as NCCL lays
/// them out (`nccl-rank`'s `comms`: per communicator private buffers, then per peer a shared
/// buffer exported to that peer only and a private one): the last of three cycles' pause and
/// resume counts, the same on every rank.
fn steady_counts(
    ranks: usize,
    comms: u64,
    group: u32,
) -> (BTreeMap<String, u64>, BTreeMap<String, u64>) {
    let dirs = Dirs::new();
    let mut job = Job::start(ranks, group, &dirs.fake, &dirs.rt, 30_000);
    job.all_ok("alloc 4");
    job.all_ok(&format!("comms {comms} 4"));
    job.all_ok("exchange");
    job.write_all(1);
    job.all_ok("pwrite 2");
    job.all("prepared");
    let mut last = None;
    for _ in 0..3 {
        job.all("calls");
        job.all_ok("pause");
        let pause: Vec<_> = job.all("calls").iter().map(|a| parse(a).0).collect();
        job.all_ok("resume");
        let resume: Vec<_> = job.all("calls").iter().map(|a| parse(a).0).collect();
        job.check_all_seeded(1);
        job.all_ok("pcheck 2");
        for r in 1..ranks {
            assert_eq!((&pause[r], &resume[r]), (&pause[0], &resume[0]), "rank {r}");
        }
        last = Some((pause[0].clone(), resume[0].clone()));
    }
    last.expect("three cycles")
}

/// A pause and a resume make as many driver calls with 8 communicators as with 1, at 2, 4 and 8
/// ranks: one physical allocation for each process's buffers (they sit side by side, and fit
/// one run), and one import and mapping of it in each peer; at most 16 x (peers + 1).
#[test]
fn the_counts_do_not_grow_with_communicators() {
    for (ranks, group) in [(2, 64), (4, 65), (8, 66)] {
        let peers = ranks as u64 - 1;
        let one = steady_counts(ranks, 1, group);
        let eight = steady_counts(ranks, 8, group + 10);
        // Every VMM call of the driver's (not the copies and launches, not host memory).
        let calls = |c: &BTreeMap<String, u64>| -> u64 {
            CALL_KINDS
                .iter()
                .filter(|k| !["copy", "launch"].contains(k) && !k.starts_with("host"))
                .map(|k| c[*k])
                .sum()
        };
        for (name, a, b) in [("pause", &one.0, &eight.0), ("resume", &one.1, &eight.1)] {
            assert_eq!(
                calls(a),
                calls(b),
                "{ranks} ranks, {name}: 1 comm {a:?}, 8 comms {b:?}"
            );
            assert!(calls(b) <= 16 * (peers + 1), "{ranks} ranks, {name}: {b:?}");
        }
        assert_eq!(
            (eight.0["unmap"], eight.0["release"]),
            (1 + peers, 1 + peers)
        );
        assert_eq!(
            (eight.1["create"], eight.1["export"], eight.1["import"]),
            (1, peers, peers)
        );
    }
}

/// With `MEMSAVER_NCCL_BACKUP=headers`, the backup prepared in the background for a buffer NCCL
/// shares is its header (64 KiB) once NCCL has shared it, the others' stay whole, and all are
/// ready before the first pause as with the full backup: that pause pins nothing, and its
/// copies go to what was prepared.
#[test]
fn with_headers_the_first_pause_finds_the_headers_prepared() {
    let dirs = Dirs::new();
    let env = [
        ("MEMSAVER_NCCL_BACKUP", "headers"),
        ("MEMSAVER_PACK", "off"),
    ];
    let mut job = Job::start_with(2, 67, &dirs.fake, &dirs.rt, 30_000, &env);
    job.all_ok("alloc 4");
    job.all_ok("shared 2 4");
    job.all_ok("private 5 2");
    job.all_ok("exchange");
    job.write_all(1);
    let want = (10 << 20) + 3 * (64 << 10); // 5 private buffers of 2 MiB, 3 headers
    for (r, a) in job.all("prepared").iter().enumerate() {
        assert_eq!(*a, format!("ok {want}"), "rank {r}: bytes prepared");
    }
    job.all("calls");
    job.all_ok("pause");
    for (r, a) in job.all("calls").iter().enumerate() {
        let (c, _) = parse(a);
        assert_eq!(
            (c["host_alloc"], c["host_register"]),
            (0, 0),
            "rank {r}: {c:?}"
        );
        assert_eq!(c["copy"], 8, "rank {r}: one copy per own buffer");
    }
    job.all_ok("resume");
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).map_or(default, |v| v.parse().expect(name))
}

/// The benchmark: a table per rank of the calls by kind per pause and per resume, and the
/// wall time of each cycle's call.
#[test]
#[ignore = "a benchmark: run with --ignored --nocapture"]
fn table() {
    let l = Layout {
        ranks: env_or("NCCL_CALLS_RANKS", 2) as usize,
        private: env_or("NCCL_CALLS_PRIVATE", 64),
        shared: env_or("NCCL_CALLS_SHARED", 8).max(1),
        shared_mib: env_or("NCCL_CALLS_SHARED_MIB", 4),
    };
    let cycles = env_or("NCCL_CALLS_CYCLES", 3) as usize;
    let results = measure(&l, 63, cycles);
    println!(
        "\n{} ranks; per rank {} private buffers of 2 MiB, {} shared of {} MiB ({} imports); {} cycles\n",
        l.ranks,
        l.private,
        l.shared,
        l.shared_mib,
        l.shared * (l.ranks as u64 - 1),
        cycles
    );
    let header: Vec<&str> = CALL_KINDS.to_vec();
    println!(
        "| rank | call   | {} | wall ms per cycle |",
        header.join(" | ")
    );
    println!(
        "| ---- | ------ |{}| ----------------- |",
        header
            .iter()
            .map(|h| format!(" {} ", "-".repeat(h.len().max(3))))
            .collect::<Vec<_>>()
            .join("|")
    );
    for r in 0..l.ranks {
        for (name, pick) in [("pause", 0), ("resume", 1)] {
            fn of(c: &Cycle, r: usize, pick: u8) -> &(BTreeMap<String, u64>, u64) {
                if pick == 0 { &c[r].0 } else { &c[r].1 }
            }
            // The steady state: the last cycle's counts (the first pause finds no runs yet).
            let last = &of(results.last().expect("a cycle"), r, pick).0;
            let same = results.iter().all(|c| &of(c, r, pick).0 == last);
            let cells: Vec<String> = CALL_KINDS
                .iter()
                .map(|k| format!("{:>w$}", last[*k], w = k.len().max(3)))
                .collect();
            let ms: Vec<String> = results
                .iter()
                .map(|c| format!("{:.1}", of(c, r, pick).1 as f64 / 1000.0))
                .collect();
            println!(
                "| {r:>4} | {name:<6} | {} | {}{} |",
                cells.join(" | "),
                ms.join(", "),
                if same { "" } else { " (cycle 1 differs)" }
            );
        }
    }
}
