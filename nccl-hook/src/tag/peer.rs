//! The `nccl` tag's exchanges with its peers through the cross-process layer
//! (`memsaver_ipc`), under the `nccl` timeout: the pause tells owners which imports it released,
//! the resume asks owners for the new generation of its imports ([`crate::tag::provider`]).
//!
//! NCCL shares a P2P buffer by exporting its handle as a POSIX fd, sending the fd over its own Unix
//! socket and importing it in the peer. The export wrapper ([`crate::interpose::sharing`]) hands
//! NCCL a token instead (`memsaver_ipc::token`, naming the buffer by its virtual handle); the
//! importer's wrapper trades it for the real fd with the owner; the owner serves it from its
//! registry ([`crate::tag::exports`]). So the owner knows every importer of each buffer, and every
//! importer knows the owner and buffer behind each import. Who may talk to whom, and what enforces
//! it, is docs/security.md.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use memsaver_allocator::steps::Op;
use memsaver_allocator::{Allocator, Error};
use memsaver_ipc::deadline::{Outcome, PerPeer, listed};
use memsaver_ipc::protocol::Buffer;
use memsaver_ipc::shared::{self, Holders, requests};

use crate::options;
use crate::registry::{self, TAG};
use crate::tag::local::{Holding, Notices, device_of, places};

pub(crate) use memsaver_ipc::identity::alive;

/// How long pause waits for importers to let go and resume for owners to come back
/// (`MEMSAVER_NCCL_TIMEOUT_MS`); also how long an owner waits for a buffer still resuming
/// before it answers a peer's import.
pub(crate) fn timeout() -> Duration {
    options::get().nccl_timeout
}

/// The option that sets [`timeout`], named in progress lines.
pub(crate) const TIMEOUT_SETTING: &str = "MEMSAVER_NCCL_TIMEOUT_MS";

/// Buffers `wants` of `owner` (each at least the generation given): the real fd of each, with
/// the generation it is and where it lies in the memory served, or word that the owner freed
/// it; on a failure, what to tell the owner.
pub(crate) fn request_fds(
    group: i64,
    owner: u32,
    wants: &[Buffer],
) -> Result<Vec<requests::Answer>, requests::FetchFailed> {
    requests::request_fds(group, owner, wants, timeout())
}

/// Pause, when this process's own pause failed (`message`): tells each owner of imports it
/// still maps, so that their pauses stop waiting for it (a thread per owner).
pub(crate) fn tell_pause_failed(
    group: i64,
    owners: BTreeMap<u32, ()>,
    message: String,
    deadline: Instant,
) -> PerPeer<std::result::Result<(), String>> {
    PerPeer::start(
        "nccl-failed",
        TIMEOUT_SETTING,
        owners,
        deadline,
        move |owner, ()| {
            requests::notify_pause_failed(group, owner, &message, timeout())
                .map_err(|e| e.to_string())
        },
        |_, _| {},
    )
}

/// Tells `owner` that this process released its imports `items`.
pub(crate) fn notify_released(group: i64, owner: u32, items: &[Buffer]) -> Result<(), String> {
    requests::notify_released(group, owner, items, timeout()).map_err(|e| e.to_string())
}

