//! Memory the application allocates through NCCL: `ncclMemAlloc` and `ncclMemFree`, interposed.
//!
//! torch's NCCL memory pools (`torch.cuda.MemPool(backend.mem_allocator)`), torch's symmetric
//! memory on the NCCL backend, vLLM's and SGLang's NCCL allocators take memory for their own
//! tensors from `ncclMemAlloc`. That memory is the application's, not NCCL's scratch: it takes
//! the tag any other allocation of the calling thread would take, and keeps every byte.
//!
//! * **Tagged** (a region is open on the thread, or whole-process mode gives the process tag):
//!   the memory comes from memsaver's allocator, exactly as a `cudaMalloc` there would
//!   ([`APP_ALLOCATORS`], filled by the layer that knows the regions). It pauses and resumes
//!   with its tag under that tag's backup policy. When NCCL registers it (`ncclCommRegister`,
//!   `ncclCommWindowRegister`) NCCL retains and exports a handle of memsaver memory, which the
//!   wrappers already treat as a tagged registration: the peers' imports follow the tag.
//! * **Untagged**: forwarded to libnccl's own `ncclMemAlloc`, with this thread marked
//!   ([`in_application_alloc`]) so that the VMM wrappers record none of its driver calls: the
//!   memory stays resident, as any untagged allocation does, and the `nccl` tag never touches it.
//!
//! NCCL's own calls of `ncclMemAlloc` (its copy-engine collectives' buffers: the caller is
//! libnccl) are NCCL's memory, the tag `nccl`, as before. `ncclMemFree` frees memsaver's memory
//! in memsaver and forwards the rest. Both appear in
//! `nccl_stats()["application"]`, apart from NCCL's own memory.
//!
//! With libmemsaver.so preloaded these definitions come first in the global lookup scope, so
//! torch (linked against libnccl) reaches them; code that looks them up in libnccl's handle
//! (`ctypes.CDLL("libnccl.so.2").ncclMemAlloc`) is handed them by the `dlsym` interposer through
//! [`lookup`], when they forward to the function found.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::AtomicUsize;

use parking_lot::Mutex;

use crate::interpose::dl;
use crate::interpose::guard::{
    NCCL_INVALID_ARGUMENT, NCCL_INVALID_USAGE, NCCL_SUCCESS, NCCL_SYSTEM_ERROR,
    NCCL_UNHANDLED_CUDA_ERROR, resolve,
};
use crate::registry::AppMemoryStats;

/// How the layer that knows the calling thread's region allocates application memory.
pub struct AppAllocator {
    /// Allocates `size` bytes with the thread's tag (its open region, or the whole-process
    /// tag) on the current device; `None` when no tag applies (the memory is NCCL's to make).
    pub alloc: fn(size: usize) -> Option<Result<u64, memsaver_allocator::Error>>,
    /// Frees `ptr` if memsaver allocated it; `None` when it did not.
    pub free: fn(ptr: u64) -> Option<Result<(), memsaver_allocator::Error>>,
}

/// The application allocator (torch-shim adds the one of libmemsaver.so); empty in a process
/// that links no such layer, where every `ncclMemAlloc` is forwarded untagged.
#[linkme::distributed_slice]
pub static APP_ALLOCATORS: [AppAllocator];

thread_local! {
    /// This thread is inside libnccl's `ncclMemAlloc` on the application's behalf.
    static APPLICATION: Cell<bool> = const { Cell::new(false) };
}

/// Whether the driver call being wrapped on this thread belongs to an application allocation
/// made by libnccl's own `ncclMemAlloc` (untagged): the VMM wrappers forward it unrecorded.
pub(crate) fn in_application_alloc() -> bool {
    APPLICATION.get()
}

/// One application buffer from `ncclMemAlloc`.
struct AppBuffer {
    size: u64,
    /// Its tag when memsaver allocated it; `None`: libnccl did, resident.
    tag: Option<String>,
}

