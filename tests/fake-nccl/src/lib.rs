//! `libnccl.so.2` stand-in for tests: it reaches the CUDA driver the way NCCL's statically
//! linked CUDA runtime does (`dlopen("libcuda.so.1")`, `dlsym(h, "cuGetProcAddress_v2")`, then
//! every function through that, `cuGetProcAddress` itself included) and allocates device
//! memory the way NCCL's cuMem path does (create exportable, reserve, map, set access, export
//! a POSIX fd). The `dlsym` call sites are inside this library, so memsaver's caller filter
//! sees a libnccl caller, as with the real NCCL.

use std::ffi::{CStr, c_char, c_int, c_ulonglong, c_void};

use memsaver_allocator::driver::sys::{fns, *};

/// What one allocation did, for the test to inspect and to free it again.
#[repr(C)]
#[derive(Default)]
pub struct FakeNcclAlloc {
    /// The `cuGetProcAddress_v2` that `dlsym` handed out, and the `cuMemCreate` that it gave.
    pub get_proc_address: usize,
    pub mem_create: usize,
    pub handle: u64,
    pub ptr: u64,
    pub size: usize,
    pub exported_fd: c_int,
}

type GetProcAddress = unsafe extern "C" fn(
    *const c_char,
    *mut *mut c_void,
    c_int,
    c_ulonglong,
    *mut c_int,
) -> CUresult;

struct Driver {
    gpa: GetProcAddress,
}

