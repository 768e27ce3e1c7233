//! Streams, events, asynchronous copies and memsets, and pinned host memory: what the copies of
//! a backup need (the VMM calls and the context are in `mod.rs`).

use std::ffi::c_void;

use super::sys::*;
use super::{Call, Driver, DriverError, WAIT, check};

/// A stream (`CUstream`). Destroy with [`Driver::stream_destroy`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stream(pub(super) CUstream);
// SAFETY: streams may be used from any thread; the driver serialises work on them.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

/// An event (`CUevent`). [`Driver::event_wait`] destroys it.
#[derive(Debug)]
pub struct Event(CUevent);
// SAFETY: events may be recorded and waited on from any thread.
unsafe impl Send for Event {}

impl Driver {
    /// Creates a non-blocking stream in the current context.
    pub fn stream_create(&self) -> Result<Stream, DriverError> {
        let mut s: CUstream = std::ptr::null_mut();
        // SAFETY: `s` is a valid out-pointer.
        check("cuStreamCreate", unsafe {
            (self.f.cuStreamCreate)(&mut s, CU_STREAM_NON_BLOCKING)
        })?;
        Ok(Stream(s))
    }

    pub fn stream_synchronize(&self, s: Stream) -> Result<(), DriverError> {
        let _timer = self.calls.time(WAIT);
        // SAFETY: `s` was created by `stream_create` and not destroyed.
        check("cuStreamSynchronize", unsafe {
            (self.f.cuStreamSynchronize)(s.0)
        })
    }

    pub fn stream_destroy(&self, s: Stream) -> Result<(), DriverError> {
        // SAFETY: `s` was created by `stream_create`; it is consumed here.
        check("cuStreamDestroy", unsafe {
            (self.f.cuStreamDestroy_v2)(s.0)
        })
    }

    /// Lets the calling thread make calls that are unsafe during a stream capture (pinning
    /// host memory) while another thread captures in global mode, which such a call would
    /// otherwise invalidate (`CU_STREAM_CAPTURE_MODE_RELAXED`, for this thread only). For
    /// memsaver's own threads, which never capture.
    pub fn relax_capture_mode(&self) -> Result<(), DriverError> {
        let mut mode = CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: a valid in/out pointer; the mode applies to the calling thread only.
        check("cuThreadExchangeStreamCaptureMode", unsafe {
            (self.f.cuThreadExchangeStreamCaptureMode)(&mut mode)
        })
    }

    /// Records a new timing-free event on `s`.
    pub fn event_record(&self, s: Stream) -> Result<Event, DriverError> {
        let mut e: CUevent = std::ptr::null_mut();
        // SAFETY: `e` is a valid out-pointer.
        check("cuEventCreate", unsafe {
            (self.f.cuEventCreate)(&mut e, CU_EVENT_DISABLE_TIMING)
        })?;
        // SAFETY: `e` and `s` are live.
        if let Err(err) = check("cuEventRecord", unsafe { (self.f.cuEventRecord)(e, s.0) }) {
            // SAFETY: `e` was created above and is not used again.
            unsafe { (self.f.cuEventDestroy_v2)(e) };
            return Err(err);
        }
        Ok(Event(e))
    }

    /// Waits for `e`, then destroys it.
    pub fn event_wait(&self, e: Event) -> Result<(), DriverError> {
        let r = {
            let _timer = self.calls.time(WAIT);
            // SAFETY: `e` is live until destroyed below.
            check("cuEventSynchronize", unsafe {
                (self.f.cuEventSynchronize)(e.0)
            })
        };
        // SAFETY: `e` is consumed here.
        let d = check("cuEventDestroy", unsafe { (self.f.cuEventDestroy_v2)(e.0) });
        r.and(d)
    }

    /// # Safety
    /// 1. `src..src+n` is mapped device memory and `dst..dst+n` is pinned host memory.
    /// 2. Both stay valid until the copy completes on `s`.
    pub unsafe fn copy_dtoh_async(
        &self,
        dst: *mut u8,
        src: CUdeviceptr,
        n: usize,
        s: Stream,
    ) -> Result<(), DriverError> {
        let _timer = self.calls.start(Call::Copy);
        // SAFETY: guaranteed by the caller.
        check("cuMemcpyDtoHAsync", unsafe {
            (self.f.cuMemcpyDtoHAsync_v2)(dst.cast(), src, n, s.0)
        })
    }

