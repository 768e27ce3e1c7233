//! Wrappers of the driver's entry points that hand NCCL's memory beyond this process's own
//! mappings: exports to peers and imports of theirs (`cuMemExportToShareableHandle`,
//! `cuMemImportFromShareableHandle`), a handle for a NIC (GPUDirect RDMA) and multicast objects.
//! Exports and imports between processes carry tokens instead of fds:
//! [`crate::interpose::tokens`] makes, reads and trades them; the wrappers here make the driver
//! calls and record what was shared in [`crate::registry`]. Memory given to a NIC or bound to a
//! multicast object stays resident (pinned).

use std::ffi::{c_int, c_uint, c_ulonglong, c_void};
use std::os::fd::{AsRawFd, IntoRawFd};

use crate::interpose::vmm::{PLACE, answered, in_run, paused_use, prepare_header, quietly};
use crate::interpose::{real, tokens};
use crate::registry::{self, Keep, Kind, Physical, Registration};
use memsaver_allocator::driver::Handle;
use memsaver_allocator::driver::sys::*;
use memsaver_ipc::token::Token;

pub(super) unsafe extern "C" fn mem_export(
    shareable: *mut c_void,
    handle: CUmemGenericAllocationHandle,
    handle_type: c_uint,
    flags: c_ulonglong,
) -> CUresult {
    let Some(f) = real::EXPORT() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    let mut reg = registry::lock();
    // Where NCCL maps it here (its token says so to importers); only for one of ours.
    let place = if reg.physicals.contains_key(&handle) {
        reg.place_of(handle)
    } else {
        0
    };
    let Some(p) = reg.physicals.get_mut(&handle) else {
        drop(reg);
        // SAFETY: not one of ours: forwarded unchanged.
        return unsafe { f(shareable, handle, handle_type, flags) };
    };
    let Some(h) = p.real() else {
        return paused_use("cuMemExportToShareableHandle", p);
    };
    if let Some(Registration::Retained { at, .. }) = p.registration {
        drop(reg);
        return answered(|| export_tagged(shareable, h, at, handle_type, flags, f));
    }
    if handle_type == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        && tokens::enabled()
        && !shareable.is_null()
        && let Some(fd) = tokens::for_buffer(handle, p, place)
    {
        let first = !std::mem::replace(&mut p.exported, true);
        let (device, size) = (p.device(), p.size);
        drop(reg);
        // SAFETY: for POSIX fds the out-pointer holds one int; NCCL owns the fd now.
        unsafe { *shareable.cast::<c_int>() = fd.into_raw_fd() };
        if first {
            prepare_header(handle, device, size);
        }
        return CUDA_SUCCESS;
    }
    // A buffer in a run goes to peers through a token only: its owner serves the run, which
    // the importer maps whole ([`crate::interpose::vmm`]); the driver's fd would be the run's.
    if p.run.is_some() {
        return in_run("cuMemExportToShareableHandle");
    }
    // SAFETY: the caller's arguments with the driver's handle.
    let r = unsafe { f(shareable, h, handle_type, flags) };
    if r == CUDA_SUCCESS {
        p.exported = true;
        // Its importers are unknown: it stays resident (checked above: it is mapped).
        let _ = p.keep(Keep::ExportedRaw);
    }
    r
}

