//! Pause and resume: the state transitions of allocations, in three phases.
//!
//! 1. **Claim** (table lock): resolve the tags, move every affected allocation to `Pausing` or
//!    `Resuming` and take its handle and backup out of the table into a [`Job`].
//! 2. **Work** (no table lock, `work.rs`): the driver calls. Copies are queued asynchronously
//!    on each device's stream for all jobs first, and unmapping (pause) or mapping (resume)
//!    proceeds while they run, so copy and VMM work overlap.
//! 3. **Settle** (table lock): each job ends `Resident` if it holds a handle and `Paused` if
//!    not, so a failure leaves every allocation in one of the two stable states. Frees requested
//!    during the transition are carried out now.
//!
//! Pausing a paused allocation and resuming a resident one are no-ops: only `Resident`
//! allocations are claimed by a pause and only `Paused` ones by a resume.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::allocator::Allocator;
use crate::backup::{Backup, BackupKind};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::external::{ExternalTag, Report};
use crate::guard::PauseGuard;
use crate::options::Pack;
use crate::steps::{Op, Piece, Plan};
use crate::table::{Allocation, Backing, Phase, Run, Table};
use crate::types::Policy;

/// One claimed allocation: its piece of memory (key: the allocation's id; backed up whole)
/// and what the transition did to it.
pub(crate) struct Job {
    pub(crate) piece: Piece,
    /// Some while physical memory is mapped: decides the state the job settles in.
    pub(crate) backing: Option<Backing>,
    pub(crate) error: Option<Error>,
    /// The allocation is shared with other processes (`sharing.rs`): a resume gives it a
    /// physical allocation of its own, and the sharing layer hears of it.
    pub(crate) shared: bool,
}

impl Job {
    pub(crate) fn ptr(&self) -> u64 {
        self.piece.ptr
    }

    pub(crate) fn size(&self) -> usize {
        self.piece.len
    }

    pub(crate) fn copies(&self) -> bool {
        self.piece.copies()
    }

    pub(crate) fn device(&self) -> &Arc<Device> {
        &self.piece.device
    }
}

/// What the caller of one transition chose instead of the allocations' own policies and the
/// retention setting.
#[derive(Clone, Copy, Debug, Default)]
struct Choice {
    /// Pause: the policy every allocation it pauses is paused with (`None`: each its own).
    backup: Option<Policy>,
    /// Pause: also release the backups of allocations already paused (a discard).
    discard: bool,
    /// Resume: keep the backups of what resumed (`None`: the retention setting).
    keep_backups: Option<bool>,
}

impl Allocator {
    /// Pauses every allocation of `tags` (all tags when empty): backs up the contents of `cpu`,
    /// `mmap` and `disk` allocations, then unmaps and releases the physical memory. Addresses stay
    /// reserved. New allocations with these tags are refused until they are resumed.
    pub fn pause(&self, tags: &[&str]) -> Result<Report> {
        self.transition(Op::Pause, tags, Choice::default())
    }

    /// [`Allocator::pause`] with the backup policy chosen now: every allocation this call pauses
    /// is paused as if `backup` were its policy (`None`: its own). The contents of one paused
    /// with `Discard` are dropped, and so is a backup it kept from an earlier cycle; one paused
    /// with a keeping policy gets a backup of that kind, and its resume restores it. Allocations
    /// already paused keep what their pause did. The choice applies to the tags of
    /// allocations: naming an external tag (`nccl`, whose backups follow its own option) with a
    /// policy is `InvalidArgument`; with no tag named, external tags pause as always.
    pub fn pause_with_backup(&self, tags: &[&str], backup: Option<Policy>) -> Result<Report> {
        let choice = Choice {
            backup,
            ..Choice::default()
        };
        self.transition(Op::Pause, tags, choice)
    }

    /// Drops the contents of every allocation of `tags` (every tag of allocations when empty)
    /// and their backups: resident allocations are paused without a copy, paused ones lose
    /// their backup, so that the next resume maps memory holding arbitrary bytes. Afterwards
    /// the tags are paused, as after a pause. External tags (`nccl`) cannot be discarded:
    /// naming one is `InvalidArgument`, and no tag named leaves them alone.
    pub fn discard(&self, tags: &[&str]) -> Result<Report> {
        let choice = Choice {
            backup: Some(Policy::Discard),
            discard: true,
            ..Choice::default()
        };
        self.transition(Op::Pause, tags, choice)
    }

