//! A process that uses the fake libnccl.so.2 the way an NCCL application does, for the
//! nccl-hook scenarios. Prints `key=value` lines the test reads:
//!
//! `nccl_like <libnccl.so.2> <libcuda.so.1>`: allocates 4 MiB through the fake NCCL, reports
//! which library each looked-up function lives in and, when libmemsaver.so is preloaded, the
//! hook's view of NCCL's memory (`memsaver_nccl_stats_json`) after the allocation and after
//! the free.

use std::ffi::{CStr, CString, c_char, c_int, c_void};

#[repr(C)]
#[derive(Default)]
struct FakeNcclAlloc {
    get_proc_address: usize,
    mem_create: usize,
    handle: u64,
    ptr: u64,
    size: usize,
    exported_fd: c_int,
}

type Alloc = unsafe extern "C" fn(*const c_char, usize, *mut FakeNcclAlloc) -> c_int;
type Free = unsafe extern "C" fn(*const c_char, *const FakeNcclAlloc) -> c_int;
type StatsJson = unsafe extern "C" fn(*mut c_char, usize, *mut usize) -> c_int;

/// The file name of the object containing `addr`.
fn object_of(addr: usize) -> String {
    // SAFETY: zeroed Dl_info is a valid out-parameter.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: any address may be asked about.
    if unsafe { libc::dladdr(addr as *const c_void, &mut info) } == 0 || info.dli_fname.is_null() {
        return "?".into();
    }
    // SAFETY: NUL-terminated file name from dladdr.
    let path = unsafe { CStr::from_ptr(info.dli_fname) }
        .to_string_lossy()
        .into_owned();
    path.rsplit('/').next().unwrap_or(&path).to_owned()
}

fn sym<T: Copy>(h: *mut c_void, name: &CStr) -> T {
    // SAFETY: live handle (or RTLD_DEFAULT), NUL-terminated name.
    let p = unsafe { libc::dlsym(h, name.as_ptr()) };
    assert!(!p.is_null(), "missing symbol {name:?}");
    // SAFETY: the caller names the function's type.
    unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) }
}

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
    let (nccl, cuda) = (
        CString::new(args[1].as_str()).unwrap(),
        CString::new(args[2].as_str()).unwrap(),
    );
    // SAFETY: NUL-terminated paths.
    let (hn, hc) = unsafe {
        (
            libc::dlopen(nccl.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL),
            libc::dlopen(cuda.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL),
        )
    };
    assert!(
        !hn.is_null() && !hc.is_null(),
        "cannot open the fake libraries"
    );
    // The same lookup from this executable: never wrapped (the caller is not libnccl).
    let gpa: *mut c_void = sym(hc, c"cuGetProcAddress_v2");
    println!("gpa_from_exe={}", object_of(gpa as usize));

    let alloc: Alloc = sym(hn, c"fake_nccl_alloc");
    let free: Free = sym(hn, c"fake_nccl_free");
    let mut a = FakeNcclAlloc::default();
    // SAFETY: valid arguments per the fake NCCL's contract.
    let rc = unsafe { alloc(cuda.as_ptr(), 4 << 20, &mut a) };
    assert_eq!(rc, 0, "fake_nccl_alloc failed");
    println!("gpa_from_nccl={}", object_of(a.get_proc_address));
    println!("create_from_nccl={}", object_of(a.mem_create));
    println!("stats_after_alloc={}", nccl_stats());
    // SAFETY: `a` came from fake_nccl_alloc.
    let rc = unsafe { free(cuda.as_ptr(), &a) };
    assert_eq!(rc, 0, "fake_nccl_free failed");
    println!("stats_after_free={}", nccl_stats());
}
