//! The driver-primitive layer: the only code of the core that calls the CUDA driver (above the
//! core, nccl-hook's wrappers call the driver's functions that NCCL looked up, as NCCL would).
//! This file: loading, errors, call accounting, contexts and the VMM calls; `streams.rs`:
//! streams, events, copies and pinned host memory; `kernels.rs`: modules and launches.
//!
//! # Contract
//!
//! * The driver library is opened at run time with `dlopen` (default `libcuda.so.1`, or the path
//!   in `MEMSAVER_CUDA_LIB`), so everything builds and runs on machines without CUDA. The fake
//!   driver in `tests/fake-cuda` is swapped in by pointing the loader at it: there is no
//!   test-only branch in the allocator.
//! * A missing library or symbol is a [`LoadError`] value, never a panic.
//! * Every call returns `Result<_, DriverError>`; a `DriverError` names the entry point and the
//!   driver's status code (`cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY`).
//! * Functions that take raw device or host addresses are `unsafe`: the caller guarantees the
//!   ranges are valid for the operation. Handles, streams and events are plain values; their
//!   owners (the allocator's tables) release them.
//! * Nothing here takes a lock or keeps state besides the immutable table of entry points and
//!   relaxed counters of the calls made and the time they took ([`Driver::calls`],
//!   [`Driver::call_time`]), so every function may be called from any thread at any time.
//!
//! Calls that need a current context (copies, streams, events, `cuMemGetInfo`) are made inside
//! [`Driver::with_context`].

mod kernels;
mod streams;
pub mod sys;

use std::ffi::{CStr, CString, c_int, c_void};
use std::fmt;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};

use sys::*;

pub use kernels::{Function, Module};
pub use streams::{Event, Stream};

/// A failed driver call: which entry point, and the status code it returned.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct DriverError {
    pub call: &'static str,
    pub code: CUresult,
}

impl DriverError {
    pub fn is_out_of_memory(&self) -> bool {
        self.code == CUDA_ERROR_OUT_OF_MEMORY
    }
}

/// The symbolic name of a status code, as `cuGetErrorName` would give it, without needing a
/// loaded driver (errors must be printable after the driver failed to load).
pub fn error_name(code: CUresult) -> &'static str {
    match code {
        CUDA_SUCCESS => "CUDA_SUCCESS",
        CUDA_ERROR_INVALID_VALUE => "CUDA_ERROR_INVALID_VALUE",
        CUDA_ERROR_OUT_OF_MEMORY => "CUDA_ERROR_OUT_OF_MEMORY",
        CUDA_ERROR_NOT_INITIALIZED => "CUDA_ERROR_NOT_INITIALIZED",
        CUDA_ERROR_NO_DEVICE => "CUDA_ERROR_NO_DEVICE",
        CUDA_ERROR_INVALID_DEVICE => "CUDA_ERROR_INVALID_DEVICE",
        CUDA_ERROR_INVALID_CONTEXT => "CUDA_ERROR_INVALID_CONTEXT",
        CUDA_ERROR_UNSUPPORTED_LIMIT => "CUDA_ERROR_UNSUPPORTED_LIMIT",
        CUDA_ERROR_ALREADY_MAPPED => "CUDA_ERROR_ALREADY_MAPPED",
        CUDA_ERROR_NOT_MAPPED => "CUDA_ERROR_NOT_MAPPED",
        CUDA_ERROR_INVALID_HANDLE => "CUDA_ERROR_INVALID_HANDLE",
        CUDA_ERROR_NOT_FOUND => "CUDA_ERROR_NOT_FOUND",
        CUDA_ERROR_NOT_READY => "CUDA_ERROR_NOT_READY",
        CUDA_ERROR_LAUNCH_FAILED => "CUDA_ERROR_LAUNCH_FAILED",
        CUDA_ERROR_NOT_PERMITTED => "CUDA_ERROR_NOT_PERMITTED",
        CUDA_ERROR_NOT_SUPPORTED => "CUDA_ERROR_NOT_SUPPORTED",
        CUDA_ERROR_UNKNOWN => "CUDA_ERROR_UNKNOWN",
        _ => "CUDA_ERROR (see cuda.h)",
    }
}

