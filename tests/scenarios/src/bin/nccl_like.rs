//! A process that uses the fake libnccl.so.2 the way an NCCL application does, for the
//! nccl-hook scenarios. Prints `key=value` lines the test reads:
//!
//! `nccl_like <libnccl.so.2> <libcuda.so.1>`: allocates, through the fake NCCL, a 4 MiB buffer
//! it exports (as NCCL does for peers) and a 6 MiB private one, reports which library each
//! looked-up function lives in and, when libmemsaver.so is preloaded, the hook's view of NCCL's
//! memory; then pauses and resumes the `nccl` tag (device memory freed, contents and address
//! kept), frees the private buffer while paused, and frees the rest.

use std::ffi::{CString, c_char, c_int, c_uint, c_void};

use memsaver_scenarios::{Alloc, FakeNcclAlloc, Free, TagCall, object_of, open_fake_libs, sym};

type StatsJson = unsafe extern "C" fn(*mut c_char, usize, *mut usize) -> c_int;

fn nccl_stats() -> String {
    // SAFETY: RTLD_DEFAULT lookup of a NUL-terminated name.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"memsaver_nccl_stats_json".as_ptr()) };
    if p.is_null() {
        return "none".into();
    }
    // SAFETY: the function of that name has this signature (memsaver.h).
    let f: StatsJson = unsafe { std::mem::transmute::<*mut c_void, StatsJson>(p) };
    let mut buf = vec![0u8; 4096];
    let mut needed = 0;
    // SAFETY: `buf` has 4096 writable bytes.
    let rc = unsafe { f(buf.as_mut_ptr().cast(), buf.len(), &mut needed) };
    assert_eq!(rc, 0);
    String::from_utf8_lossy(&buf[..needed - 1]).into_owned()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (hn, hc) = open_fake_libs(&args[1], &args[2]);
    let cuda = CString::new(args[2].as_str()).unwrap();
    // The same lookup from this executable (as the CUDA runtime makes it): memsaver's other
    // wrapper, which wraps graph and limit calls only, so the VMM calls stay the driver's.
    let gpa: memsaver_allocator::driver::sys::fns::cuGetProcAddress_v2 =
        sym(hc, c"cuGetProcAddress_v2");
    println!("gpa_from_exe={}", object_of(gpa as usize));
    let mut create = std::ptr::null_mut();
    let mut status = 0;
    // SAFETY: valid out-pointers, NUL-terminated name.
    unsafe { gpa(c"cuMemCreate".as_ptr(), &mut create, 12000, 0, &mut status) };
    println!("create_from_exe={}", object_of(create as usize));

    let alloc: Alloc = sym(hn, c"fake_nccl_alloc");
    let free: Free = sym(hn, c"fake_nccl_free");
    let (mut shared, mut private) = (FakeNcclAlloc::default(), FakeNcclAlloc::default());
    // SAFETY: valid arguments per the fake NCCL's contract.
    unsafe {
        assert_eq!(
            alloc(cuda.as_ptr(), 4 << 20, 1, &mut shared),
            0,
            "fake_nccl_alloc failed"
        );
        assert_eq!(
            alloc(cuda.as_ptr(), 6 << 20, 0, &mut private),
            0,
            "fake_nccl_alloc failed"
        );
    }
    println!("gpa_from_nccl={}", object_of(shared.get_proc_address));
    println!("create_from_nccl={}", object_of(shared.mem_create));
    println!("stats_after_alloc={}", nccl_stats());

    // SAFETY: RTLD_DEFAULT lookups of NUL-terminated names.
    let (pause, resume) = unsafe {
        (
            libc::dlsym(libc::RTLD_DEFAULT, c"memsaver_pause".as_ptr()),
            libc::dlsym(libc::RTLD_DEFAULT, c"memsaver_resume".as_ptr()),
        )
    };
    if !pause.is_null() {
        // SAFETY: the functions of these names have this signature (memsaver.h).
        let (pause, resume) = unsafe {
            (
                std::mem::transmute::<*mut c_void, TagCall>(pause),
                std::mem::transmute::<*mut c_void, TagCall>(resume),
            )
        };
        let mem_info = device_memory(hc);
        // On the fake driver device memory is host memory at the same address.
        // SAFETY: the private buffer is mapped read-write, 6 MiB.
        let bytes = unsafe { std::slice::from_raw_parts_mut(private.ptr as *mut u8, private.size) };
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        // NCCL's kernels make the driver raise the per-thread stack size (with 2+ ranks);
        // pause lowers it to CUDA's default (no graph, no limit set by the application),
        // resume gives it back.
        let get_limit: unsafe extern "C" fn(*mut usize, c_uint) -> c_int =
            sym(hc, c"cuCtxGetLimit");
        let kernel: unsafe extern "C" fn(usize) -> c_int =
            sym(hc, c"fakecuda_launch_kernel_needing_stack");
        let stack = || {
            let mut v = 0;
            // SAFETY: valid out-pointer; the context pushed by `device_memory` is current.
            unsafe { get_limit(&mut v, 0) };
            v
        };
        // SAFETY: a fake-driver test control, in the current context.
        unsafe { kernel(1744) };
        let before = mem_info();
        // SAFETY: NUL-terminated tag list.
        println!("pause_rc={}", unsafe { pause(c"nccl".as_ptr()) });
        println!("stack_paused={}", stack());
        let paused = mem_info();
        println!("freed_by_pause={}", paused - before);
        println!("stats_paused={}", nccl_stats());
        println!("allreduce_paused_rc={}", all_reduce(hn));
        println!("allreduce_via_handle_paused_rc={}", all_reduce_from(hn, hn));
        // SAFETY: NUL-terminated tag list.
        println!("resume_rc={}", unsafe { resume(c"nccl".as_ptr()) });
        println!("taken_by_resume={}", paused - mem_info());
        println!("stack_resumed={}", stack());
        // SAFETY: resumed at the same address.
        let bytes = unsafe { std::slice::from_raw_parts(private.ptr as *const u8, private.size) };
        println!(
            "private_intact={}",
            bytes.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8)
        );
        println!("stats_resumed={}", nccl_stats());
        println!("allreduce_resumed_rc={}", all_reduce(hn));
        println!(
            "allreduce_via_handle_resumed_rc={}",
            all_reduce_from(hn, hn)
        );
        // Out of memory on resume, with 5 MiB free: the two buffers, adjacent, do not fit as
        // one run; retried one at a time, the exported 4 MiB buffer is re-created, the private
        // 6 MiB one's cuMemCreate fails. Resume reports it, keeps what it restored, and a
        // second resume (memory free again) finishes the job with the contents intact.
        // SAFETY: as above.
        println!("pause_oom_rc={}", unsafe { pause(c"nccl".as_ptr()) });
        let limit: unsafe extern "C" fn(u64) -> c_int = sym(hc, c"fakecuda_fail_creates_over");
        // SAFETY: a fake-driver test control taking a size.
        unsafe { limit(5 << 20) };
        // SAFETY: as above.
        println!("resume_oom_rc={}", unsafe { resume(c"nccl".as_ptr()) });
        // SAFETY: as above.
        unsafe { limit(0) };
        println!("stats_oom={}", nccl_stats());
        println!("allreduce_oom_rc={}", all_reduce(hn));
        // SAFETY: as above.
        println!("resume_retry_rc={}", unsafe { resume(c"nccl".as_ptr()) });
        // SAFETY: resumed at the same address.
        let bytes = unsafe { std::slice::from_raw_parts(private.ptr as *const u8, private.size) };
        println!(
            "private_intact_after_oom={}",
            bytes.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8)
        );
        // Free a buffer while paused, through NCCL's own free path, then resume the rest.
        // SAFETY: as above.
        println!("pause2_rc={}", unsafe { pause(c"nccl".as_ptr()) });
        // SAFETY: `private` came from fake_nccl_alloc.
        println!("free_while_paused_rc={}", unsafe {
            free(cuda.as_ptr(), &private)
        });
        // SAFETY: as above.
        println!("resume2_rc={}", unsafe { resume(c"nccl".as_ptr()) });
        margin_and_retention(pause, resume, &mem_info);
    } else {
        // SAFETY: `private` came from fake_nccl_alloc.
        assert_eq!(unsafe { free(cuda.as_ptr(), &private) }, 0);
    }
    amem_api(hn);
    // SAFETY: `shared` came from fake_nccl_alloc.
    let rc = unsafe { free(cuda.as_ptr(), &shared) };
    assert_eq!(rc, 0, "fake_nccl_free failed");
    println!("stats_after_free={}", nccl_stats());
}

