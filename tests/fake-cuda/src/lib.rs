//! A fake CUDA driver: a `libcuda.so.1` stand-in that keeps "device memory" in host memory, for
//! tests on machines without a GPU. It implements the driver API subset memsaver uses (VMM,
//! contexts, streams, events, copies), from the very C types of
//! `memsaver_allocator::driver::sys`, so it is swapped in by the loader and the code under test
//! cannot tell.
//!
//! # Knobs (environment variables, read once, at the first call that needs them)
//!
//! | variable                   | default                                 | effect |
//! | -------------------------- | --------------------------------------- | ------ |
//! | `FAKE_CUDA_DEVICES`        | `2`                                     | number of devices (0 makes `cuInit` fail with `CUDA_ERROR_NO_DEVICE`) |
//! | `FAKE_CUDA_MEM_BYTES`      | `8GiB`                                  | memory per device: bytes, or `512MiB`, `8GiB`, `1500MB`, ... |
//! | `FAKE_CUDA_DIR`            | `/dev/shm/fake-cuda-<uid>` (else tmp)   | shared state: processes with the same directory share devices |
//! | `FAKE_CUDA_FAIL_CREATE_AT` | unset                                   | the Nth `cuMemCreate` of the process fails with `CUDA_ERROR_OUT_OF_MEMORY`, once |
//! | `FAKE_CUDA_FAIL_MAP_AT`    | unset                                   | the Nth `cuMemMap` of the process fails with `CUDA_ERROR_UNKNOWN`, once       |
//! | `FAKE_CUDA_PIN_MS_PER_GIB` | `100`                                   | how long a pinning call holds the driver lock, per GiB pinned |
//!
//! Run-time controls, exported as C functions: `fakecuda_fail_create_at(n)` and
//! `fakecuda_fail_map_at(n)`, `fakecuda_fail_unmap_at(n)`, `fakecuda_fail_reserve_at(n)` (the
//! nth call from now fails; 0
//! disarms; replaces the knob), `fakecuda_fail_registers_over(bytes)` (a `cuMemHostRegister`
//! that would take the bytes registered over `bytes` fails with `CUDA_ERROR_OUT_OF_MEMORY`),
//! `fakecuda_reset_faults()`, and `fakecuda_live_handles()` (handle values of this process not
//! yet released). `fakecuda_launch_kernel_needing_stack(bytes)` stands for a kernel launch whose
//! kernel needs `bytes` of stack per thread (the limit grows if below, as the driver grows it;
//! `tests/fake-nccl` calls it for collectives with 2+ ranks, like NCCL's kernels), and
//! `fakecuda_instantiate_unseen(exec, graph)` for a graph instantiation that no wrapper saw.
//!
//! Call counts, per process: `fakecuda_call_counts(out: *mut u64, n: usize) -> usize` writes
//! the first `min(n, 16)` counts to `out` and returns 16, `fakecuda_reset_call_counts()` sets
//! them to 0. Every call entered is counted (failed ones too), with one relaxed atomic add. The
//! order is fixed:
//!
//! | index | kind           | calls counted |
//! | ----- | -------------- | ------------- |
//! | 0     | `create`       | `cuMemCreate` |
//! | 1     | `map`          | `cuMemMap` |
//! | 2     | `set_access`   | `cuMemSetAccess` |
//! | 3     | `unmap`        | `cuMemUnmap` |
//! | 4     | `release`      | `cuMemRelease` |
//! | 5     | `export`       | `cuMemExportToShareableHandle` |
//! | 6     | `import`       | `cuMemImportFromShareableHandle` |
//! | 7     | `copy`         | `cuMemcpyDtoH`, `cuMemcpyHtoD` and their `Async` forms (`_v2` or not) |
//! | 8     | `reserve`      | `cuMemAddressReserve` |
//! | 9     | `address_free` | `cuMemAddressFree` |
//! | 10    | `host_alloc`   | `cuMemHostAlloc` |
//! | 11    | `host_free`    | `cuMemFreeHost` |
//! | 12    | `host_register`   | `cuMemHostRegister_v2` |
//! | 13    | `host_unregister` | `cuMemHostUnregister` |
//! | 14    | `memset`       | `cuMemsetD8` (`_v2` or not) and `cuMemsetD8Async` |
//! | 15    | `launch`       | `cuLaunchKernel` |
//!
//! Kernels (`kernels.rs`): `cuModuleLoadData` of PTX and launches of memsaver's packing kernels,
//! run on the host; `fakecuda_transfer_stats(out, n)` gives the bytes copied each way and the
//! bytes those kernels moved.
//!
//! Pinning, per process (`pinning.rs`): every entry point takes the driver lock shared and a
//! pinning call (`cuMemHostAlloc`, `cuMemHostRegister_v2`) takes it exclusive for
//! `FAKE_CUDA_PIN_MS_PER_GIB` per GiB, as the real driver holds up other threads' calls while
//! it pins; `fakecuda_pin_stats(out, n)` gives the pinning calls, the largest, the calls that
//! waited behind one and the largest one waited behind; `fakecuda_reset_pin_stats()`. A copy
//! whose host side crosses registrations fails with `CUDA_ERROR_INVALID_VALUE`, as measured.
//! `fakecuda_hold_pinning(mode, ms)` holds pinning calls so a test can order the application's
//! calls against them without timing: at their entry, holding nothing (mode 1; with
//! `fakecuda_wait_pinning_held(n, ms)`), or holding the lock until another thread's call waits
//! behind them (mode 2); 0 lets them go, and so does the deadline `ms`, counted in
//! `fakecuda_pin_hold_stats(out, n)` (calls held at their entry now, calls the deadline let
//! go); `fakecuda_pass_pinning(n)` lets `n` held calls go while the hold stays. Copies are
//! counted by their host side, registered or pageable, with the registrations live now
//! (`fakecuda_host_copy_stats(out, n)`). `fakecuda_hold_map(ms)` holds every `cuMemMap` at its entry (holding nothing) for at
//! most `ms` (0 lets them go), and `fakecuda_wait_map_held(n, ms)` waits until `n` are held, so
//! a test can run a pause while another thread's allocation is being mapped.
//! `fakecuda_global_capture(on)` stands for another thread capturing a stream in global mode:
//! meanwhile pinning calls from threads not in relaxed capture mode
//! (`cuThreadExchangeStreamCaptureMode`) fail with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and
//! invalidate the capture, counted by `fakecuda_captures_invalidated()` (`capture.rs`).
//!
//! # Faithful
//!
//! * Memory accounting across processes: a physical allocation counts against its device while
//!   any handle, mapping or exported fd in any process refers to it, and a process that dies
//!   (even by `SIGKILL`) lets go of its share. `physical.rs` says how.
//! * Export/import of real file descriptors (a new fd per export, passable with `SCM_RIGHTS`;
//!   import `dup`s, so the caller closes its fd), and shared contents between processes.
//! * VMM rules: 2 MiB granularity (misaligned sizes and addresses are `CUDA_ERROR_INVALID_VALUE`),
//!   mapping only inside reservations (anywhere in one, or across ones that follow each other
//!   without a gap; a hint right after a reservation is honoured) and never over a mapping
//!   (`CUDA_ERROR_ALREADY_MAPPED`), whole allocations only (a nonzero offset or a smaller size is
//!   `CUDA_ERROR_NOT_SUPPORTED`, as measured on an H100 whatever the documentation says), one
//!   `cuMemUnmap` or `cuMemSetAccess` over several adjacent mappings but never part of one
//!   (`CUDA_ERROR_INVALID_VALUE`); `tests/vmm_rules.rs` checks these here and
//!   `tests/gpu/vmm_rules.py` on a GPU. The virtual range stays reserved
//!   after `cuMemUnmap`, access only after `cuMemSetAccess`, release while mapped keeps memory
//!   alive until unmapped, `cuMemRetainAllocationHandle` returns the mapping's handle value with
//!   one more reference (NCCL then releases it twice), and fails with `CUDA_ERROR_INVALID_VALUE`
//!   on an unmapped address, as `cuMemGetAddressRange` fails with `CUDA_ERROR_NOT_FOUND`.
//! * `cuGetProcAddress(_v2)` resolves base names to the `_v2` variants by CUDA version, and
//!   `cuGraphInstantiate` to `cuGraphInstantiateWithFlags` from CUDA 12.0 on
//!   (`cuGraphInstantiate_v2`, five arguments, below).
//! * The stack limit and CUDA graphs (`graphs.rs`): the per-thread stack limit
//!   (`CU_LIMIT_STACK_SIZE`, default 1024) is per process and device; an executable graph
//!   remembers the limit in force when it was instantiated, and `cuGraphLaunch` below that
//!   limit fails with `CUDA_ERROR_LAUNCH_FAILED` (719) and loses the device's context: from
//!   then on `cuGraphLaunch`, `cuCtxSynchronize`, `cuStreamSynchronize`, `cuMemCreate`,
//!   `cuMemMap`, `cuCtxSetLimit` and the copies return 719 in it, as measured on H100/H200.
//!   `cuDeviceGetAttribute` gives an H200's 132 multiprocessors and 2048 threads per
//!   multiprocessor (the local memory a stack limit reserves is limit x 132 x 2048).
//!
//! # Simplified
//!
//! * Everything is synchronous: async copies and launches complete before they return; streams
//!   and events are validated tokens. The only kernels are memsaver's own (`kernels.rs`):
//!   graphs are empty, and a kernel's need for stack is the test control above. A kernel's
//!   fault is reported by its launch.
//! * A lost context is checked for the calling thread's current context (and the graph's own
//!   device at launch), not for whatever context a stream or handle belongs to.
//! * One memory for all devices: access flags for any device apply to the whole process.
//! * A copy or memset touching memory that is not mapped with the needed access fails with
//!   `CUDA_ERROR_INVALID_VALUE` instead of a sticky `CUDA_ERROR_ILLEGAL_ADDRESS`.
//! * The legacy (non-`_v2`) names that real libcuda still exports with 32-bit types
//!   (`cuMemGetInfo`, `cuMemsetD8`, `cuMemGetAddressRange`, `cuMemcpy{DtoH,HtoD}Async`) are
//!   aliases of the `_v2` functions here.
//! * `cuMemAddressFree` of a range that still has mappings drops them instead of failing.
//! * `cuMemGetInfo` without a current context reports device 0.
//! * Only POSIX-fd handles: fabric and Win32 handle types are `CUDA_ERROR_NOT_SUPPORTED`.
//! * Memory is host memory (sparse tmpfs files): tests should allocate MiBs, not GiBs, unless
//!   the machine has the RAM.
//! * All fds the fake opens or exports are close-on-exec. A child that `fork`s without `exec`
//!   inherits them (and the mappings), so it keeps the memory alive until it exits; the real
//!   driver does not support using CUDA across `fork` at all.
//! * A handle keeps its fd until its last reference is released *and* its last mapping in the
//!   process is gone (the real driver frees at the same moment, so the accounting agrees).