impl fmt::Display for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} ({})",
            self.call,
            error_name(self.code),
            self.code
        )
    }
}

impl fmt::Debug for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::error::Error for DriverError {}

/// The driver could not be opened or initialised.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    #[error(
        "cannot open the CUDA driver library '{path}': {reason}; install the NVIDIA driver, or set \
         MEMSAVER_CUDA_LIB to the path of libcuda.so.1 (or of the fake driver for tests)"
    )]
    Library { path: String, reason: String },
    #[error(
        "the CUDA driver '{path}' has no symbol '{symbol}'; memsaver needs a CUDA 12.0 or newer driver"
    )]
    Symbol { path: String, symbol: &'static str },
    #[error("cuInit failed: {0}; is a GPU visible to this process (CUDA_VISIBLE_DEVICES)?")]
    Init(DriverError),
}

fn check(call: &'static str, code: CUresult) -> Result<(), DriverError> {
    if code == CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DriverError { call, code })
    }
}

macro_rules! entry_points {
    ($($name:ident),* $(,)?) => {
        /// The resolved entry points, one field per C function, named as in `cuda.h`.
        #[allow(non_snake_case)]
        struct EntryPoints { $($name: fns::$name,)* }

        impl EntryPoints {
            /// # Safety
            /// `lib` must be a live handle returned by `dlopen`.
            unsafe fn resolve(lib: *mut c_void, path: &str) -> Result<Self, LoadError> {
                Ok(Self { $($name: {
                    let name = concat!(stringify!($name), "\0");
                    // SAFETY: `lib` is a live dlopen handle and `name` is NUL-terminated.
                    let p = unsafe { libc::dlsym(lib, name.as_ptr().cast()) };
                    if p.is_null() {
                        return Err(LoadError::Symbol { path: path.to_owned(), symbol: stringify!($name) });
                    }
                    // SAFETY: the symbol is the driver function of that name, whose C signature
                    // is the one `fns::$name` spells out (sys.rs mirrors cuda.h).
                    unsafe { std::mem::transmute::<*mut c_void, fns::$name>(p) }
                },)* })
            }
        }
    };
}

entry_points!(
    cuInit,
    cuDriverGetVersion,
    cuDeviceGetCount,
    cuDeviceGet,
    cuDevicePrimaryCtxRetain,
    cuCtxPushCurrent_v2,
    cuCtxPopCurrent_v2,
    cuCtxSynchronize,
    cuCtxGetDevice,
    cuCtxGetLimit,
    cuCtxSetLimit,
    cuDeviceGetAttribute,
    cuMemGetInfo_v2,
    cuMemGetAllocationGranularity,
    cuMemCreate,
    cuMemRelease,
    cuMemAddressReserve,
    cuMemAddressFree,
    cuMemMap,
    cuMemUnmap,
    cuMemSetAccess,
    cuMemGetAllocationPropertiesFromHandle,
    cuMemExportToShareableHandle,
    cuMemImportFromShareableHandle,
    cuStreamCreate,
    cuStreamSynchronize,
    cuStreamDestroy_v2,
    cuEventCreate,
    cuEventRecord,
    cuEventSynchronize,
    cuEventDestroy_v2,
    cuMemcpyDtoHAsync_v2,
    cuMemcpyHtoDAsync_v2,
    cuMemsetD8_v2,
    cuMemsetD8Async,
    cuMemHostAlloc,
    cuMemFreeHost,
    cuMemHostRegister_v2,
    cuMemHostUnregister,
    cuThreadExchangeStreamCaptureMode,
    cuModuleLoadData,
    cuModuleGetFunction,
    cuLaunchKernel,
);

