//! Per-device runtime state: the primary context, the VMM granularity and the copy stream
//! (shared by every tag's pause and resume: see `steps`).

use crate::driver::{Context, Driver, DriverError, Stream};

pub struct Device {
    pub ordinal: i32,
    pub ctx: Context,
    /// Allocation sizes and addresses are multiples of this.
    pub granularity: usize,
    /// The stream backups are copied on; one per device so devices copy in parallel.
    pub stream: Stream,
}

impl Device {
    pub(crate) fn open(driver: &Driver, ordinal: i32) -> Result<Self, DriverError> {
        let count = driver.device_count()?;
        if ordinal < 0 || ordinal >= count {
            return Err(DriverError {
                call: "cuDeviceGet",
                code: crate::driver::sys::CUDA_ERROR_INVALID_DEVICE,
            });
        }
        let ctx = driver.primary_context(ordinal)?;
        let granularity = driver.granularity(ordinal)?;
        let stream = driver.with_context(ctx, || driver.stream_create())?;
        Ok(Self {
            ordinal,
            ctx,
            granularity,
            stream,
        })
    }

    /// `size` rounded up to the granularity; `None` when that does not fit in a `usize`.
    pub(crate) fn round_up(&self, size: usize) -> Option<usize> {
        size.div_ceil(self.granularity)
            .checked_mul(self.granularity)
    }
}
