//! Kernels memsaver launches itself (the packing kernels of `packed.rs`): a module loaded from
//! PTX into a context, its functions, and launches on a stream.

use std::ffi::{CStr, c_void};

use super::sys::*;
use super::{Call, Driver, DriverError, Stream, check};

/// A module loaded into a context; kept for the life of the process (never unloaded: launches
/// may be queued on it at any time).
#[derive(Debug)]
pub struct Module(CUmodule);
// SAFETY: a CUmodule is a driver object that any thread may use once loaded.
unsafe impl Send for Module {}
// SAFETY: as above; the pointer is only passed back to the driver.
unsafe impl Sync for Module {}

/// A kernel of a [`Module`].
#[derive(Clone, Copy, Debug)]
pub struct Function(CUfunction);
// SAFETY: as for `Module`.
unsafe impl Send for Function {}
// SAFETY: as above.
unsafe impl Sync for Function {}

impl Driver {
    /// Loads the PTX `image` into the current context (the driver compiles it for the device).
    pub fn load_module(&self, image: &CStr) -> Result<Module, DriverError> {
        let mut m = std::ptr::null_mut();
        // SAFETY: `m` is a valid out-pointer and `image` is NUL-terminated text.
        check("cuModuleLoadData", unsafe {
            (self.f.cuModuleLoadData)(&mut m, image.as_ptr().cast())
        })?;
        Ok(Module(m))
    }

    /// The kernel `name` of `module`.
    pub fn function(&self, module: &Module, name: &CStr) -> Result<Function, DriverError> {
        let mut f = std::ptr::null_mut();
        // SAFETY: `f` is a valid out-pointer, `module` is loaded and `name` NUL-terminated.
        check("cuModuleGetFunction", unsafe {
            (self.f.cuModuleGetFunction)(&mut f, module.0, name.as_ptr())
        })?;
        Ok(Function(f))
    }

    /// Queues `f` on `s` with `grid` blocks of `threads` threads, its parameters pointed to
    /// by `params` (one pointer per parameter, in order; the driver copies the values).
    ///
    /// # Safety
    /// `f` belongs to a module of the current context, `params` matches its parameters in
    /// number and types, and every memory the kernel reaches through them stays valid (device
    /// memory mapped, host memory registered) until it completes on `s`.
    pub unsafe fn launch(
        &self,
        f: Function,
        grid: u32,
        threads: u32,
        s: Stream,
        params: &mut [*mut c_void],
    ) -> Result<(), DriverError> {
        let _timer = self.calls.start(Call::Launch);
        // SAFETY: guaranteed by the caller.
        check("cuLaunchKernel", unsafe {
            (self.f.cuLaunchKernel)(
                f.0,
                grid,
                1,
                1,
                threads,
                1,
                1,
                0,
                s.0,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }

    /// The device attribute `attr` of device `ordinal`.
    pub fn attribute(&self, ordinal: i32, attr: i32) -> Result<i32, DriverError> {
        let mut v = 0;
        // SAFETY: `v` is a valid out-pointer; plain values otherwise.
        check("cuDeviceGetAttribute", unsafe {
            (self.f.cuDeviceGetAttribute)(&mut v, attr, ordinal)
        })?;
        Ok(v)
    }
}