/// The kinds of driver call [`Driver::calls`] counts: the VMM calls whose number decides what a
/// pause or resume costs (each one's cost is per call, not per byte), the copies, and the
/// calls that pin host memory (slow, and they hold up every other driver call of the process
/// while they run: see `pinned.rs`). Named as the fake driver's counts are.
pub const CALL_KINDS: [&str; 16] = [
    "create",
    "map",
    "set_access",
    "unmap",
    "release",
    "export",
    "import",
    "copy",
    "reserve",
    "address_free",
    "host_alloc",
    "host_free",
    "host_register",
    "host_unregister",
    "memset",
    "launch",
];

#[derive(Clone, Copy)]
enum Call {
    Create,
    Map,
    SetAccess,
    Unmap,
    Release,
    Export,
    Import,
    Copy,
    Reserve,
    AddressFree,
    HostAlloc,
    HostFree,
    HostRegister,
    HostUnregister,
    Memset,
    Launch,
}

/// The kinds of call [`Driver::call_time`] times: those of [`CALL_KINDS`], then the waits for
/// the device (`cuCtxSynchronize`, `cuStreamSynchronize`, `cuEventSynchronize`) and the
/// changes of a context's limits (`cuCtxSetLimit`, which waits for the device too).
pub const TIMED_KINDS: [&str; CALL_KINDS.len() + 2] = {
    let mut out = [""; CALL_KINDS.len() + 2];
    let mut i = 0;
    while i < CALL_KINDS.len() {
        out[i] = CALL_KINDS[i];
        i += 1;
    }
    out[i] = "wait";
    out[i + 1] = "set_limit";
    out
};

/// The timed calls that [`CALL_KINDS`] does not count, by their place in [`TIMED_KINDS`].
const WAIT: usize = CALL_KINDS.len();
const SET_LIMIT: usize = CALL_KINDS.len() + 1;

/// How many calls of each kind of [`CALL_KINDS`] this driver has made, failed ones included,
/// and the nanoseconds spent in each kind of [`TIMED_KINDS`].
#[derive(Default)]
struct CallCounts {
    calls: [AtomicU64; CALL_KINDS.len()],
    nanos: [AtomicU64; TIMED_KINDS.len()],
}

impl CallCounts {
    /// Counts a call of kind `c` and times it until the guard returned is dropped.
    fn start(&self, c: Call) -> Timer<'_> {
        self.calls[c as usize].fetch_add(1, Ordering::Relaxed);
        self.time(c as usize)
    }

    /// Times a call of [`TIMED_KINDS`] `i` until the guard returned is dropped.
    fn time(&self, i: usize) -> Timer<'_> {
        Timer {
            into: &self.nanos[i],
            since: std::time::Instant::now(),
        }
    }
}

/// Adds the time from its making to its drop to one kind's total.
struct Timer<'a> {
    into: &'a AtomicU64,
    since: std::time::Instant,
}

impl Drop for Timer<'_> {
    fn drop(&mut self) {
        let ns = u64::try_from(self.since.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.into.fetch_add(ns, Ordering::Relaxed);
    }
}

/// The time spent in each kind of [`TIMED_KINDS`] between two readings of
/// [`Driver::call_time`], the kinds that took 10 µs or more, longest first:
/// `unmap 3.10 ms, wait 1.20 ms`.
pub fn time_spent(before: &[u64; TIMED_KINDS.len()], after: &[u64; TIMED_KINDS.len()]) -> String {
    let mut spent: Vec<(u64, &str)> = TIMED_KINDS
        .iter()
        .enumerate()
        .map(|(i, k)| (after[i].saturating_sub(before[i]), *k))
        .filter(|(ns, _)| *ns >= 10_000)
        .collect();
    spent.sort_by_key(|s| std::cmp::Reverse(s.0));
    let parts: Vec<String> = spent
        .iter()
        .map(|(ns, k)| format!("{k} {:.2} ms", *ns as f64 / 1e6))
        .collect();
    parts.join(", ")
}

/// A physical allocation handle (`CUmemGenericAllocationHandle`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Handle(pub CUmemGenericAllocationHandle);