    /// Resumes every paused allocation of `tags` (all tags when empty) at its old address,
    /// restoring backed-up contents. On running out of device memory it stops and returns
    /// [`Error::ResumeOutOfMemory`]; what was resumed stays resident, the rest stays paused with
    /// its backup, and calling resume again after freeing memory finishes the job.
    pub fn resume(&self, tags: &[&str]) -> Result<Report> {
        self.transition(Op::Resume, tags, Choice::default())
    }

    /// [`Allocator::resume`] that keeps (`Some(true)`) or releases (`Some(false)`) the backups
    /// of what it resumes, whatever the retention setting says (`None`: as it says); external
    /// tags named (`nccl`) follow the same choice. Releasing also drops the backups retained by
    /// resident allocations of the tags, as a resume with retention off does.
    pub fn resume_keep_backups(&self, tags: &[&str], keep: Option<bool>) -> Result<Report> {
        let choice = Choice {
            keep_backups: keep,
            ..Choice::default()
        };
        self.transition(Op::Resume, tags, choice)
    }

    fn transition(&self, op: Op, names: &[&str], choice: Choice) -> Result<Report> {
        let _one_at_a_time = self.transition.lock();
        let start = Instant::now();
        let (table_names, mut externals) = self.split_external(names)?;
        if choice.backup.is_some() && !externals.is_empty() {
            if !names.is_empty() {
                let what = if choice.discard {
                    "cannot be discarded"
                } else {
                    "cannot be paused with a backup policy chosen at pause time"
                };
                return Err(Error::InvalidArgument(format!(
                    "tag '{}' {what}: memsaver keeps its contents as its own option says                      (MEMSAVER_NCCL_BACKUP for 'nccl'); pause it in a call of its own, without                      a backup policy",
                    externals[0].0
                )));
            }
            if choice.discard {
                externals.clear();
            }
        }
        let pauses_table = names.is_empty() || !table_names.is_empty();
        // The guard hears of every transition, so it can let go of what a resume, or a pause
        // that changed nothing, made resident again.
        let guard = self.pause_guard();
        let _after = guard.as_ref().map(|g| AfterTransition(g.as_ref()));
        if op == Op::Pause
            && pauses_table
            && let Some(g) = &guard
        {
            let tags = if names.is_empty() {
                self.table.lock().known_tags()
            } else {
                table_names.iter().map(|t| (*t).to_owned()).collect()
            };
            g.before_pause(&tags).map_err(Error::PauseRefused)?;
        }
        // Steps made during this call (the external tags' too) read it, through the settings.
        let _keep = KeepBackups::choose(self, choice.keep_backups);
        let mut report = Report::default();
        let mut first_error = None;
        if pauses_table {
            match self.table_transition(op, &table_names, choice) {
                Ok(r) => report.merge(r),
                Err(e) => first_error = Some(e),
            }
        }
        for (name, ext) in externals {
            let r = match op {
                Op::Pause => ext.pause(),
                Op::Resume => ext.resume(),
            };
            match r {
                Ok(r) => report.merge(r),
                Err(e) => {
                    tracing::warn!(op = op.name(), tag = %name, error = %e, "external tag failed");
                    first_error.get_or_insert(e);
                }
            }
        }
        report.elapsed = start.elapsed();
        tracing::info!(
            op = op.name(),
            tags = ?report.tags,
            allocations = report.allocations,
            bytes = report.bytes,
            copied = report.copied_bytes,
            ms = report.elapsed.as_secs_f64() * 1e3,
            ok = first_error.is_none(),
        );
        first_error.map_or(Ok(report), Err)
    }

    /// Splits `names` into tags of the table and external tags, refusing unknown names before
    /// anything changes. An empty list means every tag of both kinds.
    #[allow(clippy::type_complexity)]
    fn split_external<'a>(
        &self,
        names: &[&'a str],
    ) -> Result<(Vec<&'a str>, Vec<(String, Arc<dyn ExternalTag>)>)> {
        let ext = self.external.read();
        if names.is_empty() {
            let all = ext.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            return Ok((Vec::new(), all));
        }
        for name in names {
            // A malformed name is reported as such, not as an unknown tag.
            crate::allocator::validate_tag(name)?;
        }
        let t = self.table.lock();
        let (mut table_names, mut externals) = (Vec::new(), Vec::new());
        for name in names {
            if let Some(e) = ext.get(*name) {
                if !externals.iter().any(|(n, _)| n == name) {
                    externals.push(((*name).to_owned(), e.clone()));
                }
            } else if t.tags.contains_key(*name) {
                table_names.push(*name);
            } else {
                let mut known = t.known_tags();
                known.extend(ext.keys().cloned());
                known.sort();
                return Err(Error::UnknownTag {
                    tag: (*name).to_owned(),
                    known,
                });
            }
        }
        Ok((table_names, externals))
    }

