//! The AMem NCCL-plugin API (`ncclPause`, `ncclResume`, `ncclMemStats`, `ncclSetGroupID`,
//! `ncclGetGroupID`), exported by libmemsaver.so so code written for AMem works unchanged.
//!
//! pynccl-style code looks these functions up in *libnccl's* handle
//! (`dlsym(libnccl, "ncclPause")`), where stock NCCL has no such symbol; the `dlsym`
//! interposer answers those lookups with the functions below (see `lookup`).

use std::ffi::{c_int, c_void};

use memsaver_allocator::Error;
use memsaver_ipc::group::{self, SetError};

use crate::interpose::guard::{
    NCCL_INTERNAL_ERROR, NCCL_INVALID_ARGUMENT, NCCL_INVALID_USAGE, NCCL_SUCCESS,
    NCCL_SYSTEM_ERROR, NCCL_UNHANDLED_CUDA_ERROR,
};
use crate::interpose::{guard, procaddr};
use crate::registry;

/// Sets the group id (`ncclSetGroupID`, `memsaver.set_group`): the process group of
/// `memsaver_ipc` (AMem's group id), which namespaces the cross-process coordination of the
/// `nccl` tag. It is fixed once NCCL has shared memory with a peer (the tokens and the socket
/// of this process name it), or the process serves control requests: changing it then is
/// refused.
pub fn set_group_id(id: i64) -> Result<(), Error> {
    group::set(id).map_err(|e| match e {
        SetError::OutOfRange { .. } => Error::InvalidArgument(e.to_string()),
        SetError::Fixed(g) => Error::InvalidArgument(format!(
            "the nccl group of this process is already {g}: its memsaver socket serves that \
             group (NCCL shared memory with peers under it, or it serves control requests); \
             set the group (memsaver.set_group, MEMSAVER_GROUP or ncclSetGroupID) before NCCL \
             initialises and before memsaver.serve_control()"
        )),
    })
}

fn result(r: Result<(), Error>) -> c_int {
    match r {
        Ok(()) => NCCL_SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "memsaver: NCCL memory pause/resume failed");
            match e {
                Error::Driver(_) | Error::OutOfMemory { .. } | Error::ResumeOutOfMemory { .. } => {
                    NCCL_UNHANDLED_CUDA_ERROR
                }
                Error::Load(_) => NCCL_SYSTEM_ERROR,
                Error::InvalidArgument(_) | Error::UnknownTag { .. } => NCCL_INVALID_ARGUMENT,
                _ => NCCL_INTERNAL_ERROR,
            }
        }
    }
}

fn transition(pause: bool) -> c_int {
    let r = std::panic::catch_unwind(|| {
        let a = memsaver_allocator::global()?;
        if pause {
            a.pause(&["nccl"])
        } else {
            a.resume(&["nccl"])
        }
        .map(drop)
    });
    r.map_or(NCCL_INTERNAL_ERROR, result)
}

/// Releases NCCL's device memory in this process (every communicator; `comm` is ignored).
#[unsafe(no_mangle)]
pub extern "C" fn ncclPause(_comm: *mut c_void) -> c_int {
    transition(true)
}

/// Restores what `ncclPause` released, at the same addresses.
#[unsafe(no_mangle)]
pub extern "C" fn ncclResume(_comm: *mut c_void) -> c_int {
    transition(false)
}

/// Writes NCCL's memory figures of this process to stderr, one line.
#[unsafe(no_mangle)]
pub extern "C" fn ncclMemStats() -> c_int {
    let r = std::panic::catch_unwind(|| {
        // The registry's figures (what the line shows), as `memsaver.nccl_stats()` gives them.
        let s = registry::stats(procaddr::installed(), false, guard::is_paused());
        eprintln!(
            "memsaver nccl group:{} pid:{} owned:{} B exported:{} B imported:{} B paused:{} B hooked:{}",
            group::id(),
            std::process::id(),
            s.owned_bytes,
            s.exported_bytes,
            s.imported_bytes,
            s.paused_bytes,
            s.hooked
        );
    });
    if r.is_ok() {
        NCCL_SUCCESS
    } else {
        NCCL_INTERNAL_ERROR
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclSetGroupID(id: c_int) -> c_int {
    match set_group_id(i64::from(id)) {
        Ok(()) => NCCL_SUCCESS,
        Err(e) => {
            tracing::error!("ncclSetGroupID({id}): {e}");
            NCCL_INVALID_USAGE
        }
    }
}

/// # Safety
/// `id` is NULL or a valid out-pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetGroupID(id: *mut c_int) -> c_int {
    if id.is_null() {
        return NCCL_INVALID_ARGUMENT;
    }
    // SAFETY: non-null out-pointer per the contract.
    unsafe { *id = group::id() as c_int };
    NCCL_SUCCESS
}

/// Our function for an AMem API name, for the `dlsym` interposer.
pub(crate) fn lookup(name: &[u8]) -> Option<*mut c_void> {
    Some(match name {
        b"ncclPause" => ncclPause as *mut c_void,
        b"ncclResume" => ncclResume as *mut c_void,
        b"ncclMemStats" => ncclMemStats as *mut c_void,
        b"ncclSetGroupID" => ncclSetGroupID as *mut c_void,
        b"ncclGetGroupID" => ncclGetGroupID as *mut c_void,
        _ => return None,
    })
}