/// A primary context, retained for the life of the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Context(CUcontext);
// SAFETY: a CUcontext is a process-wide driver object; the driver allows any thread to make it
// current.
unsafe impl Send for Context {}
// SAFETY: as above; the pointer is only passed back to the driver.
unsafe impl Sync for Context {}

/// The opened CUDA driver.
pub struct Driver {
    path: String,
    /// Kept only to show the library is never closed: memory mapped through it outlives any
    /// value, and unloading libcuda while the process has contexts is never safe.
    #[allow(dead_code)]
    lib: *mut c_void,
    f: EntryPoints,
    version: c_int,
    calls: CallCounts,
}

// SAFETY: `lib` is only used to keep the library loaded; the entry points are plain function
// pointers into a thread-safe C library.
unsafe impl Send for Driver {}
// SAFETY: as above; `Driver` holds no interior mutability.
unsafe impl Sync for Driver {}

impl fmt::Debug for Driver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Driver")
            .field("path", &self.path)
            .field("version", &self.version)
            .finish()
    }
}

impl Driver {
    /// Opens the driver library at `path` (a file name searched the usual way, or a path),
    /// resolves every entry point memsaver uses and calls `cuInit(0)`.
    pub fn load(path: &str) -> Result<Self, LoadError> {
        let c_path = CString::new(path).map_err(|_| LoadError::Library {
            path: path.to_owned(),
            reason: "the path contains a NUL byte".into(),
        })?;
        // SAFETY: `c_path` is NUL-terminated. RTLD_LOCAL keeps the driver's symbols out of the
        // global namespace, so a preloaded interposer of ours never sees them by accident.
        let lib = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if lib.is_null() {
            return Err(LoadError::Library {
                path: path.to_owned(),
                reason: dlerror_string(),
            });
        }
        // SAFETY: `lib` is the live handle just returned.
        let f = unsafe { EntryPoints::resolve(lib, path) }?;
        // SAFETY: cuInit takes no pointers.
        check("cuInit", unsafe { (f.cuInit)(0) }).map_err(LoadError::Init)?;
        let mut version = 0;
        // SAFETY: `version` is a valid out-pointer.
        check("cuDriverGetVersion", unsafe {
            (f.cuDriverGetVersion)(&mut version)
        })
        .map_err(LoadError::Init)?;
        Ok(Self {
            path: path.to_owned(),
            lib,
            f,
            version,
            calls: CallCounts::default(),
        })
    }

    /// How many calls of each kind in [`CALL_KINDS`] this process has made through memsaver's
    /// driver layer so far (memsaver's own calls and those it makes for NCCL), in that order.
    /// A figure that does not depend on the machine: the difference across a pause is what the
    /// pause asked of the driver.
    pub fn calls(&self) -> [u64; CALL_KINDS.len()] {
        std::array::from_fn(|i| self.calls.calls[i].load(Ordering::Relaxed))
    }

    /// Nanoseconds this process has spent in each kind of [`TIMED_KINDS`] call through
    /// memsaver's driver layer so far, in that order: the difference across a pause says
    /// which driver calls its time went to ([`time_spent`]).
    pub fn call_time(&self) -> [u64; TIMED_KINDS.len()] {
        std::array::from_fn(|i| self.calls.nanos[i].load(Ordering::Relaxed))
    }

    /// The path the driver was opened from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The driver's CUDA version, e.g. 12080 for 12.8.
    pub fn version(&self) -> i32 {
        self.version
    }

    pub fn device_count(&self) -> Result<i32, DriverError> {
        let mut n = 0;
        // SAFETY: `n` is a valid out-pointer.
        check("cuDeviceGetCount", unsafe {
            (self.f.cuDeviceGetCount)(&mut n)
        })?;
        Ok(n)
    }

    /// Retains the primary context of device `ordinal`. The retain is never released: the
    /// context lives as long as the process, like the CUDA runtime's.
    pub fn primary_context(&self, ordinal: i32) -> Result<Context, DriverError> {
        let mut dev: CUdevice = 0;
        // SAFETY: `dev` is a valid out-pointer.
        check("cuDeviceGet", unsafe {
            (self.f.cuDeviceGet)(&mut dev, ordinal)
        })?;
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer.
        check("cuDevicePrimaryCtxRetain", unsafe {
            (self.f.cuDevicePrimaryCtxRetain)(&mut ctx, dev)
        })?;
        Ok(Context(ctx))
    }