impl Driver {
    /// # Safety
    /// `T` is the function-pointer type of `name`.
    unsafe fn get<T: Copy>(&self, name: &CStr) -> Result<T, c_int> {
        let mut p: *mut c_void = std::ptr::null_mut();
        let mut status = 0;
        // SAFETY: valid out-pointers; NUL-terminated name.
        let r = unsafe { (self.gpa)(name.as_ptr(), &mut p, 12000, 0, &mut status) };
        if r != CUDA_SUCCESS || p.is_null() {
            return Err(-(r as c_int).max(1));
        }
        // SAFETY: per this function's contract.
        Ok(unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
    }
}

fn ok(r: CUresult) -> Result<(), c_int> {
    if r == CUDA_SUCCESS {
        Ok(())
    } else {
        Err(r as c_int)
    }
}

/// # Safety
/// `cuda_lib` is NUL-terminated.
unsafe fn open(cuda_lib: *const c_char) -> Result<Driver, c_int> {
    // SAFETY: NUL-terminated path.
    let h = unsafe { libc::dlopen(cuda_lib, libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() {
        return Err(-1);
    }
    // SAFETY: live handle, NUL-terminated name. This call site is what the filter checks.
    let gpa = unsafe { libc::dlsym(h, c"cuGetProcAddress_v2".as_ptr()) };
    if gpa.is_null() {
        return Err(-2);
    }
    // SAFETY: the driver's cuGetProcAddress_v2 (or memsaver's wrapper of it).
    let gpa = unsafe { std::mem::transmute::<*mut c_void, GetProcAddress>(gpa) };
    let first = Driver { gpa };
    // Like cudart: ask that function for cuGetProcAddress again, and use what it returns.
    // SAFETY: the type matches the CUDA 12 signature of cuGetProcAddress.
    let gpa: GetProcAddress = unsafe { first.get(c"cuGetProcAddress") }?;
    Ok(Driver { gpa })
}

/// Allocates `size` bytes on device 0 like NCCL's cuMem path, exporting a POSIX fd of it when
/// `export` is 1 (as NCCL does for buffers peers map). `export == 2` allocates host memory
/// (`HOST_NUMA`, mapped for device 0) instead, exported too, as NCCL's shared-memory transport
/// does.
/// `export == 3` only creates the device memory (NCCL between its `cuMemCreate` and its
/// `cuMemMap`): `out.ptr` stays 0 until [`fake_nccl_map`]. Returns 0 or an error code.
///
/// # Safety
/// `cuda_lib` is NUL-terminated; `out` is a valid out-pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fake_nccl_alloc(
    cuda_lib: *const c_char,
    size: usize,
    export: c_int,
    out: *mut FakeNcclAlloc,
) -> c_int {
    let (fd, host, mapped) = (matches!(export, 1 | 2), export == 2, export != 3);
    // SAFETY: per this function's contract.
    match unsafe { alloc(cuda_lib, size, fd, host, mapped) } {
        Ok(a) => {
            // SAFETY: valid out-pointer.
            unsafe { *out = a };
            0
        }
        Err(e) => e,
    }
}

/// # Safety
/// `cuda_lib` is NUL-terminated.
unsafe fn alloc(
    cuda_lib: *const c_char,
    size: usize,
    export_fd: bool,
    host: bool,
    mapped: bool,
) -> Result<FakeNcclAlloc, c_int> {
    // SAFETY: per the caller's contract.
    let d = unsafe { open(cuda_lib) }?;
    // SAFETY: each `get` names the CUDA signature of its function; every pointer passed to
    // the driver points to a live local.
    unsafe {
        let init: fns::cuInit = d.get(c"cuInit")?;
        let retain: fns::cuDevicePrimaryCtxRetain = d.get(c"cuDevicePrimaryCtxRetain")?;
        let push: fns::cuCtxPushCurrent_v2 = d.get(c"cuCtxPushCurrent")?;
        let create: fns::cuMemCreate = d.get(c"cuMemCreate")?;
        let export: fns::cuMemExportToShareableHandle = d.get(c"cuMemExportToShareableHandle")?;
        // NCCL looks every driver function up at its start, before its first allocation.
        let _: fns::cuMemAddressReserve = d.get(c"cuMemAddressReserve")?;
        let _: fns::cuMemMap = d.get(c"cuMemMap")?;
        let _: fns::cuMemSetAccess = d.get(c"cuMemSetAccess")?;

        ok(init(0))?;
        let mut ctx = std::ptr::null_mut();
        ok(retain(&mut ctx, 0))?;
        ok(push(ctx))?;
        let prop = CUmemAllocationProp {
            type_: CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes: CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            location: CUmemLocation {
                type_: if host {
                    CU_MEM_LOCATION_TYPE_HOST_NUMA
                } else {
                    CU_MEM_LOCATION_TYPE_DEVICE
                },
                id: 0,
            },
            ..Default::default()
        };
        let mut a = FakeNcclAlloc {
            get_proc_address: d.gpa as usize,
            mem_create: create as usize,
            size,
            ..Default::default()
        };
        ok(create(&mut a.handle, size, &prop, 0))?;
        a.exported_fd = -1;
        if mapped {
            place(&d, &mut a)?;
        }
        if export_fd {
            let fd = (&mut a.exported_fd as *mut c_int).cast();
            ok(export(
                fd,
                a.handle,
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            ))?;
        }
        Ok(a)
    }
}

/// Reserves a range for the memory `a` holds, maps it there and grants device 0 access, as
/// NCCL does after its `cuMemCreate`.
///
/// # Safety
/// `a.handle` is a live handle of `a.size` bytes, not mapped.
unsafe fn place(d: &Driver, a: &mut FakeNcclAlloc) -> Result<(), c_int> {
    // SAFETY: each `get` names the CUDA signature of its function; every pointer passed to
    // the driver points to a live local.
    unsafe {
        let reserve: fns::cuMemAddressReserve = d.get(c"cuMemAddressReserve")?;
        let map: fns::cuMemMap = d.get(c"cuMemMap")?;
        let access: fns::cuMemSetAccess = d.get(c"cuMemSetAccess")?;
        ok(reserve(&mut a.ptr, a.size, 0, 0, 0))?;
        ok(map(a.ptr, a.size, 0, a.handle, 0))?;
        let desc = CUmemAccessDesc {
            location: CUmemLocation {
                type_: CU_MEM_LOCATION_TYPE_DEVICE,
                id: 0,
            },
            flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        ok(access(a.ptr, a.size, &desc, 1))
    }
}

/// Maps the memory of `a` (from `fake_nccl_alloc` with `export == 3`): reserves, maps and
/// grants device 0 access, setting `a.ptr`. Returns 0 or an error code.
///
/// # Safety
/// `cuda_lib` is NUL-terminated; `a` came from `fake_nccl_alloc` with `export == 3` and was not
/// mapped yet.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fake_nccl_map(cuda_lib: *const c_char, a: *mut FakeNcclAlloc) -> c_int {
    // SAFETY: per this function's contract.
    let r = unsafe { open(cuda_lib).and_then(|d| place(&d, &mut *a)) };
    r.err().unwrap_or(0)
}

/// Imports a peer's buffer from `fd` like NCCL's P2P setup (import, close the fd, reserve,
/// map, grant device 0 access). Returns 0 or an error code.
///
/// # Safety
/// `cuda_lib` is NUL-terminated; `fd` is an fd received from the owner; `out` is valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fake_nccl_import(
    cuda_lib: *const c_char,
    fd: c_int,
    size: usize,
    out: *mut FakeNcclAlloc,
) -> c_int {
    // SAFETY: per this function's contract; every pointer passed to the driver is a live local.
    let r = unsafe {
        (|| -> Result<FakeNcclAlloc, c_int> {
            let d = open(cuda_lib)?;
            let import: fns::cuMemImportFromShareableHandle =
                d.get(c"cuMemImportFromShareableHandle")?;
            let reserve: fns::cuMemAddressReserve = d.get(c"cuMemAddressReserve")?;
            let map: fns::cuMemMap = d.get(c"cuMemMap")?;
            let access: fns::cuMemSetAccess = d.get(c"cuMemSetAccess")?;
            let mut a = FakeNcclAlloc {
                size,
                exported_fd: -1,
                ..Default::default()
            };
            let r = import(
                &mut a.handle,
                fd as isize as *mut c_void,
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            );
            libc::close(fd);
            ok(r)?;
            ok(reserve(&mut a.ptr, size, 0, 0, 0))?;
            ok(map(a.ptr, size, 0, a.handle, 0))?;
            let loc = CUmemLocation {
                type_: CU_MEM_LOCATION_TYPE_DEVICE,
                id: 0,
            };
            let desc = CUmemAccessDesc {
                location: loc,
                flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            ok(access(a.ptr, size, &desc, 1))?;
            Ok(a)
        })()
    };
    match r {
        Ok(a) => {
            // SAFETY: valid out-pointer.
            unsafe { *out = a };
            0
        }
        Err(e) => e,
    }
}

/// Frees what `fake_nccl_alloc` made, in NCCL's order (close fd, unmap, release, free VA).
///
/// # Safety
/// `cuda_lib` is NUL-terminated; `a` came from `fake_nccl_alloc` and is freed once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fake_nccl_free(cuda_lib: *const c_char, a: *const FakeNcclAlloc) -> c_int {
    // SAFETY: per this function's contract.
    let r = unsafe {
        (|| -> Result<(), c_int> {
            let d = open(cuda_lib)?;
            let a = &*a;
            let unmap: fns::cuMemUnmap = d.get(c"cuMemUnmap")?;
            let release: fns::cuMemRelease = d.get(c"cuMemRelease")?;
            let free: fns::cuMemAddressFree = d.get(c"cuMemAddressFree")?;
            if a.exported_fd >= 0 {
                libc::close(a.exported_fd);
            }
            // NCCL's free path (`ncclCuMemFree`): retain the handle from the address, release
            // it, ask the driver the range's size, unmap it, release the original reference,
            // free the range.
            let retain: fns::cuMemRetainAllocationHandle = d.get(c"cuMemRetainAllocationHandle")?;
            let range: fns::cuMemGetAddressRange_v2 = d.get(c"cuMemGetAddressRange")?;
            let mut h = 0;
            ok(retain(&mut h, a.ptr as *mut c_void))?;
            if h != a.handle {
                return Err(-3);
            }
            ok(release(h))?;
            let mut size = 0;
            ok(range(std::ptr::null_mut(), &mut size, a.ptr))?;
            if size != a.size {
                return Err(-4);
            }
            ok(unmap(a.ptr, size))?;
            ok(release(a.handle))?;
            ok(free(a.ptr, size))
        })()
    };
    r.err().unwrap_or(0)
}

/// Exports a POSIX fd of the buffer `a` made, as NCCL's proxy does when a peer asks for it
/// (`cuMemExportToShareableHandle`). Returns the fd, or minus the error code.
///
/// # Safety
/// `cuda_lib` is NUL-terminated; `a` came from `fake_nccl_alloc`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fake_nccl_export(
    cuda_lib: *const c_char,
    a: *const FakeNcclAlloc,
) -> c_int {
    // SAFETY: per this function's contract; the out-pointer is a live local.
    let r = unsafe {
        (|| -> Result<c_int, c_int> {
            let d = open(cuda_lib)?;
            let export: fns::cuMemExportToShareableHandle =
                d.get(c"cuMemExportToShareableHandle")?;
            let mut fd: c_int = -1;
            ok(export(
                (&mut fd as *mut c_int).cast(),
                (*a).handle,
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            ))?;
            Ok(fd)
        })()
    };
    r.unwrap_or_else(|e| -e.abs())
}

