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
//!   mmap) and the backup enum; `disk`: disk backup files.
//! * [`options`]: every `MEMSAVER_*` option in one table.

pub mod driver;
pub mod options;
pub mod profile;
pub mod stats;
pub mod types;

mod allocator;
pub mod backup;
mod device;
mod disk;
mod engine;
mod error;
mod external;
mod table;

use std::sync::{Arc, OnceLock};

pub use allocator::Allocator;
pub use backup::BackupKind;
pub use engine::Report;
pub use error::{Error, Result};
pub use external::ExternalTag;
pub use options::Options;
pub use stats::{DeviceUsage, Stats, TagStats, Usage};
pub use types::{Policy, State, human_bytes};

static GLOBAL: OnceLock<std::result::Result<Allocator, driver::LoadError>> = OnceLock::new();

/// The process-wide allocator if something has already started it; never loads the driver.
/// Hooks on hot paths (every `cudaFree` of the process) use this to stay out of the way of
/// processes that never allocate through memsaver.
pub fn global_if_started() -> Option<&'static Allocator> {
    GLOBAL.get().and_then(|r| r.as_ref().ok())
}

/// The process-wide allocator, created on first use from [`options::get`]. A driver that fails
/// to load, or an invalid option (see [`Options::check`]), is reported by every call, never by
/// a panic.
pub fn global() -> Result<&'static Allocator> {
    options::get().check()?;
    started()
}

/// The process-wide driver, also when an option is invalid: for the hooks that must answer
/// NCCL's driver calls whatever the options say (an import's properties, a peer's fd).
pub fn global_driver() -> Result<&'static driver::Driver> {
    Ok(started()?.driver())
}

fn started() -> Result<&'static Allocator> {
    GLOBAL
        .get_or_init(|| {
            let opts = options::get();
            driver::Driver::load(&opts.cuda_lib).map(|d| Allocator::with_options(Arc::new(d), opts))
        })
        .as_ref()
        .map_err(|e| Error::Load(e.clone()))
}
