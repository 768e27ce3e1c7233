//! The `dlsym` interposer: the one door through which NCCL's driver calls are seen.
//!
//! libnccl links the CUDA runtime statically; that runtime opens `libcuda.so.1` with `dlopen` and
//! looks up `cuGetProcAddress_v2` with `dlsym`, then resolves every driver function NCCL uses
//! through it. When libmemsaver.so is preloaded its `dlsym` comes first, so for exactly those
//! lookups it hands out one of `crate::interpose::procaddr`'s wrappers instead of the driver's
//! function: libnccl's pair (VMM and graph calls) to libnccl, the other pair (graph calls and
//! `cuCtxSetLimit`, see `crate::interpose::graphs`) to every other object, the CUDA runtime
//! included, but never to libmemsaver.so itself (its driver layer resolves through `dlsym` too).
//! Direct lookups of those graph and limit names by objects other than libnccl and libmemsaver.so
//! are answered with `crate::interpose::graphs`' wrappers. Every other lookup is forwarded
//! untouched.
//!
//! Forwarding must be a tail jump: glibc derives what `RTLD_NEXT` means from the return
//! address of its caller, so a plain call from here would make every other library's
//! `dlsym(RTLD_NEXT, ...)` resolve relative to libmemsaver.so. The entry point is therefore a
//! naked function that asks `decide` (a normal function: no locks, no allocation on the
//! pass-through path) whether to answer, and otherwise jumps to the real `dlsym` with the
//! caller's registers and return address intact.

use std::ffi::{CStr, c_char, c_void};

use crate::interpose::dl::{Caller, REAL_DLSYM, call_real_dlsym, caller, real_dlsym};

/// Decides whether the interposer answers a lookup itself. Returns the pointer to hand out,
/// or NULL to forward the call to the real `dlsym` (also on any internal failure).
extern "C" fn decide(
    handle: *mut c_void,
    symbol: *const c_char,
    from: *const c_void,
) -> *mut c_void {
    // Resolve the forwarding target before anything else: the entry point jumps to it.
    real_dlsym();
    let r = std::panic::catch_unwind(|| {
        if symbol.is_null() || handle == libc::RTLD_NEXT {
            return std::ptr::null_mut();
        }
        // SAFETY: dlsym's contract: a NUL-terminated symbol name.
        let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
        if name.starts_with(b"nccl") {
            // Looked up in libnccl's handle by pynccl-style code. AMem's API: ours, unless the
            // library really has it (a patched NCCL). Collectives and `ncclMemAlloc`/`Free`:
            // ours, when they forward to the very function found.
            let ours = crate::interpose::amem::lookup(name);
            let forwards = crate::interpose::guard::is_guarded(name)
                || crate::interpose::appmem::is_interposed(name);
            if ours.is_none() && !forwards {
                return std::ptr::null_mut(); // NCCL's own lookups (plugins ...): forwarded
            }
            // SAFETY: an explicit handle or pseudo-handle other than RTLD_NEXT; NUL-terminated.
            let real = unsafe { call_real_dlsym(handle, symbol) };
            return match ours {
                Some(ours) if real.is_null() => ours,
                Some(_) => std::ptr::null_mut(),
                None if real.is_null() => std::ptr::null_mut(),
                None => crate::interpose::guard::lookup(name, real)
                    .or_else(|| crate::interpose::appmem::lookup(name, real))
                    .unwrap_or(std::ptr::null_mut()),
            };
        }
        let entry = crate::interpose::procaddr::is_entry_name(name);
        if !entry && !crate::interpose::graphs::is_direct_name(name) {
            return std::ptr::null_mut();
        }
        let who = caller(from);
        if who == Caller::Memsaver || (!entry && who == Caller::Nccl) {
            return std::ptr::null_mut();
        }
        // SAFETY: an explicit handle from the caller's dlopen; NUL-terminated name.
        let real = unsafe { call_real_dlsym(handle, symbol) };
        if real.is_null() {
            return std::ptr::null_mut();
        }
        if entry {
            crate::interpose::procaddr::wrap_entry(name, real, who == Caller::Nccl)
        } else {
            crate::interpose::graphs::wrap(name, None, true, real).unwrap_or(std::ptr::null_mut())
        }
    });
    r.unwrap_or(std::ptr::null_mut())
}

/// `dlsym`, interposed (see the module documentation).
///
/// # Safety
/// As glibc's `dlsym`.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    // On entry rsp = 8 (mod 16). Save the two arguments, realign, pass the caller's return
    // address as the third argument of `decide`.
    core::arch::naked_asm!(
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "mov rdx, [rsp + 24]",
        "call {decide}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "test rax, rax",
        "jz 2f",
        "ret",
        "2:",
        "jmp qword ptr [rip + {real}]",
        decide = sym decide,
        real = sym REAL_DLSYM,
    )
}
