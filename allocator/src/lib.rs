//! memsaver's allocator core: one tag-based CUDA virtual-memory allocator per process.
//!
//! Every pausable byte is an allocation with a tag. [`Allocator::pause`] releases the physical
//! memory of every allocation of the given tags and keeps their virtual ranges reserved;
//! [`Allocator::resume`] maps fresh physical memory at the same addresses and restores the
//! contents where the allocation's [`Policy`] says to. See [`types`] for the vocabulary and
//! `docs/architecture.md` for the design.
//!
//! Modules, one topic each:
//! * [`driver`]: the only code that calls the CUDA driver (loaded at run time).
//! * `allocator`: malloc, free, stats; `engine`: pause and resume; `table`: the allocation
//!   table; `device`: per-device context and copy stream; `backup`: host backups (pinned,
//!   mmap) and the backup enum; `disk`: disk backup files; `prepare`: pinned backups allocated
//!   ahead of the first pause, on a background thread; [`steps`]: the steps of a pause and a
//!   resume on one piece of memory, used by every tag (the table's and the external ones).
//! * [`options`]: every `MEMSAVER_*` option in one table.
//! * [`process`]: process identity (pid, start time, nonce) and liveness; [`private_dir`]:
//!   directories held open by descriptor, checked with `fstat` and used through it. Both serve
//!   the disk backups here and the sockets of `memsaver_nccl_hook`.

pub mod driver;
pub mod options;
pub mod private_dir;
pub mod process;
pub mod stats;
pub mod types;

mod allocator;
pub mod backup;
mod device;
mod disk;
mod engine;
mod error;
mod external;
mod prepare;
pub mod steps;
mod table;

use std::sync::{Arc, Once, OnceLock};

pub use allocator::{AllocationInfo, Allocator, validate_tag};
pub use backup::{Backup, BackupKind};
pub use device::Device;
pub use disk::{BackupFile, DiskBackups, disk_backups};
pub use engine::Report;
pub use error::{Error, Result};
pub use external::ExternalTag;
pub use options::Options;
pub use stats::{DeviceUsage, Stats, TagStats, Usage};
pub use types::{Policy, State, human_bytes};

/// The process-wide allocator, or why the driver did not load; set once by [`start_global`].
static GLOBAL: OnceLock<std::result::Result<Allocator, driver::LoadError>> = OnceLock::new();
/// Completed once the external tags of the process-wide allocator are registered.
static EXTERNAL_TAGS: Once = Once::new();

/// The process-wide allocator if it has been started (external tags registered); never starts
/// it, so never loads the driver. The accessor for hooks on hot paths (every `cudaFree` of the
/// process), which must stay out of the way of processes that never allocate through memsaver.
pub fn global_if_started() -> Option<&'static Allocator> {
    if !EXTERNAL_TAGS.is_completed() {
        return None;
    }
    GLOBAL.get().and_then(|r| r.as_ref().ok())
}

/// Starts the process-wide allocator, the one entry point that creates it: the first call loads
/// the driver and creates the allocator from [`options::get`], then runs
/// `register_external_tags` with it, once; no call returns the allocator before that is done.
/// Later calls return the same allocator, or the same error: a driver that fails to load is
/// reported by every call, never by a panic.
///
/// Its only caller is `memsaver_nccl_hook`, which registers the `nccl` tag (the core knows
/// nothing of NCCL); everything in libmemsaver.so starts the allocator through it, so none of
/// it can see the allocator without its external tags. An invalid option does not stop the
/// start: the hooks that answer NCCL's driver calls need the driver whatever the options say,
/// and what acts for the application (`memsaver_nccl_hook::allocator`) checks
/// [`Options::check`] first. The start takes the `table` and `external` locks: see the lock
/// order in `docs/architecture.md`.
pub fn start_global(
    register_external_tags: impl FnOnce(&'static Allocator),
) -> Result<&'static Allocator> {
    let a = GLOBAL
        .get_or_init(|| {
            let opts = options::get();
            driver::Driver::load(&opts.cuda_lib).map(|d| Allocator::with_options(Arc::new(d), opts))
        })
        .as_ref()
        .map_err(|e| Error::Load(e.clone()))?;
    EXTERNAL_TAGS.call_once(|| register_external_tags(a));
    Ok(a)
}
