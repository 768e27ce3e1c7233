//! The allocation hooks that PyTorch calls.
//!
//! * **Preload mode** (`LD_PRELOAD=libmemsaver.so`): this library defines `cudaMalloc` and
//!   `cudaFree`. libc10_cuda imports them dynamically from libcudart, so these definitions win.
//!   Inside a region the allocation goes to memsaver with the region's tag and policy; outside,
//!   the call is forwarded untouched to the real function of libcudart, unless whole-process
//!   mode (`MEMSAVER_PROCESS_TAG`, see [`crate::region`]) gives it the process tag.
//! * **Pluggable mode** (no preload): `torch.cuda.memory.CUDAPluggableAllocator` is pointed at
//!   `memsaver_torch_malloc` / `memsaver_torch_free` and used through one `MemPool` per
//!   (tag, policy, device), entered only inside regions.
//!
//! * **NCCL's allocator** (`ncclMemAlloc`/`ncclMemFree`, interposed by nccl-hook): the same
//!   choice as `cudaMalloc` in preload mode, through `memsaver_nccl_hook::APP_ALLOCATORS`.
//!
//! The hooks are thin: read the thread's region, then call the allocator or forward. Errors
//! are reported through the return value torch expects and `memsaver_last_error`.

use std::ffi::{CStr, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::OnceLock;

use memsaver_allocator::{Allocator, Error, global_if_started};

use crate::ffi::set_last_error;
use crate::region;

/// `cudaError_t` values we return ourselves.
const CUDA_SUCCESS: c_int = 0;
const CUDA_ERROR_INVALID_VALUE: c_int = 1;
const CUDA_ERROR_MEMORY_ALLOCATION: c_int = 2;
/// `cudaErrorInitializationError`: libcudart is not loaded, so there is nothing to forward to.
const CUDA_ERROR_INITIALIZATION: c_int = 3;

type CudaMalloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
type CudaFree = unsafe extern "C" fn(*mut c_void) -> c_int;

/// Finds the real definition of a libcudart function: the next one in the lookup order after
/// this library, else in an already loaded libcudart (torch may load it with RTLD_LOCAL, where
/// RTLD_NEXT cannot see it).
fn real_symbol(name: &CStr) -> Option<*mut c_void> {
    // SAFETY: `name` is NUL-terminated; RTLD_NEXT is a valid pseudo-handle.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) };
    if !p.is_null() {
        return Some(p);
    }
    for lib in [c"libcudart.so.13", c"libcudart.so.12"] {
        // SAFETY: NUL-terminated name; RTLD_NOLOAD never loads anything new.
        let h = unsafe { libc::dlopen(lib.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        if !h.is_null() {
            // SAFETY: `h` is a live handle; the name is NUL-terminated.
            let p = unsafe { libc::dlsym(h, name.as_ptr()) };
            if !p.is_null() {
                return Some(p);
            }
        }
    }
    None
}

fn real_cuda_malloc() -> Option<CudaMalloc> {
    static REAL: OnceLock<CudaMalloc> = OnceLock::new();
    if let Some(f) = REAL.get() {
        return Some(*f);
    }
    // SAFETY: the symbol is libcudart's cudaMalloc, whose C signature `CudaMalloc` spells out.
    let f = unsafe { std::mem::transmute::<*mut c_void, CudaMalloc>(real_symbol(c"cudaMalloc")?) };
    Some(*REAL.get_or_init(|| f))
}

fn real_cuda_free() -> Option<CudaFree> {
    static REAL: OnceLock<CudaFree> = OnceLock::new();
    if let Some(f) = REAL.get() {
        return Some(*f);
    }
    // SAFETY: the symbol is libcudart's cudaFree, whose C signature `CudaFree` spells out.
    let f = unsafe { std::mem::transmute::<*mut c_void, CudaFree>(real_symbol(c"cudaFree")?) };
    Some(*REAL.get_or_init(|| f))
}

/// The device of the caller's current context, as the CUDA runtime would allocate on.
fn current_device(a: &Allocator) -> i32 {
    a.driver().current_device().unwrap_or(0)
}

/// Allocates `size` bytes for the calling thread's region (or the whole-process tag); `None`
/// when neither applies.
fn region_alloc(size: usize, device: Option<i32>) -> Option<Result<u64, Error>> {
    let (tag, policy) = match region::lookup() {
        Ok(current) => current?,
        Err(e) => return Some(Err(e)),
    };
    Some(crate::allocator().and_then(|a| {
        let device = device.unwrap_or_else(|| current_device(a));
        a.malloc(size, device, &tag, policy)
    }))
}

/// Frees `ptr` if memsaver made it; `None` if it is not ours.
fn owned_free(ptr: *mut c_void) -> Option<Result<(), Error>> {
    match global_if_started()?.free(ptr as u64) {
        Err(Error::UnknownPointer { .. }) => None,
        r => Some(r),
    }
}

/// `ncclMemAlloc`/`ncclMemFree` (interposed by nccl-hook) allocate the application's memory
/// here when the thread's region or the whole-process tag applies, as `cudaMalloc` does; a
/// failure is also this thread's `memsaver_last_error` (NCCL's callers see only a status).
#[linkme::distributed_slice(memsaver_nccl_hook::APP_ALLOCATORS)]
static NCCL_MEM_ALLOC: memsaver_nccl_hook::AppAllocator = memsaver_nccl_hook::AppAllocator {
    alloc: |size| region_alloc(size, None).map(noted),
    free: |ptr| owned_free(ptr as *mut c_void).map(noted),
};

/// `r`, its error also set as this thread's last error.
fn noted<T>(r: Result<T, Error>) -> Result<T, Error> {
    r.inspect_err(|e| set_last_error(&e.to_string()))
}

/// `cudaMalloc`, interposed. Inside a region the memory comes from memsaver.
///
/// # Safety
/// As `cudaMalloc`: `dev_ptr` is a valid out-pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaMalloc(dev_ptr: *mut *mut c_void, size: usize) -> c_int {
    catch_unwind(AssertUnwindSafe(|| {
        if dev_ptr.is_null() {
            return CUDA_ERROR_INVALID_VALUE;
        }
        match region_alloc(size, None) {
            Some(Ok(p)) => {
                // SAFETY: non-null out-pointer per cudaMalloc's contract.
                unsafe { *dev_ptr = p as *mut c_void };
                CUDA_SUCCESS
            }
            Some(Err(e)) => {
                tracing::warn!(bytes = size, error = %e, "cudaMalloc in a memsaver region failed");
                set_last_error(&e.to_string());
                CUDA_ERROR_MEMORY_ALLOCATION
            }
            None => match real_cuda_malloc() {
                // SAFETY: forwarding the caller's arguments to the real function.
                Some(real) => unsafe { real(dev_ptr, size) },
                None => CUDA_ERROR_INITIALIZATION,
            },
        }
    }))
    .unwrap_or(CUDA_ERROR_MEMORY_ALLOCATION)
}

/// `cudaFree`, interposed. Memory made by memsaver is freed by memsaver, in any state.
///
/// # Safety
/// As `cudaFree`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaFree(dev_ptr: *mut c_void) -> c_int {
    catch_unwind(AssertUnwindSafe(|| match owned_free(dev_ptr) {
        Some(Ok(())) => CUDA_SUCCESS,
        Some(Err(e)) => {
            set_last_error(&e.to_string());
            CUDA_ERROR_INVALID_VALUE
        }
        None => match real_cuda_free() {
            // SAFETY: forwarding the caller's argument to the real function.
            Some(real) => unsafe { real(dev_ptr) },
            None => CUDA_ERROR_INITIALIZATION,
        },
    }))
    .unwrap_or(CUDA_ERROR_INVALID_VALUE)
}

/// Allocation entry point for `CUDAPluggableAllocator`. Returns NULL (torch reports out of
/// memory) with the reason in `memsaver_last_error` when outside a region or on failure.
#[unsafe(no_mangle)]
pub extern "C" fn memsaver_torch_malloc(
    size: isize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    // Memsaver's memory is not stream-ordered: any stream may use it once it is returned.
    let _ = stream;
    let r = catch_unwind(|| {
        let size = usize::try_from(size)
            .map_err(|_| Error::InvalidArgument(format!("negative allocation size {size}")))?;
        region_alloc(size, Some(device)).unwrap_or_else(|| {
            Err(Error::InvalidArgument(
                "the memsaver pluggable allocator was called outside a memsaver region; allocate \
                 inside `with memsaver.region(tag):`"
                    .into(),
            ))
        })
    });
    match r {
        Ok(Ok(p)) => p as *mut c_void,
        Ok(Err(e)) => {
            tracing::warn!(bytes = size, device, error = %e, "memsaver_torch_malloc failed");
            set_last_error(&e.to_string());
            std::ptr::null_mut()
        }
        Err(_) => std::ptr::null_mut(),
    }
}

/// Free entry point for `CUDAPluggableAllocator`.
#[unsafe(no_mangle)]
pub extern "C" fn memsaver_torch_free(
    ptr: *mut c_void,
    size: isize,
    device: c_int,
    stream: *mut c_void,
) {
    // The allocation is found by its address; torch's size, device and stream add nothing.
    let _ = (size, device, stream);
    let r = catch_unwind(|| owned_free(ptr));
    match r {
        Ok(Some(Ok(()))) => {}
        Ok(Some(Err(e))) => set_last_error(&e.to_string()),
        Ok(None) => {
            let e = format!("memsaver_torch_free: {ptr:p} was not allocated by memsaver");
            tracing::error!("{e}");
            set_last_error(&e);
        }
        Err(_) => {}
    }
}

/// `cudaIpcMemHandle_t`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CudaIpcMemHandle {
    pub reserved: [u8; memsaver_ipc::shared::HANDLE_BYTES],
}