    /// Runs `f` with `ctx` current on this thread, restoring the caller's context afterwards.
    pub fn with_context<T>(
        &self,
        ctx: Context,
        f: impl FnOnce() -> Result<T, DriverError>,
    ) -> Result<T, DriverError> {
        // SAFETY: `ctx` is a retained primary context.
        check("cuCtxPushCurrent", unsafe {
            (self.f.cuCtxPushCurrent_v2)(ctx.0)
        })?;
        let out = f();
        let mut popped: CUcontext = std::ptr::null_mut();
        // SAFETY: `popped` is a valid out-pointer; we pushed exactly one context above.
        let pop = check("cuCtxPopCurrent", unsafe {
            (self.f.cuCtxPopCurrent_v2)(&mut popped)
        });
        let out = out?;
        pop?;
        Ok(out)
    }

    /// The device of the calling thread's current context, or `None` without one.
    pub fn current_device(&self) -> Option<i32> {
        let mut dev: CUdevice = 0;
        // SAFETY: `dev` is a valid out-pointer.
        let r = unsafe { (self.f.cuCtxGetDevice)(&mut dev) };
        (r == CUDA_SUCCESS).then_some(dev)
    }

    /// The current context's per-thread stack size (`CU_LIMIT_STACK_SIZE`), in bytes.
    pub fn stack_size(&self) -> Result<usize, DriverError> {
        let mut v = 0;
        // SAFETY: `v` is a valid out-pointer.
        check("cuCtxGetLimit", unsafe {
            (self.f.cuCtxGetLimit)(&mut v, CU_LIMIT_STACK_SIZE)
        })?;
        Ok(v)
    }

    /// Sets the current context's per-thread stack size; the driver resizes the context's
    /// local memory to match (and grows it again when a kernel needs more).
    pub fn set_stack_size(&self, bytes: usize) -> Result<(), DriverError> {
        let _timer = self.calls.time(SET_LIMIT);
        // SAFETY: plain values.
        check("cuCtxSetLimit", unsafe {
            (self.f.cuCtxSetLimit)(CU_LIMIT_STACK_SIZE, bytes)
        })
    }

    /// Bytes of local memory each byte of per-thread stack limit reserves on device `ordinal`:
    /// one stack per thread that can be resident (multiprocessors x threads per
    /// multiprocessor; 132 x 2048 on an H200).
    pub fn stack_bytes_per_thread_byte(&self, ordinal: i32) -> Result<u64, DriverError> {
        let attribute = |attr| Ok::<_, DriverError>(self.attribute(ordinal, attr)?.max(0) as u64);
        Ok(attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            * attribute(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR)?)
    }

    /// Waits until all work queued in the current context has finished.
    pub fn synchronize(&self) -> Result<(), DriverError> {
        let _timer = self.calls.time(WAIT);
        // SAFETY: no arguments.
        check("cuCtxSynchronize", unsafe { (self.f.cuCtxSynchronize)() })
    }

    /// (free, total) bytes of the current context's device.
    pub fn mem_info(&self) -> Result<(usize, usize), DriverError> {
        let (mut free, mut total) = (0, 0);
        // SAFETY: both are valid out-pointers.
        check("cuMemGetInfo", unsafe {
            (self.f.cuMemGetInfo_v2)(&mut free, &mut total)
        })?;
        Ok((free, total))
    }

    fn device_prop(ordinal: i32, exportable: bool) -> CUmemAllocationProp {
        CUmemAllocationProp {
            type_: CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes: if exportable {
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            } else {
                CU_MEM_HANDLE_TYPE_NONE
            },
            location: CUmemLocation {
                type_: CU_MEM_LOCATION_TYPE_DEVICE,
                id: ordinal,
            },
            ..Default::default()
        }
    }