use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};

use counts::Call;
use memsaver_allocator::driver::sys::fns;
use memsaver_allocator::driver::sys::{
    CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
    CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    CU_EVENT_DISABLE_TIMING, CU_LIMIT_STACK_SIZE, CU_STREAM_NON_BLOCKING,
    CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_FOUND, CUDA_ERROR_UNKNOWN,
    CUDA_ERROR_UNSUPPORTED_LIMIT, CUDA_GRAPH_INSTANTIATE_PARAMS, CUDA_SUCCESS, CUcontext, CUdevice,
    CUdeviceptr, CUevent, CUfunction, CUgraph, CUgraphExec, CUgraphNode, CUmemAccessDesc,
    CUmemAllocationProp, CUmemGenericAllocationHandle, CUmodule, CUresult, CUstream,
};

mod capture;
mod config;
mod context;
mod counts;
mod errors;
mod faults;
mod gate;
mod graphs;
mod kernels;
mod physical;
mod pinning;
mod procaddr;
mod state;

/// What `cuDriverGetVersion` reports: CUDA 12.8.
const DRIVER_VERSION: c_int = 12080;

/// `CUdriverProcAddressQueryResult`.
const CU_GET_PROC_ADDRESS_SUCCESS: c_int = 0;
const CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND: c_int = 1;

/// `cuEventCreate` flags: `BLOCKING_SYNC | DISABLE_TIMING | INTERPROCESS`.
const EVENT_FLAGS: c_uint = 1 | CU_EVENT_DISABLE_TIMING | 4;

/// The entry points that pin host memory: they take the driver lock exclusive themselves
/// (`pinning`), where every other one takes it shared in [`guard`].
const PINNING_CALLS: [&str; 2] = ["cuMemHostAlloc", "cuMemHostRegister_v2"];

/// Runs the body of the export `name` under the driver lock; a panic becomes
/// `CUDA_ERROR_UNKNOWN` instead of unwinding into C.
fn guard(name: &str, body: impl FnOnce() -> Result<(), CUresult>) -> CUresult {
    let _shared = (!PINNING_CALLS.contains(&name)).then(pinning::shared);
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
}

/// A status code as a `Result`.
fn check(code: CUresult) -> Result<(), CUresult> {
    if code == CUDA_SUCCESS {
        Ok(())
    } else {
        Err(code)
    }
}

/// Rejects a null pointer argument with `CUDA_ERROR_INVALID_VALUE`.
fn non_null<T>(p: *mut T) -> Result<*mut T, CUresult> {
    if p.is_null() {
        Err(CUDA_ERROR_INVALID_VALUE)
    } else {
        Ok(p)
    }
}

/// Reads an input struct; null is `CUDA_ERROR_INVALID_VALUE`.
///
/// # Safety
///
/// `p` must be null or valid for one read of `T`.
unsafe fn read_in<T: Copy>(p: *const T) -> Result<T, CUresult> {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null, and valid for reads per this function's contract.
    Ok(unsafe { p.read() })
}

/// Defines the CUDA entry points. Each body returns `Result<(), CUresult>` and runs under
/// [`guard`]. Also generates [`exported`], the name table `cuGetProcAddress` answers from.
macro_rules! cuda_exports {
    ($(
        $(#[doc = $doc:literal])*
        fn $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) $body:block
    )*) => {
        $(
            $(#[doc = $doc])*
            ///
            /// # Safety
            ///
            /// Pointer arguments must be null or valid for the reads and writes that the CUDA
            /// driver API documents for this function.
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
                guard(stringify!($name), move || $body)
            }
        )*

        /// This library's CUDA entry point called `name`.
        fn exported(name: &str) -> Option<*mut c_void> {
            match name {
                $( stringify!($name) => Some($name as *mut c_void), )*
                _ => None,
            }
        }
    };
}

