//! memsaver's hook on NCCL's own memory: all device memory NCCL allocates is the tag `nccl`.
//!
//! NCCL (linked statically against the CUDA runtime) reaches the driver only through
//! `dlsym(libcuda, "cuGetProcAddress_v2")` and the functions that lookup returns, so when
//! libmemsaver.so is preloaded:
//!
//! 1. [`interpose::dlsym`]: our `dlsym` answers lookups of `cuGetProcAddress(_v2)` made *from libnccl*
//!    with our wrapper, and forwards everything else untouched (tail jump).
//! 2. [`interpose::procaddr`]: that wrapper asks the driver and swaps in our wrappers for NCCL's VMM calls.
//! 3. `vmm`: the wrappers give NCCL virtual handles and record every handle and mapping in
//!    `registry`, so the memory behind them can be released and re-created; `sharing`'s
//!    exports and imports between processes carry tokens instead of fds (`tokens`).
//! 4. [`NcclTag`]: the `nccl` tag of the allocator. Pause backs up and releases NCCL's device
//!    memory; resume restores it at the same addresses.
//!
//! 5. [`amem`]: the AMem plugin's C API (`ncclPause`, `ncclResume`, ...), also answered to
//!    lookups in libnccl's handle.
//!
//! 6. `peer`, `exports`: cross-process references of NCCL's buffers (token exports, imports,
//!    the memory behind the owner's answers), over the cross-process layer `memsaver_ipc`,
//!    whose owner's ledger records each exported buffer's key, generation and importers (its
//!    collective delivery), so pause and resume release and rebuild exported buffers and
//!    imports together with the peer processes.
//!    `registered`: peers' memsaver memory that NCCL registered and mapped here, released and
//!    rebuilt when its owner pauses and resumes its tag (`memsaver_ipc::shared`).
//!    `appmem`: `ncclMemAlloc`/`ncclMemFree`, interposed: the application's memory takes the
//!    thread's tag (from memsaver's allocator, through [`APP_ALLOCATORS`]) or, untagged, is
//!    made by libnccl unrecorded: it is never NCCL's scratch.
//! 7. `guard`: NCCL's collectives and send/recv, interposed, return `ncclInvalidUsage` while the
//!    tag is paused. Before each, `epochs` compares the owners' published epochs with this
//!    process's imports; an owner that paused or resumed without this process is caught up
//!    with first (`catchup`, installed into `epochs` at start).
//! 8. `graphs`: CUDA graph executables and explicit stack limits, seen through wrappers handed
//!    to every caller (not only libnccl), so the pause lowers the kernel stack size only as far
//!    as is safe for the graphs and kernels that run while it is paused.
//!
//! [`options`]: this crate's `MEMSAVER_*` options, one list.
//!
//! Layers, one folder each, each importing only those below it (`tests/layers.rs` reads the
//! folders and checks):
//! * this crate root: [`stats`], [`diagnose`], the start hook that registers the `nccl` tag;
//! * `tag`: the `nccl` tag's pause and resume, and the exchanges with peers;
//! * [`interpose`]: what NCCL does with the driver, recorded; it never calls up into what a
//!   pause does;
//! * `registry`: the records of NCCL's handles and mappings, which both sides share;
//! * below them all, [`options`].
//!
//! Below the crate: `memsaver_ipc` (everything between processes) and `memsaver_allocator`
//! (the core, and the process start-up: `memsaver_allocator::global`).

pub mod interpose;
pub mod options;
mod registry;
mod tag;

pub use interpose::amem;
pub use interpose::appmem::{APP_ALLOCATORS, AppAllocator};
pub use registry::{AppMemoryStats, NcclStats};
pub use tag::provider::NcclTag;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use memsaver_allocator::{Allocator, StartHook};

/// At the allocator's start: the `nccl` tag is registered before anyone gets the allocator.
#[linkme::distributed_slice(memsaver_allocator::START_HOOKS)]
static AT_START: StartHook = StartHook {
    name: "nccl",
    order: 0,
    run: register_tag,
};

fn register_tag(a: &'static Allocator) -> Result<(), memsaver_allocator::LayerError> {
    tag::catchup::install();
    if let Err(e) = a.register_external("nccl", Arc::new(NcclTag::new(a))) {
        tracing::warn!(error = %e, "the nccl tag is not available");
    }
    Ok(())
}

/// What `memsaver diagnostics` reports about the `nccl` tag's cross-process coordination.
#[derive(Debug, serde::Serialize)]
pub struct Diagnosis {
    /// The runtime directory, the group and the processes serving it.
    #[serde(flatten)]
    pub peers: memsaver_ipc::Diagnosis,
    /// Why NCCL's exports fell back to plain fds in this process, if they did.
    pub fallback_reason: Option<String>,
}

/// Checks the runtime directory and the group's directory without creating anything, and
/// lists the group's owners.
pub fn diagnose() -> Diagnosis {
    Diagnosis {
        peers: memsaver_ipc::diagnose(),
        fallback_reason: interpose::tokens::fallback_reason(),
    }
}

/// NCCL's memory in this process as the hook has seen it.
pub fn stats() -> NcclStats {
    // NCCL's own variable, not an option of memsaver's (see `options`).
    let cumem_disabled = std::env::var("NCCL_CUMEM_ENABLE").is_ok_and(|v| v.trim() == "0");
    let mut s = registry::stats(
        interpose::procaddr::installed(),
        cumem_disabled,
        interpose::guard::is_paused(),
    );
    let mut reasons = Vec::new();
    for (dev, p) in &interpose::graphs::lock().paused {
        s.stack_lowered_bytes += p.lowered_bytes;
        s.stack_kept_bytes += p.kept_bytes;
        if let Some(why) = p.why {
            reasons.push(format!("device {dev}: {}", why.reason()));
        }
    }
    s.stack_kept_reason = (!reasons.is_empty()).then(|| reasons.join("; "));
    s.fallback_exports = interpose::tokens::fallback_exports();
    s.fallback_reason = interpose::tokens::fallback_reason();
    s.application = interpose::appmem::stats();
    s.bytes_copied_per_pause = tag::provider::COPIED[0].load(Ordering::Relaxed);
    s.bytes_copied_per_resume = tag::provider::COPIED[1].load(Ordering::Relaxed);
    s
}
