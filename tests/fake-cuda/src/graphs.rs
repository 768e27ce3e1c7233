//! CUDA graphs, and what the per-thread stack limit does to them.
//!
//! The model, as measured on H100 and H200: an executable graph is bound to the stack limit
//! (`CU_LIMIT_STACK_SIZE`) in force when it was instantiated. Launching it once the limit of
//! its device is below that value fails with `CUDA_ERROR_LAUNCH_FAILED` ("unspecified launch
//! failure") and the context is lost for good: from then on every call that works in it
//! returns `CUDA_ERROR_LAUNCH_FAILED` too ([`crate::context::alive`]). A kernel that needs more
//! stack than the limit grows the limit when it is launched (the driver does that by itself;
//! NCCL's kernels do it with 2+ ranks): [`launch_kernel_needing_stack`] stands for such a
//! launch. Graphs hold no nodes here: an empty graph is all the tests need.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};

use memsaver_allocator::driver::sys::{
    CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_LAUNCH_FAILED, CUdevice,
    CUgraph, CUgraphExec, CUresult,
};
use parking_lot::Mutex;

use crate::context::{self, Tokens};

/// Live graphs (`cuGraphCreate` .. `cuGraphDestroy`).
pub static GRAPHS: Tokens = Tokens::new(0x9a9a_0000_0000);

/// Live executables of this process: token -> (device, stack limit in force when it was
/// instantiated). The lock guards only this map.
static EXECS: Mutex<BTreeMap<usize, (CUdevice, usize)>> = Mutex::new(BTreeMap::new());

/// The next executable token (tokens are never dereferenced).
static NEXT_EXEC: AtomicUsize = AtomicUsize::new(0xe8e8_0000_0010);

/// Instantiates `graph` in the current context, remembering the stack limit in force.
pub fn instantiate(graph: CUgraph) -> Result<CUgraphExec, CUresult> {
    let dev = context::require_current()?;
    context::alive(dev)?;
    GRAPHS.check(graph)?;
    let token = NEXT_EXEC.fetch_add(16, Ordering::Relaxed);
    EXECS.lock().insert(token, (dev, context::stack_size(dev)));
    Ok(std::ptr::without_provenance_mut::<c_void>(token))
}

pub fn exec_destroy(exec: CUgraphExec) -> Result<(), CUresult> {
    EXECS
        .lock()
        .remove(&(exec as usize))
        .map(drop)
        .ok_or(CUDA_ERROR_INVALID_HANDLE)
}

/// Launches `exec`: fails, and loses its device's context, when the device's stack limit is
/// below the one the executable was instantiated at.
pub fn launch(exec: CUgraphExec) -> Result<(), CUresult> {
    let (dev, needed) = *EXECS
        .lock()
        .get(&(exec as usize))
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    context::alive(dev)?;
    if context::stack_size(dev) < needed {
        context::lose(dev);
        return Err(CUDA_ERROR_LAUNCH_FAILED);
    }
    Ok(())
}

/// A kernel launch in the current context whose kernel needs `bytes` of stack per thread:
/// grows the limit to `bytes` if it is below, as the driver does.
pub fn launch_kernel_needing_stack(bytes: usize) -> Result<(), CUresult> {
    let dev = context::require_current()?;
    context::alive(dev)?;
    if bytes == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if context::stack_size(dev) < bytes {
        context::set_stack_size(dev, bytes);
    }
    Ok(())
}