cuda_exports! {
    /// Reads the knobs and prepares the shared state directory.
    fn cuInit(flags: c_uint) {
        context::init(flags)
    }

    /// Reports CUDA 12.8.
    fn cuDriverGetVersion(version: *mut c_int) {
        let out = non_null(version)?;
        // SAFETY: non-null; the caller passes a valid out-pointer.
        unsafe { out.write(DRIVER_VERSION) };
        Ok(())
    }

    /// Name of an error code; unknown codes give null and `CUDA_ERROR_INVALID_VALUE`.
    fn cuGetErrorName(e: CUresult, s: *mut *const c_char) {
        let out = non_null(s)?;
        let name = errors::name(e);
        // SAFETY: non-null; the caller passes a valid out-pointer. The string is static.
        unsafe { out.write(name.map_or(std::ptr::null(), CStr::as_ptr)) };
        name.map(drop).ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    /// Message of an error code; unknown codes give null and `CUDA_ERROR_INVALID_VALUE`.
    fn cuGetErrorString(e: CUresult, s: *mut *const c_char) {
        let out = non_null(s)?;
        let message = errors::message(e);
        // SAFETY: non-null; the caller passes a valid out-pointer. The string is static.
        unsafe { out.write(message.map_or(std::ptr::null(), CStr::as_ptr)) };
        message.map(drop).ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    /// `FAKE_CUDA_DEVICES`.
    fn cuDeviceGetCount(count: *mut c_int) {
        let out = non_null(count)?;
        let cfg = context::initialised()?;
        // SAFETY: non-null; the caller passes a valid out-pointer.
        unsafe { out.write(cfg.devices) };
        Ok(())
    }

    /// The device of an ordinal (they are the same number).
    fn cuDeviceGet(dev: *mut CUdevice, ordinal: c_int) {
        let out = non_null(dev)?;
        let d = context::device(context::initialised()?, ordinal)?;
        // SAFETY: non-null; the caller passes a valid out-pointer.
        unsafe { out.write(d) };
        Ok(())
    }

    /// The device's primary context (one opaque token per device).
    fn cuDevicePrimaryCtxRetain(ctx: *mut CUcontext, dev: CUdevice) {
        let out = non_null(ctx)?;
        let d = context::device(context::initialised()?, dev)?;
        // SAFETY: non-null; the caller passes a valid out-pointer.
        unsafe { out.write(context::primary_context(d)) };
        Ok(())
    }

    /// Validates the device; primary contexts are never destroyed.
    fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) {
        context::device(context::initialised()?, dev).map(drop)
    }

    /// Pushes a context on the calling thread's stack.
    fn cuCtxPushCurrent_v2(ctx: CUcontext) {
        let dev = context::context_device(context::initialised()?, ctx)?;
        context::push_current(dev);
        Ok(())
    }

    /// Pops the calling thread's current context (`ctx` may be null).
    fn cuCtxPopCurrent_v2(ctx: *mut CUcontext) {
        context::initialised()?;
        let dev = context::pop_current()?;
        if !ctx.is_null() {
            // SAFETY: non-null; the caller passes a valid out-pointer.
            unsafe { ctx.write(context::primary_context(dev)) };
        }
        Ok(())
    }

    /// Replaces the calling thread's current context; null unbinds it.
    fn cuCtxSetCurrent(ctx: CUcontext) {
        let cfg = context::initialised()?;
        let dev = if ctx.is_null() { None } else { Some(context::context_device(cfg, ctx)?) };
        context::set_current(dev);
        Ok(())
    }

    /// The calling thread's current context, or null.
    fn cuCtxGetCurrent(ctx: *mut CUcontext) {
        let out = non_null(ctx)?;
        context::initialised()?;
        let current = context::current().map_or(std::ptr::null_mut(), context::primary_context);
        // SAFETY: non-null; the caller passes a valid out-pointer.
        unsafe { out.write(current) };
        Ok(())
    }

    /// The current context's device; `CUDA_ERROR_INVALID_CONTEXT` without one.
    fn cuCtxGetDevice(dev: *mut CUdevice) {
        let out = non_null(dev)?;
        context::initialised()?;
        let d = context::current().ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        // SAFETY: non-null; the caller passes a valid out-pointer.
        unsafe { out.write(d) };
        Ok(())
    }

    /// A limit of the current context: only `CU_LIMIT_STACK_SIZE` (default 1024 bytes, as on
    /// the real driver); others are `CUDA_ERROR_UNSUPPORTED_LIMIT`.
    fn cuCtxGetLimit(value: *mut usize, limit: c_uint) {
        let out = non_null(value)?;
        context::initialised()?;
        let dev = context::require_current()?;
        if limit != CU_LIMIT_STACK_SIZE {
            return Err(CUDA_ERROR_UNSUPPORTED_LIMIT);
        }
        // SAFETY: non-null; the caller passes a valid out-pointer.
        unsafe { out.write(context::stack_size(dev)) };
        Ok(())
    }

    /// Sets a limit of the current context (see [`cuCtxGetLimit`]).
    fn cuCtxSetLimit(limit: c_uint, value: usize) {
        context::initialised()?;
        let dev = context::require_current()?;
        if limit != CU_LIMIT_STACK_SIZE {
            return Err(CUDA_ERROR_UNSUPPORTED_LIMIT);
        }
        context::alive(dev)?;
        context::set_stack_size(dev, value);
        Ok(())
    }

    /// Waits for the current context's work: there is none pending, ever. Without a current
    /// context, `CUDA_ERROR_INVALID_CONTEXT`, as on the real driver.
    fn cuCtxSynchronize() {
        context::initialised()?;
        context::current().map(context::alive).ok_or(CUDA_ERROR_INVALID_CONTEXT)?
    }

    /// Free and total memory of the current context's device; "used" is what live
    /// allocations of all processes hold.
    fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) {
        let (free_out, total_out) = (non_null(free)?, non_null(total)?);
        let cfg = context::initialised()?;
        let live = physical::live_bytes(cfg, context::require_current()?)?;
        // SAFETY: both non-null; the caller passes valid out-pointers.
        unsafe {
            free_out.write(cfg.mem_bytes.saturating_sub(live) as usize);
            total_out.write(cfg.mem_bytes as usize);
        }
        Ok(())
    }

    /// 2 MiB, minimum and recommended.
    fn cuMemGetAllocationGranularity(
        granularity: *mut usize,
        prop: *const CUmemAllocationProp,
        option: c_uint,
    ) {
        let out = non_null(granularity)?;
        let cfg = context::initialised()?;
        // SAFETY: the caller passes null or a valid property struct.
        let prop = unsafe { read_in(prop) }?;
        let g = state::granularity(cfg, &prop, option)?;
        // SAFETY: non-null; the caller passes a valid out-pointer.
        unsafe { out.write(g) };
        Ok(())
    }

    /// Creates physical memory on a device (counted) or on the host (not counted).
    fn cuMemCreate(
        handle: *mut CUmemGenericAllocationHandle,
        size: usize,
        prop: *const CUmemAllocationProp,
        flags: c_ulonglong,
    ) {
        counts::count(Call::Create);
        let out = non_null(handle)?;
        let cfg = context::initialised()?;
        context::current_alive()?;
        // SAFETY: the caller passes null or a valid property struct.
        let prop = unsafe { read_in(prop) }?;
        let h = state::create(cfg, size, &prop, flags)?;
        // SAFETY: non-null; the caller passes a valid out-pointer.
        unsafe { out.write(h) };
        Ok(())
    }

    /// Drops one reference to a handle.
    fn cuMemRelease(handle: CUmemGenericAllocationHandle) {
        counts::count(Call::Release);
        context::initialised()?;
        state::release(handle)
    }

    /// Reserves a virtual range aligned to max(alignment, 2 MiB).
    fn cuMemAddressReserve(
        ptr: *mut CUdeviceptr,
        size: usize,
        alignment: usize,
        addr: CUdeviceptr,
        flags: c_ulonglong,
    ) {
        counts::count(Call::Reserve);
        let out = non_null(ptr)?;
        context::initialised()?;
        let p = state::reserve(size, alignment, addr, flags)?;
        // SAFETY: non-null; the caller passes a valid out-pointer.
        unsafe { out.write(p) };
        Ok(())
    }

    /// Frees a whole reservation.
    fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) {
        counts::count(Call::AddressFree);
        context::initialised()?;
        state::address_free(ptr, size)
    }

    /// Maps an allocation at a reserved range (no access until `cuMemSetAccess`).
    fn cuMemMap(
        ptr: CUdeviceptr,
        size: usize,
        offset: usize,
        handle: CUmemGenericAllocationHandle,
        flags: c_ulonglong,
    ) {
        counts::count(Call::Map);
        gate::MAP.enter();
        let cfg = context::initialised()?;
        context::current_alive()?;
        state::map(cfg, ptr, size, offset, handle, flags)
    }

    /// Unmaps whole mappings; the range stays reserved.
    fn cuMemUnmap(ptr: CUdeviceptr, size: usize) {
        counts::count(Call::Unmap);
        context::initialised()?;
        state::unmap(ptr, size)
    }

    /// Sets the access of a fully mapped range.
    fn cuMemSetAccess(ptr: CUdeviceptr, size: usize, desc: *const CUmemAccessDesc, count: usize) {
        counts::count(Call::SetAccess);
        let cfg = context::initialised()?;
        if desc.is_null() || count == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null; the caller passes `count` valid descriptors.
        let descs = unsafe { std::slice::from_raw_parts(desc, count) };
        state::set_access(cfg, ptr, size, descs)
    }

    /// Writes a new fd (an `int`) to `shareable`; the caller owns and closes it.
    fn cuMemExportToShareableHandle(
        shareable: *mut c_void,
        handle: CUmemGenericAllocationHandle,
        handle_type: c_uint,
        flags: c_ulonglong,
    ) {
        counts::count(Call::Export);
        let out = non_null(shareable.cast::<c_int>())?;
        context::initialised()?;
        let fd = state::export(handle, handle_type, flags)?;
        // SAFETY: non-null; for POSIX fds the caller passes a pointer to an int.
        unsafe { out.write(fd) };
        Ok(())
    }

    /// Imports an exported fd, passed by value as `(void *)(intptr_t)fd`; the caller keeps it.
    fn cuMemImportFromShareableHandle(
        handle: *mut CUmemGenericAllocationHandle,
        os_handle: *mut c_void,
        handle_type: c_uint,
    ) {
        counts::count(Call::Import);
        let out = non_null(handle)?;
        context::initialised()?;
        let fd = c_int::try_from(os_handle as isize).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        let h = state::import(fd, handle_type)?;
        // SAFETY: non-null; the caller passes a valid out-pointer.
        unsafe { out.write(h) };
        Ok(())
    }

    /// The handle of the mapping at `addr`, with one more reference.
    fn cuMemRetainAllocationHandle(handle: *mut CUmemGenericAllocationHandle, addr: *mut c_void) {
        let out = non_null(handle)?;
        context::initialised()?;
        let h = state::retain(addr as u64)?;
        // SAFETY: non-null; the caller passes a valid out-pointer.
        unsafe { out.write(h) };
        Ok(())
    }

    /// The properties given at creation (for imports: pinned, the owner's device, POSIX fd).
    fn cuMemGetAllocationPropertiesFromHandle(
        prop: *mut CUmemAllocationProp,
        handle: CUmemGenericAllocationHandle,
    ) {
        let out = non_null(prop)?;
        context::initialised()?;
        let p = state::properties(handle)?;
        // SAFETY: non-null; the caller passes a valid out-pointer.
        unsafe { out.write(p) };
        Ok(())
    }

    /// Base and size of the mapping containing `ptr` (either out-pointer may be null).
    fn cuMemGetAddressRange_v2(base: *mut CUdeviceptr, size: *mut usize, ptr: CUdeviceptr) {
        context::initialised()?;
        let (b, s) = state::address_range(ptr)?;
        // SAFETY: each is written only when non-null; the caller passes valid out-pointers.
        unsafe {
            if !base.is_null() {
                base.write(b);
            }
            if !size.is_null() {
                size.write(s);
            }
        }
        Ok(())
    }

    /// A dmabuf fd of a mapped range, as a NIC driver would be given it (GPUDirect RDMA):
    /// a new fd the caller owns; the range must lie inside one mapping.
    fn cuMemGetHandleForAddressRange(
        handle: *mut c_void,
        ptr: CUdeviceptr,
        size: usize,
        handle_type: c_uint,
        flags: c_ulonglong,
    ) {
        let out = non_null(handle.cast::<c_int>())?;
        context::initialised()?;
        // CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, no flags.
        if handle_type != 1 || flags != 0 || size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (base, len) = state::address_range(ptr)?;
        if ptr + size as u64 > base + len as u64 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: NUL-terminated name; valid flags.
        let fd = unsafe { libc::memfd_create(c"fakecuda-dmabuf".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(CUDA_ERROR_UNKNOWN);
        }
        // SAFETY: non-null; the caller passes a pointer to an int.
        unsafe { out.write(fd) };
        Ok(())
    }

    /// A stream token.
    fn cuStreamCreate(stream: *mut CUstream, flags: c_uint) {
        let out = non_null(stream)?;
        context::initialised()?;
        context::require_current()?;
        if flags & !CU_STREAM_NON_BLOCKING != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null; the caller passes a valid out-pointer.
        unsafe { out.write(context::STREAMS.create()) };
        Ok(())
    }

    /// Validates the stream (all work is already complete).
    fn cuStreamSynchronize(stream: CUstream) {
        context::initialised()?;
        context::current_alive()?;
        context::check_stream(stream)
    }

    /// Destroys a stream token.
    fn cuStreamDestroy_v2(stream: CUstream) {
        context::initialised()?;
        context::STREAMS.destroy(stream)
    }

    /// An event token.
    fn cuEventCreate(event: *mut CUevent, flags: c_uint) {
        let out = non_null(event)?;
        context::initialised()?;
        context::require_current()?;
        if flags & !EVENT_FLAGS != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null; the caller passes a valid out-pointer.
        unsafe { out.write(context::EVENTS.create()) };
        Ok(())
    }

    /// Validates event and stream (the event is complete at once).
    fn cuEventRecord(event: CUevent, stream: CUstream) {
        context::initialised()?;
        context::check_event(event)?;
        context::check_stream(stream)
    }

    /// Validates the event (it is always complete).
    fn cuEventSynchronize(event: CUevent) {
        context::initialised()?;
        context::check_event(event)
    }

    /// Destroys an event token.
    fn cuEventDestroy_v2(event: CUevent) {
        context::initialised()?;
        context::EVENTS.destroy(event)
    }

    /// Device to host copy, complete on return.
    fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: CUdeviceptr, bytes: usize, stream: CUstream) {
        counts::count(Call::Copy);
        context::initialised()?;
        context::alive(context::require_current()?)?;
        context::check_stream(stream)?;
        // SAFETY: the caller passes a host destination valid for `bytes` writes.
        unsafe { copy_dtoh(dst, src, bytes) }
    }

    /// Host to device copy, complete on return.
    fn cuMemcpyHtoDAsync_v2(dst: CUdeviceptr, src: *const c_void, bytes: usize, stream: CUstream) {
        counts::count(Call::Copy);
        context::initialised()?;
        context::alive(context::require_current()?)?;
        context::check_stream(stream)?;
        // SAFETY: the caller passes a host source valid for `bytes` reads.
        unsafe { copy_htod(dst, src, bytes) }
    }

    /// Device to host copy.
    fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, bytes: usize) {
        counts::count(Call::Copy);
        context::initialised()?;
        context::alive(context::require_current()?)?;
        // SAFETY: the caller passes a host destination valid for `bytes` writes.
        unsafe { copy_dtoh(dst, src, bytes) }
    }

    /// Host to device copy.
    fn cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, bytes: usize) {
        counts::count(Call::Copy);
        context::initialised()?;
        context::alive(context::require_current()?)?;
        // SAFETY: the caller passes a host source valid for `bytes` reads.
        unsafe { copy_htod(dst, src, bytes) }
    }

    /// Sets `count` bytes of device memory to `value`.
    fn cuMemsetD8_v2(dst: CUdeviceptr, value: u8, count: usize) {
        counts::count(Call::Memset);
        context::initialised()?;
        context::require_current()?;
        memset(dst, value, count)
    }

    /// Sets `count` bytes of device memory to `value`, complete on return.
    fn cuMemsetD8Async(dst: CUdeviceptr, value: u8, count: usize, stream: CUstream) {
        counts::count(Call::Memset);
        context::initialised()?;
        context::require_current()?;
        context::check_stream(stream)?;
        memset(dst, value, count)
    }

    /// Page-aligned host memory (not device memory), pinned under the driver lock
    /// (`pinning`).
    fn cuMemHostAlloc(pp: *mut *mut c_void, bytes: usize, flags: c_uint) {
        counts::count(Call::HostAlloc);
        let out = non_null(pp)?;
        let cfg = context::initialised()?;
        context::require_current()?;
        if flags & !0x7 != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        capture::unsafe_call()?;
        let _pinning = pinning::exclusive(bytes, cfg.pin_ms_per_gib);
        let p = state::host_alloc(bytes)?;
        // SAFETY: non-null; the caller passes a valid out-pointer.
        unsafe { out.write(p) };
        Ok(())
    }

    /// Frees memory from `cuMemHostAlloc`.
    fn cuMemFreeHost(p: *mut c_void) {
        counts::count(Call::HostFree);
        context::initialised()?;
        context::require_current()?;
        state::host_free(p)
    }

    /// Pins host memory the caller mapped, under the driver lock (`pinning`); a range that
    /// overlaps a registration is `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`.
    fn cuMemHostRegister_v2(p: *mut c_void, bytes: usize, flags: c_uint) {
        counts::count(Call::HostRegister);
        let cfg = context::initialised()?;
        context::require_current()?;
        if flags & !0xf != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        capture::unsafe_call()?;
        let _pinning = pinning::exclusive(bytes, cfg.pin_ms_per_gib);
        pinning::register(p, bytes)
    }

    /// Sets the calling thread's capture interaction mode (`capture`).
    fn cuThreadExchangeStreamCaptureMode(mode: *mut c_int) {
        let m = non_null(mode)?;
        // SAFETY: non-null; the caller passes a valid in/out pointer.
        let mut v = unsafe { m.read() };
        capture::exchange(&mut v)?;
        // SAFETY: as above.
        unsafe { m.write(v) };
        Ok(())
    }

    /// Unpins a registration, named by its start.
    fn cuMemHostUnregister(p: *mut c_void) {
        counts::count(Call::HostUnregister);
        context::initialised()?;
        context::require_current()?;
        pinning::unregister(p)
    }

    /// `CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT` (132) and
    /// `CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR` (2048), an H200's; other
    /// attributes are `CUDA_ERROR_INVALID_VALUE`.
    fn cuModuleLoadData(module: *mut CUmodule, image: *const c_void) {
        let out = non_null(module)?;
        context::initialised()?;
        context::current_alive()?;
        context::require_current()?;
        if image.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null; PTX images are NUL-terminated text.
        let m = kernels::load(unsafe { CStr::from_ptr(image.cast()) })?;
        // SAFETY: non-null; the caller passes a valid out-pointer.
        unsafe { out.write(m) };
        Ok(())
    }

    /// The kernel `name` of a loaded module.
    fn cuModuleGetFunction(function: *mut CUfunction, module: CUmodule, name: *const c_char) {
        let out = non_null(function)?;
        context::initialised()?;
        if name.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null and NUL-terminated per the driver API.
        let f = kernels::function(module, unsafe { CStr::from_ptr(name) })?;
        // SAFETY: non-null; the caller passes a valid out-pointer.
        unsafe { out.write(f) };
        Ok(())
    }

    /// Runs memsaver's packing kernels at once (`kernels.rs`).
    fn cuLaunchKernel(
        f: CUfunction,
        grid_x: c_uint,
        grid_y: c_uint,
        grid_z: c_uint,
        block_x: c_uint,
        block_y: c_uint,
        block_z: c_uint,
        shared_bytes: c_uint,
        stream: CUstream,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
    ) {
        counts::count(Call::Launch);
        context::initialised()?;
        context::check_stream(stream)?;
        if grid_x == 0 || grid_y != 1 || grid_z != 1 || block_y != 1 || block_z != 1
            || shared_bytes != 0 || !extra.is_null()
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller passes one pointer per kernel parameter.
        unsafe { kernels::launch(f, block_x, params) }
    }

    /// The attributes memsaver reads: an H200's multiprocessors and threads per multiprocessor,
    /// and whether registered host memory is reached at its host address
    /// (`FAKE_CUDA_HOST_POINTER`).
    fn cuDeviceGetAttribute(value: *mut c_int, attribute: c_int, dev: CUdevice) {
        let out = non_null(value)?;
        context::device(context::initialised()?, dev)?;
        let v = match attribute {
            CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT => 132,
            CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR => 2048,
            CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM => {
                context::initialised()?.host_pointer.into()
            }
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        // SAFETY: non-null; the caller passes a valid out-pointer.
        unsafe { out.write(v) };
        Ok(())
    }

    /// An empty graph.
    fn cuGraphCreate(graph: *mut CUgraph, flags: c_uint) {
        let out = non_null(graph)?;
        context::initialised()?;
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null; the caller passes a valid out-pointer.
        unsafe { out.write(graphs::GRAPHS.create()) };
        Ok(())
    }

    /// Destroys a graph (its executables live on).
    fn cuGraphDestroy(graph: CUgraph) {
        context::initialised()?;
        graphs::GRAPHS.destroy(graph)
    }

    /// Instantiates a graph in the current context at the stack limit in force (see
    /// `graphs`). Also what `cuGetProcAddress("cuGraphInstantiate")` gives for CUDA >= 12.0.
    fn cuGraphInstantiateWithFlags(exec: *mut CUgraphExec, graph: CUgraph, flags: c_ulonglong) {
        let out = non_null(exec)?;
        context::initialised()?;
        let _ = flags; // auto-free on launch, upload, device launch: nothing to do here
        let e = graphs::instantiate(graph)?;
        // SAFETY: non-null; the caller passes a valid out-pointer.
        unsafe { out.write(e) };
        Ok(())
    }

    /// The pre-12.0 form of [`cuGraphInstantiateWithFlags`] (no error node or log is ever
    /// written).
    fn cuGraphInstantiate_v2(
        exec: *mut CUgraphExec,
        graph: CUgraph,
        error_node: *mut CUgraphNode,
        log: *mut c_char,
        log_size: usize,
    ) {
        let _ = (error_node, log, log_size);
        // SAFETY: same contract as the called function.
        check(unsafe { cuGraphInstantiateWithFlags(exec, graph, 0) })
    }

    /// The legacy export of [`cuGraphInstantiate_v2`] (same signature).
    fn cuGraphInstantiate(
        exec: *mut CUgraphExec,
        graph: CUgraph,
        error_node: *mut CUgraphNode,
        log: *mut c_char,
        log_size: usize,
    ) {
        // SAFETY: same contract as the aliased function.
        check(unsafe { cuGraphInstantiate_v2(exec, graph, error_node, log, log_size) })
    }

    /// [`cuGraphInstantiateWithFlags`] taking a parameter struct; writes its result field.
    fn cuGraphInstantiateWithParams(
        exec: *mut CUgraphExec,
        graph: CUgraph,
        params: *mut CUDA_GRAPH_INSTANTIATE_PARAMS,
    ) {
        let params = non_null(params)?;
        // SAFETY: the caller passes a valid parameter struct.
        check(unsafe { cuGraphInstantiateWithFlags(exec, graph, (*params).flags) })?;
        // SAFETY: as above.
        unsafe { (*params).result_out = 0 };
        Ok(())
    }

    /// Destroys an executable.
    fn cuGraphExecDestroy(exec: CUgraphExec) {
        context::initialised()?;
        graphs::exec_destroy(exec)
    }

    /// Launches an executable: `CUDA_ERROR_LAUNCH_FAILED`, and the context lost, when its
    /// device's stack limit is below the one it was instantiated at (see `graphs`).
    fn cuGraphLaunch(exec: CUgraphExec, stream: CUstream) {
        context::initialised()?;
        context::check_stream(stream)?;
        graphs::launch(exec)
    }

    /// This library's entry point for `symbol` (base names resolve to the newest variant the
    /// caller's CUDA version knows). Works before `cuInit`.
    fn cuGetProcAddress_v2(
        symbol: *const c_char,
        pfn: *mut *mut c_void,
        cuda_version: c_int,
        flags: c_ulonglong,
        status: *mut c_int,
    ) {
        let _ = flags; // stream-semantics variants (_ptds/_ptsz) do not exist here
        // SAFETY: the caller passes a NUL-terminated symbol name and valid out-pointers.
        unsafe { get_proc_address(symbol, pfn, cuda_version, status) }
    }

    /// The CUDA 11.3 form of [`cuGetProcAddress_v2`], without the status out-parameter.
    fn cuGetProcAddress(
        symbol: *const c_char,
        pfn: *mut *mut c_void,
        cuda_version: c_int,
        flags: c_ulonglong,
    ) {
        let _ = flags;
        // SAFETY: the caller passes a NUL-terminated symbol name and a valid out-pointer.
        unsafe { get_proc_address(symbol, pfn, cuda_version, std::ptr::null_mut()) }
    }

    /// Legacy name of [`cuMemGetInfo_v2`].
    fn cuMemGetInfo(free: *mut usize, total: *mut usize) {
        // SAFETY: same contract as the aliased function.
        check(unsafe { cuMemGetInfo_v2(free, total) })
    }

    /// Legacy name of [`cuCtxPushCurrent_v2`].
    fn cuCtxPushCurrent(ctx: CUcontext) {
        // SAFETY: same contract as the aliased function.
        check(unsafe { cuCtxPushCurrent_v2(ctx) })
    }

    /// Legacy name of [`cuCtxPopCurrent_v2`].
    fn cuCtxPopCurrent(ctx: *mut CUcontext) {
        // SAFETY: same contract as the aliased function.
        check(unsafe { cuCtxPopCurrent_v2(ctx) })
    }

    /// Legacy name of [`cuEventDestroy_v2`].
    fn cuEventDestroy(event: CUevent) {
        // SAFETY: same contract as the aliased function.
        check(unsafe { cuEventDestroy_v2(event) })
    }

    /// Legacy name of [`cuStreamDestroy_v2`].
    fn cuStreamDestroy(stream: CUstream) {
        // SAFETY: same contract as the aliased function.
        check(unsafe { cuStreamDestroy_v2(stream) })
    }

    /// Legacy name of [`cuMemcpyDtoHAsync_v2`].
    fn cuMemcpyDtoHAsync(dst: *mut c_void, src: CUdeviceptr, bytes: usize, stream: CUstream) {
        // SAFETY: same contract as the aliased function.
        check(unsafe { cuMemcpyDtoHAsync_v2(dst, src, bytes, stream) })
    }

    /// Legacy name of [`cuMemcpyHtoDAsync_v2`].
    fn cuMemcpyHtoDAsync(dst: CUdeviceptr, src: *const c_void, bytes: usize, stream: CUstream) {
        // SAFETY: same contract as the aliased function.
        check(unsafe { cuMemcpyHtoDAsync_v2(dst, src, bytes, stream) })
    }

    /// Legacy name of [`cuMemsetD8_v2`].
    fn cuMemsetD8(dst: CUdeviceptr, value: u8, count: usize) {
        // SAFETY: same contract as the aliased function.
        check(unsafe { cuMemsetD8_v2(dst, value, count) })
    }

    /// Legacy name of [`cuMemGetAddressRange_v2`].
    fn cuMemGetAddressRange(base: *mut CUdeviceptr, size: *mut usize, ptr: CUdeviceptr) {
        // SAFETY: same contract as the aliased function.
        check(unsafe { cuMemGetAddressRange_v2(base, size, ptr) })
    }
}

