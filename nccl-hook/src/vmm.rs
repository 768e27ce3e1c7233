//! Wrappers of the driver's VMM entry points, handed to libnccl by [`crate::procaddr`]. Each
//! calls the real function and records the outcome in [`crate::ledger`].
//!
//! They observe only: NCCL's calls reach the driver unchanged. Pausing `nccl` (releasing and
//! re-creating the physical memory behind NCCL's handles, and the references peers hold) is
//! built on this metadata next (issue 4).

use std::ffi::{c_uint, c_ulonglong, c_void};
use std::sync::atomic::Ordering;

use memsaver_allocator::driver::sys::*;

use crate::ledger;

/// Declares, per wrapped entry point, the slot holding the driver's function, the wrapper,
/// and the CUDA version from which the driver hands out the signature we implement.
macro_rules! wrappers {
    ($(
        $name:ident since $since:literal
        fn($($arg:ident: $ty:ty),*) $after:block
    )*) => {
        $(
            #[allow(non_snake_case, non_upper_case_globals)]
            mod $name {
                pub(super) static REAL: std::sync::atomic::AtomicUsize =
                    std::sync::atomic::AtomicUsize::new(0);
            }

            #[allow(non_snake_case)]
            unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
                type F = unsafe extern "C" fn($($ty),*) -> CUresult;
                // SAFETY: the slot was filled with the driver's function of this signature
                // before this wrapper was handed out.
                let real = unsafe { std::mem::transmute::<usize, F>($name::REAL.load(Ordering::Acquire)) };
                // SAFETY: forwarding the caller's arguments unchanged.
                let r = unsafe { real($($arg),*) };
                if r == CUDA_SUCCESS {
                    let _ = std::panic::catch_unwind(|| $after);
                }
                r
            }
        )*

        /// Our wrapper for `name` (resolved for CUDA `version`), storing `real`; `None` for
        /// entry points we do not wrap.
        pub(crate) fn wrap(name: &[u8], version: i32, real: *mut c_void) -> Option<*mut c_void> {
            $(
                if name == stringify!($name).as_bytes() {
                    if version < $since {
                        return None;
                    }
                    $name::REAL.store(real as usize, Ordering::Release);
                    return Some($name as *mut c_void);
                }
            )*
            None
        }
    };
}

wrappers! {
    cuMemCreate since 10020
    fn(handle: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationProp, flags: c_ulonglong) {
        // SAFETY: on success the driver wrote the handle; `prop` is the caller's valid input.
        unsafe { ledger::created(*handle, size, &*prop) }
    }
    cuMemRelease since 10020
    fn(handle: CUmemGenericAllocationHandle) {
        ledger::released(handle)
    }
    cuMemRetainAllocationHandle since 11000
    fn(handle: *mut CUmemGenericAllocationHandle, addr: *mut c_void) {
        // SAFETY: written by the driver on success.
        ledger::retained(unsafe { *handle })
    }
    cuMemMap since 10020
    fn(ptr: CUdeviceptr, size: usize, offset: usize, handle: CUmemGenericAllocationHandle, flags: c_ulonglong) {
        ledger::mapped(ptr, size, handle)
    }
    cuMemUnmap since 10020
    fn(ptr: CUdeviceptr, size: usize) {
        ledger::unmapped(ptr)
    }
    cuMemExportToShareableHandle since 10020
    fn(shareable: *mut c_void, handle: CUmemGenericAllocationHandle, handle_type: c_uint, flags: c_ulonglong) {
        ledger::exported(handle)
    }
    cuMemImportFromShareableHandle since 10020
    fn(handle: *mut CUmemGenericAllocationHandle, os_handle: *mut c_void, handle_type: c_uint) {
        // SAFETY: written by the driver on success.
        ledger::imported(unsafe { *handle })
    }
    cuMemGetHandleForAddressRange since 11070
    fn(handle: *mut c_void, ptr: CUdeviceptr, size: usize, handle_type: c_uint, flags: c_ulonglong) {
        ledger::nic_range(ptr, size)
    }
    cuMulticastCreate since 12010
    fn(handle: *mut CUmemGenericAllocationHandle, prop: *const c_void) {
        ledger::multicast_created()
    }
}
