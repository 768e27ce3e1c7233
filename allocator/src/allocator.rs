//! The allocator: allocation, free, stats. Pause and resume live in `engine.rs` and `work.rs`,
//! the run-time settings' getters and setters in `settings.rs`.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use crate::backup::{Backup, BackupKind};
use crate::device::Device;
use crate::driver::{Driver, Handle};
use crate::error::{Error, Result};
use crate::external::ExternalTag;
use crate::guard::PauseGuard;
use crate::options::{Options, Pack};
use crate::prepare::Preparer;
use crate::private_dir::Dir;
use crate::sharing::Sharing;
use crate::stats::Stats;
use crate::steps::{Op, Plan, Steps};
use crate::table::{Allocation, Backing, Phase, Run, Table};
use crate::types::{Policy, State};

/// One allocation, as [`Allocator::allocations`] lists it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct AllocationInfo {
    /// Its device address, which never changes.
    pub ptr: u64,
    /// Bytes reserved (and mapped while resident): the request rounded up to the granularity.
    pub size: usize,
    pub device: i32,
    pub tag: String,
    /// The policy it was allocated with (a pause may have chosen another).
    pub policy: Policy,
    pub state: State,
    /// The kind of backup it holds now, if any (a paused allocation without one resumes with
    /// arbitrary bytes).
    pub backup: Option<BackupKind>,
    pub backup_bytes: u64,
}

/// One tag-based VMM allocator. A process normally has exactly one, started by
/// [`crate::start_global`]; tests may build more over the same driver.
///
/// Lock order: docs/architecture.md, "Locks", which lists every lock of the process in its
/// order (this struct's among nccl-hook's and memsaver-ipc's); a thread holding one of them
/// takes only locks after it.
pub struct Allocator {
    pub(crate) driver: Arc<Driver>,
    /// Guards the map of opened devices only; a device is opened once and never closed. Held
    /// across the driver calls that open a device (the first use of it), and nothing is taken
    /// under it. Taken under `REGISTRY` and `GRAPHS` (the `nccl` tag's steps open its devices).
    devices: Mutex<HashMap<i32, Arc<Device>>>,
    /// Guards the allocation table and the tag registry. Held for bookkeeping only, never
    /// across a driver call, so allocations proceed while a pause copies or unmaps; only
    /// `preparer` is taken under it (the stats read the prepared backups). Taken under
    /// `external` when tag names are resolved.
    pub(crate) table: Mutex<Table>,
    /// Serialises pause and resume: one transition at a time per allocator, held across the
    /// whole transition (driver calls and the external tags' steps included). malloc and free
    /// never take it.
    pub(crate) transition: Mutex<()>,
    /// Guards the registry of external tags (written once per tag, when the process-wide
    /// allocator starts). Read while tag names are resolved (the table lock is taken under it)
    /// and while external tags report `paused` and `usage` (the `nccl` tag's takes
    /// `REGISTRY`); never held while an external tag pauses or resumes: the transition clones
    /// them out first.
    pub(crate) external: RwLock<BTreeMap<String, Arc<dyn ExternalTag>>>,
    /// Guards the run-time settings only; never held across a driver call or file I/O, and
    /// nothing is taken under it.
    pub(crate) settings: Mutex<Settings>,
    /// Pinned backups of `cpu` allocations, allocated on a background thread before their
    /// first pause. Under its lock only the backup reserve's is taken; it is taken under `table`
    /// by stats only.
    pub(crate) preparer: Arc<Preparer>,
    /// The layer that shares allocations with other processes, if one registered
    /// (`sharing.rs`).
    pub(crate) sharing: std::sync::OnceLock<Arc<dyn Sharing>>,
    /// The pause guard, if one is installed (`guard.rs`). A leaf: the transition clones it out
    /// and calls it with this lock released.
    guard: RwLock<Option<Arc<dyn PauseGuard>>>,
}