/// The signatures above are exactly those of `sys::fns`: a mismatch fails to compile.
macro_rules! same_signature {
    ($($export:ident: $ty:ident),* $(,)?) => { $( const _: fns::$ty = $export; )* };
}

same_signature! {
    cuInit: cuInit, cuDriverGetVersion: cuDriverGetVersion, cuGetErrorName: cuGetErrorName,
    cuGetErrorString: cuGetErrorString, cuDeviceGetCount: cuDeviceGetCount,
    cuDeviceGet: cuDeviceGet, cuDevicePrimaryCtxRetain: cuDevicePrimaryCtxRetain,
    cuCtxPushCurrent_v2: cuCtxPushCurrent_v2, cuCtxPopCurrent_v2: cuCtxPopCurrent_v2,
    cuCtxSynchronize: cuCtxSynchronize,
    cuCtxGetLimit: cuCtxGetLimit, cuCtxSetLimit: cuCtxSetLimit,
    cuDeviceGetAttribute: cuDeviceGetAttribute, cuGraphCreate: cuGraphCreate,
    cuGraphDestroy: cuGraphDestroy, cuGraphInstantiateWithFlags: cuGraphInstantiateWithFlags,
    cuGraphInstantiate_v2: cuGraphInstantiate_v2, cuGraphInstantiate: cuGraphInstantiate_v2,
    cuGraphInstantiateWithParams: cuGraphInstantiateWithParams,
    cuGraphExecDestroy: cuGraphExecDestroy, cuGraphLaunch: cuGraphLaunch,
    cuMemGetInfo_v2: cuMemGetInfo_v2,
    cuMemGetAllocationGranularity: cuMemGetAllocationGranularity, cuMemCreate: cuMemCreate,
    cuMemRelease: cuMemRelease, cuMemAddressReserve: cuMemAddressReserve,
    cuMemAddressFree: cuMemAddressFree, cuMemMap: cuMemMap, cuMemUnmap: cuMemUnmap,
    cuMemSetAccess: cuMemSetAccess, cuMemExportToShareableHandle: cuMemExportToShareableHandle,
    cuMemImportFromShareableHandle: cuMemImportFromShareableHandle,
    cuMemRetainAllocationHandle: cuMemRetainAllocationHandle,
    cuMemGetAllocationPropertiesFromHandle: cuMemGetAllocationPropertiesFromHandle,
    cuMemGetAddressRange_v2: cuMemGetAddressRange_v2, cuStreamCreate: cuStreamCreate,
    cuStreamSynchronize: cuStreamSynchronize, cuStreamDestroy_v2: cuStreamDestroy_v2,
    cuEventCreate: cuEventCreate, cuEventRecord: cuEventRecord,
    cuEventSynchronize: cuEventSynchronize, cuEventDestroy_v2: cuEventDestroy_v2,
    cuMemcpyDtoHAsync_v2: cuMemcpyDtoHAsync_v2, cuMemcpyHtoDAsync_v2: cuMemcpyHtoDAsync_v2,
    cuMemsetD8_v2: cuMemsetD8_v2, cuMemsetD8Async: cuMemsetD8Async,
    cuMemHostAlloc: cuMemHostAlloc, cuMemFreeHost: cuMemFreeHost,
    cuMemHostRegister_v2: cuMemHostRegister_v2, cuMemHostUnregister: cuMemHostUnregister,
    cuThreadExchangeStreamCaptureMode: cuThreadExchangeStreamCaptureMode,
    cuGetProcAddress_v2: cuGetProcAddress_v2, cuModuleLoadData: cuModuleLoadData,
    cuModuleGetFunction: cuModuleGetFunction, cuLaunchKernel: cuLaunchKernel,
    // Aliases: same types as the variant they stand for.
    cuMemGetInfo: cuMemGetInfo_v2, cuCtxPushCurrent: cuCtxPushCurrent_v2,
    cuCtxPopCurrent: cuCtxPopCurrent_v2, cuEventDestroy: cuEventDestroy_v2,
    cuStreamDestroy: cuStreamDestroy_v2, cuMemcpyDtoHAsync: cuMemcpyDtoHAsync_v2,
    cuMemcpyHtoDAsync: cuMemcpyHtoDAsync_v2, cuMemsetD8: cuMemsetD8_v2,
    cuMemGetAddressRange: cuMemGetAddressRange_v2,
}

