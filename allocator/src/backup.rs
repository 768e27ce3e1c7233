//! Pinned host buffers that hold the contents of paused `cpu`-policy allocations.
//!
//! A buffer is allocated the first time its allocation is paused and then kept, attached to the
//! allocation, for every later cycle: allocating pinned memory is slow (about 5 s for 8 GiB on
//! an H200 host), copying into existing pinned memory runs at the PCIe limit. It is freed with
//! its allocation.

use std::sync::Arc;

use crate::driver::{Context, Driver, DriverError};

pub struct HostBuffer {
    ptr: *mut u8,
    len: usize,
    driver: Arc<Driver>,
    /// The context it was allocated in (pinned memory is allocated and freed in one).
    ctx: Context,
}

// SAFETY: the buffer is plain pinned host memory owned by this value; no thread-affine state.
unsafe impl Send for HostBuffer {}

impl HostBuffer {
    pub fn new(driver: &Arc<Driver>, ctx: Context, len: usize) -> Result<Self, DriverError> {
        let ptr = driver.with_context(ctx, || driver.host_alloc(len))?;
        let driver = driver.clone();
        Ok(Self {
            ptr,
            len,
            driver,
            ctx,
        })
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        self.len
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        let d = &self.driver;
        // SAFETY: `ptr` came from host_alloc; the engine waits for every copy touching a backup
        // before the backup can be dropped, and this value is its only owner.
        let freed = d.with_context(self.ctx, || unsafe { d.host_free(self.ptr) });
        if let Err(e) = freed {
            tracing::warn!(bytes = self.len, error = %e, "could not free a pinned backup buffer");
        }
    }
}
