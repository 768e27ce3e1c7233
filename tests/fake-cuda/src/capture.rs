//! Stream capture, as threads that do not capture see it. A test stands for another thread
//! capturing in global mode (`fakecuda_global_capture(1)`). While it does, a call that is unsafe
//! during a capture (pinning host memory) from a thread whose capture mode is not relaxed
//! (`cuThreadExchangeStreamCaptureMode`) fails with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and
//! invalidates the capture, as on the real driver (measured on an H100: a `torch.cuda.graph`
//! capture failed with `cudaErrorStreamCaptureInvalidated` while memsaver's preparation thread
//! pinned a backup); the invalidations are counted (`fakecuda_captures_invalidated`).

use std::cell::Cell;
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use memsaver_allocator::driver::sys::{
    CU_STREAM_CAPTURE_MODE_RELAXED, CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, CUresult,
};

thread_local! {
    /// This thread's capture interaction mode: global (0), thread-local (1) or relaxed (2).
    static MODE: Cell<c_int> = const { Cell::new(0) };
}

/// Set while a test stands for a capture in global mode on another thread.
static GLOBAL_CAPTURE: AtomicBool = AtomicBool::new(false);
/// Captures invalidated by an unsafe call.
static INVALIDATED: AtomicU64 = AtomicU64::new(0);

/// `cuThreadExchangeStreamCaptureMode`: sets this thread's mode to `*mode`, and writes the
/// mode it had into `*mode`.
pub fn exchange(mode: &mut c_int) -> Result<(), CUresult> {
    if !(0..=CU_STREAM_CAPTURE_MODE_RELAXED).contains(mode) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    *mode = MODE.with(|m| m.replace(*mode));
    Ok(())
}

/// A call that is unsafe during a capture: refused, invalidating the capture, while one runs in
/// global mode and this thread's mode is not relaxed.
pub fn unsafe_call() -> Result<(), CUresult> {
    let relaxed = MODE.with(Cell::get) == CU_STREAM_CAPTURE_MODE_RELAXED;
    if GLOBAL_CAPTURE.load(Ordering::SeqCst) && !relaxed {
        INVALIDATED.fetch_add(1, Ordering::SeqCst);
        return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    Ok(())
}

/// Starts (`true`) or ends a capture in global mode on another thread.
pub fn set_global_capture(on: bool) {
    GLOBAL_CAPTURE.store(on, Ordering::SeqCst);
}

/// Captures invalidated so far.
pub fn invalidated() -> u64 {
    INVALIDATED.load(Ordering::SeqCst)
}