/// The settings a transition reads, started from the options and changed through the setters
/// ([`Allocator::set_retain_backups`], ...).
pub(crate) struct Settings {
    pub(crate) retain_backups: bool,
    /// The keep-backups choice of the resume in progress (`Allocator::resume_keep_backups`),
    /// which wins over `retain_backups` for its steps; `None` outside such a resume.
    pub(crate) transition_keep_backups: Option<bool>,
    pub(crate) merge_limit: usize,
    pub(crate) memory_margin: u64,
    pub(crate) disk_dir: Option<PathBuf>,
    /// `disk_dir`, opened and checked (`disk::open_dir`): by `set_disk_dir`, or by the first
    /// pause that needs it when the directory came from `MEMSAVER_DISK_DIR`.
    pub(crate) disk_dir_held: Option<Arc<Dir>>,
    pub(crate) disk_chunk: usize,
    pub(crate) pack: Pack,
}

impl Allocator {
    /// An allocator with the default options (not read from the environment).
    pub fn new(driver: Arc<Driver>) -> Self {
        Self::with_options(driver, &Options::default())
    }

    pub fn with_options(driver: Arc<Driver>, opts: &Options) -> Self {
        Self {
            preparer: Preparer::new(
                driver.clone(),
                opts.backup_prepare_limit,
                opts.backup_reserve,
            ),
            driver,
            devices: Mutex::new(HashMap::new()),
            table: Mutex::new(Table::default()),
            transition: Mutex::new(()),
            external: RwLock::new(BTreeMap::new()),
            sharing: std::sync::OnceLock::new(),
            guard: RwLock::new(None),
            settings: Mutex::new(Settings {
                retain_backups: opts.retain_backups,
                transition_keep_backups: None,
                merge_limit: opts.merge_limit,
                memory_margin: opts.memory_margin,
                disk_dir: opts.disk_dir.clone(),
                disk_dir_held: None,
                disk_chunk: opts.disk_chunk,
                pack: opts.pack,
            }),
        }
    }

    /// The host address of byte `ptr` in the host backup (`cpu` or `mmap`) of the allocation
    /// holding `[ptr, ptr + size)`, when that backup exists; it holds the contents as of the
    /// allocation's last pause. `None` when the range is not inside one allocation or the
    /// allocation has no host backup (never paused, `discard` or `disk`, released because
    /// retention is off, or a pause or resume holds it now). The address stays valid until the
    /// backup is released: by a resume with retention off, or by free.
    pub fn backup_pointer(&self, ptr: u64, size: usize) -> Option<*mut u8> {
        let t = self.table.lock();
        let (base, a) = t.containing(ptr)?;
        let offset = ptr - base;
        if offset.checked_add(size as u64)? > a.size as u64 {
            return None;
        }
        let host = a.backup.as_ref()?.host()?;
        // SAFETY: `offset < a.size == host.len()`: the result stays inside the buffer.
        Some(unsafe { host.as_ptr().add(offset as usize) }.cast_mut())
    }

    /// Marks `tag` as a whole-process tag (registering it): new allocations with it are
    /// accepted while it is paused, resident; a resume skips them (they are not paused).
    pub fn allow_malloc_while_paused(&self, tag: &str) -> Result<()> {
        validate_tag(tag)?;
        self.check_not_external(tag)?;
        let mut t = self.table.lock();
        let k = t.intern(tag);
        t.tags.get_mut(&k).expect("interned").allocates_while_paused = true;
        Ok(())
    }

    pub fn driver(&self) -> &Arc<Driver> {
        &self.driver
    }

    /// The device `ordinal`, opened on first use (its primary context and copy stream).
    pub fn device(&self, ordinal: i32) -> Result<Arc<Device>> {
        let mut devices = self.devices.lock();
        if let Some(d) = devices.get(&ordinal) {
            return Ok(d.clone());
        }
        let d = Arc::new(Device::open(&self.driver, ordinal).map_err(|e| {
            if e.code == crate::driver::sys::CUDA_ERROR_INVALID_DEVICE {
                Error::InvalidArgument(format!(
                    "device {ordinal} does not exist ({} device(s) visible)",
                    self.driver.device_count().unwrap_or(0)
                ))
            } else {
                e.into()
            }
        })?);
        devices.insert(ordinal, d.clone());
        drop(devices);
        // The backup reserve pins in the first device's context, if it waits for one.
        self.preparer.offer_context(d.ctx);
        Ok(d)
    }

