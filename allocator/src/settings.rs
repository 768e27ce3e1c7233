//! The allocator's run-time settings, started from the options and changed by the setters
//! (the C ABI and the Python package call them): what each transition reads (backup retention,
//! the merge limit of runs, the memory margin of resume, the disk directory, packing), and the
//! knobs of the backups prepared ahead and of the backup reserve. Adds methods to `Allocator`
//! from above it, as `engine.rs` does; the settings themselves are `allocator.rs`'s `Settings`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::allocator::Allocator;
use crate::error::{Error, Result};
use crate::options::Pack;
use crate::private_dir::Dir;

impl Allocator {
    /// Whether backups are kept across cycles (see [`Allocator::set_retain_backups`]).
    pub fn retain_backups(&self) -> bool {
        self.settings.lock().retain_backups
    }

    /// On (the default): a backup stays attached to its allocation after resume, so the next
    /// pause allocates nothing. Off: a backup is released as soon as its allocation has
    /// resumed; the next resume also releases the retained backups of resident allocations of
    /// the tags it names. Applies from the next resume.
    pub fn set_retain_backups(&self, on: bool) {
        self.settings.lock().retain_backups = on;
        tracing::info!(retain = on, "backup retention set");
    }

    /// Whether the steps of the resume in progress keep backups: its caller's choice, else the
    /// retention setting.
    pub(crate) fn resume_keeps_backups(&self) -> bool {
        let s = self.settings.lock();
        s.transition_keep_backups.unwrap_or(s.retain_backups)
    }

    /// Sets the keep-backups choice of the transition in progress (see `engine::KeepBackups`).
    pub(crate) fn set_transition_keep_backups(&self, keep: Option<bool>) {
        self.settings.lock().transition_keep_backups = keep;
    }

    /// The most host memory the allocator prepares ahead of first pauses, in bytes (see
    /// [`Allocator::set_backup_prepare_limit`]).
    pub fn backup_prepare_limit(&self) -> u64 {
        self.preparer.limit()
    }

    /// With retention on, a `cpu` allocation's pinned backup is allocated on a background
    /// thread when the allocation is made, so that its first pause only copies. At most `bytes`
    /// are held that way (buffers already prepared stay); 0 turns it off for new allocations.
    pub fn set_backup_prepare_limit(&self, bytes: u64) {
        self.preparer.set_limit(bytes);
    }

    /// The bytes of the backup reserve asked for (see [`Allocator::reserve_backups`]).
    pub fn backup_reserve(&self) -> u64 {
        self.preparer.reserve_target()
    }

    /// Keeps `bytes` of pinned host memory (rounded up to 2 MiB) that the pinned backups of
    /// `cpu` allocations are carved from at once, before their preparation would start
    /// (`reserve.rs`): a background thread maps and pins it in 16 MiB steps, starting now in
    /// the calling thread's current device's context if it has one, else in that of the first
    /// device memsaver opens. Backups released go back to it. A smaller value releases the
    /// free part beyond it (memory lent to backups stays until a later call finds it free); 0
    /// releases all that is free. `bytes` above the host's memory is
    /// [`Error::InvalidArgument`]. A reserve that cannot be pinned whole keeps what it got and
    /// says so in the log.
    pub fn reserve_backups(&self, bytes: u64) -> Result<()> {
        let host = crate::options::host_memory();
        if host.is_some_and(|h| bytes > h) {
            return Err(Error::InvalidArgument(format!(
                "a backup reserve of {bytes} bytes is more than this host's memory: expected \
                 0 to {} bytes",
                host.unwrap_or(0)
            )));
        }
        let ctx = match self.driver.current_device() {
            Some(d) => Some(self.device(d)?.ctx),
            None => None,
        };
        self.preparer.set_reserve(bytes, ctx);
        tracing::info!(bytes, "backup reserve set");
        Ok(())
    }

    /// Starts pinning the backup reserve of `MEMSAVER_BACKUP_RESERVE_MB` in the calling
    /// thread's current device's context, if it has one (else the first device memsaver opens
    /// starts it): for the process-wide allocator's start, so that the reserve overlaps with
    /// what the process does before it allocates.
    pub fn start_backup_reserve(&self) {
        if self.preparer.reserve_target() == 0 {
            return;
        }
        if let Some(d) = self.driver.current_device()
            && let Err(e) = self.device(d)
        {
            tracing::info!(device = d, error = %e, "backup reserve: cannot open the current device; the reserve waits for the first device memsaver opens");
        }
    }

