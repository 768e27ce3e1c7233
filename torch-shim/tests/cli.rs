//! The `memsaver` command, run as a real process on the fake driver.

use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// Runs the command with its own fake-driver state directory, so the device memory it
/// measures is not disturbed by other tests running at the same time.
fn memsaver(args: &[&str]) -> (bool, String) {
    static N: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "memsaver-cli-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let out = Command::new(env!("CARGO_BIN_EXE_memsaver"))
        .args(args)
        .env("FAKE_CUDA_DIR", &dir)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn demo_runs_a_staged_cycle_and_verifies_contents() {
    let (ok, out) = memsaver(&["demo", "--fake"]);
    assert!(ok, "{out}");
    for stage in [
        "allocated and filled",
        "sleep 1",
        "sleep 2",
        "wake 1",
        "wake 2",
        "verified bit-exact",
    ] {
        assert!(out.contains(stage), "missing '{stage}' in:\n{out}");
    }
    // After both sleep stages nothing of the three tags is resident.
    let sleep2 = out.lines().find(|l| l.starts_with("sleep 2")).unwrap();
    assert_eq!(sleep2.matches(" 0 B").count(), 3, "{sleep2}");
}

#[test]
fn bench_checks_memory_and_contents() {
    let (ok, out) = memsaver(&[
        "bench",
        "--fake",
        "--cpu-gib",
        "0.0625",
        "--discard-gib",
        "0.125",
        "--cycles",
        "3",
        "--chunk-mib",
        "16",
    ]);
    assert!(ok, "{out}");
    assert!(out.contains("all checks passed"), "{out}");
    assert_eq!(
        out.lines().filter(|l| l.contains("bench_cpu")).count(),
        3,
        "{out}"
    );
}

#[test]
fn bad_arguments_are_reported() {
    let (ok, out) = memsaver(&["bench", "--fake", "--cyles", "3"]);
    assert!(!ok);
    assert!(out.contains("unknown option --cyles"), "{out}");
    let (ok, out) = memsaver(&["frobnicate"]);
    assert!(!ok && out.contains("unknown command 'frobnicate'"), "{out}");
}
