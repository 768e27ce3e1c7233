//! `cuGetProcAddress` wrappers: the second door. NCCL's runtime asks the driver's
//! `cuGetProcAddress(_v2)` for every entry point; ours asks the real one and swaps in
//! `crate::interpose::vmm`'s and `crate::interpose::sharing`'s wrappers for the VMM calls NCCL
//! makes ([`wrap`], which stores the driver's function in `crate::interpose::real`), leaving
//! everything else as it is.
//!
//! Two pairs of wrappers, told apart by the const parameter `NCCL`: libnccl's (VMM calls and
//! `crate::interpose::graphs`' graph calls, so graphs NCCL captures count) and everyone else's, the
//! CUDA runtime's included (graph calls and `cuCtxSetLimit` only: the limits the application sets).

use std::ffi::{CStr, c_char, c_int, c_ulonglong, c_void};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use memsaver_allocator::driver::sys::{CUDA_SUCCESS, CUresult};

type GetProcAddressV2 = unsafe extern "C" fn(
    *const c_char,
    *mut *mut c_void,
    c_int,
    c_ulonglong,
    *mut c_int,
) -> CUresult;
type GetProcAddressV1 =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, c_ulonglong) -> CUresult;

/// The driver's functions we wrap, set when NCCL first looks them up.
static REAL_V2: AtomicUsize = AtomicUsize::new(0);
static REAL_V1: AtomicUsize = AtomicUsize::new(0);
/// Set once NCCL resolved its driver entry points through us.
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// Whether NCCL has resolved driver functions through memsaver's wrappers in this process.
pub fn installed() -> bool {
    INSTALLED.load(Ordering::Relaxed)
}

/// The names whose `dlsym` lookups from libnccl the interposer answers.
pub(crate) fn is_entry_name(name: &[u8]) -> bool {
    name == b"cuGetProcAddress_v2" || name == b"cuGetProcAddress"
}

/// Our wrapper for the entry point `name` whose real address is `real`, for libnccl (`nccl`)
/// or another caller.
pub(crate) fn wrap_entry(name: &[u8], real: *mut c_void, nccl: bool) -> *mut c_void {
    // Called on the dlsym path: nothing here may lock, allocate or log.
    if nccl {
        INSTALLED.store(true, Ordering::Relaxed);
    }
    pair(name == b"cuGetProcAddress_v2", real, nccl)
}

/// Stores the driver's lookup function `real` (the CUDA 12 signature when `v2`) and returns
/// the wrapper of the pair for libnccl (`nccl`) or another caller.
fn pair(v2: bool, real: *mut c_void, nccl: bool) -> *mut c_void {
    match (v2, nccl) {
        (true, n) => {
            REAL_V2.store(real as usize, Ordering::Release);
            if n {
                get_proc_address_v2::<true> as *mut c_void
            } else {
                get_proc_address_v2::<false> as *mut c_void
            }
        }
        (false, n) => {
            REAL_V1.store(real as usize, Ordering::Release);
            if n {
                get_proc_address_v1::<true> as *mut c_void
            } else {
                get_proc_address_v1::<false> as *mut c_void
            }
        }
    }
}

/// Replaces `*pfn` with a wrapper when `symbol` is one we interpose for libnccl (`nccl`) or
/// for another caller.
///
/// # Safety
/// `symbol` is NUL-terminated and `pfn` points to the driver's answer for it.
unsafe fn substitute(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, nccl: bool) {
    // SAFETY: per this function's contract.
    let (name, real) = unsafe { (CStr::from_ptr(symbol).to_bytes(), *pfn) };
    if real.is_null() {
        return;
    }
    memsaver_allocator::init_logging();
    let wrapper = if name == b"cuGetProcAddress" {
        // Asked for the lookup function itself: the _v2 signature from CUDA 12.0 on.
        Some(pair(version >= 12000, real, nccl))
    } else if nccl {
        wrap(name, version, real)
            .or_else(|| crate::interpose::graphs::wrap(name, Some(version), false, real))
    } else {
        crate::interpose::graphs::wrap(name, Some(version), true, real)
    };
    if let Some(w) = wrapper {
        // SAFETY: `pfn` is the caller's valid out-pointer.
        unsafe { *pfn = w };
    }
}

unsafe extern "C" fn get_proc_address_v2<const NCCL: bool>(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: c_ulonglong,
    status: *mut c_int,
) -> CUresult {
    // SAFETY: REAL_V2 was stored before this wrapper was handed out; same signature.
    let real =
        unsafe { std::mem::transmute::<usize, GetProcAddressV2>(REAL_V2.load(Ordering::Acquire)) };
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { real(symbol, pfn, version, flags, status) };
    if r == CUDA_SUCCESS && !symbol.is_null() && !pfn.is_null() {
        let _ = std::panic::catch_unwind(|| {
            // SAFETY: the driver filled `*pfn` for the NUL-terminated `symbol`.
            unsafe { substitute(symbol, pfn, version, NCCL) }
        });
    }
    r
}

unsafe extern "C" fn get_proc_address_v1<const NCCL: bool>(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: c_ulonglong,
) -> CUresult {
    // SAFETY: REAL_V1 was stored before this wrapper was handed out; same signature.
    let real =
        unsafe { std::mem::transmute::<usize, GetProcAddressV1>(REAL_V1.load(Ordering::Acquire)) };
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { real(symbol, pfn, version, flags) };
    if r == CUDA_SUCCESS && !symbol.is_null() && !pfn.is_null() {
        let _ = std::panic::catch_unwind(|| {
            // SAFETY: the driver filled `*pfn` for the NUL-terminated `symbol`.
            unsafe { substitute(symbol, pfn, version, NCCL) }
        });
    }
    r
}

/// Our wrapper of the VMM entry point `name` (resolved for CUDA `version`), once the driver's
/// `real` is stored for it ([`real::store`](crate::interpose::real::store)); `None` for entry
/// points we do not wrap.
fn wrap(name: &[u8], version: i32, real: *mut c_void) -> Option<*mut c_void> {
    use crate::interpose::real::{self, Slot};
    use crate::interpose::{sharing, vmm};
    let w: *mut c_void = match real::store(name, version, real)? {
        Slot::CREATE => vmm::mem_create as *mut c_void,
        Slot::RELEASE => vmm::mem_release as *mut c_void,
        Slot::RETAIN => vmm::mem_retain as *mut c_void,
        Slot::MAP => vmm::mem_map as *mut c_void,
        Slot::UNMAP => vmm::mem_unmap as *mut c_void,
        Slot::SET_ACCESS => vmm::mem_set_access as *mut c_void,
        Slot::PROPS => vmm::mem_props as *mut c_void,
        Slot::RANGE => vmm::mem_range as *mut c_void,
        Slot::RESERVE => vmm::mem_reserve as *mut c_void,
        Slot::FREE => vmm::mem_address_free as *mut c_void,
        Slot::EXPORT => sharing::mem_export as *mut c_void,
        Slot::IMPORT => sharing::mem_import as *mut c_void,
        Slot::NIC_HANDLE => sharing::mem_nic_handle as *mut c_void,
        Slot::MC_CREATE => sharing::mc_create as *mut c_void,
        Slot::MC_BIND_MEM => sharing::mc_bind_mem as *mut c_void,
    };
    Some(w)
}