    /// The VMM granularity of `device`: allocation sizes are rounded up to it.
    pub fn granularity(&self, device: i32) -> Result<usize> {
        Ok(self.device(device)?.granularity)
    }

    /// Registers a tag whose memory `tag` manages itself (NCCL's, for `nccl`). It pauses,
    /// resumes and reports with the other tags; allocating with its name is refused.
    pub fn register_external(&self, name: &str, tag: Arc<dyn ExternalTag>) -> Result<()> {
        validate_tag(name)?;
        if self.table.lock().tags.contains_key(name) {
            return Err(Error::InvalidArgument(format!(
                "tag '{name}' already holds allocations; an external tag needs a name of its own"
            )));
        }
        self.external.write().insert(name.to_owned(), tag);
        Ok(())
    }

    fn check_not_external(&self, tag: &str) -> Result<()> {
        if self.external.read().contains_key(tag) {
            return Err(Error::InvalidArgument(format!(
                "tag '{tag}' is reserved: memsaver manages its memory itself; choose another tag"
            )));
        }
        Ok(())
    }

    /// Registers `tag` without allocating, so it can be paused, resumed and listed.
    pub fn register_tag(&self, tag: &str) -> Result<()> {
        validate_tag(tag)?;
        self.check_not_external(tag)?;
        self.table.lock().intern(tag);
        Ok(())
    }