    /// Pause or resume of tags in the allocation table (all of them when `names` is empty).
    fn table_transition(&self, op: Op, names: &[&str], choice: Choice) -> Result<Report> {
        let mut steps = self.steps(op);
        let (tags, mut jobs, mut runs, released) = self.claim(op, names, &steps.plan, choice)?;
        // Backups of resident allocations that retention no longer keeps (outside the lock:
        // freeing pinned memory is a driver call).
        drop(released);
        jobs.sort_by_key(|j| (j.device().ordinal, j.copies(), j.ptr()));
        let largest_disk = jobs
            .iter()
            .filter(|j| j.piece.policy == Policy::Disk)
            .map(Job::size)
            .max()
            .unwrap_or(0);
        steps.expect_disk(largest_disk);
        let sharing = self.sharing().cloned();
        let shared_ids = |jobs: &[Job]| -> Vec<u64> {
            jobs.iter()
                .filter(|j| j.shared && j.error.is_none())
                .map(|j| j.piece.key)
                .collect()
        };
        // What other processes did not do in time (non-fatal: reported after the work).
        let mut peers_behind = None;
        if op == Op::Pause
            && let Some(s) = &sharing
        {
            // Other processes let go of their imports before this one's memory goes.
            let ids = shared_ids(&jobs);
            if !ids.is_empty() {
                peers_behind = s.before_release(&ids).err();
            }
        }
        match op {
            Op::Pause => self.pause_jobs(&mut jobs, &mut runs, &mut steps),
            Op::Resume => self.resume_jobs(&mut jobs, &mut runs, &mut steps),
        }
        let done = || jobs.iter().filter(|j| j.error.is_none());
        let report = Report {
            tags: tags.iter().map(|t| t.to_string()).collect(),
            allocations: done().count(),
            bytes: done().map(|j| j.size() as u64).sum(),
            copied_bytes: steps.copied_bytes(),
            elapsed: Duration::ZERO,
        };
        // The staging buffer goes before settle, as every driver call of the work phase.
        let plan = steps.into_plan();
        let resumed = match (op, &sharing) {
            (Op::Resume, Some(_)) => shared_ids(&jobs),
            // Shared allocations whose pause failed stay resident: the importers map them again.
            (Op::Pause, Some(_)) => jobs
                .iter()
                .filter(|j| j.shared && j.error.is_some() && j.backing.is_some())
                .map(|j| j.piece.key)
                .collect(),
            _ => Vec::new(),
        };
        let settled = self.settle(op, &tags, jobs, runs, &plan);
        // Resident again, with the owner's contents: importers map the new memory.
        if let Some(s) = &sharing
            && !resumed.is_empty()
            && let Err(e) = s.after_resume(&resumed)
        {
            peers_behind.get_or_insert(e);
        }
        settled?;
        match peers_behind {
            // This process's part is done; the caller learns what other processes still hold.
            Some(e) => Err(Error::Peer {
                tag: tags.join(", "),
                message: e.to_string(),
            }),
            None => Ok(report),
        }
    }

