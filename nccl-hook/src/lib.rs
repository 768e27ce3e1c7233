//! memsaver's hook on NCCL's own memory: all device memory NCCL allocates is the tag `nccl`.
//!
//! NCCL (linked statically against the CUDA runtime) reaches the driver only through
//! `dlsym(libcuda, "cuGetProcAddress_v2")` and the functions that lookup returns, so when
//! libmemsaver.so is preloaded:
//!
//! 1. [`interpose`]: our `dlsym` answers lookups of `cuGetProcAddress(_v2)` made *from libnccl*
//!    with our wrapper, and forwards everything else untouched (tail jump).
//! 2. [`procaddr`]: that wrapper asks the driver and swaps in our wrappers for NCCL's VMM calls.
//! 3. `vmm`: the wrappers give NCCL virtual handles and record every handle and mapping in
//!    `registry`, so the memory behind them can be released and re-created.
//! 4. [`NcclTag`]: the `nccl` tag of the allocator. Pause backs up and releases NCCL's device
//!    memory; resume restores it at the same addresses.
//!
//! 5. [`amem`]: the AMem plugin's C API (`ncclPause`, `ncclResume`, ...), also answered to
//!    lookups in libnccl's handle.
//!
//! 6. `peer`: cross-process references (token exports, owners' sockets) so pause and resume
//!    release and rebuild exported buffers and imports together with the peer processes.
//! 7. `guard`: NCCL's collectives and send/recv, interposed, return `ncclInvalidUsage` while the
//!    tag is paused.
//! 8. `graphs`: CUDA graph executables and explicit stack limits, seen through wrappers handed
//!    to every caller (not only libnccl), so the pause lowers the kernel stack size only as far
//!    as is safe for the graphs and kernels that run while it is paused.
//!
//! [`options`]: this crate's `MEMSAVER_*` options, one list (the `nccl` tag's, then the
//! cross-process ones of `peer`, `server` and `control`).

pub mod amem;
pub mod control;
mod graphs;
mod guard;
pub mod interpose;
pub mod options;
mod peer;
pub mod procaddr;
mod protocol;
mod provider;
mod registry;
mod rundir;
mod server;
mod vmm;

pub use provider::NcclTag;
pub use registry::NcclStats;

use std::sync::{Arc, Once};

use memsaver_allocator::{Allocator, Result};

/// Sends memsaver's log to stderr, at the level `MEMSAVER_LOG` gives (default `warn`), once
/// per process; a host application's own subscriber, if it has one, is left alone. An invalid
/// filter cannot be returned as an error from here (hooks call this): it is one warning line
/// naming the variable, and the default.
pub fn init_logging() {
    static LOG: Once = Once::new();
    LOG.call_once(|| {
        let opts = memsaver_allocator::options::get();
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(&opts.log))
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init();
        if let Some(w) = &opts.log_warning {
            tracing::warn!("memsaver: {w}; logging at '{}'", opts.log);
        }
    });
}

/// The process-wide allocator, started on first use with the `nccl` tag registered: the one
/// entry point of libmemsaver.so that starts it (through [`memsaver_allocator::start_global`]);
/// [`memsaver_allocator::global_if_started`] is the accessor that never does. The first call
/// takes the allocator's `table` and `external` locks: call it with no lock held but `GRAPHS`
/// (lock order in docs/architecture.md), never under `REGISTRY`.
///
/// An invalid `MEMSAVER_*` option of the core or of this crate is an error here
/// ([`options::check`]: every operation done for the application names it), and so is
/// `MEMSAVER_CONTROL=1` in a process that could not start serving control requests; the hooks
/// that must answer NCCL's driver calls whatever the options say use [`driver`] instead.
pub fn allocator() -> Result<&'static Allocator> {
    options::check()?;
    let a = started()?;
    match control::start_error() {
        Some(e) => Err(memsaver_allocator::Error::InvalidArgument(e.to_owned())),
        None => Ok(a),
    }
}

/// The process-wide driver, also when an option is invalid (an import's properties, a peer's
/// fd). Starts the allocator like [`allocator`].
pub(crate) fn driver() -> Result<&'static memsaver_allocator::driver::Driver> {
    Ok(started()?.driver())
}

fn started() -> Result<&'static Allocator> {
    init_logging();
    memsaver_allocator::start_global(|a| {
        if let Err(e) = a.register_external("nccl", Arc::new(NcclTag::new(a))) {
            tracing::warn!(error = %e, "the nccl tag is not available");
        }
        // MEMSAVER_CONTROL=1: reachable from other processes once it holds memory.
        control::on_start();
    })
}

/// The directory of the sockets processes use to coordinate the `nccl` tag (created, mode
/// 0700, by the first process that serves a peer).
pub fn runtime_dir() -> std::path::PathBuf {
    peer::runtime_dir()
}

/// What `memsaver diagnostics` reports about the `nccl` tag's cross-process coordination.
#[derive(Debug, serde::Serialize)]
pub struct Diagnosis {
    pub runtime_dir: std::path::PathBuf,
    pub runtime_dir_state: rundir::Found,
    pub group: i64,
    pub group_dir_state: rundir::Found,
    /// The processes serving this group (socket name, pid, alive); a dead one left its socket
    /// behind (it exited without its exit handlers: harmless, nobody else removes it).
    pub owners: Vec<(String, u32, bool)>,
    /// Why NCCL's exports fell back to plain fds in this process, if they did.
    pub fallback_reason: Option<String>,
}

/// Checks the runtime directory and the group's directory without creating anything, and
/// lists the group's owners.
pub fn diagnose() -> Diagnosis {
    let runtime_dir = peer::runtime_dir();
    let group = amem::group_id();
    let (base, dir, entries) = rundir::inspect(&runtime_dir, group);
    Diagnosis {
        runtime_dir,
        runtime_dir_state: base,
        group,
        group_dir_state: dir,
        owners: peer::owners_in(&entries),
        fallback_reason: peer::fallback_reason(),
    }
}

/// NCCL's memory in this process as the hook has seen it.
pub fn stats() -> NcclStats {
    // NCCL's own variable, not an option of memsaver's (see `options`).
    let cumem_disabled = std::env::var("NCCL_CUMEM_ENABLE").is_ok_and(|v| v.trim() == "0");
    registry::stats(procaddr::installed(), cumem_disabled)
}