    /// # Safety
    /// 1. `dst..dst+n` is mapped device memory and `src..src+n` is pinned host memory.
    /// 2. Both stay valid until the copy completes on `s`.
    pub unsafe fn copy_htod_async(
        &self,
        dst: CUdeviceptr,
        src: *const u8,
        n: usize,
        s: Stream,
    ) -> Result<(), DriverError> {
        let _timer = self.calls.start(Call::Copy);
        // SAFETY: guaranteed by the caller.
        check("cuMemcpyHtoDAsync", unsafe {
            (self.f.cuMemcpyHtoDAsync_v2)(dst, src.cast(), n, s.0)
        })
    }

    /// # Safety
    /// `dst..dst+n` is mapped device memory.
    pub unsafe fn memset_d8(
        &self,
        dst: CUdeviceptr,
        value: u8,
        n: usize,
    ) -> Result<(), DriverError> {
        // SAFETY: guaranteed by the caller.
        check("cuMemsetD8", unsafe {
            (self.f.cuMemsetD8_v2)(dst, value, n)
        })
    }

    /// Queues setting `n` bytes of device memory at `dst` to `value` on `s`.
    ///
    /// # Safety
    /// `dst..dst+n` is mapped device memory of the current context, and stays mapped until
    /// `s` is synchronised.
    pub unsafe fn memset_d8_async(
        &self,
        dst: CUdeviceptr,
        value: u8,
        n: usize,
        s: Stream,
    ) -> Result<(), DriverError> {
        let _timer = self.calls.start(Call::Memset);
        // SAFETY: guaranteed by the caller.
        check("cuMemsetD8Async", unsafe {
            (self.f.cuMemsetD8Async)(dst, value, n, s.0)
        })
    }

    /// Allocates `n` bytes of pinned (page-locked) host memory.
    pub fn host_alloc(&self, n: usize) -> Result<*mut u8, DriverError> {
        let mut p: *mut c_void = std::ptr::null_mut();
        let _timer = self.calls.start(Call::HostAlloc);
        // SAFETY: `p` is a valid out-pointer.
        check("cuMemHostAlloc", unsafe {
            (self.f.cuMemHostAlloc)(&mut p, n, CU_MEMHOSTALLOC_PORTABLE)
        })?;
        Ok(p.cast())
    }

    /// # Safety
    /// `p` came from [`Driver::host_alloc`], is not used afterwards, and no copy into or out of
    /// it is pending.
    pub unsafe fn host_free(&self, p: *mut u8) -> Result<(), DriverError> {
        let _timer = self.calls.start(Call::HostFree);
        // SAFETY: guaranteed by the caller.
        check("cuMemFreeHost", unsafe { (self.f.cuMemFreeHost)(p.cast()) })
    }

    /// Pins `p..p+n` (host memory this process mapped) for every context
    /// (`cuMemHostRegister(PORTABLE)`). The driver holds up the process's other driver calls
    /// while it pins, for a time that grows with `n`: callers pin in bounded steps.
    ///
    /// # Safety
    /// `p..p+n` is mapped host memory that stays mapped until [`Driver::host_unregister`].
    pub unsafe fn host_register(&self, p: *mut u8, n: usize) -> Result<(), DriverError> {
        let _timer = self.calls.start(Call::HostRegister);
        // SAFETY: guaranteed by the caller.
        check("cuMemHostRegister", unsafe {
            (self.f.cuMemHostRegister_v2)(p.cast(), n, CU_MEMHOSTREGISTER_PORTABLE)
        })
    }

    /// Unpins memory pinned by [`Driver::host_register`] at `p`.
    ///
    /// # Safety
    /// `p` is the start of a range registered by [`Driver::host_register`], and no copy into or
    /// out of it is pending.
    pub unsafe fn host_unregister(&self, p: *mut u8) -> Result<(), DriverError> {
        let _timer = self.calls.start(Call::HostUnregister);
        // SAFETY: guaranteed by the caller.
        check("cuMemHostUnregister", unsafe {
            (self.f.cuMemHostUnregister)(p.cast())
        })
    }
}