/// The `nccl` tag follows the settings every tag follows: a resume stops at the memory margin
/// (out of memory, nothing lost), and with retention off it keeps no backup after resume.
fn margin_and_retention(pause: TagCall, resume: TagCall, mem_info: &impl Fn() -> usize) {
    type SetSize = unsafe extern "C" fn(usize) -> c_int;
    type SetFlag = unsafe extern "C" fn(c_int) -> c_int;
    // SAFETY: RTLD_DEFAULT lookups of NUL-terminated names; memsaver.h gives the signatures.
    let (margin, retain): (SetSize, SetFlag) = unsafe {
        (
            std::mem::transmute::<*mut c_void, SetSize>(libc::dlsym(
                libc::RTLD_DEFAULT,
                c"memsaver_set_memory_margin".as_ptr(),
            )),
            std::mem::transmute::<*mut c_void, SetFlag>(libc::dlsym(
                libc::RTLD_DEFAULT,
                c"memsaver_set_retain_backups".as_ptr(),
            )),
        )
    };
    // SAFETY: NUL-terminated tag lists; plain values.
    unsafe {
        println!("margin_pause_rc={}", pause(c"nccl".as_ptr()));
        println!("margin_backup_paused={}", nccl_backup_bytes());
        // Every byte free is margin: no buffer fits.
        assert_eq!(margin(mem_info()), 0);
        println!("margin_resume_rc={}", resume(c"nccl".as_ptr()));
        println!("margin_error={}", last_error());
        println!("margin_stats={}", nccl_stats());
        assert_eq!(margin(0), 0);
        println!("margin_resume_again_rc={}", resume(c"nccl".as_ptr()));
        println!("retained_backup={}", nccl_backup_bytes());
        assert_eq!(retain(0), 0);
        println!("noretain_pause_rc={}", pause(c"nccl".as_ptr()));
        println!("noretain_backup_paused={}", nccl_backup_bytes());
        println!("noretain_resume_rc={}", resume(c"nccl".as_ptr()));
        println!("noretain_backup_resumed={}", nccl_backup_bytes());
        assert_eq!(retain(1), 0);
    }
}