/// NCCL exports memsaver memory it registers (the allocation at `at`, whose driver handle it
/// retained as `h`): the peer gets a token naming the allocation, so that its import follows
/// the allocation's tag (`memsaver_ipc::shared`). A plain fd would let the peers' imports keep
/// the old memory across a pause and map stale memory after the resume, so when no token can
/// be made (tokens off, this process cannot serve its socket) the export fails with the reason:
/// NCCL then fails the registration and says so.
fn export_tagged(
    shareable: *mut c_void,
    h: CUmemGenericAllocationHandle,
    at: u64,
    handle_type: c_uint,
    flags: c_ulonglong,
    real_export: fns::cuMemExportToShareableHandle,
) -> CUresult {
    if handle_type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || shareable.is_null() {
        // SAFETY: the caller's arguments with the driver's handle (memsaver's memory exports
        // POSIX fds only: the driver refuses other types itself).
        return unsafe { real_export(shareable, h, handle_type, flags) };
    }
    match tokens::for_allocation(at) {
        Some(fd) => {
            // SAFETY: for POSIX fds the out-pointer holds one int; NCCL owns the fd now.
            unsafe { *shareable.cast::<c_int>() = fd.into_raw_fd() };
            CUDA_SUCCESS
        }
        None => CUDA_ERROR_NOT_SUPPORTED,
    }
}

pub(super) unsafe extern "C" fn mem_import(
    handle: *mut CUmemGenericAllocationHandle,
    os_handle: *mut c_void,
    handle_type: c_uint,
) -> CUresult {
    let Some(f) = real::IMPORT() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    if handle.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let token = tokens::read(handle_type, os_handle);
    if let Some(t) = token.filter(tokens::names_allocation) {
        return answered(|| import_registered(handle, &t, handle_type, f));
    }
    let (r, source) = match token {
        None => {
            // SAFETY: forwarded unchanged.
            (unsafe { f(handle, os_handle, handle_type) }, None)
        }
        Some(t) => match tokens::import(&t) {
            Some(imported) => {
                let fd = imported.fd.as_raw_fd();
                // SAFETY: the owner's real fd, imported the way NCCL asked; we close it after.
                let r = unsafe { f(handle, fd as isize as *mut c_void, handle_type) };
                // NCCL reserves the import's addresses next, on this thread: at the buffer's
                // place in this process's copy of the owner's layout.
                if r == CUDA_SUCCESS && t.place != 0 && t.len != 0 {
                    PLACE.set(Some((t.pid, t.place, t.len)));
                }
                (r, Some(imported))
            }
            None => return CUDA_ERROR_INVALID_VALUE,
        },
    };
    if r == CUDA_SUCCESS {
        record_import(handle, |h, prop| match source {
            None => Physical::imported(h, prop, None),
            Some(i) => {
                let mut p = Physical::imported(h, prop, Some((i.source, i.generation)));
                p.served = i.served;
                p
            }
        });
    }
    r
}

/// Records the driver handle NCCL just imported (`*handle`) as `make(handle, properties)` and
/// gives NCCL the virtual handle instead. Where the memory lives (a peer's device, or host
/// memory for NCCL's shared-memory transport) is asked of the driver directly: NCCL may never
/// have looked the query up.
fn record_import(
    handle: *mut CUmemGenericAllocationHandle,
    make: impl FnOnce(CUmemGenericAllocationHandle, CUmemAllocationProp) -> Physical,
) {
    quietly(|| {
        // SAFETY: written by the driver on success.
        let h = unsafe { *handle };
        // Before the registry lock: this may start the allocator.
        let prop = memsaver_allocator::global_driver()
            .ok()
            .and_then(|d| d.properties(Handle(h)).ok())
            .unwrap_or_default();
        let vh = registry::lock().insert(make(h, prop));
        // SAFETY: the caller's out-pointer.
        unsafe { *handle = vh };
    });
}

/// NCCL imports a peer's memsaver memory it registered (token `t`): the fd comes from the
/// owner ([`tokens::open_registered`]), which records this process as an importer, so the
/// owner's pause releases the import and its resume maps it again ([`crate::tag::registered`]).
fn import_registered(
    handle: *mut CUmemGenericAllocationHandle,
    t: &Token,
    handle_type: c_uint,
    real_import: fns::cuMemImportFromShareableHandle,
) -> CUresult {
    // Until the import is recorded: the owner's release of it waits (`registered`).
    let _registering = registry::REGISTERING.lock();
    let Some(opened) = tokens::open_registered(t) else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    // SAFETY: the owner's real fd, imported the way NCCL asked; it is closed after.
    let r = unsafe {
        real_import(
            handle,
            opened.fd.as_raw_fd() as isize as *mut c_void,
            handle_type,
        )
    };
    if r != CUDA_SUCCESS {
        tokens::not_imported(t);
    } else {
        record_import(handle, |h, prop| tokens::registered(h, prop, t, &opened));
    }
    r
}