/// Gives `size` bytes at `ptr` to a NIC the way NCCL's network transport does with GPUDirect
/// RDMA over dmabuf (`cuMemGetHandleForAddressRange`, then the fd goes to the NIC driver; here
/// it is closed). Returns 0 or an error code.
///
/// # Safety
/// `cuda_lib` is NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fake_nccl_give_to_nic(
    cuda_lib: *const c_char,
    ptr: u64,
    size: usize,
) -> c_int {
    type GetHandle = unsafe extern "C" fn(*mut c_void, u64, usize, u32, u64) -> CUresult;
    // SAFETY: per this function's contract; the out-pointer is a live local.
    let r = unsafe {
        (|| -> Result<(), c_int> {
            let d = open(cuda_lib)?;
            let get: GetHandle = d.get(c"cuMemGetHandleForAddressRange")?;
            let mut fd: c_int = -1;
            ok(get((&mut fd as *mut c_int).cast(), ptr, size, 1, 0))?;
            libc::close(fd);
            Ok(())
        })()
    };
    r.err().unwrap_or(0)
}

/// Registers the user buffer at `buff` the way NCCL's IPC registration does
/// (`ncclCommRegister`, and the buffers of collectives captured in a graph, with cuMem on):
/// asks the driver for the range the buffer lies in, retains the handle at its base, exports
/// a POSIX fd of it for the peers and releases the retained handle. `out` gets the range
/// (`ptr`, `size`) and the exported fd; the peers import and map it with [`fake_nccl_import`]
/// (the whole range, as NCCL's proxy maps `size` bytes of the import) and unmap it with
/// [`fake_nccl_free`]. Returns 0 or an error code.
///
/// # Safety
/// `cuda_lib` is NUL-terminated; `out` is a valid out-pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fake_nccl_register(
    cuda_lib: *const c_char,
    buff: u64,
    out: *mut FakeNcclAlloc,
) -> c_int {
    // SAFETY: per this function's contract; every pointer passed to the driver is a live local.
    let r = unsafe {
        (|| -> Result<FakeNcclAlloc, c_int> {
            let d = open(cuda_lib)?;
            let range: fns::cuMemGetAddressRange_v2 = d.get(c"cuMemGetAddressRange")?;
            let retain: fns::cuMemRetainAllocationHandle = d.get(c"cuMemRetainAllocationHandle")?;
            let export: fns::cuMemExportToShareableHandle =
                d.get(c"cuMemExportToShareableHandle")?;
            let release: fns::cuMemRelease = d.get(c"cuMemRelease")?;
            let mut a = FakeNcclAlloc {
                exported_fd: -1,
                ..Default::default()
            };
            ok(range(&mut a.ptr, &mut a.size, buff))?;
            let mut h = 0;
            ok(retain(&mut h, a.ptr as *mut c_void))?;
            let mut fd: c_int = -1;
            let r = export(
                (&mut fd as *mut c_int).cast(),
                h,
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            );
            ok(release(h))?;
            ok(r)?;
            a.exported_fd = fd;
            Ok(a)
        })()
    };
    match r {
        Ok(a) => {
            // SAFETY: valid out-pointer.
            unsafe { *out = a };
            0
        }
        Err(e) => e,
    }
}