    /// Waits until every requested backup buffer is prepared (or failed), and the backup
    /// reserve is pinned: for benchmarks and tests that need the first pause to find them
    /// ready. An error when that takes longer than `within`, saying how much is still to do.
    pub fn wait_backups_prepared(&self, within: std::time::Duration) -> Result<()> {
        if self.preparer.wait_idle(std::time::Instant::now() + within) {
            return Ok(());
        }
        Err(Error::Backup(format!(
            "pinned backups still being prepared after {} ms: {} buffer(s) queued, in flight \
             or being pinned, and the backup reserve {}",
            within.as_millis(),
            self.preparer.pending(),
            if self.preparer.reserve_has_work() {
                "still being pinned"
            } else {
                "done"
            }
        )))
    }

    /// Asks for a pinned buffer of `len` bytes on `device` to be prepared in the background for
    /// the first pause of the piece of memory `key` (an external tag's buffer, keyed with
    /// [`crate::steps::external_key`]; the table's allocations ask for theirs when they are
    /// made); see [`Allocator::set_backup_prepare_limit`]. Never fails: without a buffer the
    /// pause allocates one.
    pub fn prepare_backup(&self, key: u64, device: i32, len: usize) {
        if len == 0 {
            return;
        }
        if let Ok(dev) = self.device(device) {
            self.preparer.request(key, dev.ctx, len);
        }
    }

    /// Which tags' pinned backups are packed (`MEMSAVER_PACK`).
    pub fn pack(&self) -> Pack {
        self.settings.lock().pack
    }

    /// The bytes prepared for the piece `key`, for its tag's stats.
    pub fn prepared_bytes(&self, key: u64) -> u64 {
        self.preparer.ready_bytes(key).unwrap_or(0) as u64
    }

    /// Forgets the piece `key` (freed): its prepared buffer is freed.
    pub fn forget_prepared_backup(&self, key: u64) {
        drop(self.preparer.forget(key));
    }

    /// The largest physical allocation a resume makes to back adjacent allocations of one tag
    /// together, in bytes (0: one per allocation).
    pub fn merge_limit(&self) -> usize {
        self.settings.lock().merge_limit
    }

    /// Sets [`Allocator::merge_limit`]; applies from the next resume.
    pub fn set_merge_limit(&self, bytes: usize) {
        self.settings.lock().merge_limit = bytes;
    }

    /// The bytes resume keeps free on each device.
    pub fn memory_margin(&self) -> u64 {
        self.settings.lock().memory_margin
    }

    /// Resume refuses to map an allocation that would leave less than `bytes` free on its
    /// device ([`Error::ResumeOutOfMemory`]). 0 turns the check off.
    pub fn set_memory_margin(&self, bytes: u64) {
        self.settings.lock().memory_margin = bytes;
    }

    /// The directory of disk backup files, if one is set.
    pub fn disk_dir(&self) -> Option<PathBuf> {
        self.settings.lock().disk_dir.clone()
    }

    /// Sets the directory of disk backup files, or unsets it with `None`. The directory is
    /// created with mode 0700 if missing; an existing one must belong to this user and not be
    /// writable by group or others (else `InvalidArgument`, naming its owner and mode). It is
    /// opened now and held (docs/security.md, "Backup files"); stale backup files of processes
    /// no longer running are removed from it. Files of backups already made stay where they
    /// are.
    pub fn set_disk_dir(&self, dir: Option<&Path>) -> Result<()> {
        let held = dir
            .map(|d| crate::disk::open_dir(d, "memsaver_set_disk_dir"))
            .transpose()?;
        let mut s = self.settings.lock();
        s.disk_dir = dir.map(Path::to_path_buf);
        s.disk_dir_held = held;
        Ok(())
    }

    /// The disk backup directory, opened and checked, for a pause of disk-backed allocations
    /// (opened here the first time when it came from `MEMSAVER_DISK_DIR`; a refusal is
    /// returned again by every pause until the directory is fixed or another one is set).
    pub(crate) fn disk_dir_held(&self) -> Result<Arc<Dir>> {
        let dir = {
            let s = self.settings.lock();
            if let Some(held) = &s.disk_dir_held {
                return Ok(held.clone());
            }
            s.disk_dir.clone()
        };
        let dir = dir.ok_or_else(|| {
            Error::InvalidArgument(
                "backup='disk' needs a disk backup directory: set MEMSAVER_DISK_DIR or call \
                 memsaver.set_disk_dir(path) (memsaver_set_disk_dir in C) before pausing"
                    .into(),
            )
        })?;
        // Opened outside the settings lock (file I/O); kept unless the setting changed since.
        let held = crate::disk::open_dir(&dir, "MEMSAVER_DISK_DIR")?;
        let mut s = self.settings.lock();
        if s.disk_dir.as_deref() == Some(dir.as_path()) && s.disk_dir_held.is_none() {
            s.disk_dir_held = Some(held.clone());
        }
        Ok(held)
    }

    pub(crate) fn disk_chunk(&self) -> usize {
        self.settings.lock().disk_chunk
    }
}