/// `cudaErrorInvalidResourceHandle`: a handle that cannot be opened.
const CUDA_ERROR_INVALID_RESOURCE_HANDLE: c_int = 400;
/// `cudaErrorMapBufferObjectFailed`: the owner refused or could not serve the memory.
const CUDA_ERROR_MAP_BUFFER_OBJECT_FAILED: c_int = 205;

type CudaIpcGetMemHandle = unsafe extern "C" fn(*mut CudaIpcMemHandle, *mut c_void) -> c_int;
type CudaIpcOpenMemHandle =
    unsafe extern "C" fn(*mut *mut c_void, CudaIpcMemHandle, std::ffi::c_uint) -> c_int;
type CudaIpcCloseMemHandle = unsafe extern "C" fn(*mut c_void) -> c_int;

/// The real libcudart function `name`, as `F`.
///
/// # Safety
/// `F` is the C signature of `name`.
unsafe fn real<F: Copy>(name: &CStr) -> Option<F> {
    let p = real_symbol(name)?;
    // SAFETY: guaranteed by the caller; a function pointer has the size of a data pointer.
    Some(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

/// `cudaIpcGetMemHandle`, interposed: a handle of memsaver's own (see
/// `memsaver_ipc::shared`) for memory memsaver allocated, the real runtime's otherwise.
///
/// # Safety
/// As `cudaIpcGetMemHandle`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaIpcGetMemHandle(
    handle: *mut CudaIpcMemHandle,
    dev_ptr: *mut c_void,
) -> c_int {
    catch_unwind(AssertUnwindSafe(|| {
        if handle.is_null() {
            return CUDA_ERROR_INVALID_VALUE;
        }
        match memsaver_ipc::shared::handle_of(dev_ptr as u64) {
            Ok(Some(h)) => {
                // SAFETY: non-null out-pointer per the function's contract.
                unsafe {
                    (*handle).reserved = h.encode();
                }
                CUDA_SUCCESS
            }
            Ok(None) => {
                // SAFETY: the C signature of cudaIpcGetMemHandle.
                match unsafe { real::<CudaIpcGetMemHandle>(c"cudaIpcGetMemHandle") } {
                    // SAFETY: forwarding the caller's arguments.
                    Some(f) => forwarded("cudaIpcGetMemHandle", unsafe { f(handle, dev_ptr) }),
                    None => CUDA_ERROR_INITIALIZATION,
                }
            }
            Err(e) => {
                tracing::warn!("cudaIpcGetMemHandle of memsaver memory failed: {e}");
                set_last_error(&e.to_string());
                CUDA_ERROR_INVALID_VALUE
            }
        }
    }))
    .unwrap_or(CUDA_ERROR_INVALID_VALUE)
}

/// The status of a call forwarded to libcudart; a failure is also this thread's last error, so
/// that `memsaver_last_error` never shows an older message of memsaver's for it.
fn forwarded(name: &str, rc: c_int) -> c_int {
    if rc != CUDA_SUCCESS {
        set_last_error(&format!(
            "{name}: not memsaver memory, forwarded to libcudart, which returned {rc}"
        ));
    }
    rc
}

/// `cudaIpcOpenMemHandle`, interposed: memsaver's handles are opened through their owner (the
/// import follows the owner's pauses and resumes), others by the real runtime.
///
/// # Safety
/// As `cudaIpcOpenMemHandle`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaIpcOpenMemHandle(
    dev_ptr: *mut *mut c_void,
    handle: CudaIpcMemHandle,
    flags: std::ffi::c_uint,
) -> c_int {
    catch_unwind(AssertUnwindSafe(|| {
        if dev_ptr.is_null() {
            return CUDA_ERROR_INVALID_VALUE;
        }
        match memsaver_ipc::shared::open(&handle.reserved) {
            Ok(Some(p)) => {
                // SAFETY: non-null out-pointer per the function's contract.
                unsafe { *dev_ptr = p as *mut c_void };
                CUDA_SUCCESS
            }
            Ok(None) => {
                // SAFETY: the C signature of cudaIpcOpenMemHandle.
                match unsafe { real::<CudaIpcOpenMemHandle>(c"cudaIpcOpenMemHandle") } {
                    Some(f) => {
                        // SAFETY: forwarding the caller's arguments.
                        let rc = unsafe { f(dev_ptr, handle, flags) };
                        forwarded("cudaIpcOpenMemHandle", rc)
                    }
                    None => CUDA_ERROR_INITIALIZATION,
                }
            }
            Err(e) => {
                tracing::warn!("cudaIpcOpenMemHandle of memsaver memory failed: {e}");
                set_last_error(&e.to_string());
                CUDA_ERROR_MAP_BUFFER_OBJECT_FAILED
            }
        }
    }))
    .unwrap_or(CUDA_ERROR_INVALID_RESOURCE_HANDLE)
}

/// `cudaIpcCloseMemHandle`, interposed: imports of memsaver memory are released here (and
/// their owner told), others by the real runtime.
///
/// # Safety
/// As `cudaIpcCloseMemHandle`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaIpcCloseMemHandle(dev_ptr: *mut c_void) -> c_int {
    catch_unwind(AssertUnwindSafe(|| {
        match memsaver_ipc::shared::close(dev_ptr as u64) {
            Some(Ok(())) => CUDA_SUCCESS,
            Some(Err(e)) => {
                // Released here; only the owner's notice failed.
                tracing::warn!("cudaIpcCloseMemHandle: {e}");
                set_last_error(&e.to_string());
                CUDA_SUCCESS
            }
            None => {
                // SAFETY: the C signature of cudaIpcCloseMemHandle.
                match unsafe { real::<CudaIpcCloseMemHandle>(c"cudaIpcCloseMemHandle") } {
                    // SAFETY: forwarding the caller's argument.
                    Some(f) => forwarded("cudaIpcCloseMemHandle", unsafe { f(dev_ptr) }),
                    None => CUDA_ERROR_INITIALIZATION,
                }
            }
        }
    }))
    .unwrap_or(CUDA_ERROR_INVALID_VALUE)
}
