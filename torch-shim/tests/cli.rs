//! The core's commands of the `memsaver` command line (`memsaver::cli::main`, what
//! `memsaver_cli_main` runs), on the fake driver. The Python tests run the same commands
//! through the `memsaver` console script (tests/python/test_cli.py).

use std::sync::Mutex;

/// One command at a time: bench measures the device's free memory, which another command
/// allocating on the same fake device at the same time would disturb.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn memsaver(args: &[&str]) -> (i32, String) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let mut out = Vec::new();
    let code = memsaver::cli::main(&args, &mut out);
    (code, String::from_utf8_lossy(&out).into_owned())
}

#[test]
fn demo_runs_a_staged_cycle_and_verifies_contents() {
    let (code, out) = memsaver(&["demo", "--fake"]);
    assert_eq!(code, 0, "{out}");
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
    let (code, out) = memsaver(&[
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
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("all checks passed"), "{out}");
    assert_eq!(
        out.lines().filter(|l| l.contains("bench_cpu")).count(),
        3,
        "{out}"
    );
}

#[test]
fn help_options_and_bad_arguments() {
    let (code, out) = memsaver(&["bench", "--help"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("--cpu-gib") && out.contains("options "),
        "{out}"
    );
    let (code, out) = memsaver(&["options"]);
    assert_eq!(code, 0);
    assert!(out.contains("`MEMSAVER_CUDA_LIB`"), "{out}");
    assert_eq!(memsaver(&["bench", "--fake", "--cyles", "3"]).0, 2);
    assert_eq!(memsaver(&["frobnicate"]).0, 2);
    assert_eq!(memsaver(&[]).0, 2);
}