    /// The VMM granularity of device memory on `ordinal` (2 MiB on Hopper).
    pub fn granularity(&self, ordinal: i32) -> Result<usize, DriverError> {
        let prop = Self::device_prop(ordinal, false);
        let mut g = 0;
        // SAFETY: `g` and `prop` are valid for the call.
        check("cuMemGetAllocationGranularity", unsafe {
            (self.f.cuMemGetAllocationGranularity)(&mut g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        })?;
        Ok(g)
    }

    /// Creates `size` bytes of physical memory on device `ordinal`; `exportable` asks for a
    /// POSIX-fd shareable handle type.
    pub fn create(
        &self,
        ordinal: i32,
        size: usize,
        exportable: bool,
    ) -> Result<Handle, DriverError> {
        self.create_with(&Self::device_prop(ordinal, exportable), size)
    }

    /// Creates `size` bytes of physical memory as `prop` describes (a property set recorded
    /// from another caller's `cuMemCreate`).
    pub fn create_with(
        &self,
        prop: &CUmemAllocationProp,
        size: usize,
    ) -> Result<Handle, DriverError> {
        let mut h = 0;
        let _timer = self.calls.start(Call::Create);
        // SAFETY: `h` and `prop` are valid for the call.
        check("cuMemCreate", unsafe {
            (self.f.cuMemCreate)(&mut h, size, prop, 0)
        })?;
        Ok(Handle(h))
    }

    pub fn release(&self, h: Handle) -> Result<(), DriverError> {
        let _timer = self.calls.start(Call::Release);
        // SAFETY: no pointers involved; an invalid handle is reported by the driver.
        check("cuMemRelease", unsafe { (self.f.cuMemRelease)(h.0) })
    }

    /// Reserves `size` bytes of virtual address space aligned to `align`, at `hint` if that
    /// range is free (0: anywhere; the driver may place it elsewhere).
    pub fn reserve(
        &self,
        size: usize,
        align: usize,
        hint: CUdeviceptr,
    ) -> Result<CUdeviceptr, DriverError> {
        let mut p = 0;
        let _timer = self.calls.start(Call::Reserve);
        // SAFETY: `p` is a valid out-pointer.
        check("cuMemAddressReserve", unsafe {
            (self.f.cuMemAddressReserve)(&mut p, size, align, hint, 0)
        })?;
        Ok(p)
    }

    /// # Safety
    /// 1. `[ptr, ptr+size)` is a range returned by [`Driver::reserve`] with nothing mapped in it.
    /// 2. No one uses addresses in it afterwards.
    pub unsafe fn address_free(&self, ptr: CUdeviceptr, size: usize) -> Result<(), DriverError> {
        let _timer = self.calls.start(Call::AddressFree);
        // SAFETY: guaranteed by the caller.
        check("cuMemAddressFree", unsafe {
            (self.f.cuMemAddressFree)(ptr, size)
        })
    }

    /// Maps `h` at `ptr` and grants device `ordinal` read-write access.
    ///
    /// # Safety
    /// `[ptr, ptr+size)` lies in a reserved range and is not mapped.
    pub unsafe fn map(
        &self,
        ptr: CUdeviceptr,
        size: usize,
        h: Handle,
        ordinal: i32,
    ) -> Result<(), DriverError> {
        let desc = CUmemAccessDesc {
            location: CUmemLocation {
                type_: CU_MEM_LOCATION_TYPE_DEVICE,
                id: ordinal,
            },
            flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: forwarded contract.
        unsafe { self.map_with_access(ptr, size, h, &[desc]) }
    }

    /// Maps `h` at `ptr` and applies `access` (as recorded from another caller's
    /// `cuMemSetAccess`). On failure nothing stays mapped.
    ///
    /// # Safety
    /// `[ptr, ptr+size)` lies in a reserved range and is not mapped.
    pub unsafe fn map_with_access(
        &self,
        ptr: CUdeviceptr,
        size: usize,
        h: Handle,
        access: &[CUmemAccessDesc],
    ) -> Result<(), DriverError> {
        {
            let _timer = self.calls.start(Call::Map);
            // SAFETY: guaranteed by the caller.
            check("cuMemMap", unsafe {
                (self.f.cuMemMap)(ptr, size, 0, h.0, 0)
            })?;
        }
        if access.is_empty() {
            return Ok(());
        }
        let r = {
            let _timer = self.calls.start(Call::SetAccess);
            // SAFETY: the range was just mapped; `access` is valid for the call.
            check("cuMemSetAccess", unsafe {
                (self.f.cuMemSetAccess)(ptr, size, access.as_ptr(), access.len())
            })
        };
        if r.is_err() {
            let _timer = self.calls.start(Call::Unmap);
            // SAFETY: we mapped this range above and nobody has seen it yet.
            let _ = unsafe { (self.f.cuMemUnmap)(ptr, size) };
        }
        r
    }

    /// # Safety
    /// 1. `[ptr, ptr+size)` is mapped.
    /// 2. No work queued on the device still reads or writes it.
    pub unsafe fn unmap(&self, ptr: CUdeviceptr, size: usize) -> Result<(), DriverError> {
        let _timer = self.calls.start(Call::Unmap);
        // SAFETY: guaranteed by the caller.
        check("cuMemUnmap", unsafe { (self.f.cuMemUnmap)(ptr, size) })
    }

    /// Exports `h` as a new POSIX file descriptor, owned by the caller.
    pub fn export_fd(&self, h: Handle) -> Result<OwnedFd, DriverError> {
        let mut fd: c_int = -1;
        let _timer = self.calls.start(Call::Export);
        // SAFETY: for POSIX fds the driver writes one `int` to the out-pointer.
        check("cuMemExportToShareableHandle", unsafe {
            (self.f.cuMemExportToShareableHandle)(
                (&mut fd as *mut c_int).cast(),
                h.0,
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        // SAFETY: the driver just opened `fd` for us and nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Imports a POSIX fd exported by [`Driver::export_fd`] (in any process). The caller keeps
    /// ownership of `fd`.
    pub fn import_fd(&self, fd: RawFd) -> Result<Handle, DriverError> {
        let mut h = 0;
        let _timer = self.calls.start(Call::Import);
        // SAFETY: for POSIX fds the driver reads the fd from the pointer value itself.
        check("cuMemImportFromShareableHandle", unsafe {
            (self.f.cuMemImportFromShareableHandle)(
                &mut h,
                fd as isize as *mut c_void,
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        Ok(Handle(h))
    }

    /// The properties `h` was created with (for an imported handle: as the driver knows them,
    /// its location included).
    pub fn properties(&self, h: Handle) -> Result<CUmemAllocationProp, DriverError> {
        let mut prop = CUmemAllocationProp::default();
        // SAFETY: `prop` is a valid out-pointer; the driver validates the handle.
        check("cuMemGetAllocationPropertiesFromHandle", unsafe {
            (self.f.cuMemGetAllocationPropertiesFromHandle)(&mut prop, h.0)
        })?;
        Ok(prop)
    }
}

fn dlerror_string() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string owned by libc.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: non-null and NUL-terminated, per dlerror's contract.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_spent_names_the_kinds_that_took_10_us_or_more_longest_first() {
        let before = [0; TIMED_KINDS.len()];
        let mut after = before;
        after[Call::Unmap as usize] = 3_100_000;
        after[WAIT] = 12_500_000;
        after[Call::Map as usize] = 9_999;
        after[SET_LIMIT] = 10_000;
        assert_eq!(
            time_spent(&before, &after),
            "wait 12.50 ms, unmap 3.10 ms, set_limit 0.01 ms"
        );
        assert_eq!(time_spent(&after, &after), "");
        assert_eq!(&TIMED_KINDS[..CALL_KINDS.len()], &CALL_KINDS[..]);
        assert_eq!(TIMED_KINDS[WAIT], "wait");
    }
}