/// Stack per thread NCCL 2.28's kernels need (the driver grows the limit to it when they
/// launch with 2+ ranks; with one rank NCCL launches no kernel that needs it).
pub const KERNEL_STACK_BYTES: usize = 1744;

/// The fake driver's `fakecuda_launch_kernel_needing_stack`, when a communicator of 2+ ranks
/// was set up with [`fake_nccl_comm_init`].
static KERNEL_LAUNCH: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Stands for `ncclCommInitRank`: remembers the communicator's size; with 2+ ranks, each
/// `ncclAllReduce` then "launches NCCL's kernel" in the caller's current context, which grows
/// the stack limit to [`KERNEL_STACK_BYTES`] as on a GPU. Returns 0 or an error code.
///
/// # Safety
/// `cuda_lib` is NUL-terminated and names the fake driver.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fake_nccl_comm_init(cuda_lib: *const c_char, nranks: c_int) -> c_int {
    if nranks < 2 {
        KERNEL_LAUNCH.store(0, std::sync::atomic::Ordering::Relaxed);
        return 0;
    }
    // SAFETY: NUL-terminated path; a live handle and a NUL-terminated name. A test control of
    // the fake driver, not a driver function: looked up directly.
    let f = unsafe {
        let h = libc::dlopen(cuda_lib, libc::RTLD_NOW | libc::RTLD_LOCAL);
        if h.is_null() {
            return -1;
        }
        libc::dlsym(h, c"fakecuda_launch_kernel_needing_stack".as_ptr())
    };
    if f.is_null() {
        return -2;
    }
    KERNEL_LAUNCH.store(f as usize, std::sync::atomic::Ordering::Relaxed);
    0
}

