//! Pieces shared by the scenario programs (`src/bin/`) that drive the fake libnccl.so.2.

use std::ffi::{CStr, c_char, c_int, c_void};

/// What `fake_nccl_alloc` / `fake_nccl_import` report (layout of the fake NCCL's struct).
#[repr(C)]
#[derive(Default, Clone, Copy)]
pub struct FakeNcclAlloc {
    pub get_proc_address: usize,
    pub mem_create: usize,
    pub handle: u64,
    pub ptr: u64,
    pub size: usize,
    pub exported_fd: c_int,
}

pub type Alloc = unsafe extern "C" fn(*const c_char, usize, c_int, *mut FakeNcclAlloc) -> c_int;
pub type Import = unsafe extern "C" fn(*const c_char, c_int, usize, *mut FakeNcclAlloc) -> c_int;
pub type Free = unsafe extern "C" fn(*const c_char, *const FakeNcclAlloc) -> c_int;
/// `memsaver_pause` / `memsaver_resume`.
pub type TagCall = unsafe extern "C" fn(*const c_char) -> c_int;

/// The function `name` of `h` (a dlopen handle or RTLD_DEFAULT) as type `T`; panics if missing.
/// Test support: every caller passes a handle it got from `dlopen` (or RTLD_DEFAULT).
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn sym<T: Copy>(h: *mut c_void, name: &CStr) -> T {
    // SAFETY: live handle (or RTLD_DEFAULT), NUL-terminated name.
    let p = unsafe { libc::dlsym(h, name.as_ptr()) };
    assert!(!p.is_null(), "missing symbol {name:?}");
    // SAFETY: the caller names the function's type.
    unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) }
}
