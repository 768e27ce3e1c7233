//! The driver's own VMM functions that NCCL looked up, stored for the wrappers to call: one
//! list (`slots!` below) names each entry point, the signature it has and the CUDA version
//! from which the driver hands out that signature. `procaddr` stores the driver's function when
//! it answers NCCL's lookup ([`store`]) and hands out the wrapper of its [`Slot`] (`vmm`,
//! `sharing`); the wrappers call the driver's function through the accessor of the same name.

use std::ffi::{c_uint, c_ulonglong, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

use memsaver_allocator::driver::sys::{fns, *};

type GetHandleForAddressRange =
    unsafe extern "C" fn(*mut c_void, CUdeviceptr, usize, c_uint, c_ulonglong) -> CUresult;
type MulticastCreate =
    unsafe extern "C" fn(*mut CUmemGenericAllocationHandle, *const c_void) -> CUresult;
type MulticastBindMem = unsafe extern "C" fn(
    CUmemGenericAllocationHandle,
    usize,
    CUmemGenericAllocationHandle,
    usize,
    usize,
    c_ulonglong,
) -> CUresult;

/// Makes, from the list of entry points: a static per slot, [`Slot`], [`store`] and a typed
/// accessor per slot.
macro_rules! slots {
    ($($slot:ident: $ty:ty = $name:literal since $since:literal;)*) => {
        /// The stored driver functions (0: not looked up yet).
        mod stored {
            use super::*;
            $(pub(super) static $slot: AtomicUsize = AtomicUsize::new(0);)*
        }

        /// An entry point we wrap.
        #[allow(non_camel_case_types, clippy::upper_case_acronyms)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub(crate) enum Slot {
            $($slot,)*
        }

        /// Stores the driver's `real` for `name` (resolved for CUDA `version`) and gives its
        /// slot; `None` for an entry point we do not wrap, or one whose signature at `version`
        /// is not the one we implement.
        pub(crate) fn store(name: &[u8], version: i32, real: *mut c_void) -> Option<Slot> {
            $(
                if name == $name.as_bytes() {
                    if version < $since {
                        return None;
                    }
                    stored::$slot.store(real as usize, Ordering::Release);
                    return Some(Slot::$slot);
                }
            )*
            None
        }

        $(
            /// The driver's function of this slot, once NCCL looked it up.
            #[allow(non_snake_case)]
            pub(crate) fn $slot() -> Option<$ty> {
                let p = stored::$slot.load(Ordering::Acquire);
                // SAFETY: the slot holds 0 or the driver's function of this signature.
                (p != 0).then(|| unsafe { std::mem::transmute::<usize, $ty>(p) })
            }
        )*
    };
}

slots! {
    CREATE: fns::cuMemCreate = "cuMemCreate" since 10020;
    RELEASE: fns::cuMemRelease = "cuMemRelease" since 10020;
    RETAIN: fns::cuMemRetainAllocationHandle = "cuMemRetainAllocationHandle" since 11000;
    MAP: fns::cuMemMap = "cuMemMap" since 10020;
    UNMAP: fns::cuMemUnmap = "cuMemUnmap" since 10020;
    SET_ACCESS: fns::cuMemSetAccess = "cuMemSetAccess" since 10020;
    EXPORT: fns::cuMemExportToShareableHandle = "cuMemExportToShareableHandle" since 10020;
    IMPORT: fns::cuMemImportFromShareableHandle = "cuMemImportFromShareableHandle" since 10020;
    PROPS: fns::cuMemGetAllocationPropertiesFromHandle = "cuMemGetAllocationPropertiesFromHandle" since 10020;
    RANGE: fns::cuMemGetAddressRange_v2 = "cuMemGetAddressRange" since 3020;
    RESERVE: fns::cuMemAddressReserve = "cuMemAddressReserve" since 10020;
    FREE: fns::cuMemAddressFree = "cuMemAddressFree" since 10020;
    NIC_HANDLE: GetHandleForAddressRange = "cuMemGetHandleForAddressRange" since 11070;
    MC_CREATE: MulticastCreate = "cuMulticastCreate" since 12010;
    MC_BIND_MEM: MulticastBindMem = "cuMulticastBindMem" since 12010;
}
