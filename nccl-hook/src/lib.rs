//! memsaver's hook on NCCL's own memory.
//!
//! All device memory NCCL allocates is the tag `nccl`. NCCL (linked statically against the
//! CUDA runtime) reaches the driver only through `dlsym(libcuda, "cuGetProcAddress_v2")` and
//! the functions that lookup returns, so when libmemsaver.so is preloaded:
//!
//! 1. [`interpose`]: our `dlsym` answers lookups of `cuGetProcAddress(_v2)` made *from libnccl*
//!    with our wrapper, and forwards everything else untouched (tail jump).
//! 2. [`procaddr`]: that wrapper asks the driver and swaps in our wrappers for NCCL's VMM calls.
//! 3. `vmm`: the wrappers call the driver and record every handle and mapping in `ledger`.
//!
//! Status: steps 1-3 are built and observe NCCL's memory (see [`stats`]). Releasing it on
//! pause and rebuilding it, with the references peer processes hold, on resume is the next
//! part of issue 4.

pub mod interpose;
mod ledger;
pub mod procaddr;
mod vmm;

pub use ledger::NcclStats;

/// NCCL's memory in this process as the hook has seen it.
pub fn stats() -> NcclStats {
    let cumem_disabled = std::env::var("NCCL_CUMEM_ENABLE").is_ok_and(|v| v.trim() == "0");
    ledger::stats(procaddr::installed(), cumem_disabled)
}