/// `count` bytes of mapped, writable device memory at `dst` set to `value`.
fn memset(dst: CUdeviceptr, value: u8, count: usize) -> Result<(), CUresult> {
    if count == 0 {
        return Ok(());
    }
    let _held = state::access(dst, count, true)?;
    // SAFETY: `access` checked that the range is mapped writable, and holds it mapped.
    unsafe { std::ptr::write_bytes(dst as *mut u8, value, count) };
    Ok(())
}

/// Copies device (or pinned host) memory to host memory.
///
/// # Safety
///
/// `dst` must be valid for `bytes` writes.
unsafe fn copy_dtoh(dst: *mut c_void, src: CUdeviceptr, bytes: usize) -> Result<(), CUresult> {
    if bytes == 0 {
        return Ok(());
    }
    let dst = non_null(dst)?;
    pinning::check_host_side(dst, bytes)?;
    let _held = state::access(src, bytes, false)?;
    kernels::COPIED_TO_HOST.fetch_add(bytes as u64, std::sync::atomic::Ordering::Relaxed);
    // SAFETY: `access` checked that the source is mapped readable and holds it mapped; the
    // destination is valid per this function's contract. `copy` tolerates overlap.
    unsafe { std::ptr::copy(src as *const u8, dst.cast::<u8>(), bytes) };
    Ok(())
}