/// `memsaver_last_error()`.
fn last_error() -> String {
    // SAFETY: RTLD_DEFAULT lookup; the function returns a NUL-terminated string it owns.
    unsafe {
        let f = libc::dlsym(libc::RTLD_DEFAULT, c"memsaver_last_error".as_ptr());
        let f = std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> *const c_char>(f);
        std::ffi::CStr::from_ptr(f()).to_string_lossy().into_owned()
    }
}

/// The `nccl` tag's backup bytes in `memsaver_stats_json`.
fn nccl_backup_bytes() -> u64 {
    // SAFETY: RTLD_DEFAULT lookup of a NUL-terminated name.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"memsaver_stats_json".as_ptr()) };
    // SAFETY: the function of that name has this signature (memsaver.h).
    let f: StatsJson = unsafe { std::mem::transmute::<*mut c_void, StatsJson>(p) };
    let mut buf = vec![0u8; 1 << 16];
    let mut needed = 0;
    // SAFETY: `buf` has that many writable bytes.
    let rc = unsafe { f(buf.as_mut_ptr().cast(), buf.len(), &mut needed) };
    assert_eq!(rc, 0);
    let v: serde_json::Value = serde_json::from_slice(&buf[..needed - 1]).expect("stats JSON");
    v["tags"]
        .as_array()
        .and_then(|tags| tags.iter().find(|t| t["tag"] == "nccl"))
        .and_then(|t| t["backup_bytes"].as_u64())
        .expect("the nccl tag's backup_bytes")
}