/// NCCL's `ncclAllReduce`, reduced to what the tests need: it succeeds (returns 0) and counts
/// its calls, so a test can tell a forwarded call from a refused one. With 2+ ranks it launches
/// "NCCL's kernel" (see [`fake_nccl_comm_init`]).
#[unsafe(no_mangle)]
pub extern "C" fn ncclAllReduce(
    _send: *const c_void,
    _recv: *mut c_void,
    _count: usize,
    _dtype: c_int,
    _op: c_int,
    _comm: *mut c_void,
    _stream: *mut c_void,
) -> c_int {
    ALL_REDUCE_CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let launch = KERNEL_LAUNCH.load(std::sync::atomic::Ordering::Relaxed);
    if launch != 0 {
        // SAFETY: the fake driver's `fakecuda_launch_kernel_needing_stack(usize) -> CUresult`.
        let launch =
            unsafe { std::mem::transmute::<usize, extern "C" fn(usize) -> CUresult>(launch) };
        let r = launch(KERNEL_STACK_BYTES);
        if r != CUDA_SUCCESS {
            return 1; // ncclUnhandledCudaError
        }
    }
    0
}

static ALL_REDUCE_CALLS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// How many times `ncclAllReduce` ran.
#[unsafe(no_mangle)]
pub extern "C" fn fake_nccl_all_reduce_calls() -> u32 {
    ALL_REDUCE_CALLS.load(std::sync::atomic::Ordering::Relaxed)
}

/// The driver library named by [`fake_nccl_set_cuda_lib`].
static CUDA_LIB: std::sync::Mutex<Option<std::ffi::CString>> = std::sync::Mutex::new(None);

/// Names the driver library that NCCL's own entry points below open (the real NCCL opens
/// `libcuda.so.1`; the tests name the fake driver's path).
///
/// # Safety
/// `cuda_lib` is NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fake_nccl_set_cuda_lib(cuda_lib: *const c_char) {
    // SAFETY: per this function's contract.
    let path = unsafe { CStr::from_ptr(cuda_lib) }.to_owned();
    *CUDA_LIB.lock().unwrap_or_else(|e| e.into_inner()) = Some(path);
}

/// The driver library NCCL's own entry points open: the one named by
/// [`fake_nccl_set_cuda_lib`], else `libcuda.so.1`.
fn cuda_lib() -> std::ffi::CString {
    let named = CUDA_LIB.lock().unwrap_or_else(|e| e.into_inner()).clone();
    named.unwrap_or_else(|| c"libcuda.so.1".to_owned())
}

/// `ncclResult_t` values of NCCL's own entry points below.
const NCCL_SUCCESS: c_int = 0;
const NCCL_UNHANDLED_CUDA_ERROR: c_int = 1;
const NCCL_INVALID_ARGUMENT: c_int = 4;