/// Copies host memory to device (or pinned host) memory.
///
/// # Safety
///
/// `src` must be valid for `bytes` reads.
unsafe fn copy_htod(dst: CUdeviceptr, src: *const c_void, bytes: usize) -> Result<(), CUresult> {
    if bytes == 0 {
        return Ok(());
    }
    if src.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    pinning::check_host_side(src, bytes)?;
    let _held = state::access(dst, bytes, true)?;
    kernels::COPIED_TO_DEVICE.fetch_add(bytes as u64, std::sync::atomic::Ordering::Relaxed);
    // SAFETY: `access` checked that the destination is mapped writable and holds it mapped;
    // the source is valid per this function's contract. `copy` tolerates overlap.
    unsafe { std::ptr::copy(src.cast::<u8>(), dst as *mut u8, bytes) };
    Ok(())
}

/// Shared body of `cuGetProcAddress` and `cuGetProcAddress_v2`.
///
/// # Safety
///
/// `symbol` must be null or NUL-terminated; `pfn` and `status` null or valid for a write.
unsafe fn get_proc_address(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    status: *mut c_int,
) -> Result<(), CUresult> {
    if symbol.is_null() || pfn.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null and NUL-terminated per this function's contract.
    let name = unsafe { CStr::from_ptr(symbol) }.to_str().ok();
    let found = name.and_then(|n| procaddr::resolve(n, cuda_version, exported));
    // SAFETY: `pfn` is non-null and valid for a write; `status` is written only when non-null.
    unsafe {
        pfn.write(found.unwrap_or(std::ptr::null_mut()));
        if !status.is_null() {
            status.write(if found.is_some() {
                CU_GET_PROC_ADDRESS_SUCCESS
            } else {
                CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
            });
        }
    }
    found.map(drop).ok_or(CUDA_ERROR_NOT_FOUND)
}

