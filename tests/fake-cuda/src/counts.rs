//! Per-process counts of the driver's VMM and copy calls by kind, for the machine-independent
//! figure of a pause or resume (how many driver calls it makes). One relaxed atomic add per
//! call; every call entered is counted, including calls that fail.

use std::sync::atomic::{AtomicU64, Ordering};

/// A kind of call; the discriminant is its index in `fakecuda_call_counts`'s order.
#[derive(Clone, Copy)]
pub enum Call {
    /// `cuMemCreate`.
    Create,
    /// `cuMemMap`.
    Map,
    /// `cuMemSetAccess`.
    SetAccess,
    /// `cuMemUnmap`.
    Unmap,
    /// `cuMemRelease`.
    Release,
    /// `cuMemExportToShareableHandle`.
    Export,
    /// `cuMemImportFromShareableHandle`.
    Import,
    /// `cuMemcpy{DtoH,HtoD}` and their `Async` forms.
    Copy,
    /// `cuMemAddressReserve`.
    Reserve,
    /// `cuMemAddressFree`.
    AddressFree,
    /// `cuMemHostAlloc`.
    HostAlloc,
    /// `cuMemFreeHost`.
    HostFree,
    /// `cuMemHostRegister_v2`.
    HostRegister,
    /// `cuMemHostUnregister`.
    HostUnregister,
    /// `cuMemsetD8` and its `Async` form.
    Memset,
    /// `cuLaunchKernel`.
    Launch,
}

/// How many kinds there are.
pub const KINDS: usize = 16;

static COUNTS: [AtomicU64; KINDS] = [const { AtomicU64::new(0) }; KINDS];

/// Counts one call of `kind`.
pub fn count(kind: Call) {
    COUNTS[kind as usize].fetch_add(1, Ordering::Relaxed);
}

/// Writes the first `out.len()` counts (at most [`KINDS`]).
pub fn read(out: &mut [u64]) {
    for (o, c) in out.iter_mut().zip(&COUNTS) {
        *o = c.load(Ordering::Relaxed);
    }
}

/// Sets every count to 0.
pub fn reset() {
    for c in &COUNTS {
        c.store(0, Ordering::Relaxed);
    }
}
