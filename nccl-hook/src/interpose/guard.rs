//! NCCL's collective and point-to-point entry points, guarded: while the `nccl` tag is paused,
//! or when a buffer passed lies in memsaver memory whose tag is paused, they return
//! `ncclInvalidUsage` with a clear message instead of letting NCCL touch released memory (a
//! crash, a hang, or silent corruption; with registration, the peers' mappings of the buffer
//! are released too). A peer that paused or resumed `nccl` without this process is caught up
//! with first ([`crate::interpose::epochs`]): refused when it cannot be. Otherwise they forward to
//! libnccl.
//!
//! With libmemsaver.so preloaded these definitions come first in the global lookup scope, so
//! callers linked against libnccl (torch's ProcessGroupNCCL) reach them. Code that looks the
//! functions up in libnccl's own handle (pynccl: `ctypes.CDLL("libnccl.so.2").ncclAllReduce`)
//! is handed them by the `dlsym` interposer through [`lookup`], when the library it asks is
//! the one they forward to.

use std::ffi::{CStr, c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crate::interpose::dl;

/// `ncclResult_t` values (also returned by `amem`'s functions).
pub(crate) const NCCL_SUCCESS: c_int = 0;
pub(crate) const NCCL_UNHANDLED_CUDA_ERROR: c_int = 1;
pub(crate) const NCCL_SYSTEM_ERROR: c_int = 2;
pub(crate) const NCCL_INTERNAL_ERROR: c_int = 3;
pub(crate) const NCCL_INVALID_ARGUMENT: c_int = 4;
pub(crate) const NCCL_INVALID_USAGE: c_int = 5;

/// Mirrors the `nccl` tag's paused state, read on every guarded call without a lock.
static PAUSED: AtomicBool = AtomicBool::new(false);

pub(crate) fn set_paused(paused: bool) {
    PAUSED.store(paused, Ordering::Release);
}

/// Whether the `nccl` tag is paused: set by a pause, cleared by a resume that completed.
pub(crate) fn is_paused() -> bool {
    PAUSED.load(Ordering::Acquire)
}

fn refuse(name: &str) -> c_int {
    tracing::error!(
        "{name} called while the 'nccl' tag is paused: call memsaver.resume('nccl') (or ncclResume) first"
    );
    NCCL_INVALID_USAGE
}

/// The first of `buffers` that lies in memsaver memory not resident now, and its tag.
fn paused_buffer(buffers: &[usize]) -> Option<(usize, std::sync::Arc<str>)> {
    let a = memsaver_allocator::global_if_started()?;
    buffers
        .iter()
        .filter(|&&b| b != 0)
        .find_map(|&b| match a.allocation_at(b as u64) {
            Some((_, tag, false)) => Some((b, tag)),
            _ => None,
        })
}

fn refuse_buffer(name: &str, (ptr, tag): (usize, std::sync::Arc<str>)) -> c_int {
    tracing::error!(
        "{name} called with the buffer at {ptr:#x}, memory of the tag '{tag}', which is paused \
         (or being paused or resumed): call it after memsaver.resume('{tag}') returns"
    );
    NCCL_INVALID_USAGE
}

/// Refuses a call that would run on peers' memory this process could not bring up to date
/// ([`crate::interpose::epochs`]).
fn refuse_behind(name: &str, why: &str) -> c_int {
    tracing::error!("{name} refused: {why}");
    NCCL_INVALID_USAGE
}

/// libnccl's definition of `name`: the next one after this library, else in an already loaded
/// libnccl (loaded into a local scope, where RTLD_NEXT does not look).
pub(crate) fn resolve(slot: &AtomicUsize, name: &CStr) -> Option<usize> {
    let cached = slot.load(Ordering::Acquire);
    if cached != 0 {
        return Some(cached);
    }
    // SAFETY: RTLD_NEXT lookup of a NUL-terminated name.
    let mut p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) };
    if p.is_null() {
        // SAFETY: NUL-terminated name; RTLD_NOLOAD never loads anything new.
        let h =
            unsafe { libc::dlopen(c"libnccl.so.2".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        if !h.is_null() {
            // Past the interposer: its answer for libnccl's handle is this very function.
            // SAFETY: live handle, NUL-terminated name.
            p = unsafe { dl::call_real_dlsym(h, name.as_ptr()) };
        }
    }
    if p.is_null() || in_this_library(p) {
        return None;
    }
    slot.store(p as usize, Ordering::Release);
    Some(p as usize)
}

/// The version code of the libnccl this process uses (`ncclGetVersion`: 22809 for 2.28.9),
/// `None` when it cannot be asked.
pub(crate) fn nccl_version() -> Option<i32> {
    static SLOT: AtomicUsize = AtomicUsize::new(0);
    let f = resolve(&SLOT, c"ncclGetVersion")?;
    // SAFETY: libnccl's ncclGetVersion(int*) -> ncclResult_t (nccl.h).
    let f = unsafe { std::mem::transmute::<usize, unsafe extern "C" fn(*mut c_int) -> c_int>(f) };
    let mut v = 0;
    // SAFETY: a valid out-pointer.
    (unsafe { f(&mut v) } == NCCL_SUCCESS).then_some(v)
}

/// Whether `p` lies in libmemsaver.so itself (never forward to ourselves).
fn in_this_library(p: *mut c_void) -> bool {
    let base = |addr: *const c_void| dl::object_at(addr).map(|i| i.dli_fbase);
    let here = base(p);
    here.is_some() && here == base(refuse as *const c_void)
}

macro_rules! guarded {
    ($($name:ident [$($buf:ident),*] ($($arg:ident: $ty:ty),*);)*) => {
        $(
            /// Where the guarded function of this name forwards to (resolved on first use).
            #[allow(non_snake_case)]
            mod $name {
                pub(super) static REAL: super::AtomicUsize = super::AtomicUsize::new(0);
                pub(super) const NAME: &std::ffi::CStr = {
                    match std::ffi::CStr::from_bytes_with_nul(
                        concat!(stringify!($name), "\0").as_bytes(),
                    ) {
                        Ok(c) => c,
                        Err(_) => panic!("a literal with one trailing NUL"),
                    }
                };
            }

            /// Guarded NCCL entry point (see the module documentation).
            ///
            /// # Safety
            /// As NCCL's function of the same name.
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn $name($($arg: $ty),*) -> c_int {
                if PAUSED.load(Ordering::Acquire) {
                    return refuse(stringify!($name));
                }
                if let Some(paused) = paused_buffer(&[$($buf as usize),*]) {
                    return refuse_buffer(stringify!($name), paused);
                }
                if let Err(why) = crate::interpose::epochs::before_nccl() {
                    return refuse_behind(stringify!($name), &why);
                }
                match resolve(&$name::REAL, $name::NAME) {
                    Some(f) => {
                        // SAFETY: libnccl's function of this name has this C signature (nccl.h).
                        let f = unsafe { std::mem::transmute::<usize, unsafe extern "C" fn($($ty),*) -> c_int>(f) };
                        // SAFETY: forwarding the caller's arguments unchanged.
                        unsafe { f($($arg),*) }
                    }
                    None => NCCL_SYSTEM_ERROR,
                }
            }
        )*

        /// For a `dlsym(handle, name)` lookup that found `real`: the guarded function of that
        /// name if it forwards to `real` (the same library), else `None` (another NCCL, or
        /// not a guarded name: hand out `real`).
        pub(crate) fn is_guarded(name: &[u8]) -> bool {
            $(name == stringify!($name).as_bytes())||*
        }

        pub(crate) fn lookup(name: &[u8], real: *mut c_void) -> Option<*mut c_void> {
            $(
                if name == stringify!($name).as_bytes() {
                    let target = resolve(&$name::REAL, $name::NAME)?;
                    return (target == real as usize).then_some($name as *const () as *mut c_void);
                }
            )*
            None
        }
    };
}

type Buf = *const c_void;
type BufMut = *mut c_void;
type Comm = *mut c_void;
type Stream = *mut c_void;

guarded! {
    ncclAllReduce [send, recv] (send: Buf, recv: BufMut, count: usize, dtype: c_int, op: c_int, comm: Comm, stream: Stream);
    ncclBroadcast [send, recv] (send: Buf, recv: BufMut, count: usize, dtype: c_int, root: c_int, comm: Comm, stream: Stream);
    ncclBcast [buf] (buf: BufMut, count: usize, dtype: c_int, root: c_int, comm: Comm, stream: Stream);
    ncclReduce [send, recv] (send: Buf, recv: BufMut, count: usize, dtype: c_int, op: c_int, root: c_int, comm: Comm, stream: Stream);
    ncclAllGather [send, recv] (send: Buf, recv: BufMut, count: usize, dtype: c_int, comm: Comm, stream: Stream);
    ncclReduceScatter [send, recv] (send: Buf, recv: BufMut, count: usize, dtype: c_int, op: c_int, comm: Comm, stream: Stream);
    ncclAlltoAll [send, recv] (send: Buf, recv: BufMut, count: usize, dtype: c_int, comm: Comm, stream: Stream);
    ncclGather [send, recv] (send: Buf, recv: BufMut, count: usize, dtype: c_int, root: c_int, comm: Comm, stream: Stream);
    ncclScatter [send, recv] (send: Buf, recv: BufMut, count: usize, dtype: c_int, root: c_int, comm: Comm, stream: Stream);
    ncclSend [send] (send: Buf, count: usize, dtype: c_int, peer: c_int, comm: Comm, stream: Stream);
    ncclRecv [recv] (recv: BufMut, count: usize, dtype: c_int, peer: c_int, comm: Comm, stream: Stream);
}
