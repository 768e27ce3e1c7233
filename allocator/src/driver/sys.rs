//! Raw C types, constants and function-pointer signatures of the CUDA driver API subset that
//! memsaver uses. Hand-written from `cuda.h`; the layouts are identical in CUDA 12.x and 13.x.
//!
//! Only this module and [`super`] know the C ABI. The fake driver used by the tests
//! (`tests/fake-cuda`) implements the same signatures from these very definitions, so the two can
//! not drift apart.
#![allow(non_camel_case_types, non_snake_case)]

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};

pub type CUresult = c_uint;
pub type CUdevice = c_int;
pub type CUdeviceptr = c_ulonglong;
pub type CUmemGenericAllocationHandle = c_ulonglong;
pub type CUcontext = *mut c_void;
pub type CUstream = *mut c_void;
pub type CUevent = *mut c_void;
pub type CUgraph = *mut c_void;
pub type CUgraphExec = *mut c_void;
pub type CUgraphNode = *mut c_void;
pub type CUmodule = *mut c_void;
pub type CUfunction = *mut c_void;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_NO_DEVICE: CUresult = 100;
pub const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
pub const CUDA_ERROR_UNSUPPORTED_LIMIT: CUresult = 215;
pub const CUDA_ERROR_ALREADY_MAPPED: CUresult = 208;
pub const CUDA_ERROR_NOT_MAPPED: CUresult = 211;
pub const CUDA_ERROR_INVALID_HANDLE: CUresult = 400;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
/// A kernel failed; the context is unusable afterwards (every later call returns it).
pub const CUDA_ERROR_LAUNCH_FAILED: CUresult = 719;
pub const CUDA_ERROR_NOT_PERMITTED: CUresult = 800;
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;
/// A call a thread may not make while a stream captures (it invalidates the capture).
pub const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: CUresult = 900;
/// `CU_STREAM_CAPTURE_MODE_RELAXED`: the thread may make calls that are unsafe during a
/// capture, whatever other threads capture.
pub const CU_STREAM_CAPTURE_MODE_RELAXED: c_int = 2;
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;

