//! Process start-up: the process-wide allocator, started once, and the start hooks of the
//! layers above the core.
//!
//! The core knows nothing of NCCL or of other processes, yet the process-wide allocator must
//! not be handed out before every layer linked into the process has done its part at start
//! (nccl-hook registers the external tag `nccl`; memsaver-ipc serves control requests when
//! `MEMSAVER_CONTROL=1`). So each layer adds a [`StartHook`] to [`START_HOOKS`], a list the
//! linker assembles (a `linkme` distributed slice): no layer calls up into another, and no code
//! runs at load time (no constructor, so no CUDA call either). Whatever starts the allocator
//! (the C ABI, a wrapper of NCCL's driver calls, the peer server) runs the same hooks, once.
//!
//! Three accessors, one entry point:
//! * [`global`]: for operations done for the application (malloc, pause, resume, stats, ...):
//!   an invalid `MEMSAVER_*` option is its error, and so is a hook that failed at start (a
//!   process asked to serve control requests that cannot);
//! * [`start_global`] (and [`global_driver`]): for hooks that must answer the driver's calls
//!   whatever the options say (an import's properties, a peer's fd, a graph's device);
//! * [`global_if_started`]: never starts anything (hot paths such as every `cudaFree`).
//!
//! Lock order (docs/architecture.md): the start takes the allocator's `table` and `external`
//! locks (hooks register external tags): call it with no lock held but nccl-hook's `GRAPHS`,
//! never under its `REGISTRY`.

use std::sync::{Arc, Once, OnceLock};

use crate::error::{Error, LayerError, Result};
use crate::{Allocator, driver, options};

/// What a layer does once, when the process-wide allocator starts.
pub struct StartHook {
    /// Who adds it, for messages.
    pub name: &'static str,
    /// Hooks run in increasing order (registering external tags: 0; starting services that
    /// other processes may use at once: 10).
    pub order: u32,
    /// Runs with the new allocator. An error is kept: every [`global`] call returns it, as
    /// it returns an invalid option, while [`start_global`] still hands out the allocator.
    pub run: fn(&'static Allocator) -> std::result::Result<(), LayerError>,
}

/// The start hooks of every layer linked into this process (see the module documentation).
#[linkme::distributed_slice]
pub static START_HOOKS: [StartHook];

/// The option lists of the layers above the core linked into this process (each adds its
/// `LAYER`, made by [`crate::declare_options!`]): [`global`] fails on an invalid value of any,
/// as on the core's.
#[linkme::distributed_slice]
pub static OPTION_LAYERS: [&'static options::Layer];

/// Every `MEMSAVER_*` option of the core and of the layers linked into this process is valid;
/// else an error naming each invalid variable (the core's first) and what it accepts.
pub fn check_options() -> Result<()> {
    let mut errors = options::get().errors.clone();
    for layer in OPTION_LAYERS {
        errors.extend((layer.errors)());
    }
    options::check_messages(&errors)
}

/// The process-wide allocator, or why the driver did not load; set once by [`start_global`].
static GLOBAL: OnceLock<std::result::Result<Allocator, driver::LoadError>> = OnceLock::new();
/// Completed once every start hook of the process-wide allocator has run.
static HOOKS_RUN: Once = Once::new();
/// The first error a start hook gave.
static START_ERROR: OnceLock<LayerError> = OnceLock::new();

/// Sends memsaver's log to stderr, at the level `MEMSAVER_LOG` gives (default `warn`), once
/// per process; a host application's own subscriber, if it has one, is left alone. An invalid
/// filter cannot be returned as an error from here (hooks call this): it is one warning line
/// naming the variable, and the default.
pub fn init_logging() {
    static LOG: Once = Once::new();
    LOG.call_once(|| {
        let opts = options::get();
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

/// Starts the process-wide allocator, the one entry point that creates it: the first call
/// starts logging, loads the driver, creates the allocator from [`options::get`] and runs every
/// [`START_HOOKS`] entry with it, once; no call returns the allocator before that is done.
/// Later calls return the same allocator, or the same error: a driver that fails to load is
/// reported by every call, never by a panic.
///
/// An invalid option does not stop the start, nor does a failed hook: the hooks that answer
/// NCCL's driver calls need the driver whatever the options say. What acts for the
/// application uses [`global`], which checks both.
pub fn start_global() -> Result<&'static Allocator> {
    init_logging();
    let a = GLOBAL
        .get_or_init(|| {
            let opts = options::get();
            driver::Driver::load(&opts.cuda_lib).map(|d| Allocator::with_options(Arc::new(d), opts))
        })
        .as_ref()
        .map_err(|e| Error::Load(e.clone()))?;
    HOOKS_RUN.call_once(|| {
        // The backup reserve starts pinning now if the starting thread has a device, so that
        // it overlaps with whatever the process does before it allocates.
        a.start_backup_reserve();
        let mut hooks: Vec<&StartHook> = START_HOOKS.iter().collect();
        hooks.sort_by_key(|h| h.order);
        for h in hooks {
            if let Err(e) = (h.run)(a) {
                tracing::debug!(hook = h.name, "memsaver: a start hook failed: {e}");
                let _ = START_ERROR.set(e);
            }
        }
    });
    Ok(a)
}

/// The process-wide allocator for an operation done for the application, started on first
/// use ([`start_global`]). An invalid `MEMSAVER_*` option is an error here (every such
/// operation names it), and so is a start hook that failed (`MEMSAVER_CONTROL=1` in a process
/// that could not start serving control requests).
pub fn global() -> Result<&'static Allocator> {
    check_options()?;
    let a = start_global()?;
    match START_ERROR.get() {
        Some(e) => Err(Error::Start(e.clone())),
        None => Ok(a),
    }
}

/// The process-wide driver, also when an option is invalid (an import's properties, a peer's
/// fd). Starts the allocator like [`start_global`].
pub fn global_driver() -> Result<&'static driver::Driver> {
    Ok(start_global()?.driver())
}

/// The process-wide allocator if it has been started (start hooks run); never starts it, so
/// never loads the driver. The accessor for hooks on hot paths (every `cudaFree` of the
/// process), which must stay out of the way of processes that never allocate through memsaver.
pub fn global_if_started() -> Option<&'static Allocator> {
    if !HOOKS_RUN.is_completed() {
        return None;
    }
    GLOBAL.get().and_then(|r| r.as_ref().ok())
}