/// The application's buffers from `ncclMemAlloc` that are not freed yet, by address.
static BUFFERS: Mutex<BTreeMap<u64, AppBuffer>> = Mutex::new(BTreeMap::new());

pub(crate) fn stats() -> AppMemoryStats {
    let mut s = AppMemoryStats::default();
    for b in BUFFERS.lock().values() {
        s.allocations += 1;
        s.bytes += b.size;
        match &b.tag {
            Some(t) => *s.tagged_bytes.entry(t.clone()).or_default() += b.size,
            None => s.untagged_bytes += b.size,
        }
    }
    s
}

type MemAlloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
type MemFree = unsafe extern "C" fn(*mut c_void) -> c_int;

static REAL_ALLOC: AtomicUsize = AtomicUsize::new(0);
static REAL_FREE: AtomicUsize = AtomicUsize::new(0);

fn real_alloc() -> Option<MemAlloc> {
    let f = resolve(&REAL_ALLOC, c"ncclMemAlloc")?;
    // SAFETY: libnccl's ncclMemAlloc has this C signature (nccl.h).
    Some(unsafe { std::mem::transmute::<usize, MemAlloc>(f) })
}

fn real_free() -> Option<MemFree> {
    let f = resolve(&REAL_FREE, c"ncclMemFree")?;
    // SAFETY: libnccl's ncclMemFree has this C signature (nccl.h).
    Some(unsafe { std::mem::transmute::<usize, MemFree>(f) })
}

/// The status NCCL would give for memsaver's error `e`.
fn status_of(e: &memsaver_allocator::Error) -> c_int {
    use memsaver_allocator::Error;
    match e {
        Error::Driver(_) | Error::OutOfMemory { .. } => NCCL_UNHANDLED_CUDA_ERROR,
        Error::TagPaused { .. } => NCCL_INVALID_USAGE,
        _ => NCCL_INVALID_ARGUMENT,
    }
}

/// libnccl's `ncclMemAlloc` for an untagged allocation, its driver calls unrecorded.
fn forward_alloc(ptr: *mut *mut c_void, size: usize) -> c_int {
    let Some(f) = real_alloc() else {
        tracing::error!("ncclMemAlloc: libnccl's own ncclMemAlloc cannot be found");
        return NCCL_SYSTEM_ERROR;
    };
    let before = APPLICATION.replace(true);
    // SAFETY: forwarding the caller's arguments unchanged.
    let r = unsafe { f(ptr, size) };
    APPLICATION.set(before);
    if r == NCCL_SUCCESS {
        // SAFETY: written by libnccl on success (the out-pointer was checked non-null).
        let at = unsafe { *ptr } as u64;
        BUFFERS.lock().insert(
            at,
            AppBuffer {
                size: size as u64,
                tag: None,
            },
        );
    }
    r
}

/// libnccl's own `ncclMemAlloc`, recorded as NCCL's memory: NCCL calls it itself (through
/// its PLT, so it reaches this library's definition) for the buffers of its copy-engine
/// collectives, which are its own, as much as those it allocates with `cuMemCreate`.
fn forward_nccls_own(ptr: *mut *mut c_void, size: usize) -> c_int {
    match real_alloc() {
        // SAFETY: forwarding the caller's arguments unchanged.
        Some(f) => unsafe { f(ptr, size) },
        None => NCCL_SYSTEM_ERROR,
    }
}

/// `ncclMemAlloc`, interposed (see the module documentation): hands the caller's return
/// address to [`mem_alloc_from`] by a tail jump (the stack stays the caller's).
///
/// # Safety
/// As NCCL's `ncclMemAlloc`: `ptr` is a valid out-pointer.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> c_int {
    // On entry [rsp] is the return address; the two arguments are in rdi and rsi.
    core::arch::naked_asm!(
        "mov rdx, [rsp]",
        "jmp {from}",
        from = sym mem_alloc_from,
    )
}

/// `ncclMemAlloc`, interposed, where the caller cannot be told (no tail-jump entry point for
/// this architecture): every call is the application's.
///
/// # Safety
/// As NCCL's `ncclMemAlloc`: `ptr` is a valid out-pointer.
#[cfg(not(target_arch = "x86_64"))]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> c_int {
    mem_alloc_from(ptr, size, std::ptr::null())
}

