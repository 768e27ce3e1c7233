//! `memsaver bench`: pause/resume throughput of the allocator core, per policy.
//!
//! Allocates `--cpu-gib` of cpu-policy memory and `--discard-gib` of discard memory in
//! `--chunk-mib` allocations, fills the cpu-policy ones with a pattern, then runs `--cycles`
//! pause/resume cycles of each tag. Every cycle checks, with `cuMemGetInfo`, that pause gave
//! back at least 99% of the tag's bytes to the device, and (unless `--no-verify`) that the
//! cpu-policy contents came back bit for bit. Prints ms and GB/s per cycle, a summary of the
//! cycles after the first with the first apart, and the driver calls one pause and one resume
//! make. The pinned backups are prepared in the background while the cpu-policy memory is
//! filled; the bench waits for them before the first cycle, as a training step would take
//! longer than preparing them. Fails on any check.

use std::time::{Duration, Instant};

use memsaver_allocator::driver::CALL_KINDS;
use memsaver_allocator::{Allocator, Policy, human_bytes};

use std::io::Write;

use super::devmem::Staging;
use super::{Flags, open_driver};

const MIB: usize = 1 << 20;

struct Series {
    tag: &'static str,
    policy: Policy,
    bytes: usize,
    ptrs: Vec<(u64, usize)>,
    pause: Vec<Duration>,
    resume: Vec<Duration>,
    /// Driver calls of the last cycle's pause and resume, by kind.
    calls: ([u64; CALL_KINDS.len()], [u64; CALL_KINDS.len()]),
}

/// `after - before`, kind by kind.
fn delta(
    before: [u64; CALL_KINDS.len()],
    after: [u64; CALL_KINDS.len()],
) -> [u64; CALL_KINDS.len()] {
    std::array::from_fn(|i| after[i] - before[i])
}

/// `create=1 map=1 ...`: the kinds called at least once.
fn call_list(calls: &[u64]) -> String {
    let v: Vec<String> = CALL_KINDS
        .iter()
        .zip(calls)
        .filter(|(_, n)| **n > 0)
        .map(|(k, n)| format!("{k}={n}"))
        .collect();
    if v.is_empty() {
        "none".into()
    } else {
        v.join(" ")
    }
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn median(v: &[Duration]) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    v[v.len() / 2]
}

