//! C ABI scenarios that need a process of their own: whole-process mode (its options are read
//! from the environment once) and process-wide settings (retention, memory margin) that would
//! disturb the other tests of a shared process. Each `scenario_*` test is ignored in a normal
//! run; the `run_*` tests start this test binary again with the scenario's environment and only
//! that scenario selected.

use std::ffi::c_void;
use std::process::Command;

use memsaver::*;

mod common;
use common::{c, last_error, stats, tag};

/// Runs the ignored test `name` in a child process with `env` added, its own fake-driver
/// state and no inherited MEMSAVER_*/TMS_* options.
fn run(name: &str, env: &[(&str, &str)]) {
    let state = std::env::temp_dir().join(format!("memsaver-own-{}-{name}", std::process::id()));
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        name,
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]);
    for (k, _) in std::env::vars() {
        if (k.starts_with("MEMSAVER_") && k != "MEMSAVER_CUDA_LIB") || k.starts_with("TMS_") {
            cmd.env_remove(k);
        }
    }
    cmd.env("FAKE_CUDA_DIR", &state).envs(env.iter().copied());
    let out = cmd.output().unwrap();
    let _ = std::fs::remove_dir_all(&state);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{name} failed:\n{text}"
    );
}

fn malloc_hooked(size: usize) -> (i32, *mut c_void) {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    let rc = unsafe { hooks::cudaMalloc(&mut p, size) };
    (rc, p)
}

fn backup_pointer(p: *mut c_void) -> *mut c_void {
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    assert_eq!(unsafe { memsaver_backup_pointer(p as u64, 1, &mut out) }, 0);
    out
}

fn current_json() -> String {
    let mut buf = vec![0u8; 256];
    let mut needed = 0usize;
    // SAFETY: `buf` has 256 bytes.
    let rc =
        unsafe { memsaver_region_current_json(buf.as_mut_ptr().cast(), buf.len(), &mut needed) };
    assert_eq!(rc, 0, "{}", last_error());
    String::from_utf8(buf[..needed - 1].to_vec()).unwrap()
}

#[test]
fn run_whole_process_mode() {
    run(
        "scenario_whole_process_mode",
        &[
            ("MEMSAVER_PROCESS_TAG", "proc"),
            ("MEMSAVER_PROCESS_BACKUP", "cpu"),
        ],
    );
}