/// `CUmemAllocationType`
pub const CU_MEM_ALLOCATION_TYPE_PINNED: c_uint = 1;
/// `CUmemAllocationHandleType`
pub const CU_MEM_HANDLE_TYPE_NONE: c_uint = 0;
pub const CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: c_uint = 1;
pub const CU_MEM_HANDLE_TYPE_FABRIC: c_uint = 8;
/// `CUmemLocationType`
pub const CU_MEM_LOCATION_TYPE_DEVICE: c_uint = 1;
/// `CUlimit`: per-thread stack size of kernels (bytes); the driver sizes the context's local
/// memory from it.
pub const CU_LIMIT_STACK_SIZE: c_uint = 0;
/// `CUdevice_attribute`: what sizes the local memory the stack limit reserves (one stack per
/// thread that can be resident: multiprocessors x threads per multiprocessor).
pub const CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: c_int = 16;
pub const CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: c_int = 39;
/// `CUdevice_attribute`: the device reaches registered host memory at its host address (so a
/// kernel may be given a pointer into a registered backup).
pub const CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM: c_int = 91;
pub const CU_MEM_LOCATION_TYPE_HOST: c_uint = 2;
pub const CU_MEM_LOCATION_TYPE_HOST_NUMA: c_uint = 3;
pub const CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT: c_uint = 4;
/// `CUmemAccess_flags`
pub const CU_MEM_ACCESS_FLAGS_PROT_NONE: c_uint = 0;
pub const CU_MEM_ACCESS_FLAGS_PROT_READ: c_uint = 1;
pub const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: c_uint = 3;
/// `CUmemAllocationGranularity_flags`
pub const CU_MEM_ALLOC_GRANULARITY_MINIMUM: c_uint = 0;
pub const CU_MEM_ALLOC_GRANULARITY_RECOMMENDED: c_uint = 1;
/// `CUstream_flags`
pub const CU_STREAM_NON_BLOCKING: c_uint = 1;
/// `CUevent_flags`
pub const CU_EVENT_DISABLE_TIMING: c_uint = 2;
/// `cuMemHostAlloc` flags
pub const CU_MEMHOSTALLOC_PORTABLE: c_uint = 1;
/// `cuMemHostRegister` flags
pub const CU_MEMHOSTREGISTER_PORTABLE: c_uint = 1;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CUmemLocation {
    pub type_: c_uint,
    pub id: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CUmemAllocFlags {
    pub compressionType: u8,
    pub gpuDirectRDMACapable: u8,
    pub usage: u16,
    pub reserved: [u8; 4],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CUmemAllocationProp {
    pub type_: c_uint,
    pub requestedHandleTypes: c_uint,
    pub location: CUmemLocation,
    pub win32HandleMetaData: *mut c_void,
    pub allocFlags: CUmemAllocFlags,
}

// SAFETY: the only pointer, `win32HandleMetaData`, is Windows-only metadata: NULL on Linux and
// never dereferenced by memsaver, so the value is plain data that any thread may hold.
unsafe impl Send for CUmemAllocationProp {}
// SAFETY: as above.
unsafe impl Sync for CUmemAllocationProp {}

impl Default for CUmemAllocationProp {
    fn default() -> Self {
        Self {
            type_: 0,
            requestedHandleTypes: 0,
            location: CUmemLocation::default(),
            win32HandleMetaData: std::ptr::null_mut(),
            allocFlags: CUmemAllocFlags::default(),
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CUmemAccessDesc {
    pub location: CUmemLocation,
    pub flags: c_uint,
}

/// `CUDA_GRAPH_INSTANTIATE_PARAMS` (`cuGraphInstantiateWithParams`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_GRAPH_INSTANTIATE_PARAMS {
    pub flags: u64,
    pub hUploadStream: CUstream,
    pub hErrNode_out: CUgraphNode,
    /// `CUgraphInstantiateResult`: 0 is success.
    pub result_out: c_uint,
}

// Layout checks against cuda.h (x86-64 and aarch64 alike).
const _: () = assert!(std::mem::size_of::<CUDA_GRAPH_INSTANTIATE_PARAMS>() == 32);
const _: () = assert!(std::mem::size_of::<CUmemAllocationProp>() == 32);
const _: () = assert!(std::mem::size_of::<CUmemAccessDesc>() == 12);

/// Function-pointer types, one per driver entry point, named after the C function.
pub mod fns {
    use super::*;
    pub type cuInit = unsafe extern "C" fn(flags: c_uint) -> CUresult;
    pub type cuDriverGetVersion = unsafe extern "C" fn(version: *mut c_int) -> CUresult;
    pub type cuGetErrorName = unsafe extern "C" fn(e: CUresult, s: *mut *const c_char) -> CUresult;
    pub type cuGetErrorString =
        unsafe extern "C" fn(e: CUresult, s: *mut *const c_char) -> CUresult;
    pub type cuDeviceGetCount = unsafe extern "C" fn(count: *mut c_int) -> CUresult;
    pub type cuDeviceGet = unsafe extern "C" fn(dev: *mut CUdevice, ordinal: c_int) -> CUresult;
    pub type cuDevicePrimaryCtxRetain =
        unsafe extern "C" fn(ctx: *mut CUcontext, dev: CUdevice) -> CUresult;
    pub type cuCtxPushCurrent_v2 = unsafe extern "C" fn(ctx: CUcontext) -> CUresult;
    pub type cuCtxPopCurrent_v2 = unsafe extern "C" fn(ctx: *mut CUcontext) -> CUresult;
    pub type cuCtxSynchronize = unsafe extern "C" fn() -> CUresult;
    pub type cuCtxGetDevice = unsafe extern "C" fn(dev: *mut CUdevice) -> CUresult;
    pub type cuCtxGetLimit = unsafe extern "C" fn(value: *mut usize, limit: c_uint) -> CUresult;
    pub type cuCtxSetLimit = unsafe extern "C" fn(limit: c_uint, value: usize) -> CUresult;
    pub type cuDeviceGetAttribute =
        unsafe extern "C" fn(value: *mut c_int, attribute: c_int, dev: CUdevice) -> CUresult;
    pub type cuGraphCreate = unsafe extern "C" fn(graph: *mut CUgraph, flags: c_uint) -> CUresult;
    pub type cuGraphDestroy = unsafe extern "C" fn(graph: CUgraph) -> CUresult;
    /// What `cuGetProcAddress("cuGraphInstantiate")` hands out for CUDA >= 12.0.
    pub type cuGraphInstantiateWithFlags = unsafe extern "C" fn(
        exec: *mut CUgraphExec,
        graph: CUgraph,
        flags: c_ulonglong,
    ) -> CUresult;
    /// The exported `cuGraphInstantiate` and `cuGraphInstantiate_v2`, and what
    /// `cuGetProcAddress("cuGraphInstantiate")` hands out below CUDA 12.0.
    pub type cuGraphInstantiate_v2 = unsafe extern "C" fn(
        exec: *mut CUgraphExec,
        graph: CUgraph,
        error_node: *mut CUgraphNode,
        log: *mut c_char,
        log_size: usize,
    ) -> CUresult;
    pub type cuGraphInstantiateWithParams = unsafe extern "C" fn(
        exec: *mut CUgraphExec,
        graph: CUgraph,
        params: *mut CUDA_GRAPH_INSTANTIATE_PARAMS,
    ) -> CUresult;
    pub type cuGraphExecDestroy = unsafe extern "C" fn(exec: CUgraphExec) -> CUresult;
    pub type cuGraphLaunch = unsafe extern "C" fn(exec: CUgraphExec, stream: CUstream) -> CUresult;
    pub type cuMemGetInfo_v2 =
        unsafe extern "C" fn(free: *mut usize, total: *mut usize) -> CUresult;
    pub type cuMemGetAllocationGranularity = unsafe extern "C" fn(
        granularity: *mut usize,
        prop: *const CUmemAllocationProp,
        option: c_uint,
    ) -> CUresult;
    pub type cuMemCreate = unsafe extern "C" fn(
        handle: *mut CUmemGenericAllocationHandle,
        size: usize,
        prop: *const CUmemAllocationProp,
        flags: c_ulonglong,
    ) -> CUresult;
    pub type cuMemRelease = unsafe extern "C" fn(handle: CUmemGenericAllocationHandle) -> CUresult;
    pub type cuMemAddressReserve = unsafe extern "C" fn(
        ptr: *mut CUdeviceptr,
        size: usize,
        alignment: usize,
        addr: CUdeviceptr,
        flags: c_ulonglong,
    ) -> CUresult;
    pub type cuMemAddressFree = unsafe extern "C" fn(ptr: CUdeviceptr, size: usize) -> CUresult;
    pub type cuMemMap = unsafe extern "C" fn(
        ptr: CUdeviceptr,
        size: usize,
        offset: usize,
        handle: CUmemGenericAllocationHandle,
        flags: c_ulonglong,
    ) -> CUresult;
    pub type cuMemUnmap = unsafe extern "C" fn(ptr: CUdeviceptr, size: usize) -> CUresult;
    pub type cuMemSetAccess = unsafe extern "C" fn(
        ptr: CUdeviceptr,
        size: usize,
        desc: *const CUmemAccessDesc,
        count: usize,
    ) -> CUresult;
    pub type cuMemExportToShareableHandle = unsafe extern "C" fn(
        shareable: *mut c_void,
        handle: CUmemGenericAllocationHandle,
        handle_type: c_uint,
        flags: c_ulonglong,
    ) -> CUresult;
    pub type cuMemImportFromShareableHandle = unsafe extern "C" fn(
        handle: *mut CUmemGenericAllocationHandle,
        os_handle: *mut c_void,
        handle_type: c_uint,
    ) -> CUresult;
    pub type cuMemRetainAllocationHandle = unsafe extern "C" fn(
        handle: *mut CUmemGenericAllocationHandle,
        addr: *mut c_void,
    ) -> CUresult;
    pub type cuMemGetAllocationPropertiesFromHandle = unsafe extern "C" fn(
        prop: *mut CUmemAllocationProp,
        handle: CUmemGenericAllocationHandle,
    ) -> CUresult;
    pub type cuMemGetAddressRange_v2 = unsafe extern "C" fn(
        base: *mut CUdeviceptr,
        size: *mut usize,
        ptr: CUdeviceptr,
    ) -> CUresult;
    pub type cuStreamCreate =
        unsafe extern "C" fn(stream: *mut CUstream, flags: c_uint) -> CUresult;
    pub type cuStreamSynchronize = unsafe extern "C" fn(stream: CUstream) -> CUresult;
    pub type cuStreamDestroy_v2 = unsafe extern "C" fn(stream: CUstream) -> CUresult;
    pub type cuEventCreate = unsafe extern "C" fn(event: *mut CUevent, flags: c_uint) -> CUresult;
    pub type cuEventRecord = unsafe extern "C" fn(event: CUevent, stream: CUstream) -> CUresult;
    pub type cuEventSynchronize = unsafe extern "C" fn(event: CUevent) -> CUresult;
    pub type cuEventDestroy_v2 = unsafe extern "C" fn(event: CUevent) -> CUresult;
    pub type cuMemcpyDtoHAsync_v2 = unsafe extern "C" fn(
        dst: *mut c_void,
        src: CUdeviceptr,
        bytes: usize,
        stream: CUstream,
    ) -> CUresult;
    pub type cuMemcpyHtoDAsync_v2 = unsafe extern "C" fn(
        dst: CUdeviceptr,
        src: *const c_void,
        bytes: usize,
        stream: CUstream,
    ) -> CUresult;
    pub type cuMemsetD8_v2 =
        unsafe extern "C" fn(dst: CUdeviceptr, value: u8, count: usize) -> CUresult;
    pub type cuMemsetD8Async = unsafe extern "C" fn(
        dst: CUdeviceptr,
        value: u8,
        count: usize,
        stream: CUstream,
    ) -> CUresult;
    pub type cuMemHostAlloc =
        unsafe extern "C" fn(pp: *mut *mut c_void, bytes: usize, flags: c_uint) -> CUresult;
    pub type cuMemFreeHost = unsafe extern "C" fn(p: *mut c_void) -> CUresult;
    pub type cuMemHostRegister_v2 =
        unsafe extern "C" fn(p: *mut c_void, bytes: usize, flags: c_uint) -> CUresult;
    pub type cuMemHostUnregister = unsafe extern "C" fn(p: *mut c_void) -> CUresult;
    pub type cuModuleLoadData =
        unsafe extern "C" fn(module: *mut CUmodule, image: *const c_void) -> CUresult;
    pub type cuModuleGetFunction = unsafe extern "C" fn(
        function: *mut CUfunction,
        module: CUmodule,
        name: *const c_char,
    ) -> CUresult;
    #[allow(clippy::too_many_arguments)]
    pub type cuLaunchKernel = unsafe extern "C" fn(
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
    ) -> CUresult;
    pub type cuThreadExchangeStreamCaptureMode = unsafe extern "C" fn(mode: *mut c_int) -> CUresult;
    pub type cuGetProcAddress_v2 = unsafe extern "C" fn(
        symbol: *const c_char,
        pfn: *mut *mut c_void,
        cuda_version: c_int,
        flags: c_ulonglong,
        status: *mut c_int,
    ) -> CUresult;
}