    /// Allocates `size` bytes (rounded up to the granularity) on `device`, tagged `tag`.
    /// Returns the device address, which stays the same for the allocation's whole life.
    pub fn malloc(&self, size: usize, device: i32, tag: &str, policy: Policy) -> Result<u64> {
        validate_tag(tag)?;
        self.check_not_external(tag)?;
        if size == 0 {
            return Err(Error::InvalidArgument("cannot allocate 0 bytes".into()));
        }
        // The tag is registered only with its first allocation that succeeds: a failed malloc
        // leaves no trace in the tag list.
        let hint = {
            let t = self.table.lock();
            if refuses_malloc(&t, tag) {
                return Err(Error::TagPaused {
                    tag: tag.to_owned(),
                });
            }
            t.placement_hint(tag, device)
        };
        let dev = self.device(device)?;
        let size = dev.round_up(size).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "cannot allocate {size} bytes: the size rounded up to the {} granularity does \
                 not fit in the address space",
                crate::units::human_bytes(dev.granularity as u64)
            ))
        })?;
        let d = &self.driver;
        let (ptr, handle) = d
            .with_context(dev.ctx, || {
                let ptr = match d.reserve(size, dev.granularity, hint) {
                    // The driver may refuse a range it cannot place at the hint (seen as
                    // CUDA_ERROR_OUT_OF_MEMORY on a two-GPU H100 host) instead of placing it
                    // elsewhere: adjacency is only a wish, so ask again without it.
                    Err(e) if hint != 0 => {
                        tracing::info!(
                            tag,
                            bytes = size,
                            hint = format_args!("{hint:#x}"),
                            error = %e,
                            "reserving next to the tag's last allocation failed; reserving anywhere"
                        );
                        d.reserve(size, dev.granularity, 0)?
                    }
                    r => r?,
                };
                let handle = match d.create(dev.ordinal, size, true) {
                    Ok(h) => h,
                    Err(e) => {
                        // SAFETY: reserved just above, nothing mapped.
                        let _ = unsafe { d.address_free(ptr, size) };
                        return Err(e);
                    }
                };
                // SAFETY: `ptr..ptr+size` was reserved above and is unmapped.
                if let Err(e) = unsafe { d.map(ptr, size, handle, dev.ordinal) } {
                    let _ = d.release(handle);
                    // SAFETY: as above; the failed map left nothing mapped.
                    let _ = unsafe { d.address_free(ptr, size) };
                    return Err(e);
                }
                Ok((ptr, handle))
            })
            .map_err(|e| {
                if e.is_out_of_memory() {
                    Error::OutOfMemory {
                        tag: tag.to_string(),
                        device,
                        bytes: size as u64,
                        source: e,
                    }
                } else {
                    e.into()
                }
            })?;

        let mut t = self.table.lock();
        let tag = t.intern(tag);
        let id = t.next_id;
        t.next_id += 1;
        let alloc = Allocation {
            id,
            tag: tag.clone(),
            device: dev.clone(),
            size,
            policy,
            phase: Phase::Resident(Backing::Own(handle)),
            backup: None,
            free_pending: false,
            shared: false,
        };
        if refuses_malloc(&t, &tag) {
            // The tag was paused while we were mapping: undo rather than hand out memory that
            // the pause did not see.
            drop(t);
            self.release(alloc, ptr, None);
            return Err(Error::TagPaused {
                tag: tag.to_string(),
            });
        }
        t.allocations.insert(ptr, alloc);
        t.tags
            .get_mut(&tag)
            .expect("interned")
            .next_address
            .insert(device, ptr + size as u64);
        drop(t);
        tracing::debug!(tag = %tag, ptr = format_args!("{ptr:#x}"), bytes = size, device, %policy, "malloc");
        if policy == Policy::Cpu && self.retain_backups() {
            // Without retention every pause allocates its backup again: preparing the first
            // one would only hold host memory longer.
            self.preparer.request(id, dev.ctx, size);
        }
        Ok(ptr)
    }

    /// Frees an allocation in any state, releasing its physical memory, its address range and
    /// its backup. If a pause or resume is working on it, it is freed when that finishes.
    pub fn free(&self, ptr: u64) -> Result<()> {
        let (alloc, ended) = {
            let mut t = self.table.lock();
            let Some(a) = t.allocations.get_mut(&ptr) else {
                return Err(Error::UnknownPointer { ptr });
            };
            if matches!(a.phase, Phase::Pausing | Phase::Resuming) {
                a.free_pending = true;
                return Ok(());
            }
            let a = t
                .allocations
                .remove(&ptr)
                .expect("present: looked up under the same lock");
            let ended = detach(&mut t, &a, ptr);
            (a, ended)
        };
        tracing::debug!(tag = %alloc.tag, ptr = format_args!("{ptr:#x}"), bytes = alloc.size, "free");
        self.release(alloc, ptr, ended);
        Ok(())
    }

    /// Releases everything an allocation removed from the table holds (its run's, when it was
    /// the run's last allocation: see [`detach`]). Failures are logged: the allocation is gone
    /// from the caller's point of view either way.
    pub(crate) fn release(&self, alloc: Allocation, ptr: u64, ended: Option<(u64, Run)>) {
        if alloc.shared
            && let Some(s) = self.sharing()
        {
            s.freed(alloc.id);
        }
        let d = &self.driver;
        let dev = &alloc.device;
        let r = d.with_context(dev.ctx, || match alloc.phase {
            Phase::Resident(Backing::Own(h)) => {
                // Like cudaFree: wait until no queued work can touch the memory.
                d.synchronize()?;
                // SAFETY: mapped while resident; the device is idle.
                unsafe { d.unmap(ptr, alloc.size) }?;
                d.release(h)?;
                // SAFETY: the range is ours and now unmapped; the caller dropped it from the
                // table.
                unsafe { d.address_free(ptr, alloc.size) }
            }
            // The run's mapping covers the range: freed with the run.
            Phase::Resident(Backing::Run(_)) => Ok(()),
            // SAFETY: as above; nothing is mapped in the range.
            _ => unsafe { d.address_free(ptr, alloc.size) },
        });
        if let Err(e) = r {
            tracing::error!(tag = %alloc.tag, ptr = format_args!("{ptr:#x}"), error = %e, "free failed; memory may leak");
        }
        if let Some((base, run)) = ended {
            self.release_run(base, run);
        }
        drop(self.preparer.forget(alloc.id));
        drop(alloc.backup);
    }

    /// Unmaps and releases a run that no allocation uses any more, and frees the address
    /// ranges of its freed allocations.
    pub(crate) fn release_run(&self, base: u64, run: Run) {
        let d = &self.driver;
        let r = d.with_context(run.device.ctx, || {
            d.synchronize()?;
            // SAFETY: the run's mapping; no allocation uses it and the device is idle.
            unsafe { d.unmap(base, run.size) }
        });
        match r {
            Ok(()) => self.retire_run(base, &run),
            Err(e) => {
                tracing::error!(ptr = format_args!("{base:#x}"), bytes = run.size, error = %e, "unmapping shared physical memory failed; memory may leak");
            }
        }
    }

    /// Releases the physical memory of a run just unmapped, and frees the address ranges of
    /// its freed allocations.
    pub(crate) fn retire_run(&self, base: u64, run: &Run) {
        let d = &self.driver;
        self.release_handle_logged(run.handle, base);
        for &(ptr, size) in &run.dead {
            // SAFETY: reserved by a freed allocation of the run, which is no longer mapped.
            if let Err(e) = d.with_context(run.device.ctx, || unsafe { d.address_free(ptr, size) })
            {
                tracing::error!(ptr = format_args!("{ptr:#x}"), error = %e, "cuMemAddressFree failed");
            }
        }
    }

    /// Whether `tag` is paused (false for a tag never used).
    pub fn is_paused(&self, tag: &str) -> bool {
        if let Some(e) = self.external.read().get(tag) {
            return e.paused();
        }
        self.table.lock().tags.get(tag).is_some_and(|t| t.paused)
    }

    /// The state of the allocation at `ptr`, if memsaver made it.
    pub fn state(&self, ptr: u64) -> Option<State> {
        self.table
            .lock()
            .allocations
            .get(&ptr)
            .map(|a| a.phase.state())
    }

    /// The base address and tag of the allocation holding `ptr` (any address inside it), if
    /// memsaver made it, and whether it is resident now.
    pub fn allocation_at(&self, ptr: u64) -> Option<(u64, Arc<str>, bool)> {
        let t = self.table.lock();
        let (base, a) = t.containing(ptr)?;
        Some((base, a.tag.clone(), a.phase.state() == State::Resident))
    }

    /// Every tag used so far and every external tag, in name order.
    pub fn tags(&self) -> Vec<String> {
        let mut tags = self.table.lock().known_tags();
        tags.extend(self.external.read().keys().cloned());
        tags.sort();
        tags
    }

    pub fn stats(&self) -> Stats {
        let mut s = {
            let t = self.table.lock();
            let mut s = Stats::collect(&t, |id| self.preparer.ready_bytes(id));
            s.freed_held_bytes = t.held_by_runs();
            s
        };
        s.backups_preparing = self.preparer.pending();
        let r = self.preparer.reserve_figures();
        s.backup_reserve_bytes = r.target;
        s.backup_reserve_pinned_bytes = r.pinned;
        s.backup_reserve_used_bytes = r.used;
        s.driver_calls = crate::driver::CALL_KINDS
            .iter()
            .zip(self.driver.calls())
            .map(|(k, n)| ((*k).to_owned(), n))
            .collect();
        for (name, ext) in self.external.read().iter() {
            s.add_external(name, ext.paused(), ext.usage());
        }
        s
    }

    /// The allocations of `tags` (every tag when empty), by address: what a framework that
    /// keeps its own per-allocation view (vLLM's `pointer_to_data`) reads. An unknown tag is
    /// [`Error::UnknownTag`]; an external tag (`nccl`) is not made of allocations
    /// ([`Error::InvalidArgument`]: its figures are in [`Allocator::stats`]).
    pub fn allocations(&self, tags: &[&str]) -> Result<Vec<AllocationInfo>> {
        // Read before the table lock (lock order: `external`, then `table`).
        let external: Vec<String> = self.external.read().keys().cloned().collect();
        for tag in tags {
            validate_tag(tag)?;
            if external.iter().any(|e| e == tag) {
                return Err(Error::InvalidArgument(format!(
                    "tag '{tag}' is memsaver's own and has no allocations to list; its figures \
                     are in the stats"
                )));
            }
        }
        let t = self.table.lock();
        for tag in tags {
            if !t.tags.contains_key(*tag) {
                let mut known = t.known_tags();
                known.extend(external);
                known.sort();
                return Err(Error::UnknownTag {
                    tag: (*tag).to_owned(),
                    known,
                });
            }
        }
        Ok(t.allocations
            .iter()
            .filter(|(_, a)| tags.is_empty() || tags.contains(&&*a.tag))
            .map(|(&ptr, a)| AllocationInfo {
                ptr,
                size: a.size,
                device: a.device.ordinal,
                tag: a.tag.to_string(),
                policy: a.policy,
                state: a.phase.state(),
                backup: a.backup.as_ref().map(Backup::kind),
                backup_bytes: a.backup.as_ref().map_or(0, |b| b.len() as u64),
            })
            .collect())
    }

    /// Free and total bytes of `device` as the driver reports them.
    pub fn device_memory(&self, device: i32) -> Result<(usize, usize)> {
        let dev = self.device(device)?;
        Ok(self
            .driver
            .with_context(dev.ctx, || self.driver.mem_info())?)
    }

    pub(crate) fn release_handle_logged(&self, h: Handle, ptr: u64) {
        crate::steps::release_logged(&self.driver, h, ptr);
    }

    /// The steps of one pause or resume (`steps.rs`), with the settings in force now.
    pub fn steps(&self, op: Op) -> Steps<'_> {
        let pack = self.settings.lock().pack;
        let plan = match op {
            Op::Pause => Plan {
                pack,
                retain: true,
                margin: 0,
                merge_limit: 0,
                disk_dir: self.disk_dir_held(),
                disk_chunk: self.disk_chunk(),
            },
            Op::Resume => Plan {
                pack,
                retain: self.resume_keeps_backups(),
                margin: self.memory_margin(),
                merge_limit: self.merge_limit(),
                disk_dir: Err(Error::InvalidArgument(
                    "resume writes no disk backup".into(),
                )),
                disk_chunk: self.disk_chunk(),
            },
        };
        Steps::new(&self.driver, &self.preparer, plan)
    }

    /// Installs the pause guard (`None` removes it); it replaces the one installed before.
    pub fn set_pause_guard(&self, g: Option<Arc<dyn PauseGuard>>) {
        *self.guard.write() = g;
    }

    /// The pause guard, if one is installed.
    pub(crate) fn pause_guard(&self) -> Option<Arc<dyn PauseGuard>> {
        self.guard.read().clone()
    }

    /// Registers the sharing layer (once; a second call is ignored).
    pub fn set_sharing(&self, s: Arc<dyn Sharing>) {
        let _ = self.sharing.set(s);
    }

    /// The sharing layer, if one registered (`sharing.rs`).
    pub(crate) fn sharing(&self) -> Option<&Arc<dyn Sharing>> {
        self.sharing.get()
    }
}

