//! `cuGetErrorName` / `cuGetErrorString`: the driver's own names and messages for every code
//! this fake can return.

use std::ffi::CStr;

use memsaver_allocator::driver::sys::*;

/// `CUDA_ERROR_ILLEGAL_ADDRESS`, missing from `sys` because memsaver never returns it; the
/// names table knows it so that a caller printing a real driver's code gets the right text.
pub const CUDA_ERROR_ILLEGAL_ADDRESS: CUresult = 700;

/// `(code, name, message)`, messages as the real driver words them.
const TABLE: &[(CUresult, &CStr, &CStr)] = &[
    (CUDA_SUCCESS, c"CUDA_SUCCESS", c"no error"),
    (
        CUDA_ERROR_INVALID_VALUE,
        c"CUDA_ERROR_INVALID_VALUE",
        c"invalid argument",
    ),
    (
        CUDA_ERROR_OUT_OF_MEMORY,
        c"CUDA_ERROR_OUT_OF_MEMORY",
        c"out of memory",
    ),
    (
        CUDA_ERROR_NOT_INITIALIZED,
        c"CUDA_ERROR_NOT_INITIALIZED",
        c"initialization error",
    ),
    (
        CUDA_ERROR_NO_DEVICE,
        c"CUDA_ERROR_NO_DEVICE",
        c"no CUDA-capable device is detected",
    ),
    (
        CUDA_ERROR_INVALID_DEVICE,
        c"CUDA_ERROR_INVALID_DEVICE",
        c"invalid device ordinal",
    ),
    (
        CUDA_ERROR_INVALID_CONTEXT,
        c"CUDA_ERROR_INVALID_CONTEXT",
        c"invalid device context",
    ),
    (
        CUDA_ERROR_ALREADY_MAPPED,
        c"CUDA_ERROR_ALREADY_MAPPED",
        c"resource already mapped",
    ),
    (
        CUDA_ERROR_NOT_MAPPED,
        c"CUDA_ERROR_NOT_MAPPED",
        c"resource not mapped",
    ),
    (
        CUDA_ERROR_INVALID_HANDLE,
        c"CUDA_ERROR_INVALID_HANDLE",
        c"invalid resource handle",
    ),
    (
        CUDA_ERROR_NOT_FOUND,
        c"CUDA_ERROR_NOT_FOUND",
        c"named symbol not found",
    ),
    (
        CUDA_ERROR_NOT_READY,
        c"CUDA_ERROR_NOT_READY",
        c"device not ready",
    ),
    (
        CUDA_ERROR_ILLEGAL_ADDRESS,
        c"CUDA_ERROR_ILLEGAL_ADDRESS",
        c"an illegal memory access was encountered",
    ),
    (
        CUDA_ERROR_LAUNCH_FAILED,
        c"CUDA_ERROR_LAUNCH_FAILED",
        c"unspecified launch failure",
    ),
    (
        CUDA_ERROR_NOT_PERMITTED,
        c"CUDA_ERROR_NOT_PERMITTED",
        c"operation not permitted",
    ),
    (
        CUDA_ERROR_NOT_SUPPORTED,
        c"CUDA_ERROR_NOT_SUPPORTED",
        c"operation not supported",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
        c"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        c"operation not permitted when stream is capturing",
    ),
    (CUDA_ERROR_UNKNOWN, c"CUDA_ERROR_UNKNOWN", c"unknown error"),
];

/// The name of `code`, e.g. `CUDA_ERROR_OUT_OF_MEMORY`.
pub fn name(code: CUresult) -> Option<&'static CStr> {
    TABLE.iter().find(|e| e.0 == code).map(|e| e.1)
}

/// The message of `code`, e.g. `out of memory`.
pub fn message(code: CUresult) -> Option<&'static CStr> {
    TABLE.iter().find(|e| e.0 == code).map(|e| e.2)
}