#[test]
#[ignore = "run by run_whole_process_mode in a process of its own"]
fn scenario_whole_process_mode() {
    assert!(
        current_json().contains(r#""tag":"proc","policy":"cpu""#),
        "{}",
        current_json()
    );
    // No region is open: the hooked cudaMalloc gives the process tag instead of forwarding.
    let (rc, p) = malloc_hooked(2 << 20);
    assert_eq!(rc, 0, "{}", last_error());
    // SAFETY: resident fake-driver memory.
    unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0x77, 2 << 20) };
    // A disabled scope still forwards (to libcudart, absent here: error 3).
    assert_eq!(memsaver_region_disable(), 0);
    assert_eq!(malloc_hooked(2 << 20).0, 3);
    assert!(current_json().contains(r#""disabled":true"#));
    assert_eq!(memsaver_region_exit(), 0);
    // A region still overrides the process tag.
    // SAFETY: C string arguments.
    unsafe {
        assert_eq!(
            memsaver_region_enter(c("inner").as_ptr(), std::ptr::null()),
            0
        )
    };
    let (rc, q) = malloc_hooked(2 << 20);
    assert_eq!(memsaver_region_exit(), 0);
    assert_eq!(rc, 0);

    // SAFETY: C string argument.
    let rc = unsafe { memsaver_pause(c("proc").as_ptr()) };
    assert_eq!(rc, 0, "{}", last_error());
    // torch's caching allocator may grow during a pause: allowed, and resident.
    let (rc, during) = malloc_hooked(2 << 20);
    assert_eq!(rc, 0, "{}", last_error());
    // SAFETY: resident fake-driver memory.
    unsafe { std::ptr::write_bytes(during.cast::<u8>(), 0x11, 2 << 20) };
    // SAFETY: C string argument.
    let rc = unsafe { memsaver_resume(c("proc").as_ptr()) };
    assert_eq!(rc, 0, "{}", last_error());
    // SAFETY: both resident.
    unsafe {
        assert!(
            std::slice::from_raw_parts(p.cast::<u8>(), 2 << 20)
                .iter()
                .all(|b| *b == 0x77)
        );
        assert!(
            std::slice::from_raw_parts(during.cast::<u8>(), 2 << 20)
                .iter()
                .all(|b| *b == 0x11)
        );
    }
    // Retention is on by default (no TMS_* variable): the backup stays after resume.
    assert!(!backup_pointer(p).is_null());
    for x in [p, q, during] {
        // SAFETY: pointers returned by the hook.
        assert_eq!(unsafe { hooks::cudaFree(x) }, 0);
    }
}

#[test]
fn run_torch_memory_saver_variables() {
    run(
        "scenario_torch_memory_saver_variables",
        &[
            ("TMS_INIT_ENABLE", "1"),
            ("TMS_INIT_ENABLE_CPU_BACKUP", "1"),
            ("TMS_INIT_CPU_BACKUP_BACKEND", "mmap"),
        ],
    );
}

#[test]
#[ignore = "run by run_torch_memory_saver_variables in a process of its own"]
fn scenario_torch_memory_saver_variables() {
    assert!(
        current_json().contains(r#""tag":"default","policy":"mmap""#),
        "{}",
        current_json()
    );
    let mut on = -1;
    // SAFETY: valid out-pointer.
    assert_eq!(unsafe { memsaver_retain_backups(&mut on) }, 0);
    assert_eq!(
        on, 0,
        "any TMS_* variable: retention follows TMS_RETAIN_CPU_BACKUP (unset: off)"
    );
    let (rc, p) = malloc_hooked(2 << 20);
    assert_eq!(rc, 0, "{}", last_error());
    // SAFETY: C string arguments.
    unsafe {
        assert_eq!(memsaver_pause(c("default").as_ptr()), 0, "{}", last_error());
        assert!(
            !backup_pointer(p).is_null(),
            "paused: the mmap backup exists"
        );
        assert_eq!(
            memsaver_resume(c("default").as_ptr()),
            0,
            "{}",
            last_error()
        );
    }
    assert!(
        backup_pointer(p).is_null(),
        "released at resume without retention"
    );
    // Turned on at run time: the next cycle keeps it.
    assert_eq!(memsaver_set_retain_backups(1), 0);
    // SAFETY: valid out-pointer, C string arguments.
    unsafe {
        assert_eq!(memsaver_retain_backups(&mut on), 0);
        assert_eq!(on, 1);
        assert_eq!(memsaver_pause(std::ptr::null()), 0, "{}", last_error());
        assert_eq!(memsaver_resume(std::ptr::null()), 0, "{}", last_error());
    }
    assert!(!backup_pointer(p).is_null());
    // SAFETY: a pointer returned by the hook.
    assert_eq!(unsafe { hooks::cudaFree(p) }, 0);
}

#[test]
fn run_invalid_process_options() {
    run(
        "scenario_invalid_process_options",
        &[
            ("MEMSAVER_PROCESS_TAG", "proc"),
            ("MEMSAVER_PROCESS_BACKUP", "tape"),
            ("MEMSAVER_RETAIN_BACKUP", "maybe"),
        ],
    );
}

#[test]
#[ignore = "run by run_invalid_process_options in a process of its own"]
fn scenario_invalid_process_options() {
    // The allocation that needs the process options fails, naming every invalid variable
    // and what it accepts.
    assert_eq!(malloc_hooked(2 << 20).0, 2, "cudaErrorMemoryAllocation");
    let e = last_error();
    assert!(
        e.contains("MEMSAVER_PROCESS_BACKUP='tape': expected discard, cpu, mmap or disk")
            && e.contains("MEMSAVER_RETAIN_BACKUP='maybe': expected 0 or 1"),
        "{e}"
    );
    let mut on = 0;
    // SAFETY: valid out-pointer.
    let rc = unsafe { memsaver_retain_backups(&mut on) };
    assert_eq!(rc, Status::InvalidArgument as i32);
    assert!(
        last_error().contains("MEMSAVER_RETAIN_BACKUP"),
        "{}",
        last_error()
    );
}

#[test]
fn run_memory_margin() {
    run("scenario_memory_margin", &[]);
}

#[test]
#[ignore = "run by run_memory_margin in a process of its own"]
fn scenario_memory_margin() {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointer, C strings.
    let rc = unsafe { memsaver_malloc(&mut p, 4 << 20, 0, c("m").as_ptr(), c("cpu").as_ptr()) };
    assert_eq!(rc, 0, "{}", last_error());
    // SAFETY: C string argument.
    assert_eq!(unsafe { memsaver_pause(c("m").as_ptr()) }, 0);
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers.
    let rc = unsafe { memsaver_device_memory(0, &mut free, &mut total) };
    assert_eq!(rc, 0);
    assert_eq!(memsaver_set_memory_margin(free), 0);
    // SAFETY: C string argument.
    let rc = unsafe { memsaver_resume(c("m").as_ptr()) };
    assert_eq!(rc, Status::ResumeOutOfMemory as i32);
    assert!(last_error().contains("memory margin"), "{}", last_error());
    assert_eq!(memsaver_set_memory_margin(0), 0);
    // SAFETY: C string argument.
    let rc = unsafe { memsaver_resume(c("m").as_ptr()) };
    assert_eq!(rc, 0, "{}", last_error());
    assert_eq!(memsaver_free(p), 0);
}

#[test]
fn run_device_memory() {
    run(
        "scenario_device_memory",
        &[
            ("FAKE_CUDA_MEM_BYTES", "512MiB"),
            ("FAKE_CUDA_DEVICES", "2"),
        ],
    );
}

/// (free, total) of `device` through the C ABI.
fn device_memory(device: i32) -> (usize, usize) {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers.
    let rc = unsafe { memsaver_device_memory(device, &mut free, &mut total) };
    assert_eq!(rc, 0, "{}", last_error());
    (free, total)
}

/// memsaver_device_memory gives the driver's figures: the configured memory of each device
/// (two of 512 MiB, a machine of this process's own), less what is allocated on it.
#[test]
#[ignore = "run by run_device_memory in a process of its own"]
fn scenario_device_memory() {
    const M: usize = 1 << 20;
    let all = |f0: usize, f1: usize| [(f0, 512 * M), (f1, 512 * M)];
    let both = || [device_memory(0), device_memory(1)];
    assert_eq!(both(), all(512 * M, 512 * M));
    let (mut w, mut kv): (*mut c_void, *mut c_void) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: valid out-pointers, C strings.
    unsafe {
        assert_eq!(
            memsaver_malloc(&mut w, 3 * M, 0, c("w").as_ptr(), c("cpu").as_ptr()),
            0
        );
        assert_eq!(
            memsaver_malloc(&mut kv, 6 * M, 1, c("kv").as_ptr(), c("discard").as_ptr()),
            0
        );
    }
    // 3 MiB takes 4 MiB of device 0 (2 MiB granularity).
    assert_eq!(both(), all(508 * M, 506 * M));
    // SAFETY: C string argument.
    assert_eq!(unsafe { memsaver_pause(c("w").as_ptr()) }, 0);
    assert_eq!(both(), all(512 * M, 506 * M));
    // SAFETY: C string argument.
    assert_eq!(unsafe { memsaver_resume(c("w").as_ptr()) }, 0);
    assert_eq!(memsaver_free(kv), 0);
    assert_eq!(both(), all(508 * M, 512 * M));
    assert_eq!(memsaver_free(w), 0);
    assert_eq!(both(), all(512 * M, 512 * M));
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers; then NULL ones, which the function refuses.
    unsafe {
        let rc = memsaver_device_memory(2, &mut free, &mut total);
        assert_eq!(rc, Status::InvalidArgument as i32);
        assert!(
            last_error().contains("device 2 does not exist"),
            "{}",
            last_error()
        );
        let rc = memsaver_device_memory(0, std::ptr::null_mut(), &mut total);
        assert_eq!(rc, Status::InvalidArgument as i32);
    }
}

#[test]
fn run_backup_prepare_limit() {
    run("scenario_backup_prepare_limit", &[]);
}

/// memsaver_set_backup_prepare_limit bounds the pinned memory prepared ahead of first pauses,
/// over all allocations; a first pause takes a prepared buffer instead of allocating one.
#[test]
#[ignore = "run by run_backup_prepare_limit in a process of its own"]
fn scenario_backup_prepare_limit() {
    const M: u64 = 1 << 20;
    let malloc = |name: &str, bytes: u64| {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer, C strings.
        let rc = unsafe {
            memsaver_malloc(
                &mut p,
                bytes as usize,
                0,
                c(name).as_ptr(),
                c("cpu").as_ptr(),
            )
        };
        assert_eq!(rc, 0, "{}", last_error());
        p
    };
    let prepared = |name: &str| -> u64 {
        memsaver::allocator()
            .unwrap()
            .wait_backups_prepared(std::time::Duration::from_secs(120))
            .expect("backups prepared within 120 s");
        tag(&stats(), name)["prepared_backup_bytes"]
            .as_u64()
            .unwrap()
    };
    // Pinning host memory: cuMemHostAlloc, or cuMemHostRegister of mapped chunks.
    let pinning = || {
        let calls = &stats()["driver_calls"];
        calls["host_alloc"].as_u64().unwrap() + calls["host_register"].as_u64().unwrap()
    };
    let pause = |name: &str| {
        // SAFETY: C string argument.
        let rc = unsafe { memsaver_pause(c(name).as_ptr()) };
        assert_eq!(rc, 0, "{}", last_error());
    };

    assert_eq!(memsaver_set_backup_prepare_limit(4 * M), 0);
    malloc("fits", 4 * M);
    malloc("over", 2 * M); // 4 + 2 MiB would be over the limit
    assert_eq!((prepared("fits"), prepared("over")), (4 * M, 0));
    assert_eq!(stats()["total"]["prepared_backup_bytes"], 4 * M);
    // The first pause of "fits" takes its prepared buffer; "over" allocates its backup.
    let before = pinning();
    pause("fits");
    assert_eq!(pinning(), before, "a prepared buffer was taken");
    pause("over");
    assert!(
        pinning() > before,
        "no prepared buffer: pinned by the pause"
    );
    // Taken buffers no longer count against the limit.
    malloc("next", 4 * M);
    assert_eq!(prepared("next"), 4 * M);
    // 0: nothing more is prepared; what is prepared stays.
    assert_eq!(memsaver_set_backup_prepare_limit(0), 0);
    malloc("none", 2 * M);
    assert_eq!((prepared("none"), prepared("next")), (0, 4 * M));
}
