//! The loader's own lookups, past the `dlsym` interposer ([`crate::interpose::dlsym`]): glibc's
//! real `dlsym`, and which loaded object an address belongs to. Used by the interposer and by the
//! guarded NCCL entry points ([`crate::interpose::guard`]), which resolve libnccl's functions
//! themselves; and who calls: libnccl, libmemsaver.so or any other object ([`caller`]).

use std::ffi::CStr;
use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The real `dlsym` of glibc, resolved on first use. Read by the naked entry point with a
/// rip-relative load, so it is a plain word (an `AtomicUsize` has the layout of `usize`).
pub(crate) static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);

/// Resolves glibc's `dlsym` (versioned: `GLIBC_2.34` since glibc 2.34, `GLIBC_2.2.5` before).
pub(crate) fn real_dlsym() -> usize {
    let cur = REAL_DLSYM.load(Ordering::Acquire);
    if cur != 0 {
        return cur;
    }
    let mut found = 0usize;
    for version in [c"GLIBC_2.34", c"GLIBC_2.2.5"] {
        // SAFETY: NUL-terminated strings; RTLD_NEXT from this library finds libc's definition.
        let p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
        if !p.is_null() {
            found = p as usize;
            break;
        }
    }
    if found == 0 {
        // Nothing sensible is left: answer every lookup with NULL rather than crash.
        found = no_symbol as *const () as usize;
    }
    REAL_DLSYM.store(found, Ordering::Release);
    found
}

extern "C" fn no_symbol(_: *mut c_void, _: *const c_char) -> *mut c_void {
    std::ptr::null_mut()
}

/// Calls the real `dlsym` from here (for lookups whose caller identity does not matter: an
/// explicit library handle).
///
/// # Safety
/// `handle` is a handle from `dlopen` (or a pseudo-handle other than `RTLD_NEXT`); `symbol`
/// is NUL-terminated.
pub(crate) unsafe fn call_real_dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    type Dlsym = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;
    // SAFETY: `real_dlsym` is glibc's dlsym (or `no_symbol`), both with this signature.
    let f = unsafe { std::mem::transmute::<usize, Dlsym>(real_dlsym()) };
    // SAFETY: forwarded contract.
    unsafe { f(handle, symbol) }
}

/// What the loader knows of the object containing `addr` (`None` if no object does).
pub(crate) fn object_at(addr: *const c_void) -> Option<libc::Dl_info> {
    // SAFETY: zeroed Dl_info is a valid out-parameter; dladdr only reads loader state and
    // accepts any address.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    (unsafe { libc::dladdr(addr, &mut info) } != 0).then_some(info)
}

/// Who looks a symbol up.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Caller {
    Nccl,
    /// libmemsaver.so itself (or an address no object contains).
    Memsaver,
    Other,
}

/// The base address of this library (libmemsaver.so), found once (lock-free).
fn own_base() -> usize {
    static BASE: AtomicUsize = AtomicUsize::new(0);
    let cur = BASE.load(Ordering::Relaxed);
    if cur != 0 {
        return cur;
    }
    let base = object_at(own_base as *const c_void).map_or(usize::MAX, |i| i.dli_fbase as usize);
    BASE.store(base, Ordering::Relaxed);
    base
}

/// Which object the code at `addr` belongs to.
pub(crate) fn caller(addr: *const c_void) -> Caller {
    let Some(info) = object_at(addr) else {
        return Caller::Memsaver;
    };
    if info.dli_fbase as usize == own_base() {
        return Caller::Memsaver;
    }
    if info.dli_fname.is_null() {
        return Caller::Other;
    }
    // SAFETY: dladdr gives a NUL-terminated file name.
    let path = unsafe { CStr::from_ptr(info.dli_fname) }.to_bytes();
    let file = path.rsplit(|b| *b == b'/').next().unwrap_or(path);
    if file.starts_with(b"libnccl") {
        Caller::Nccl
    } else {
        Caller::Other
    }
}
