//! `memsaver demo` (without a profile): a verl-style staged sleep and wake of tagged memory.
//!
//! Allocates `weights` and `cuda_graph` (cpu policy: contents kept) and `kv_cache` (discard),
//! fills them with a known pattern, then sleeps in two stages and wakes in two stages, printing
//! resident memory per tag and the device's free memory after each stage, and checks that the
//! kept tags come back bit for bit.

use std::time::Duration;

use memsaver_allocator::{Allocator, Policy, human_bytes};

use std::io::Write;

use super::devmem::Staging;
use super::{Flags, open_driver};

const MIB: usize = 1 << 20;

struct TagSpec {
    tag: &'static str,
    policy: Policy,
    count: usize,
    bytes: usize,
}

pub fn run(args: &[String], out: &mut dyn Write) -> Result<(), String> {
    let flags = Flags::new("demo", args)?;
    let device: i32 = flags.get("--device")?;
    let driver = open_driver(flags.has("--fake"))?;
    let alloc = Allocator::new(driver.clone());
    let (free0, total) = alloc.device_memory(device).map_err(|e| e.to_string())?;
    // On a real GPU use gigabytes; on the fake driver (host memory) stay small.
    let unit = if total > (32usize << 30) && !driver.path().contains("fake") {
        16 * MIB
    } else {
        MIB
    };
    outln!(
        out,
        "memsaver demo on device {device} via {} (CUDA {}.{}): {} free of {}\n",
        driver.path(),
        driver.version() / 1000,
        driver.version() % 1000 / 10,
        human_bytes(free0 as u64),
        human_bytes(total as u64)
    );
    let specs = [
        TagSpec {
            tag: "weights",
            policy: Policy::Cpu,
            count: 4,
            bytes: 64 * unit,
        },
        TagSpec {
            tag: "kv_cache",
            policy: Policy::Discard,
            count: 2,
            bytes: 256 * unit,
        },
        TagSpec {
            tag: "cuda_graph",
            policy: Policy::Cpu,
            count: 2,
            bytes: 16 * unit,
        },
    ];
    let mut staging = Staging::new(&driver, device, 64 * MIB)?;
    let mut kept = Vec::new();
    for (k, s) in specs.iter().enumerate() {
        for i in 0..s.count {
            let ptr = alloc
                .malloc(s.bytes, device, s.tag, s.policy)
                .map_err(|e| e.to_string())?;
            let seed = (k * 100 + i) as u64;
            staging.fill(ptr, s.bytes, seed)?;
            if s.policy == Policy::Cpu {
                kept.push((s.tag, ptr, s.bytes, seed));
            }
        }
    }

    let tags: Vec<&str> = specs.iter().map(|s| s.tag).collect();
    out!(out, "{:<34} {:>9}", "stage", "time");
    for t in &tags {
        out!(out, " {t:>12}");
    }
    outln!(out, " {:>12}", "device free");
    let row = |out: &mut dyn Write, stage: &str, took: Option<Duration>| -> Result<(), String> {
        let stats = alloc.stats();
        let (free, _) = alloc.device_memory(device).map_err(|e| e.to_string())?;
        let took = took.map_or("-".into(), |d| format!("{:.2} ms", d.as_secs_f64() * 1e3));
        out!(out, "{stage:<34} {took:>9}");
        for t in &tags {
            let r = stats.tag(t).map_or(0, |s| s.usage.resident_bytes);
            out!(out, " {:>12}", human_bytes(r));
        }
        outln!(out, " {:>12}", human_bytes(free as u64));
        Ok(())
    };
    row(out, "allocated and filled", None)?;

    type Step<'a> = (&'a str, bool, &'a [&'a str]);
    let stages: [Step; 4] = [
        (
            "sleep 1: pause kv_cache+cuda_graph",
            true,
            &["kv_cache", "cuda_graph"],
        ),
        ("sleep 2: pause weights", true, &["weights"]),
        ("wake 1: resume weights", false, &["weights"]),
        (
            "wake 2: resume kv_cache+cuda_graph",
            false,
            &["kv_cache", "cuda_graph"],
        ),
    ];
    for (name, pause, tags) in stages {
        let report = if pause {
            alloc.pause(tags)
        } else {
            alloc.resume(tags)
        }
        .map_err(|e| e.to_string())?;
        row(out, name, Some(report.elapsed))?;
        if !pause {
            for (tag, ptr, bytes, seed) in kept.iter().filter(|k| tags.contains(&k.0)) {
                staging
                    .verify(*ptr, *bytes, *seed)
                    .map_err(|e| format!("tag '{tag}': {e}"))?;
            }
        }
    }
    let (free_end, _) = alloc.device_memory(device).map_err(|e| e.to_string())?;
    outln!(
        out,
        "\ncontents of the cpu-policy tags (weights, cuda_graph) verified bit-exact after resume; \
         device free at the end: {}",
        human_bytes(free_end as u64)
    );
    Ok(())
}