/// Test control: the `n`th `cuMemCreate` from now fails with `CUDA_ERROR_OUT_OF_MEMORY`
/// (0 disarms). Replaces `FAKE_CUDA_FAIL_CREATE_AT`.
#[unsafe(no_mangle)]
pub extern "C" fn fakecuda_fail_create_at(n: u32) -> CUresult {
    guard("fakecuda test control", || {
        faults::CREATE.arm(n);
        Ok(())
    })
}

/// Test control: the `n`th `cuMemAddressReserve` from now fails with
/// `CUDA_ERROR_OUT_OF_MEMORY` (0 disarms).
#[unsafe(no_mangle)]
pub extern "C" fn fakecuda_fail_reserve_at(n: u32) -> CUresult {
    guard("fakecuda test control", || {
        faults::RESERVE.arm(n);
        Ok(())
    })
}

/// Test control: the `n`th `cuMemMap` from now fails with `CUDA_ERROR_UNKNOWN`
/// (0 disarms). Replaces `FAKE_CUDA_FAIL_MAP_AT`.
#[unsafe(no_mangle)]
pub extern "C" fn fakecuda_fail_map_at(n: u32) -> CUresult {
    guard("fakecuda test control", || {
        faults::MAP.arm(n);
        Ok(())
    })
}

/// Test control: the `n`th `cuMemUnmap` from now fails with `CUDA_ERROR_UNKNOWN` (0 disarms).
#[unsafe(no_mangle)]
pub extern "C" fn fakecuda_fail_unmap_at(n: u32) -> CUresult {
    guard("fakecuda test control", || {
        faults::UNMAP.arm(n);
        Ok(())
    })
}

