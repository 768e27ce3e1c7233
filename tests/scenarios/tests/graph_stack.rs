//! The `nccl` pause and the kernel stack limit, on the fake driver, which models what H100/H200
//! do: a CUDA graph instantiated at stack limit S fails to launch once the limit is below S
//! (`CUDA_ERROR_LAUNCH_FAILED`, 719, and the context is lost). Each case runs `graph-app` under
//! LD_PRELOAD of libmemsaver.so; the application reaches the driver as the CUDA runtime does.

use std::collections::HashMap;
use std::process::Command;

use memsaver_scenarios::{cuda_lib, fake_nccl, preload_lib, run_lines};

/// Local memory one byte of per-thread stack reserves on the fake's "H200".
const PER_BYTE: u64 = 132 * 2048;

fn run(case: &str) -> HashMap<String, String> {
    run_lines(
        Command::new(env!("CARGO_BIN_EXE_graph-app"))
            .arg(fake_nccl())
            .arg(cuda_lib())
            .arg(case)
            .env("LD_PRELOAD", preload_lib()),
        "graph",
    )
}

fn has(json: &str, fields: &[&str]) {
    for f in fields {
        assert!(json.contains(f), "{f} missing in {json}");
    }
}

fn kept(bytes: u64, reason: &str) -> [String; 3] {
    [
        r#""stack_lowered_bytes":0"#.to_owned(),
        format!(r#""stack_kept_bytes":{bytes}"#),
        format!(r#""stack_kept_reason":"device 0: {reason}""#),
    ]
}

fn has_all(json: &str, fields: &[String]) {
    has(json, &fields.iter().map(String::as_str).collect::<Vec<_>>());
}

/// Resume gives everything back and NCCL works again.
fn resumed_cleanly(r: &HashMap<String, String>) {
    assert_eq!(r["resume_rc"], "0");
    assert_eq!(r["allreduce_resumed_rc"], "0", "NCCL usable after resume");
    has(
        &r["stats_resumed"],
        &[
            r#""paused":false"#,
            r#""stack_lowered_bytes":0"#,
            r#""stack_kept_bytes":0"#,
            r#""stack_kept_reason":null"#,
        ],
    );
    assert_eq!(r["resume2_rc"], "0");
    assert_eq!(r["sync_end_rc"], "0", "the context is alive at the end");
}

/// (a) The issue's one-GPU repro: one rank (NCCL's kernels raise nothing), the application
/// raises the limit to 1744 itself and instantiates a graph; the pause must not lower it, or
/// the graph's replay kills the context. Fails on the code before the rule (719).
#[test]
fn a_graph_and_a_limit_the_application_set_keep_the_stack() {
    let r = run("app-set");
    for f in [
        "instantiate_from",
        "set_limit_from",
        "instantiate_direct_from",
        "launch_direct_from",
    ] {
        assert_eq!(
            r[f], "libmemsaver.so",
            "{f}: the application's graph calls are seen"
        );
    }
    assert_eq!(
        r["create_direct_from"], "libcuda.so.1",
        "nothing else is wrapped"
    );
    assert_eq!(r["app_set_rc"], "0");
    assert_eq!(r["stack_before"], "1744");
    assert_eq!(r["pause_rc"], "0");
    assert_eq!(r["launch_paused_rc"], "0", "the graph replays while paused");
    assert_eq!(r["stack_paused"], "1744");
    assert_eq!(r["sync_paused_rc"], "0");
    has_all(
        &r["stats_paused"],
        &kept(
            720 * PER_BYTE,
            "a live CUDA graph was instantiated at 1744 B/thread",
        ),
    );
    resumed_cleanly(&r);
    assert_eq!(r["stack_resumed"], "1744");
    assert_eq!(r["launch_resumed_rc"], "0");
    assert_eq!(r["launch_paused2_rc"], "0");
}

/// (b) Two ranks: NCCL's kernel made the driver grow the limit to 1744, a graph was captured
/// at it; the pause keeps it. Fails on the code before the rule (719).
#[test]
fn b_a_graph_instantiated_at_the_limit_nccl_grew_keeps_the_stack() {
    let r = run("nccl-grown");
    assert_eq!(r["stack_before"], "1744", "grown by NCCL's kernel launch");
    assert_eq!(r["pause_rc"], "0");
    assert_eq!(r["launch_paused_rc"], "0", "the graph replays while paused");
    assert_eq!(r["stack_paused"], "1744");
    has_all(
        &r["stats_paused"],
        &kept(
            720 * PER_BYTE,
            "a live CUDA graph was instantiated at 1744 B/thread",
        ),
    );
    resumed_cleanly(&r);
    assert_eq!(r["launch_resumed_rc"], "0");
}

/// (c) No graph and no limit set by the application: the pause frees the local memory NCCL's
/// kernels made the driver keep, and resume gives the limit back.
#[test]
fn c_without_graphs_pause_lowers_the_stack_and_resume_restores_it() {
    let r = run("no-graph");
    assert_eq!(r["stack_before"], "1744");
    assert_eq!(r["pause_rc"], "0");
    assert_eq!(r["stack_paused"], "1024");
    has(
        &r["stats_paused"],
        &[
            &format!(r#""stack_lowered_bytes":{}"#, 720 * PER_BYTE),
            r#""stack_kept_bytes":0"#,
            r#""stack_kept_reason":null"#,
        ],
    );
    resumed_cleanly(&r);
    assert_eq!(r["stack_resumed"], "1744");
    assert_eq!(r["stack_paused2"], "1024");
}

/// (d) A graph instantiated and destroyed before the pause no longer holds the stack up.
#[test]
fn d_a_destroyed_graph_does_not_keep_the_stack() {
    let r = run("destroyed");
    assert_eq!(r["launch_before_rc"], "0");
    assert_eq!(r["destroy_rc"], "0");
    assert_eq!(r["stack_paused"], "1024");
    has(
        &r["stats_paused"],
        &[&format!(r#""stack_lowered_bytes":{}"#, 720 * PER_BYTE)],
    );
    resumed_cleanly(&r);
    assert_eq!(r["stack_resumed"], "1744");
}

/// (e) While paused a kernel needs 2048 B and a graph is instantiated at it: resume does not
/// lower the limit back to the 1744 it saved, and the graph still launches.
#[test]
fn e_resume_never_lowers_the_stack() {
    let r = run("during-pause");
    assert_eq!(r["stack_paused"], "1024");
    assert_eq!(r["kernel_paused_rc"], "0");
    assert_eq!(r["stack_grown"], "2048", "grown again by the kernel");
    assert_eq!(r["instantiate_paused_rc"], "0");
    assert_eq!(r["launch2_paused_rc"], "0");
    resumed_cleanly(&r);
    assert_eq!(r["stack_resumed"], "2048");
    assert_eq!(r["launch2_resumed_rc"], "0");
    // The next pause keeps what that graph needs.
    assert_eq!(r["stack_paused2"], "2048");
    has_all(
        &r["stats_paused2"],
        &kept(
            1024 * PER_BYTE,
            "a live CUDA graph was instantiated at 2048 B/thread",
        ),
    );
}

/// (f) An executable nobody saw instantiated is launched: some path escaped the wrappers, so
/// the device's stack is never lowered again, and the stats say why.
#[test]
fn f_a_graph_from_outside_memsaver_keeps_the_stack_for_good() {
    let r = run("unseen");
    assert_eq!(r["instantiate_rc"], "0");
    assert_eq!(r["launch_before_rc"], "0");
    let reason = "a CUDA graph instantiated outside memsaver's view was launched";
    for (stack, launched, stats) in [
        ("stack_paused", "launch_paused_rc", "stats_paused"),
        ("stack_paused2", "launch_paused2_rc", "stats_paused2"),
    ] {
        assert_eq!(r[stack], "1744");
        assert_eq!(r[launched], "0");
        has_all(&r[stats], &kept(720 * PER_BYTE, reason));
    }
    resumed_cleanly(&r);
}