/// Why a peer did not do its part, as a user can act on it.
pub(crate) enum Fault {
    /// It exited (or was killed).
    Exited,
    /// It did not answer by the deadline; what it did not do.
    NoAnswer(&'static str),
    /// It still holds imports of this process's paused memory at the deadline.
    StillHolds,
    /// It answered with an error, or could not be reached.
    Failed(String),
    /// Its own resume failed (its error, as it reported it): it serves its buffers once a
    /// resume of its completes.
    ResumeFailed(String),
    /// Its own pause failed (its error, as it reported it) and left its imports of this
    /// process's memory mapped.
    PauseFailed(String),
}

/// One line of a Peer error: which process, what it holds (`holds`, a clause that follows
/// the process's name), what went wrong, what to do.
pub(crate) fn describe(
    pid: u32,
    group: i64,
    holds: &str,
    fault: &Fault,
    timeout: Duration,
) -> String {
    let who = format!("process {pid} (group {group}){holds}");
    let ms = timeout.as_millis();
    // The scheduler state: `R`, `S`, `T` (stopped), `Z`, ...
    let state = memsaver_allocator::process::stat(&pid.to_string()).map(|(s, _)| s);
    let (stopped, zombie) = (
        matches!(state, Some('T' | 't')),
        matches!(state, Some('Z' | 'X')),
    );
    match fault {
        Fault::Exited => format!(
            "{who}: the process exited: restart the job (or destroy the communicators it was in)"
        ),
        // It answered: neither stopped nor hung.
        Fault::PauseFailed(e) => format!(
            "{who}: its own pause of 'nccl' failed ({e}), so it still maps that memory: once \
             the cause is fixed there, call pause('nccl') again there"
        ),
        Fault::ResumeFailed(e) => format!(
            "{who}: its own resume of 'nccl' failed ({e}); its buffers stay paused there and \
             this process's imports of them stay paused here: once the cause is fixed there, \
             call resume('nccl') again in every process of the group"
        ),
        _ if zombie => format!(
            "{who}: the process exited (a zombie its parent has not reaped): restart the job"
        ),
        _ if stopped => format!(
            "{who}: it is stopped (SIGSTOP or a debugger) and does not answer: continue it \
             (kill -CONT {pid}), then retry"
        ),
        Fault::NoAnswer(what) => format!(
            "{who}: it {what} within {ms} ms: is it stopped or hung? raise \
             MEMSAVER_NCCL_TIMEOUT_MS if it is slow"
        ),
        Fault::StillHolds => format!(
            "{who} and did not let go within {ms} ms: every process of the group must pause \
             'nccl' too; is it stopped or hung? raise MEMSAVER_NCCL_TIMEOUT_MS if it is slow"
        ),
        Fault::Failed(e) => format!(
            "{who}: {e}: is it stopped or hung? raise MEMSAVER_NCCL_TIMEOUT_MS if it is slow"
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// The steps of pause and resume that involve peers.
// ---------------------------------------------------------------------------------------------

/// Pause step 2 (threads): tells each owner which of its buffers this process released.
pub(crate) fn notify_owners(
    group: i64,
    notices: Notices,
    deadline: Instant,
) -> PerPeer<std::result::Result<(), String>> {
    PerPeer::start(
        "nccl-notify",
        TIMEOUT_SETTING,
        notices,
        deadline,
        move |owner, items: Vec<Buffer>| notify_released(group, owner, &items),
        // Delivered late, the notice still does its job.
        |_, _| {},
    )
}

/// Pause step 2, collected: the owners that are alive and did not take the notice by the
/// deadline (a dead owner has nothing left to release).
pub(crate) fn unacknowledged(
    outcomes: BTreeMap<u32, Outcome<std::result::Result<(), String>>>,
) -> BTreeMap<u32, Fault> {
    outcomes
        .into_iter()
        .filter_map(|(owner, o)| {
            let fault = match o {
                Outcome::Done(Ok(())) => return None,
                Outcome::Done(Err(e)) | Outcome::NotStarted(e) => Fault::Failed(e),
                Outcome::NoAnswer => {
                    Fault::NoAnswer("did not take the notice that its buffers were released")
                }
            };
            alive(owner).then_some((owner, fault))
        })
        .collect()
}

/// What the processes that did not let go still hold, by pid, and the errors of those whose
/// own pause failed.
pub(crate) type StillHeld = (BTreeMap<u32, Holding>, BTreeMap<u32, String>);

/// Pause step 3: waits until every importer of this process's paused exported buffers (also
/// those paused by an earlier, failed call) has let go or said its own pause failed, or
/// `deadline`: the owner's ledger (`memsaver_ipc::exported`) records the importers and their
/// notices, and forgets those that exited (a dead process has let go of everything).
pub(crate) fn wait_importers(group: i64, deadline: Instant) -> StillHeld {
    let describe = |holders: &Holders| {
        let who: Vec<String> = holding(holders)
            .iter()
            .map(|(pid, h)| format!("process {pid} (group {group}) holds {h}"))
            .collect();
        format!(
            "pause('nccl') waits for peers to release their imports of this process's memory: {}",
            listed(&who)
        )
    };
    let (holders, failed) = shared::wait_released(deadline, TIMEOUT_SETTING, &describe);
    let failed = failed.into_iter().map(|(w, e)| (w.pid, e)).collect();
    (holding(&holders), failed)
}

/// What `holders` hold, per pid, as the registry describes the buffers (those NCCL freed
/// inside a run too: [`registry::Retired`]).
fn holding(holders: &Holders) -> BTreeMap<u32, Holding> {
    let reg = registry::lock();
    let mut out = BTreeMap::<u32, Holding>::new();
    for (who, vhs) in holders {
        let h = out.entry(who.pid).or_default();
        for vh in vhs {
            if let Some(p) = reg.physicals.get(vh) {
                h.add(p);
            } else if let Some(r) = reg.retired.get(vh) {
                h.count(r.size, r.device);
            }
        }
    }
    out
}

/// `, whose imports of <holding> this process released`, for an owner told so.
fn released_clause(h: Option<&Holding>) -> String {
    h.map_or_else(String::new, |h| {
        format!(", whose imports of {h} this process released")
    })
}

/// The error of a pause whose importers did not all let go.
pub(crate) fn pause_error(
    group: i64,
    (holders, failed): &StillHeld,
    unacked: &BTreeMap<u32, Fault>,
    released_imports: &BTreeMap<u32, Holding>,
) -> Error {
    let t = timeout();
    let mut lines: Vec<String> = holders
        .iter()
        .map(|(pid, h)| {
            let holds = format!(" holds imports of {h} of this process");
            let fault = match failed.get(pid) {
                Some(e) => Fault::PauseFailed(e.clone()),
                None => Fault::StillHolds,
            };
            describe(*pid, group, &holds, &fault, t)
        })
        .collect();
    // An owner that also holds imports of ours is named once, above.
    lines.extend(
        unacked
            .iter()
            .filter(|(pid, _)| !holders.contains_key(pid))
            .map(|(pid, f)| {
                describe(
                    *pid,
                    group,
                    &released_clause(released_imports.get(pid)),
                    f,
                    t,
                )
            }),
    );
    peer_error(format!(
        "pause released this process's memory, but {} process(es) still hold imports of it, \
         so that device memory is not free yet: {}",
        holders.len(),
        lines.join("; ")
    ))
}

/// An import to fetch at resume: its handle here, and the item asking its owner for it.
#[derive(Clone, Copy)]
pub(crate) struct Wanted {
    pub(crate) vh: u64,
    pub(crate) owner: Buffer,
}

/// An import's new generation, served by its owner: its handle here, the item naming it there
/// (with the generation served), the fd, and where the buffer lies in the memory the fd is
/// (offset, size of that memory).
pub(crate) struct Fetched {
    pub(crate) vh: u64,
    pub(crate) owner: Buffer,
    pub(crate) fd: OwnedFd,
    pub(crate) served: (u64, u64),
    /// The owner's epoch when it served it (`memsaver_ipc::epoch`).
    pub(crate) epoch: u64,
}

impl Fetched {
    /// What the owner served `s` for the import `w` asked.
    pub(crate) fn of(w: Wanted, s: requests::Served) -> Self {
        Self {
            vh: w.vh,
            owner: Buffer {
                generation: s.generation,
                ..w.owner
            },
            fd: s.fd,
            served: (s.offset, s.size),
            epoch: s.epoch,
        }
    }
}

/// What one owner answered a resume's fetch: the imports it served, and those whose buffer it
/// freed while this process held them released (it answered `Gone`).
#[derive(Default)]
pub(crate) struct Fetch {
    pub(crate) served: Vec<Fetched>,
    pub(crate) gone: Vec<Wanted>,
}

pub(crate) type FetchResult = std::result::Result<Fetch, Fault>;

/// The paused imports, per owner: the generation after the one each mapped.
pub(crate) fn imports_to_fetch() -> BTreeMap<u32, Vec<Wanted>> {
    let mut fetch = BTreeMap::<u32, Vec<Wanted>>::new();
    for (vh, p) in &registry::lock().physicals {
        if let (Some(g), Some(s)) = (p.released_generation(), p.source) {
            fetch.entry(s.owner).or_default().push(Wanted {
                vh: *vh,
                owner: s.item(g + 1),
            });
        }
    }
    fetch
}

/// Resume step 2 (threads): asks each owner for the new generation of its buffers. An owner
/// registers this process as an importer of what it serves, so what is not mapped in the end
/// is reported released: on a failure here (the owner may have served part of it, at a later
/// generation than the one asked: the notice names the generation served, the one the owner
/// records) and when the answer comes after the deadline.
pub(crate) fn fetch_imports(
    group: i64,
    fetch: BTreeMap<u32, Vec<Wanted>>,
    deadline: Instant,
) -> PerPeer<FetchResult> {
    PerPeer::start(
        "nccl-fetch",
        TIMEOUT_SETTING,
        fetch,
        deadline,
        move |owner, wants: Vec<Wanted>| {
            let asks: Vec<Buffer> = wants.iter().map(|w| w.owner).collect();
            let t = Instant::now();
            let r = request_fds(group, owner, &asks);
            tracing::debug!(
                owner,
                buffers = asks.len(),
                ms = t.elapsed().as_secs_f64() * 1e3,
                "nccl resume: the owner served its buffers"
            );
            match r {
                Ok(answers) => {
                    let mut fetch = Fetch::default();
                    for (w, a) in wants.into_iter().zip(answers) {
                        match a {
                            requests::Answer::Served(s) => fetch.served.push(Fetched::of(w, s)),
                            requests::Answer::Gone => fetch.gone.push(w),
                        }
                    }
                    Ok(fetch)
                }
                Err(failed) => {
                    if alive(owner) {
                        let _ = notify_released(group, owner, &failed.release);
                    }
                    Err(match failed.error {
                        memsaver_ipc::error::Error::OwnerFailed { message, .. } => {
                            Fault::ResumeFailed(message)
                        }
                        e => Fault::Failed(e.to_string()),
                    })
                }
            }
        },
        // What was freed there is dropped by a later resume, which the owner answers the same.
        move |owner, late: FetchResult| {
            if let Ok(fetch) = late {
                let items: Vec<Buffer> = fetch.served.iter().map(|f| f.owner).collect();
                let _ = notify_released(group, owner, &items);
            }
        },
    )
}

/// What resume step 3 did.
#[derive(Default)]
pub(crate) struct Imported {
    /// Imports mapped.
    pub(crate) mapped: usize,
    /// Imports whose owner freed the buffer, dropped (`Orphaned`: NCCL frees them later).
    pub(crate) orphaned: usize,
    /// Owners whose imports stay paused, what this process imported of them, and why.
    pub(crate) faults: BTreeMap<u32, (Holding, Fault)>,
    /// The first import that was served but could not be mapped.
    pub(crate) map_error: Option<Error>,
}

/// Resume step 3: maps the new generations served by each owner where the imports were.
/// The imports of an owner that did not serve them stay paused (a later resume fetches
/// them again); a served import that cannot be mapped is reported released to its owner,
/// so that the owner's next pause does not wait for it. An import whose buffer the owner
/// freed is orphaned: no resume fetches it again, and NCCL's free of it later tells the owner.
pub(crate) fn map_imports(
    a: &'static Allocator,
    group: i64,
    fetched: BTreeMap<u32, Outcome<FetchResult>>,
) -> Imported {
    let d = a.driver();
    let steps = a.steps(Op::Resume);
    let mut out = Imported::default();
    let mut unused = Notices::new();
    let t = Instant::now();
    let mut reg = registry::lock();
    let locked_ms = t.elapsed().as_secs_f64() * 1e3;
    let ranges = reg.ranges_by_handle();
    tracing::debug!(
        locked_ms,
        ranges_ms = t.elapsed().as_secs_f64() * 1e3 - locked_ms,
        "nccl resume: imports"
    );
    for (owner, outcome) in fetched {
        let served = match outcome {
            Outcome::Done(Ok(Fetch { served, gone })) => {
                for w in gone {
                    // NCCL may have freed it meanwhile (its close told the owner).
                    let Some(p) = reg.physicals.get_mut(&w.vh) else {
                        continue;
                    };
                    if p.released_generation().is_none() {
                        continue;
                    }
                    match p.orphaned() {
                        Ok(()) => out.orphaned += 1,
                        Err(e) => {
                            out.map_error.get_or_insert(e.into());
                        }
                    }
                    tracing::debug!(
                        owner,
                        id = w.owner.id,
                        "the owner freed a buffer this process imported: the import is dropped"
                    );
                }
                served
            }
            Outcome::Done(Err(e)) => {
                let fault = if alive(owner) { e } else { Fault::Exited };
                out.faults.insert(owner, (Holding::default(), fault));
                continue;
            }
            Outcome::NotStarted(e) => {
                let fault = if alive(owner) {
                    Fault::Failed(e)
                } else {
                    Fault::Exited
                };
                out.faults.insert(owner, (Holding::default(), fault));
                continue;
            }
            Outcome::NoAnswer => {
                let fault = if alive(owner) {
                    Fault::NoAnswer(
                        "did not serve its buffers (every process of the group must resume 'nccl')",
                    )
                } else {
                    Fault::Exited
                };
                out.faults.insert(owner, (Holding::default(), fault));
                continue;
            }
        };
        // Every import of this owner maps what it served at this epoch, unless one fails.
        let epoch = served.iter().map(|f| f.epoch).min();
        let failed_before = unused.get(&owner).map_or(0, Vec::len);
        // Buffers the owner serves inside one memory (a run of its), mapped whole at once.
        let mut runs: BTreeMap<(u64, u64, u64), Vec<Fetched>> = BTreeMap::new();
        for f in served {
            let Some(p) = reg.physicals.get(&f.vh) else {
                // NCCL freed it meanwhile.
                unused.entry(owner).or_default().push(f.owner);
                continue;
            };
            if p.released_generation().is_none() {
                continue;
            }
            let rs = ranges.get(&f.vh).map_or(&[][..], Vec::as_slice);
            let (offset, size) = f.served;
            if let Some((ptr, _, _)) = rs.first()
                && (offset, size) != (0, p.size)
            {
                let key = (ptr.wrapping_sub(offset), size, f.owner.generation);
                runs.entry(key).or_default().push(f);
                continue;
            }
            let r = a.device(device_of(&reg, &ranges, f.vh)).and_then(|dev| {
                let fd = std::os::fd::AsRawFd::as_raw_fd(&f.fd);
                let h = d.with_context(dev.ctx, || d.import_fd(fd))?;
                steps.map_handle(&dev, h, &places(rs)).inspect_err(|_| {
                    let _ = d.release(h);
                })?;
                Ok(h)
            });
            match r {
                Ok(h) => {
                    // A released import, checked above under the same lock.
                    let p = reg.physicals.get_mut(&f.vh).expect("checked above");
                    p.served = f.served;
                    match p.remapped(h.0, f.owner.generation) {
                        Ok(()) => out.mapped += 1,
                        Err(e) => {
                            out.map_error.get_or_insert(e.into());
                        }
                    }
                }
                Err(e) => {
                    unused.entry(owner).or_default().push(f.owner);
                    out.map_error.get_or_insert(e);
                }
            }
        }
        for ((base, size, generation), members) in runs {
            match map_run(
                a, &steps, &mut reg, &ranges, base, size, generation, &members,
            ) {
                Ok(()) => out.mapped += members.len(),
                Err(e) => {
                    let items = members.iter().map(|f| f.owner);
                    unused.entry(owner).or_default().extend(items);
                    out.map_error.get_or_insert(e);
                }
            }
        }
        if let Some(epoch) = epoch
            && unused.get(&owner).map_or(0, Vec::len) == failed_before
        {
            crate::interpose::epochs::synced(owner, epoch);
        }
    }
    // What this process imported of the owners at fault, for the message.
    for p in reg.physicals.values() {
        if let (Some(_), Some(s)) = (p.released_generation(), p.source)
            && let Some((h, _)) = out.faults.get_mut(&s.owner)
        {
            h.add(p);
        }
    }
    drop(reg);
    // The owners that just served this process answer; wait for them within the deadline
    // of this resume, at least a moment.
    let deadline = Instant::now() + Duration::from_millis(200);
    let _ = notify_owners(group, unused, deadline).finish(
        deadline,
        "resume('nccl') tells owners which imports it did not use",
        group,
    );
    out
}

/// Maps memory an owner served for several adjacent buffers (`members`, all released imports
/// here) whole, once, at `base`, where this process laid out its imports of them as the owner
/// lays them out ([`registry::MIRROR_BLOCK`]), and records them mapped at `generation`, in one
/// run. Imports NCCL placed elsewhere (it reserved their addresses other than right after
/// importing them) get the addresses around them reserved, where free ([`around`]), so that
/// the run maps whole there too; fails (nothing mapped) when they are taken.
#[allow(clippy::too_many_arguments)]
fn map_run(
    a: &'static Allocator,
    steps: &memsaver_allocator::steps::Steps<'_>,
    reg: &mut registry::Registry,
    ranges: &registry::Ranges,
    base: u64,
    size: u64,
    generation: u64,
    members: &[Fetched],
) -> memsaver_allocator::Result<()> {
    let d = a.driver();
    let around = if reg.in_mirror(base, size) {
        Vec::new()
    } else {
        let held: Vec<(u64, u64)> = members
            .iter()
            .filter_map(|f| ranges.get(&f.vh)?.first().map(|r| (r.0, r.1)))
            .collect();
        around(d, base, size, held).map_err(|e| {
            Error::InvalidArgument(format!(
                "NCCL mapped imports of a peer's buffers elsewhere than where memsaver laid them \
                 out, and their owner now backs them together with their neighbours, which maps \
                 only whole, and the addresses around them are taken ({e}); set \
                 MEMSAVER_NCCL_MERGE_MB=0 in the process that exports them so that every NCCL buffer \
                 keeps its own memory"
            ))
        })?
    };
    let first = members[0].vh;
    let access = &ranges[&first][0].2;
    let dev = a.device(device_of(reg, ranges, first))?;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&members[0].fd);
    let h = d.with_context(dev.ctx, || d.import_fd(fd))?;
    let place = [memsaver_allocator::steps::Place {
        ptr: base,
        size: size as usize,
        access: Some(access),
    }];
    steps.map_handle(&dev, h, &place).inspect_err(|_| {
        let _ = d.release(h);
        free_reserved(d, &around);
    })?;
    let owner = reg.physicals[&first].source.map(|s| s.owner);
    let mut run = registry::Run::new(size, h.0, members.len());
    run.around = around;
    run.source = owner.map(|o| (o, generation));
    reg.runs.insert(base, run);
    for f in members {
        let p = reg.physicals.get_mut(&f.vh).expect("checked by the caller");
        p.remapped(h.0, generation)?;
        p.run = Some(base);
        p.served = f.served;
    }
    Ok(())
}

/// Reserves, at their exact addresses, the parts of `[base, base + size)` that the ranges
/// `held` (NCCL's reservations of the imports) do not cover: what a run needs around imports
/// placed elsewhere than their owner's layout. On a failure (an address taken, the driver's
/// error) nothing stays reserved.
fn around(
    d: &memsaver_allocator::driver::Driver,
    base: u64,
    size: u64,
    mut held: Vec<(u64, u64)>,
) -> std::result::Result<Vec<(u64, u64)>, String> {
    held.sort_unstable();
    let mut gaps = Vec::new();
    let mut at = base;
    for (ptr, len) in held.into_iter().chain([(base + size, 0)]) {
        if ptr > at {
            gaps.push((at, ptr - at));
        }
        at = at.max(ptr + len);
    }
    let mut got: Vec<(u64, u64)> = Vec::new();
    for (ptr, len) in gaps {
        match d.reserve(len as usize, 0, ptr) {
            Ok(p) if p == ptr => got.push((ptr, len)),
            r => {
                if let Ok(p) = r {
                    free_reserved(d, &[(p, len)]);
                }
                free_reserved(d, &got);
                return Err(match r {
                    Err(e) => e.to_string(),
                    Ok(_) => format!("{ptr:#x} is taken"),
                });
            }
        }
    }
    Ok(got)
}

/// Frees ranges [`around`] reserved, with nothing mapped in them.
fn free_reserved(d: &memsaver_allocator::driver::Driver, ranges: &[(u64, u64)]) {
    for &(ptr, len) in ranges {
        // SAFETY: reserved by `around`, nothing mapped in it, nobody else uses it.
        let _ = unsafe { d.address_free(ptr, len as usize) };
    }
}

/// The error of a resume that left imports paused.
pub(crate) fn resume_error(group: i64, imported: &Imported) -> Error {
    let t = timeout();
    let lines: Vec<String> = imported
        .faults
        .iter()
        .map(|(pid, (h, f))| {
            let holds = format!(", whose {h} this process imported");
            describe(*pid, group, &holds, f, t)
        })
        .collect();
    let unmapped = imported.map_error.as_ref().map_or_else(String::new, |e| {
        format!("; besides, an import that was served could not be mapped: {e}")
    });
    peer_error(format!(
        "resume restored this process's memory and mapped {} import(s), but the imports of \
         {} owner(s) stay paused (a later resume maps them once their owner serves them, or \
         once NCCL has freed them): {}{unmapped}",
        imported.mapped,
        imported.faults.len(),
        lines.join("; ")
    ))
}

/// An error of the `nccl` tag caused by a peer (or by what it needs from peers).
pub(crate) fn peer_error(message: String) -> Error {
    Error::Peer {
        tag: TAG.into(),
        message,
    }
}