/// Test control: every `cuMemCreate` of more than `bytes` fails with
/// `CUDA_ERROR_OUT_OF_MEMORY` from now on, smaller ones succeed (0 disarms): a device with
/// only that much memory free, for resumes that back several buffers with one allocation.
#[unsafe(no_mangle)]
pub extern "C" fn fakecuda_fail_creates_over(bytes: u64) -> CUresult {
    guard("fakecuda test control", || {
        faults::CREATE_LIMIT.store(bytes, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    })
}

/// Test control: a `cuMemHostRegister` that would take the bytes registered in this process
/// over `bytes` fails with `CUDA_ERROR_OUT_OF_MEMORY` from now on (0 disarms): a host that
/// cannot lock more memory.
#[unsafe(no_mangle)]
pub extern "C" fn fakecuda_fail_registers_over(bytes: u64) -> CUresult {
    guard("fakecuda test control", || {
        faults::REGISTER_LIMIT.store(bytes, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    })
}

/// Test control: disarms every fault trigger, the knobs' included.
#[unsafe(no_mangle)]
pub extern "C" fn fakecuda_reset_faults() -> CUresult {
    guard("fakecuda test control", || {
        faults::CREATE.reset();
        faults::MAP.reset();
        faults::UNMAP.reset();
        faults::RESERVE.reset();
        faults::CREATE_LIMIT.store(0, std::sync::atomic::Ordering::Relaxed);
        faults::REGISTER_LIMIT.store(0, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    })
}

/// Test control standing for a kernel launch whose kernel needs `bytes` of stack per thread,
/// in the current context: the limit grows to `bytes` if it is below, as the real driver grows
/// it at launch (NCCL's kernels do this with 2+ ranks; `tests/fake-nccl` calls it then).
#[unsafe(no_mangle)]
pub extern "C" fn fakecuda_launch_kernel_needing_stack(bytes: usize) -> CUresult {
    guard("fakecuda test control", || {
        context::initialised()?;
        graphs::launch_kernel_needing_stack(bytes)
    })
}

/// Test control standing for a graph instantiation that escaped memsaver's wrappers (for
/// example through the CUDA runtime's private export tables): `cuGraphInstantiateWithFlags`
/// reached without `cuGetProcAddress` or `dlsym`.
///
/// # Safety
///
/// `exec` must be null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fakecuda_instantiate_unseen(
    exec: *mut CUgraphExec,
    graph: CUgraph,
) -> CUresult {
    // SAFETY: per this function's contract.
    unsafe { cuGraphInstantiateWithFlags(exec, graph, 0) }
}

/// Test probe: handle values of this process not yet released (`u64::MAX` on internal error).
#[unsafe(no_mangle)]
pub extern "C" fn fakecuda_live_handles() -> u64 {
    catch_unwind(state::live_handles).unwrap_or(u64::MAX)
}

/// Test probe: this process's call counts by kind (see the crate doc for the order), written
/// to `out[..min(n, 10)]`. Returns the number of kinds (10); `out` may be null when `n` is 0.
///
/// # Safety
///
/// `out` must be valid for `n` writes of `u64`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fakecuda_call_counts(out: *mut u64, n: usize) -> usize {
    let n = n.min(counts::KINDS);
    if n > 0 && !out.is_null() {
        // SAFETY: per this function's contract.
        counts::read(unsafe { std::slice::from_raw_parts_mut(out, n) });
    }
    counts::KINDS
}

/// Test control: sets this process's call counts to 0.
#[unsafe(no_mangle)]
pub extern "C" fn fakecuda_reset_call_counts() {
    counts::reset();
}

/// Writes the first `min(n, 4)` figures of this process's pinning (`pinning`) to `out`:
/// pinning calls, the largest one (bytes), calls that waited behind one, and the largest
/// pinning call (bytes) another call waited behind. Returns 4.
///
/// # Safety
///
/// `out` must be valid for `n` writes of `u64`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fakecuda_pin_stats(out: *mut u64, n: usize) -> usize {
    let n = n.min(pinning::STATS);
    if n > 0 && !out.is_null() {
        // SAFETY: per this function's contract.
        pinning::read(unsafe { std::slice::from_raw_parts_mut(out, n) });
    }
    pinning::STATS
}

/// Test control: sets this process's pinning figures to 0.
#[unsafe(no_mangle)]
pub extern "C" fn fakecuda_reset_pin_stats() {
    pinning::reset();
}

/// Test control: holds this process's pinning calls (`pinning`) for at most `ms` from now.
/// `mode` 1: each pinning call waits at its entry, before it takes the driver lock, until the
/// hold ends; 2: each one, once it holds the lock, keeps it until a call of another thread
/// waits behind it; 0 ends the hold and lets every held call go. Returns 0, or -1 for another
/// mode. A call that the deadline lets go is counted (`fakecuda_pin_hold_stats`).
#[unsafe(no_mangle)]
pub extern "C" fn fakecuda_hold_pinning(mode: u32, ms: u64) -> c_int {
    let hold = match mode {
        0 => pinning::Hold::Free,
        1 => pinning::Hold::AtEntry,
        2 => pinning::Hold::UntilWaited,
        _ => return -1,
    };
    pinning::hold(hold, ms);
    0
}

/// Test control: while pinning is held at the entry (mode 1 of `fakecuda_hold_pinning`), lets
/// `n` pinning calls go on: those waiting there now first (they stop counting as waiting at
/// once), then the next ones to arrive; the others stay held. Returns 0.
#[unsafe(no_mangle)]
pub extern "C" fn fakecuda_pass_pinning(n: u64) -> c_int {
    pinning::pass(n);
    0
}

/// Writes the first `min(n, 6)` figures of this process's transfers to `out` (`kernels.rs`):
/// bytes copied device to host and host to device, bytes memsaver's kernels wrote to host
/// memory and read from it, and their launches (pack, unpack). Returns 6.
///
/// # Safety
///
/// `out` must be valid for `n` writes of `u64`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fakecuda_transfer_stats(out: *mut u64, n: usize) -> usize {
    let n = n.min(kernels::STATS);
    if n > 0 && !out.is_null() {
        // SAFETY: per this function's contract.
        kernels::read_stats(unsafe { std::slice::from_raw_parts_mut(out, n) });
    }
    kernels::STATS
}

/// Writes the first `min(n, 3)` figures of this process's copies to `out`: copies whose host
/// side lay in one registration (`cuMemHostRegister`), copies whose host side touched none
/// (pageable memory), and host ranges registered now. Returns 3.
///
/// # Safety
///
/// `out` must be valid for `n` writes of `u64`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fakecuda_host_copy_stats(out: *mut u64, n: usize) -> usize {
    let n = n.min(pinning::COPY_STATS);
    if n > 0 && !out.is_null() {
        // SAFETY: per this function's contract.
        pinning::read_copies(unsafe { std::slice::from_raw_parts_mut(out, n) });
    }
    pinning::COPY_STATS
}

/// Test control: stands for another thread capturing a stream in global mode (`on` 1) or ends
/// it (0): while it does, pinning calls from threads not in relaxed capture mode fail and
/// invalidate the capture (`capture`). Returns 0.
#[unsafe(no_mangle)]
pub extern "C" fn fakecuda_global_capture(on: c_int) -> c_int {
    capture::set_global_capture(on != 0);
    0
}

/// Test probe: captures invalidated by an unsafe call so far.
#[unsafe(no_mangle)]
pub extern "C" fn fakecuda_captures_invalidated() -> u64 {
    capture::invalidated()
}

/// Test control: holds every `cuMemMap` at its entry for at most `ms` from now (0: lets them
/// go).
#[unsafe(no_mangle)]
pub extern "C" fn fakecuda_hold_map(ms: u64) -> c_int {
    gate::MAP.hold(ms);
    0
}

/// Test probe: waits until at least `n` `cuMemMap` calls are held at their entry, or `ms`
/// pass; returns how many are.
#[unsafe(no_mangle)]
pub extern "C" fn fakecuda_wait_map_held(n: u64, ms: u64) -> u64 {
    gate::MAP.wait_held(n, ms)
}

/// Test probe: waits until at least `n` pinning calls wait at their entry (hold mode 1), or
/// `ms` pass; returns how many do.
#[unsafe(no_mangle)]
pub extern "C" fn fakecuda_wait_pinning_held(n: u64, ms: u64) -> u64 {
    pinning::wait_held(n, ms)
}

/// Writes the first `min(n, 2)` figures of this process's pinning hold to `out`: pinning calls
/// waiting at their entry now, and pinning calls that a hold's deadline let go (not its end).
/// Returns 2.
///
/// # Safety
///
/// `out` must be valid for `n` writes of `u64`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fakecuda_pin_hold_stats(out: *mut u64, n: usize) -> usize {
    let n = n.min(pinning::HOLD_STATS);
    if n > 0 && !out.is_null() {
        // SAFETY: per this function's contract.
        pinning::read_hold(unsafe { std::slice::from_raw_parts_mut(out, n) });
    }
    pinning::HOLD_STATS
}