    /// Claims the allocations of `names` (see the module documentation). A pause of disk-backed
    /// allocations without a usable disk directory is refused here, before anything changes.
    /// Also returns the runs of the claimed allocations (a pause takes them out of the table),
    /// and the backups that this call releases, for the caller to drop outside the lock: those
    /// of resident allocations that a resume without retention releases, those of allocations
    /// paused with `discard` (an older cycle's copy must not be restored), and, for a discard,
    /// those of allocations already paused.
    ///
    /// A pause copies each allocation as its policy says, or as the caller chose
    /// ([`Choice::backup`]). A resume restores an allocation exactly when it has a backup, of
    /// whichever kind its pause made: that is what the pause chose.
    #[allow(clippy::type_complexity)]
    fn claim(
        &self,
        op: Op,
        names: &[&str],
        plan: &Plan,
        choice: Choice,
    ) -> Result<(Vec<Arc<str>>, Vec<Job>, Runs, Vec<Backup>)> {
        let mut t = self.table.lock();
        let tags = resolve(&t, names)?;
        let claims = |a: &Allocation| {
            tags.contains(&a.tag)
                && matches!(
                    (op, &a.phase),
                    (Op::Pause, Phase::Resident(_)) | (Op::Resume, Phase::Paused)
                )
        };
        let paused_with = |a: &Allocation| choice.backup.unwrap_or(a.policy);
        let disk = t
            .allocations
            .values()
            .any(|a| claims(a) && paused_with(a) == Policy::Disk);
        if disk
            && op == Op::Pause
            && let Err(e) = &plan.disk_dir
        {
            return Err(e.clone());
        }
        if op == Op::Pause {
            for tag in &tags {
                t.tags.get_mut(tag).expect("resolved").paused = true;
            }
        }
        let mut jobs = Vec::new();
        let mut released = Vec::new();
        let mut runs = Runs::new();
        let pack_all = plan.pack == Pack::All;
        let Table {
            allocations,
            runs: table_runs,
            ..
        } = &mut *t;
        for (&ptr, a) in allocations.iter_mut() {
            if !tags.contains(&a.tag) {
                continue;
            }
            let policy = match op {
                Op::Pause => paused_with(a),
                Op::Resume => a
                    .backup
                    .as_ref()
                    .map_or(Policy::Discard, |b| match b.kind() {
                        BackupKind::Pinned => Policy::Cpu,
                        BackupKind::Mmap => Policy::Mmap,
                        BackupKind::Disk => Policy::Disk,
                    }),
            };
            let backing = match (op, &a.phase) {
                (Op::Pause, Phase::Resident(b)) => {
                    let b = *b;
                    if !policy.keeps_contents() {
                        released.extend(a.backup.take());
                    }
                    if let Backing::Run(base) = b
                        && !runs.contains_key(&base)
                    {
                        let run = table_runs
                            .remove(&base)
                            .expect("a run outlives its allocations");
                        runs.insert(base, run);
                    }
                    a.phase = Phase::Pausing;
                    Some(b)
                }
                (Op::Resume, Phase::Paused) => {
                    a.phase = Phase::Resuming;
                    None
                }
                (Op::Resume, Phase::Resident(_)) if !plan.retain => {
                    released.extend(a.backup.take());
                    continue;
                }
                (Op::Pause, Phase::Paused) if choice.discard => {
                    released.extend(a.backup.take());
                    continue;
                }
                _ => continue,
            };
            jobs.push(Job {
                piece: Piece::new(
                    a.id,
                    a.tag.clone(),
                    a.device.clone(),
                    policy,
                    ptr,
                    a.size,
                    a.backup.take(),
                )
                .packed(pack_all),
                backing,
                error: None,
                shared: a.shared,
            });
        }
        Ok((tags, jobs, runs, released))
    }