/// Free device memory of device 0, read through the driver directly.
fn device_memory(hc: *mut c_void) -> impl Fn() -> usize {
    use memsaver_allocator::driver::sys::fns;
    memsaver_scenarios::make_context_current(hc);
    let info: fns::cuMemGetInfo_v2 = sym(hc, c"cuMemGetInfo_v2");
    move || {
        let (mut free, mut total) = (0, 0);
        // SAFETY: valid out-pointers.
        assert_eq!(unsafe { info(&mut free, &mut total) }, 0);
        free
    }
}

/// AMem's API looked up in libnccl's handle, as pynccl-style code does.
fn amem_api(hn: *mut c_void) {
    type CommCall = unsafe extern "C" fn(*mut c_void) -> c_int;
    type SetGroup = unsafe extern "C" fn(c_int) -> c_int;
    type GetGroup = unsafe extern "C" fn(*mut c_int) -> c_int;
    // SAFETY: live handle, NUL-terminated name.
    let p = unsafe { libc::dlsym(hn, c"ncclPause".as_ptr()) };
    println!("amem_found={}", !p.is_null());
    if p.is_null() {
        return;
    }
    let pause: CommCall = sym(hn, c"ncclPause");
    let resume: CommCall = sym(hn, c"ncclResume");
    let set: SetGroup = sym(hn, c"ncclSetGroupID");
    let get: GetGroup = sym(hn, c"ncclGetGroupID");
    let mut id = 0;
    // SAFETY: the AMem signatures; NULL communicator means all.
    unsafe {
        println!("amem_pause_rc={}", pause(std::ptr::null_mut()));
        println!("amem_stats_paused={}", nccl_stats());
        println!("amem_resume_rc={}", resume(std::ptr::null_mut()));
        // NCCL already shared memory (an exported buffer) under group 0: the same group is
        // accepted, another one refused (ncclInvalidUsage).
        println!("amem_set_same_rc={}", set(0));
        println!("amem_set_rc={}", set(170));
        println!("amem_get_rc={}", get(&mut id));
    }
    println!("amem_group={id}");
}

/// Calls `ncclAllReduce` as an application linked against NCCL would (global lookup), and
/// reports its result and how many calls reached the library: `rc/calls`.
fn all_reduce(hn: *mut c_void) -> String {
    all_reduce_from(hn, libc::RTLD_DEFAULT)
}

/// `ncclAllReduce` looked up in `scope` (`RTLD_DEFAULT`, as a program linked to NCCL finds
/// it, or libnccl's own handle, as pynccl does), called; "rc/calls that reached NCCL".
fn all_reduce_from(hn: *mut c_void, scope: *mut c_void) -> String {
    type AllReduce = unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        *mut c_void,
        *mut c_void,
    ) -> c_int;
    type Calls = unsafe extern "C" fn() -> u32;
    let f: AllReduce = sym(scope, c"ncclAllReduce");
    let calls: Calls = sym(hn, c"fake_nccl_all_reduce_calls");
    let null = std::ptr::null_mut();
    // SAFETY: the fake's ncclAllReduce ignores its arguments.
    let rc = unsafe { f(null, null, 0, 0, 0, null, null) };
    // SAFETY: plain counter read.
    format!("{rc}/{}", unsafe { calls() })
}