pub(super) unsafe extern "C" fn mem_nic_handle(
    handle: *mut c_void,
    ptr: CUdeviceptr,
    size: usize,
    handle_type: c_uint,
    flags: c_ulonglong,
) -> CUresult {
    let Some(f) = real::NIC_HANDLE() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    // SAFETY: forwarded unchanged.
    let r = unsafe { f(handle, ptr, size, handle_type, flags) };
    if r == CUDA_SUCCESS {
        quietly(|| {
            pin(ptr, "given to a NIC (GPUDirect RDMA)");
            if let Some((_, tag, _)) =
                memsaver_allocator::global_if_started().and_then(|a| a.allocation_at(ptr))
            {
                // The NIC keeps what it was given: the tag's pause cannot free it, and after a
                // resume the NIC would use memory that is no longer the buffer.
                tracing::warn!(
                    "memsaver: NCCL gives memory of tag '{tag}' (a tensor it registered) to a NIC: \
                     pausing '{tag}' will not free it and the NIC would keep using the old memory \
                     after a resume; turn NCCL's registration off (NCCL_LOCAL_REGISTER=0, \
                     NCCL_GRAPH_REGISTER=0) for tensors whose tag is paused"
                );
            }
        });
    }
    r
}

pub(super) unsafe extern "C" fn mc_create(
    handle: *mut CUmemGenericAllocationHandle,
    prop: *const c_void,
) -> CUresult {
    let Some(f) = real::MC_CREATE() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    // SAFETY: forwarded unchanged.
    let r = unsafe { f(handle, prop) };
    if r == CUDA_SUCCESS {
        quietly(|| registry::lock().multicast_objects += 1);
    }
    r
}

pub(super) unsafe extern "C" fn mc_bind_mem(
    mc: CUmemGenericAllocationHandle,
    mc_offset: usize,
    mem: CUmemGenericAllocationHandle,
    mem_offset: usize,
    size: usize,
    flags: c_ulonglong,
) -> CUresult {
    let Some(f) = real::MC_BIND_MEM() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    let mut reg = registry::lock();
    let real_mem = match reg.physicals.get_mut(&mem) {
        Some(p) => {
            let Some(h) = p.real() else {
                return paused_use("cuMulticastBindMem", p);
            };
            if p.run.is_some() {
                return in_run("cuMulticastBindMem");
            }
            if p.kind == Kind::Tagged {
                // Bound, the memory stays with the multicast object: its tag's pause cannot
                // free it, and its resume would leave the object with the old memory.
                tracing::warn!(
                    "memsaver: NCCL binds memsaver memory (a tensor it registered) to a multicast \
                     object: pausing its tag will not free it; turn NVLS registration off \
                     (NCCL_NVLS_ENABLE=0) for tensors whose tag is paused"
                );
            }
            let _ = p.keep(Keep::Pinned("bound to a multicast object"));
            h
        }
        None => mem,
    };
    drop(reg);
    // SAFETY: the caller's arguments with the driver's handle.
    unsafe { f(mc, mc_offset, real_mem, mem_offset, size, flags) }
}

/// Marks the physical object mapped at `ptr` as one that must stay resident.
fn pin(ptr: CUdeviceptr, why: &'static str) {
    let mut reg = registry::lock();
    if let Some(vh) = reg.mapping_at(ptr).map(|(_, m)| m.vh)
        && let Some(p) = reg.physicals.get_mut(&vh)
    {
        // A paused range cannot be given away (the wrappers refuse it first).
        let _ = p.keep(Keep::Pinned(why));
    }
}