impl Drop for Allocator {
    fn drop(&mut self) {
        self.preparer.stop();
        let allocations = std::mem::take(&mut self.table.get_mut().allocations);
        for (ptr, a) in allocations {
            let ended = detach(self.table.get_mut(), &a, ptr);
            self.release(a, ptr, ended);
        }
        for (_, dev) in self.devices.get_mut().drain() {
            let _ = self
                .driver
                .with_context(dev.ctx, || self.driver.stream_destroy(dev.stream));
        }
    }
}

/// Takes an allocation just removed from the table out of its run, if it has one: its range
/// joins the run's freed ranges, and the run is returned (removed from the table) when this
/// was its last allocation, for the caller to release outside the lock.
pub(crate) fn detach(t: &mut Table, a: &Allocation, ptr: u64) -> Option<(u64, Run)> {
    let Phase::Resident(Backing::Run(base)) = a.phase else {
        return None;
    };
    let run = t
        .runs
        .get_mut(&base)
        .expect("a run outlives its allocations");
    run.live -= 1;
    run.dead.push((ptr, a.size));
    if run.live > 0 {
        return None;
    }
    t.runs.remove(&base).map(|r| (base, r))
}

/// Whether a new allocation with `tag` is refused now: its tag is paused and is not the
/// whole-process tag.
fn refuses_malloc(t: &Table, tag: &str) -> bool {
    t.tags
        .get(tag)
        .is_some_and(|e| e.paused && !e.allocates_while_paused)
}

/// Checks the tag grammar (1 to 64 of ASCII letters, digits, `_`, `-`, `.`): the one definition,
/// used by every entry point that takes a tag and by profiles.
pub fn validate_tag(tag: &str) -> Result<()> {
    let ok = !tag.is_empty()
        && tag.len() <= 64
        && tag
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "invalid tag {tag:?}: use 1 to 64 characters from letters, digits, '_', '-' and '.'"
        )))
    }
}