fn nccl_status(r: Result<(), c_int>) -> c_int {
    match r {
        Ok(()) => NCCL_SUCCESS,
        Err(_) => NCCL_UNHANDLED_CUDA_ERROR,
    }
}

/// NCCL's `ncclMemAlloc` (`src/allocator.cc`, cuMem on): memory of the current device, rounded
/// up to the recommended granularity, exportable as a POSIX fd, in a reservation of its own,
/// mapped and made accessible to the device. Reached through the driver as NCCL reaches it,
/// so memsaver's wrappers see these calls as NCCL's.
///
/// # Safety
/// `ptr` is a valid out-pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> c_int {
    if ptr.is_null() || size == 0 {
        return NCCL_INVALID_ARGUMENT;
    }
    let lib = cuda_lib();
    // SAFETY: NUL-terminated path; each `get` names the CUDA signature of its function; every
    // pointer passed to the driver points to a live local.
    let r = unsafe {
        (|| -> Result<u64, c_int> {
            let d = open(lib.as_ptr())?;
            let get_device: fns::cuCtxGetDevice = d.get(c"cuCtxGetDevice")?;
            let granularity: fns::cuMemGetAllocationGranularity =
                d.get(c"cuMemGetAllocationGranularity")?;
            let create: fns::cuMemCreate = d.get(c"cuMemCreate")?;
            let reserve: fns::cuMemAddressReserve = d.get(c"cuMemAddressReserve")?;
            let map: fns::cuMemMap = d.get(c"cuMemMap")?;
            let access: fns::cuMemSetAccess = d.get(c"cuMemSetAccess")?;
            let release: fns::cuMemRelease = d.get(c"cuMemRelease")?;
            let free: fns::cuMemAddressFree = d.get(c"cuMemAddressFree")?;
            let mut dev = 0;
            ok(get_device(&mut dev))?;
            let location = CUmemLocation {
                type_: CU_MEM_LOCATION_TYPE_DEVICE,
                id: dev,
            };
            let prop = CUmemAllocationProp {
                type_: CU_MEM_ALLOCATION_TYPE_PINNED,
                requestedHandleTypes: CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                location,
                ..Default::default()
            };
            let mut gran = 0;
            ok(granularity(
                &mut gran,
                &prop,
                CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            ))?;
            let size = size.div_ceil(gran.max(1)) * gran.max(1);
            let mut handle = 0;
            ok(create(&mut handle, size, &prop, 0))?;
            let mut at = 0;
            if let Err(e) = ok(reserve(&mut at, size, gran, 0, 0)) {
                release(handle);
                return Err(e);
            }
            if let Err(e) = ok(map(at, size, 0, handle, 0)) {
                release(handle);
                free(at, size);
                return Err(e);
            }
            let desc = CUmemAccessDesc {
                location,
                flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            ok(access(at, size, &desc, 1))?;
            Ok(at)
        })()
    };
    match r {
        Ok(at) => {
            // SAFETY: valid out-pointer per this function's contract.
            unsafe { *ptr = at as *mut c_void };
            NCCL_SUCCESS
        }
        Err(_) => NCCL_UNHANDLED_CUDA_ERROR,
    }
}

/// NCCL's `ncclMemFree` (as `ncclCuMemFree`): retain the handle at the address and release it,
/// ask the range's size, unmap, release the allocation's own reference, free the range.
///
/// # Safety
/// `ptr` came from `ncclMemAlloc` and is freed once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclMemFree(ptr: *mut c_void) -> c_int {
    if ptr.is_null() {
        return NCCL_SUCCESS;
    }
    let lib = cuda_lib();
    // SAFETY: as in `ncclMemAlloc`.
    nccl_status(unsafe {
        (|| -> Result<(), c_int> {
            let d = open(lib.as_ptr())?;
            let retain: fns::cuMemRetainAllocationHandle = d.get(c"cuMemRetainAllocationHandle")?;
            let range: fns::cuMemGetAddressRange_v2 = d.get(c"cuMemGetAddressRange")?;
            let unmap: fns::cuMemUnmap = d.get(c"cuMemUnmap")?;
            let release: fns::cuMemRelease = d.get(c"cuMemRelease")?;
            let free: fns::cuMemAddressFree = d.get(c"cuMemAddressFree")?;
            let mut h = 0;
            ok(retain(&mut h, ptr))?;
            ok(release(h))?;
            let mut size = 0;
            ok(range(std::ptr::null_mut(), &mut size, ptr as u64))?;
            ok(unmap(ptr as u64, size))?;
            ok(release(h))?;
            ok(free(ptr as u64, size))
        })()
    })
}