    /// Writes the jobs' outcomes back to the table and turns failures into one error. A resumed
    /// allocation's backup goes back to the table with retention on and is released (outside
    /// the lock) with retention off.
    fn settle(
        &self,
        op: Op,
        tags: &[Arc<str>],
        jobs: Vec<Job>,
        runs: Runs,
        plan: &Plan,
    ) -> Result<()> {
        let mut to_free = Vec::new();
        let mut released: Vec<Backup> = Vec::new();
        let mut errors = Vec::new();
        let mut oom_device = None;
        let (mut done, mut still_paused, mut bytes_still_paused) = (0, 0, 0u64);
        let mut tags_still_paused: Vec<Arc<str>> = Vec::new();
        // Pause: tags with a job that failed, and tags with a job that paused.
        let (mut tags_failed, mut tags_paused): (Vec<Arc<str>>, Vec<Arc<str>>) = Default::default();
        {
            let mut t = self.table.lock();
            // Runs a resume made, and runs a pause could not release.
            t.runs.extend(runs);
            for mut j in jobs {
                let backup = j.piece.backup.take();
                let a = t
                    .allocations
                    .get_mut(&j.ptr())
                    .expect("claimed allocations stay in the table");
                a.phase = match j.backing {
                    Some(b) => Phase::Resident(b),
                    None => Phase::Paused,
                };
                let resumed = op == Op::Resume && j.error.is_none();
                if resumed && !plan.retain {
                    released.extend(backup);
                } else {
                    a.backup = backup;
                }
                let seen = if j.error.is_some() {
                    &mut tags_failed
                } else {
                    &mut tags_paused
                };
                if op == Op::Pause && !seen.contains(&j.piece.tag) {
                    seen.push(j.piece.tag.clone());
                }
                match j.error.take() {
                    None => done += 1,
                    Some(e) => {
                        if op == Op::Resume {
                            still_paused += 1;
                            bytes_still_paused += j.size() as u64;
                            if !tags_still_paused.contains(&j.piece.tag) {
                                tags_still_paused.push(j.piece.tag.clone());
                            }
                            if matches!(&e, Error::Driver(d) if d.is_out_of_memory())
                                && oom_device.is_none()
                            {
                                oom_device = Some(j.device().ordinal);
                            }
                        }
                        tracing::warn!(op = op.name(), tag = %j.piece.tag, ptr = format_args!("{:#x}", j.ptr()), error = %e, "allocation kept its state");
                        errors.push(e);
                    }
                }
                if a.free_pending {
                    let a = t.allocations.remove(&j.ptr()).expect("present");
                    let ended = crate::allocator::detach(&mut t, &a, j.ptr());
                    to_free.push((j.ptr(), a, ended));
                }
            }
            if op == Op::Resume {
                for tag in tags {
                    if !tags_still_paused.contains(tag) {
                        t.tags.get_mut(tag).expect("resolved").paused = false;
                    }
                }
            }
            // A tag whose pause failed for every allocation it claimed is paused only if some
            // other allocation of it is (claim marked it): what stayed resident is usable and
            // the tag takes new allocations.
            tags_failed.retain(|tag| !tags_paused.contains(tag));
            if !tags_failed.is_empty() {
                let mut any_paused: Vec<&Arc<str>> = Vec::new();
                for a in t.allocations.values() {
                    if matches!(a.phase, Phase::Paused) && !any_paused.contains(&&a.tag) {
                        any_paused.push(&a.tag);
                    }
                }
                let unpause: Vec<Arc<str>> = tags_failed
                    .into_iter()
                    .filter(|tag| !any_paused.contains(&tag))
                    .collect();
                for tag in unpause {
                    t.tags.get_mut(&tag).expect("resolved").paused = false;
                }
            }
        }
        drop(released);
        for (ptr, a, ended) in to_free {
            self.release(a, ptr, ended);
        }
        if let Some(device) = oom_device {
            return Err(Error::ResumeOutOfMemory {
                device,
                tags: tags_still_paused.iter().map(|t| t.to_string()).collect(),
                resumed: done,
                still_paused,
                bytes_still_paused,
                margin: plan.margin,
            });
        }
        if !errors.is_empty() {
            return Err(Error::Incomplete {
                op: op.name(),
                tags: tags.iter().map(|t| t.to_string()).collect(),
                failed: errors.len(),
                first: Box::new(errors.swap_remove(0)),
            });
        }
        Ok(())
    }
}

/// The keep-backups choice of the transition in progress, put in the settings for as long as
/// it runs so that every step it makes (an external tag's too, through [`Allocator::steps`])
/// reads it; taken out again when dropped, whatever happened.
struct KeepBackups<'a>(&'a Allocator);

impl<'a> KeepBackups<'a> {
    fn choose(a: &'a Allocator, keep: Option<bool>) -> Self {
        a.set_transition_keep_backups(keep);
        Self(a)
    }
}

impl Drop for KeepBackups<'_> {
    fn drop(&mut self) {
        self.0.set_transition_keep_backups(None);
    }
}

/// Runs taken out of the table by a pause, or made by a resume (or what goes with each), by
/// base address.
pub(crate) type Runs<T = Run> = std::collections::BTreeMap<u64, T>;

/// Tells the pause guard that the transition has ended, when the transition returns (also
/// early, and also when the guard refused it), with the transition lock still held.
struct AfterTransition<'a>(&'a dyn PauseGuard);

impl Drop for AfterTransition<'_> {
    fn drop(&mut self) {
        self.0.after_transition();
    }
}

/// The interned tags named by `names`, or every known tag when `names` is empty.
fn resolve(t: &Table, names: &[&str]) -> Result<Vec<Arc<str>>> {
    if names.is_empty() {
        return Ok(t.tags.keys().cloned().collect());
    }
    let mut out: Vec<Arc<str>> = Vec::with_capacity(names.len());
    for name in names {
        match t.tags.get_key_value(*name) {
            Some((k, _)) => {
                if !out.contains(k) {
                    out.push(k.clone());
                }
            }
            None => {
                return Err(Error::UnknownTag {
                    tag: (*name).to_owned(),
                    known: t.known_tags(),
                });
            }
        }
    }
    Ok(out)
}
