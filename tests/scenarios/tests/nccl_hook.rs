//! The NCCL hook on the fake driver and the fake libnccl.so.2: with libmemsaver.so preloaded,
//! lookups made by libnccl get memsaver's wrappers and NCCL's memory is seen; anyone else gets
//! the driver's own VMM functions (and memsaver's graph and limit wrappers: tests/graph_stack.rs).

use std::collections::HashMap;
use std::process::Command;

use memsaver_scenarios::{cuda_lib, fake_nccl, preload_lib, run_lines};

/// Runs `nccl-like`, optionally under LD_PRELOAD of libmemsaver.so, and returns its lines.
fn run(preload: bool, extra_env: &[(&str, &str)]) -> HashMap<String, String> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nccl-like"));
    cmd.arg(fake_nccl())
        .arg(cuda_lib())
        .env_remove("LD_PRELOAD");
    if preload {
        cmd.env("LD_PRELOAD", preload_lib());
    }
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    run_lines(&mut cmd, "nccl")
}

#[test]
fn preloaded_hook_wraps_vmm_calls_for_libnccl_only() {
    let r = run(true, &[]);
    assert_eq!(
        r["gpa_from_exe"], "libmemsaver.so",
        "other callers get memsaver's graph-and-limit cuGetProcAddress"
    );
    assert_eq!(
        r["create_from_exe"], "libcuda.so.1",
        "which hands them the driver's VMM calls"
    );
    assert_eq!(
        r["gpa_from_nccl"], "libmemsaver.so",
        "libnccl gets memsaver's cuGetProcAddress"
    );
    assert_eq!(
        r["create_from_nccl"], "libmemsaver.so",
        "and memsaver's cuMemCreate through it"
    );
    has(
        &r["stats_after_alloc"],
        &[
            r#""hooked":true"#,
            r#""cumem_disabled":false"#,
            r#""owned_bytes":10485760"#,
            r#""owned_handles":2"#,
            r#""exported_handles":1"#,
            r#""exported_bytes":4194304"#,
            r#""mappings":2"#,
        ],
    );
    has(
        &r["stats_after_free"],
        &[r#""owned_bytes":0"#, r#""mappings":0"#],
    );
}

fn has(json: &str, fields: &[&str]) {
    for f in fields {
        assert!(json.contains(f), "{f} missing in {json}");
    }
}

#[test]
fn pausing_nccl_releases_its_memory_and_restores_it_in_place() {
    let r = run(true, &[]);
    assert_eq!(r["pause_rc"], "0");
    // Both buffers go back to the device: the private 6 MiB and the exported 4 MiB, whose
    // export no process imported (cross-process imports: tests/nccl_peers.rs).
    assert_eq!(r["freed_by_pause"], (10 << 20).to_string());
    has(
        &r["stats_paused"],
        &[
            r#""paused":true"#,
            r#""paused_bytes":10485760"#,
            r#""exported_bytes":4194304"#,
        ],
    );
    // NCCL calls while paused are refused (ncclInvalidUsage) without reaching NCCL; after
    // resume they reach it again.
    assert_eq!(r["allreduce_paused_rc"], "5/0");
    // Also when looked up in libnccl's own handle, as pynccl does.
    assert_eq!(r["allreduce_via_handle_paused_rc"], "5/0");
    assert_eq!(r["resume_rc"], "0");
    // The kernel stack size NCCL's kernels made the driver raise (1744) goes down to CUDA's
    // default while paused (no graph, no limit set by the application: its local memory is
    // freed on a GPU, 720 B x 132 SMs x 2048 threads here) and comes back on resume.
    assert_eq!(
        (r["stack_paused"].as_str(), r["stack_resumed"].as_str()),
        ("1024", "1744")
    );
    has(
        &r["stats_paused"],
        &[
            &format!(r#""stack_lowered_bytes":{}"#, 720 * 132 * 2048),
            r#""stack_kept_bytes":0"#,
            r#""stack_kept_reason":null"#,
        ],
    );
    assert_eq!(r["allreduce_resumed_rc"], "0/1");
    assert_eq!(r["allreduce_via_handle_resumed_rc"], "0/2");
    assert_eq!(r["taken_by_resume"], (10 << 20).to_string());
    assert_eq!(
        r["private_intact"], "true",
        "contents restored at the same address"
    );
    has(
        &r["stats_resumed"],
        &[r#""paused":false"#, r#""paused_bytes":0"#],
    );
    // Out of memory on resume (the second cuMemCreate fails): error 6, the exported 4 MiB
    // buffer is back, the private 6 MiB one still paused, NCCL still refused; a second
    // resume restores it with its contents.
    assert_eq!(r["pause_oom_rc"], "0");
    assert_eq!(r["resume_oom_rc"], "6");
    has(
        &r["stats_oom"],
        &[r#""paused":true"#, r#""paused_bytes":6291456"#],
    );
    // (refused; the count of calls that reached NCCL stays at the two made after resume)
    assert_eq!(r["allreduce_oom_rc"], "5/2");
    assert_eq!(r["resume_retry_rc"], "0");
    assert_eq!(r["private_intact_after_oom"], "true");
    // NCCL's free path (retain from the address, release, unmap, release, free the range)
    // works on a paused buffer: the hook answers from its records.
    assert_eq!(r["pause2_rc"], "0");
    assert_eq!(r["free_while_paused_rc"], "0");
    assert_eq!(r["resume2_rc"], "0");
    has(
        &r["stats_after_free"],
        &[r#""owned_bytes":0"#, r#""mappings":0"#],
    );
}

#[test]
fn the_nccl_tag_honours_the_memory_margin_and_retention() {
    // Every byte backed up (with the default, headers, a shared buffer's backup is 64 KiB),
    // packed: the buffer holds a few blocks, so its backup is the 256 KiB a packed backup of
    // 4 MiB starts with.
    let r = run(true, &[("MEMSAVER_NCCL_BACKUP", "cpu")]);
    let packed = (256u64 << 10).to_string();
    // Only the exported 4 MiB buffer is left at this point of nccl-like.
    assert_eq!(r["margin_pause_rc"], "0");
    assert_eq!(r["margin_backup_paused"], packed);
    // A margin of every free byte: the resume stops before creating anything, out of memory
    // (status 6), naming the margin; the buffer stays paused with its backup.
    assert_eq!(r["margin_resume_rc"], "6");
    assert!(
        r["margin_error"].contains("margin"),
        "the error names the margin: {}",
        r["margin_error"]
    );
    has(
        &r["margin_stats"],
        &[r#""paused":true"#, r#""paused_bytes":4194304"#],
    );
    assert_eq!(r["margin_resume_again_rc"], "0");
    // Retention on (the default): the backup stays after resume, for the next pause.
    assert_eq!(r["retained_backup"], packed);
    // Off: the pause still backs up, and the resume lets the backup go.
    assert_eq!(r["noretain_pause_rc"], "0");
    assert_eq!(r["noretain_backup_paused"], packed);
    assert_eq!(r["noretain_resume_rc"], "0");
    assert_eq!(r["noretain_backup_resumed"], "0");
}

#[test]
fn the_nccl_tag_takes_a_backup_policy_as_any_tag() {
    // mmap and disk keep the contents, as cpu does; discard keeps none.
    let disk_path = memsaver_scenarios::tempdir("nccl-disk");
    let disk_dir = disk_path.to_str().expect("a UTF-8 temp dir");
    for (policy, extra, intact, backup) in [
        ("mmap", None, "true", 4u64 << 20),
        ("disk", Some(disk_dir), "true", 0),
        ("discard", None, "false", 0),
    ] {
        let mut env = vec![("MEMSAVER_NCCL_BACKUP", policy)];
        if let Some(dir) = extra {
            env.push(("MEMSAVER_DISK_DIR", dir));
        }
        let r = run(true, &env);
        assert_eq!(r["pause_rc"], "0", "{policy}");
        assert_eq!(r["resume_rc"], "0", "{policy}");
        assert_eq!(
            r["private_intact"], intact,
            "{policy}: contents after resume"
        );
        assert_eq!(
            r["private_intact_after_oom"], intact,
            "{policy}: contents after a resume that ran out of memory and a retry"
        );
        // backup_bytes counts host memory (disk backups are counted apart).
        assert_eq!(r["margin_backup_paused"], backup.to_string(), "{policy}");
    }
    // A disk policy without a disk directory: the pause is refused, naming what to set, and
    // NCCL's memory stays resident and usable.
    let r = run(true, &[("MEMSAVER_NCCL_BACKUP", "disk")]);
    assert_ne!(r["pause_rc"], "0");
    assert_eq!(
        r["allreduce_paused_rc"], "0/1",
        "a pause that failed leaves NCCL usable"
    );
    std::fs::remove_dir_all(&disk_path).unwrap();
}

#[test]
fn without_preload_nothing_is_wrapped() {
    let r = run(false, &[]);
    assert_eq!(r["amem_found"], "false", "stock NCCL has no ncclPause");
    assert_eq!(r["gpa_from_exe"], "libcuda.so.1");
    assert_eq!(r["gpa_from_nccl"], "libcuda.so.1");
    assert_eq!(r["create_from_nccl"], "libcuda.so.1");
    assert_eq!(r["stats_after_alloc"], "none");
}

#[test]
fn cumem_disabled_is_reported() {
    let r = run(true, &[("NCCL_CUMEM_ENABLE", "0")]);
    assert!(
        r["stats_after_alloc"].contains("\"cumem_disabled\":true"),
        "{:?}",
        r
    );
}

#[test]
fn amem_api_is_found_in_libnccl_and_pauses_nccl() {
    let r = run(true, &[]);
    assert_eq!(
        r["amem_found"], "true",
        "dlsym(libnccl, \"ncclPause\") answered by memsaver"
    );
    assert_eq!(r["amem_pause_rc"], "0");
    has(&r["amem_stats_paused"], &[r#""paused":true"#]);
    assert_eq!(r["amem_resume_rc"], "0");
    assert_eq!(
        (
            r["amem_set_same_rc"].as_str(),
            r["amem_set_rc"].as_str(),
            r["amem_get_rc"].as_str()
        ),
        ("0", "5", "0"),
        "the group is fixed once NCCL shared memory"
    );
    assert_eq!(r["amem_group"], "0");
}
