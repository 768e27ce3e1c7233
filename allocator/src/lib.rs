//! memsaver's allocator core: one tag-based CUDA virtual-memory allocator per process.
//!
//! Every pausable byte is an allocation with a tag. [`Allocator::pause`] releases the physical
//! memory of every allocation of the given tags and keeps their virtual ranges reserved;
//! [`Allocator::resume`] maps fresh physical memory at the same addresses and restores the
//! contents where the allocation's [`Policy`] says to. See [`types`] for the vocabulary and
//! `docs/architecture.md` for the design.
//!
//! Modules, one topic each:
//! * [`driver`]: the only code of the core that calls the CUDA driver (loaded at run time).
//! * `allocator`: malloc, free, stats; `engine`: pause and resume (claim and settle; `work`: the
//!   driver calls between); `settings`: the run-time settings; `table`: the allocation table;
//!   `device`: per-device context and copy stream; `backup`: host backups (pinned, mmap) and the
//!   backup enum; `pinned`: host memory pinned in steps; `disk`: disk backup files; `prepare`:
//!   pinned backups allocated ahead of the first pause, on a background thread; `reserve`: the
//!   backup reserve, pinned host memory made before any allocation that those backups are carved
//!   from; [`steps`]: the steps of a pause and a resume on one piece of memory, used by every tag
//!   (the table's and the external ones).
//! * [`options`]: [`declare_options!`], with which every layer declares its `MEMSAVER_*`
//!   options in one list, and the core's list.
//! * [`process`]: process identity (pid, start time, nonce) and liveness; [`private_dir`]:
//!   directories held open by descriptor, checked with `fstat` and used through it. Both serve
//!   the disk backups here and the sockets of `memsaver_ipc`.
//! * `start`: the process-wide allocator ([`global`], [`start_global`], [`global_if_started`]),
//!   the start hooks that the layers above add ([`START_HOOKS`]), and [`init_logging`];
//!   `sharing`: [`Sharing`], the interface through which the layer that shares allocations
//!   with other processes hears of pauses and resumes, and its value types; `export`: the
//!   allocator's methods that mark an allocation shared and export its memory; `guard`:
//!   [`PauseGuard`], through which the layer that caches freed memory (torch's pools) keeps
//!   paused memory from being handed out.
//! * `units`: byte counts for people ([`human_bytes`]).
//!
//! No module imports one that imports it back (`tests/layers.rs` checks): `allocator` holds
//! the [`Allocator`] and its everyday methods and imports what they need (`steps`, `sharing`,
//! `external`, `table`, ...); `engine`, `work`, `settings` and `export` add its other methods
//! from above; nothing below names `Allocator`.

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
mod export;
mod external;
mod guard;
pub mod packed;
mod pinned;
mod prepare;
mod reserve;
mod settings;
mod sharing;
mod start;
pub mod steps;
mod table;
mod units;
mod work;

pub use allocator::{AllocationInfo, Allocator, validate_tag};
pub use backup::{Backup, BackupKind};
pub use device::Device;
pub use disk::{BackupFile, DiskBackups, disk_backups};
pub use error::{Error, LayerError, Result};
pub use external::ExternalTag;
pub use external::Report;
pub use guard::PauseGuard;
pub use options::Options;
pub use sharing::{ExportedMemory, SharedAllocation, Sharing};
pub use start::{
    OPTION_LAYERS, START_HOOKS, StartHook, check_options, global, global_driver, global_if_started,
    init_logging, start_global,
};
pub use stats::{DeviceUsage, Stats, TagStats, Usage};
pub use types::{Policy, State};
pub use units::human_bytes;