/// `ncclMemAlloc` called from the code at `caller`: NCCL's own call (from libnccl) is NCCL's
/// memory, any other is the application's.
extern "C" fn mem_alloc_from(ptr: *mut *mut c_void, size: usize, caller: *const c_void) -> c_int {
    std::panic::catch_unwind(|| {
        if ptr.is_null() {
            return NCCL_INVALID_ARGUMENT;
        }
        if dl::caller(caller) == dl::Caller::Nccl {
            return forward_nccls_own(ptr, size);
        }
        let tagged = APP_ALLOCATORS.first().and_then(|a| (a.alloc)(size));
        match tagged {
            None => forward_alloc(ptr, size),
            Some(Ok(at)) => {
                let tag = memsaver_allocator::global_if_started()
                    .and_then(|a| a.allocation_at(at))
                    .map_or_else(String::new, |(_, tag, _)| tag.to_string());
                BUFFERS.lock().insert(
                    at,
                    AppBuffer {
                        size: size as u64,
                        tag: Some(tag),
                    },
                );
                // SAFETY: non-null out-pointer per ncclMemAlloc's contract.
                unsafe { *ptr = at as *mut c_void };
                NCCL_SUCCESS
            }
            Some(Err(e)) => {
                tracing::error!(bytes = size, error = %e, "ncclMemAlloc in a memsaver region failed");
                status_of(&e)
            }
        }
    })
    .unwrap_or(NCCL_INTERNAL)
}

/// `ncclInternalError`, for a panic caught at the boundary.
const NCCL_INTERNAL: c_int = crate::interpose::guard::NCCL_INTERNAL_ERROR;

/// `ncclMemFree`, interposed: memsaver's memory is freed by memsaver (in any state, paused
/// included), the rest by libnccl.
///
/// # Safety
/// As NCCL's `ncclMemFree`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclMemFree(ptr: *mut c_void) -> c_int {
    std::panic::catch_unwind(|| {
        if ptr.is_null() {
            return NCCL_SUCCESS;
        }
        let ours = APP_ALLOCATORS.first().and_then(|a| (a.free)(ptr as u64));
        let r = match ours {
            Some(Ok(())) => NCCL_SUCCESS,
            Some(Err(e)) => {
                tracing::error!(ptr = format_args!("{ptr:p}"), error = %e, "ncclMemFree failed");
                return status_of(&e);
            }
            None => match real_free() {
                // SAFETY: forwarding the caller's argument unchanged.
                Some(f) => unsafe { f(ptr) },
                None => {
                    tracing::error!("ncclMemFree: libnccl's own ncclMemFree cannot be found");
                    return NCCL_SYSTEM_ERROR;
                }
            },
        };
        if r == NCCL_SUCCESS {
            BUFFERS.lock().remove(&(ptr as u64));
        }
        r
    })
    .unwrap_or(NCCL_INTERNAL)
}

/// Whether `name` is one of the functions interposed here.
pub(crate) fn is_interposed(name: &[u8]) -> bool {
    name == b"ncclMemAlloc" || name == b"ncclMemFree"
}

/// For a `dlsym(handle, name)` lookup that found `real`: the interposed function of that name
/// if it forwards to `real` (the same libnccl), else `None` (hand out `real`).
pub(crate) fn lookup(name: &[u8], real: *mut c_void) -> Option<*mut c_void> {
    let (slot, cname, ours) = match name {
        b"ncclMemAlloc" => (
            &REAL_ALLOC,
            c"ncclMemAlloc",
            ncclMemAlloc as *const () as usize,
        ),
        b"ncclMemFree" => (
            &REAL_FREE,
            c"ncclMemFree",
            ncclMemFree as *const () as usize,
        ),
        _ => return None,
    };
    let target = resolve(slot, cname)?;
    (target == real as usize).then_some(ours as *mut c_void)
}