/// What NCCL's registration of a user buffer holds: the range it registered and, for a window,
/// the handle it retained and the local mapping of it.
#[repr(C)]
#[derive(Default)]
pub struct FakeNcclRegistration {
    /// The range the buffer lies in (`cuMemGetAddressRange`) and the fd exported for the peers.
    pub range: FakeNcclAlloc,
    /// A window's own mapping of the buffer in NCCL's symmetric address space (0: none).
    pub alias: u64,
    /// The handle a window retained for its life (0: none).
    pub retained: u64,
}

/// NCCL's `ncclCommRegister` with IPC registration (cuMem on): see [`fake_nccl_register`]. The
/// handle is a `FakeNcclRegistration` the test reads (the range and the fd to send to peers)
/// and gives back to `ncclCommDeregister`.
///
/// # Safety
/// `handle` is a valid out-pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommRegister(
    _comm: *mut c_void,
    buff: *mut c_void,
    _size: usize,
    handle: *mut *mut c_void,
) -> c_int {
    if handle.is_null() {
        return NCCL_INVALID_ARGUMENT;
    }
    let lib = cuda_lib();
    let mut reg = Box::<FakeNcclRegistration>::default();
    // SAFETY: NUL-terminated path, a live out-pointer.
    let rc = unsafe { fake_nccl_register(lib.as_ptr(), buff as u64, &mut reg.range) };
    if rc != 0 {
        return NCCL_UNHANDLED_CUDA_ERROR;
    }
    // SAFETY: valid out-pointer per this function's contract.
    unsafe { *handle = Box::into_raw(reg).cast() };
    NCCL_SUCCESS
}

/// NCCL's `ncclCommDeregister`: the registration's exported fd (if the test did not send it)
/// goes with it.
///
/// # Safety
/// `handle` came from `ncclCommRegister` and is given back once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommDeregister(_comm: *mut c_void, handle: *mut c_void) -> c_int {
    if handle.is_null() {
        return NCCL_INVALID_ARGUMENT;
    }
    // SAFETY: per this function's contract.
    let reg = unsafe { Box::from_raw(handle.cast::<FakeNcclRegistration>()) };
    if reg.range.exported_fd >= 0 {
        // SAFETY: an fd this registration owns.
        unsafe { libc::close(reg.range.exported_fd) };
    }
    NCCL_SUCCESS
}

