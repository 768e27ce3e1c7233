//! The pause guard of the C ABI (`memsaver_set_pause_guard`): a function of the layer that
//! caches freed device memory above memsaver (the Python package, for torch's caching
//! allocator), called by the allocator around every pause and resume, those that control
//! requests from other processes make included (the core's `PauseGuard`, `guard.rs`).
//!
//! The function is kept in a static, and a start hook hands the allocator a guard that reads it
//! at each call: installing one never starts the allocator, and one installed after the start
//! applies from the next transition. With none installed, a pause of tensor tags in a process
//! where PyTorch's CUDA library is loaded is refused: torch would hand out its cached blocks of
//! the paused memory, and only the package's guard can stop it.

use std::ffi::{CString, c_char, c_int};
use std::sync::Arc;
use std::sync::atomic::{AtomicPtr, Ordering};

use memsaver_allocator::{Allocator, LayerError, PauseGuard, StartHook};

use crate::ffi::take_malloc_c_string;

/// The C type of a pause guard, `MemsaverPauseGuard` in memsaver.h.
pub type GuardFn = unsafe extern "C" fn(event: c_int, tags: *const c_char) -> *mut c_char;

/// The installed guard (a function pointer), or NULL.
static GUARD: AtomicPtr<()> = AtomicPtr::new(std::ptr::null_mut());

pub(crate) fn set(g: Option<GuardFn>) {
    GUARD.store(
        g.map_or(std::ptr::null_mut(), |f| f as *mut ()),
        Ordering::SeqCst,
    );
}

fn installed() -> Option<GuardFn> {
    let p = GUARD.load(Ordering::SeqCst);
    // SAFETY: a non-null value was stored from a `GuardFn` by `set`.
    (!p.is_null()).then(|| unsafe { std::mem::transmute::<*mut (), GuardFn>(p) })
}

/// Calls the installed guard, if any: its refusal, or `None`.
fn call(event: c_int, tags: Option<&[String]>) -> Option<String> {
    let f = installed()?;
    // Tag names are validated (letters, digits, `_`, `-`, `.`): no NUL, no comma.
    let list = tags.map(|t| CString::new(t.join(",")).unwrap_or_default());
    let p = list.as_ref().map_or(std::ptr::null(), |l| l.as_ptr());
    // SAFETY: the contract of `memsaver_set_pause_guard`: `f` may be called from any thread,
    // with a NUL-terminated list (or NULL) that outlives the call, and returns NULL or a
    // malloc'ed NUL-terminated message that is ours to free.
    let answer = unsafe { f(event, p) };
    // SAFETY: as above.
    unsafe { take_malloc_c_string(answer) }
}

struct Installed;

/// Why the pause guard refused a pause.
#[derive(Debug, thiserror::Error)]
enum Refusal {
    /// PyTorch's caching allocator is loaded, and no guard is installed to stop it.
    #[error(
        "this process has PyTorch's CUDA library loaded ({lib}), whose caching allocator would \
         hand out blocks of the paused memory of tag(s) {} to new tensors, and nothing here \
         stops it: import memsaver in this process (the package installs a pause guard in \
         libmemsaver.so when it is imported)",
        .tags.join(", ")
    )]
    Unguarded { lib: String, tags: Vec<String> },
    /// The installed guard (the Python package's) refused, with its message.
    #[error("{0}")]
    Guard(String),
}

/// PyTorch's CUDA library, whose caching allocator keeps freed blocks of memsaver's memory.
const TORCH_CUDA: &std::ffi::CStr = c"libtorch_cuda.so";

/// Whether PyTorch's CUDA library is loaded in this process (finding it loads nothing).
fn torch_cuda_loaded() -> bool {
    // SAFETY: RTLD_NOLOAD only looks the library up among those loaded (by soname).
    let h = unsafe { libc::dlopen(TORCH_CUDA.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
    if h.is_null() {
        return false;
    }
    // SAFETY: the reference dlopen just took.
    unsafe { libc::dlclose(h) };
    true
}

impl PauseGuard for Installed {
    fn before_pause(&self, tags: &[String]) -> Result<(), LayerError> {
        if installed().is_none() {
            if torch_cuda_loaded() {
                return Err(LayerError::new(Refusal::Unguarded {
                    lib: TORCH_CUDA.to_string_lossy().into_owned(),
                    tags: tags.to_vec(),
                }));
            }
            return Ok(());
        }
        match call(crate::MEMSAVER_GUARD_BEFORE_PAUSE, Some(tags)) {
            Some(message) => Err(LayerError::new(Refusal::Guard(message))),
            None => Ok(()),
        }
    }

    fn after_transition(&self) {
        if let Some(m) = call(crate::MEMSAVER_GUARD_AFTER_TRANSITION, None) {
            tracing::warn!(message = %m, "the pause guard failed after a transition");
        }
    }
}

#[linkme::distributed_slice(memsaver_allocator::START_HOOKS)]
static AT_START: StartHook = StartHook {
    name: "pause guard",
    order: 0,
    run: |a: &'static Allocator| {
        a.set_pause_guard(Some(Arc::new(Installed)));
        Ok(())
    },
};