pub fn run(args: &[String], out: &mut dyn Write) -> Result<(), String> {
    let flags = Flags::new("bench", args)?;
    let cpu_gib: f64 = flags.get("--cpu-gib")?;
    let discard_gib: f64 = flags.get("--discard-gib")?;
    let cycles: usize = flags.get("--cycles")?;
    let chunk = flags.get::<usize>("--chunk-mib")? * MIB;
    let device: i32 = flags.get("--device")?;
    let verify = !flags.has("--no-verify");
    if cycles == 0 || chunk == 0 {
        return Err("--cycles and --chunk-mib must be positive".into());
    }
    let driver = open_driver(flags.has("--fake"))?;
    // The options of the environment (MEMSAVER_BACKUP_PREPARE_MB=0 shows first pauses that
    // allocate their backups).
    let opts = memsaver_allocator::options::get();
    crate::options::check().map_err(|e| e.to_string())?;
    let alloc = Allocator::with_options(driver.clone(), opts);
    let (free0, total) = alloc.device_memory(device).map_err(|e| e.to_string())?;
    outln!(
        out,
        "memsaver bench: device {device} via {}, {} free of {}; {cycles} cycles, {} MiB allocations",
        driver.path(),
        human_bytes(free0 as u64),
        human_bytes(total as u64),
        chunk / MIB
    );

    let gran = alloc.granularity(device).map_err(|e| e.to_string())?;
    let mut series = Vec::new();
    for (tag, policy, gib) in [
        ("bench_cpu", Policy::Cpu, cpu_gib),
        ("bench_discard", Policy::Discard, discard_gib),
    ] {
        let bytes = ((gib * (1u64 << 30) as f64) as usize).div_ceil(gran) * gran;
        if bytes == 0 {
            continue;
        }
        let mut ptrs = Vec::new();
        let mut left = bytes;
        while left > 0 {
            let n = left.min(chunk);
            ptrs.push((
                alloc
                    .malloc(n, device, tag, policy)
                    .map_err(|e| e.to_string())?,
                n,
            ));
            left -= n;
        }
        series.push(Series {
            tag,
            policy,
            bytes,
            ptrs,
            pause: vec![],
            resume: vec![],
            calls: Default::default(),
        });
    }
    let mut staging = Staging::new(&driver, device, 256 * MIB)?;
    let seed = |ptr: u64| ptr ^ 0x5EED;
    for s in series.iter().filter(|s| s.policy == Policy::Cpu && verify) {
        for &(p, n) in &s.ptrs {
            staging.fill(p, n, seed(p))?;
        }
    }
    let waited = Instant::now();
    alloc
        .wait_backups_prepared(Duration::from_secs(600))
        .map_err(|e| e.to_string())?;
    let prepared = alloc.stats().total.prepared_backup_bytes;
    outln!(
        out,
        "pinned backups prepared in the background: {} (waited {:.1} ms after filling)",
        human_bytes(prepared),
        waited.elapsed().as_secs_f64() * 1e3
    );

    outln!(
        out,
        "{:>5} {:<14} {:>10} {:>10} {:>10} {:>10} {:>12}",
        "cycle",
        "tag",
        "pause ms",
        "GB/s",
        "resume ms",
        "GB/s",
        "freed"
    );
    for cycle in 1..=cycles {
        for s in series.iter_mut() {
            let (before, _) = alloc.device_memory(device).map_err(|e| e.to_string())?;
            let c0 = driver.calls();
            let p = alloc.pause(&[s.tag]).map_err(|e| e.to_string())?;
            let c1 = driver.calls();
            let (after, _) = alloc.device_memory(device).map_err(|e| e.to_string())?;
            let freed = after.saturating_sub(before);
            let c2 = driver.calls();
            let r = alloc.resume(&[s.tag]).map_err(|e| e.to_string())?;
            s.calls = (delta(c0, c1), delta(c2, driver.calls()));
            outln!(
                out,
                "{cycle:>5} {:<14} {:>10.2} {:>10.1} {:>10.2} {:>10.1} {:>12}",
                s.tag,
                p.elapsed.as_secs_f64() * 1e3,
                gbps(s.bytes, p.elapsed),
                r.elapsed.as_secs_f64() * 1e3,
                gbps(s.bytes, r.elapsed),
                human_bytes(freed as u64)
            );
            if (freed as f64) < s.bytes as f64 * 0.99 {
                return Err(format!(
                    "pause of '{}' freed only {} of {} on the device (cuMemGetInfo)",
                    s.tag,
                    human_bytes(freed as u64),
                    human_bytes(s.bytes as u64)
                ));
            }
            if s.policy == Policy::Cpu && verify {
                for &(ptr, n) in &s.ptrs {
                    staging
                        .verify(ptr, n, seed(ptr))
                        .map_err(|e| format!("cycle {cycle}: {e}"))?;
                }
            }
            s.pause.push(p.elapsed);
            s.resume.push(r.elapsed);
        }
    }

    outln!(
        out,
        "\nsummary (median of cycles 2..{cycles}; first cycle in brackets):"
    );
    for s in &series {
        let later = |v: &[Duration]| if v.len() > 1 { median(&v[1..]) } else { v[0] };
        let (p, r) = (later(&s.pause), later(&s.resume));
        outln!(
            out,
            "  {:<8} {:>10}: pause {:>8.2} ms {:>7.1} GB/s [{:.2} ms]   resume {:>8.2} ms {:>7.1} GB/s [{:.2} ms]",
            s.policy.as_str(),
            human_bytes(s.bytes as u64),
            p.as_secs_f64() * 1e3,
            gbps(s.bytes, p),
            s.pause[0].as_secs_f64() * 1e3,
            r.as_secs_f64() * 1e3,
            gbps(s.bytes, r),
            s.resume[0].as_secs_f64() * 1e3,
        );
    }
    outln!(
        out,
        "\ndriver calls of one pause / one resume (cycle {cycles}):"
    );
    for s in &series {
        outln!(
            out,
            "  {:<8} {:>4} allocations: pause {} / resume {}",
            s.policy.as_str(),
            s.ptrs.len(),
            call_list(&s.calls.0),
            call_list(&s.calls.1)
        );
    }
    for s in &series {
        for &(p, _) in &s.ptrs {
            alloc.free(p).map_err(|e| e.to_string())?;
        }
    }
    outln!(
        out,
        "{}",
        if verify {
            "all checks passed (memory freed, contents bit-exact)"
        } else {
            "memory-freed checks passed (contents not verified)"
        }
    );
    Ok(())
}