/// NCCL's `ncclCommWindowRegister` with `NCCL_WIN_COLL_SYMMETRIC` (`src/dev_runtime.cc`), for
/// this rank's part: the range the buffer lies in, its handle retained for the window's life,
/// mapped a second time at an address of NCCL's own (this rank's slot of the symmetric space,
/// reusing the retained handle), with access for the device, and exported as a POSIX fd for
/// the peers (NCCL's proxy answers their requests with it). The window is a
/// `FakeNcclRegistration`.
///
/// # Safety
/// `win` is a valid out-pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommWindowRegister(
    _comm: *mut c_void,
    buff: *mut c_void,
    _size: usize,
    win: *mut *mut c_void,
    _flags: c_int,
) -> c_int {
    if win.is_null() {
        return NCCL_INVALID_ARGUMENT;
    }
    let lib = cuda_lib();
    // SAFETY: every pointer passed to the driver is a live local.
    let r = unsafe {
        (|| -> Result<FakeNcclRegistration, c_int> {
            let d = open(lib.as_ptr())?;
            let range: fns::cuMemGetAddressRange_v2 = d.get(c"cuMemGetAddressRange")?;
            let retain: fns::cuMemRetainAllocationHandle = d.get(c"cuMemRetainAllocationHandle")?;
            let export: fns::cuMemExportToShareableHandle =
                d.get(c"cuMemExportToShareableHandle")?;
            let reserve: fns::cuMemAddressReserve = d.get(c"cuMemAddressReserve")?;
            let map: fns::cuMemMap = d.get(c"cuMemMap")?;
            let access: fns::cuMemSetAccess = d.get(c"cuMemSetAccess")?;
            let get_device: fns::cuCtxGetDevice = d.get(c"cuCtxGetDevice")?;
            let mut w = FakeNcclRegistration::default();
            w.range.exported_fd = -1;
            ok(range(&mut w.range.ptr, &mut w.range.size, buff as u64))?;
            ok(retain(&mut w.retained, w.range.ptr as *mut c_void))?;
            // The symmetric space is reserved apart (twice the size: other ranks' slots).
            let mut space = 0;
            ok(reserve(&mut space, 2 * w.range.size, 0, 0, 0))?;
            ok(map(space, w.range.size, 0, w.retained, 0))?;
            let mut dev = 0;
            ok(get_device(&mut dev))?;
            let desc = CUmemAccessDesc {
                location: CUmemLocation {
                    type_: CU_MEM_LOCATION_TYPE_DEVICE,
                    id: dev,
                },
                flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            ok(access(space, w.range.size, &desc, 1))?;
            w.alias = space;
            let mut fd: c_int = -1;
            ok(export(
                (&mut fd as *mut c_int).cast(),
                w.retained,
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            ))?;
            w.range.exported_fd = fd;
            Ok(w)
        })()
    };
    match r {
        Ok(w) => {
            // SAFETY: valid out-pointer per this function's contract.
            unsafe { *win = Box::into_raw(Box::new(w)).cast() };
            NCCL_SUCCESS
        }
        Err(_) => NCCL_UNHANDLED_CUDA_ERROR,
    }
}

/// NCCL's `ncclCommWindowDeregister`: unmaps its own mapping, frees that space and releases
/// the handle it retained.
///
/// # Safety
/// `win` came from `ncclCommWindowRegister` and is given back once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommWindowDeregister(_comm: *mut c_void, win: *mut c_void) -> c_int {
    if win.is_null() {
        return NCCL_INVALID_ARGUMENT;
    }
    // SAFETY: per this function's contract.
    let w = unsafe { Box::from_raw(win.cast::<FakeNcclRegistration>()) };
    let lib = cuda_lib();
    // SAFETY: NCCL's own mapping and handle, each let go once.
    nccl_status(unsafe {
        (|| -> Result<(), c_int> {
            if w.range.exported_fd >= 0 {
                libc::close(w.range.exported_fd);
            }
            let d = open(lib.as_ptr())?;
            let unmap: fns::cuMemUnmap = d.get(c"cuMemUnmap")?;
            let free: fns::cuMemAddressFree = d.get(c"cuMemAddressFree")?;
            let release: fns::cuMemRelease = d.get(c"cuMemRelease")?;
            ok(unmap(w.alias, w.range.size))?;
            ok(free(w.alias, 2 * w.range.size))?;
            ok(release(w.retained))
        })()
    })
}

/// NCCL's `ncclGetVersion`: 22809 (2.28.9, torch's), or `FAKE_NCCL_VERSION` when set.
///
/// # Safety
/// `version` is a valid out-pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> c_int {
    if version.is_null() {
        return NCCL_INVALID_ARGUMENT;
    }
    let v = std::env::var("FAKE_NCCL_VERSION")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(22809);
    // SAFETY: per this function's contract.
    unsafe { *version = v };
    NCCL_SUCCESS
}

/// NCCL's own use of `ncclMemAlloc` (`ncclCeInit`: the buffers of its copy-engine collectives),
/// which reaches it through libnccl's PLT, so that a preloaded definition answers: looked up in
/// the global scope from inside libnccl. Returns the address, or 0 on failure.
#[unsafe(no_mangle)]
pub extern "C" fn fake_nccl_ce_alloc(size: usize) -> u64 {
    type MemAlloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
    // SAFETY: NUL-terminated name; RTLD_DEFAULT searches the global scope.
    let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"ncclMemAlloc".as_ptr()) };
    if f.is_null() {
        return 0;
    }
    // SAFETY: ncclMemAlloc's C signature.
    let f = unsafe { std::mem::transmute::<*mut c_void, MemAlloc>(f) };
    let mut p = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    match unsafe { f(&mut p, size) } {
        NCCL_SUCCESS => p as u64,
        _ => 0,
    }
}
