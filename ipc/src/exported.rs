//! The owner's side of memory shared with other processes: the **ledger** of what this process
//! exported and who imports it, the owner's one serve path for opens, and the two ways
//! importers follow the owner's pauses and resumes ([`Delivery`]): the **couriers** that carry
//! them to every importer, or the importers' own **collective** pause, which the owner waits
//! for.
//!
//! The ledger keeps, per export, the owner's state (generation, resident or paused) and per
//! importer (keyed by its full identity: a reused pid is another process) how many imports it
//! holds and what it was last known to hold: [`Has::Mapped`] or [`Has::Released`] of a
//! generation. What an importer *should* hold follows from the export's state.
//!
//! [`Delivery::Courier`]: a courier sends the difference, one request per kind carrying every
//! buffer, and records the importer's acknowledgement. Because the courier always sends what
//! the ledger says *now*, the last word cannot be lost: an importer that missed a pause and its
//! resume (stopped, slow) is sent the resume's state when it can take it, and importers ignore
//! anything older than what they map. A pause or resume waits for its importers until the
//! deadline (`MEMSAVER_IPC_TIMEOUT_MS`) and then returns what is still behind; the couriers
//! carry on until each importer converges or exits.
//!
//! [`Delivery::Collective`]: nobody carries anything; every importer releases its imports in
//! its own pause and says so ([`Request::Released`]), and opens the next generation at its
//! resume. The owner's pause marks what it released ([`paused`]) and waits until the ledger
//! says every importer that maps a generation of it has released it, is gone or said its own
//! pause failed ([`wait_released`]); its resume starts the next generation ([`resumed`]). Each
//! pause and resume raises the owner's epoch ([`crate::epoch`]), which lets an importer that
//! did not follow see it for itself.
//!
//! **Tombstones.** When the memory of a [`Delivery::Collective`] export is freed (its layer's
//! NCCL destroyed a communicator, say) while importers still hold imports of it, mapped or
//! released by a pause, the ledger keeps a [`Tomb`] of its id and key with those importers. An
//! open that names it is answered [`Reply::Gone`]: the importer drops that import and maps the
//! owner's other buffers, where otherwise its whole request would be refused, as a request
//! naming an id or key the owner never gave out still is (no right to name it). A tombstone
//! lasts while one of its importers could still name it: each one leaves it when it closes its
//! import ([`Share::Close`]: its own NCCL freed it) or exits, and the last one to leave takes it
//! away. At most [`MAX_TOMBS`] are kept: beyond that the oldest goes (logged), and its
//! importers' opens of it are refused as before (their resumes fail naming the owner until
//! their NCCL frees the import). [`Delivery::Courier`] exports need none: couriers carry only
//! the exports there are, so importers never open again what the owner freed, and a first open
//! of a freed allocation is refused.
//!
//! At most [`MAX_COURIERS`] courier threads run in the process, only while some importer is
//! behind. Each importer behind has an [`Errand`]: queued (for a free courier, in turn, not
//! before its backoff) or carried (by one courier, until it converges or exits). A courier
//! that finds its importer stopped, or whose exchange fails, queues it again at the end of the
//! line after its backoff (10 ms doubling to 1 s) and takes the next one, so a stopped
//! importer never holds a courier; one that answers slowly holds its courier for at most one
//! exchange's deadline.
//!
//! [`LEDGER`]'s place in the lock order is in docs/architecture.md ("Locks"); it is never held
//! while waiting for another process.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use memsaver_allocator::{Allocator, ExportedMemory, StartHook};
use parking_lot::{Condvar, Mutex};

use crate::client;
use crate::deadline::{Progress, listed};
use crate::error::{Error, Result};
use crate::group;
use crate::handle::IpcHandle;
use crate::identity::{self, Identity};
use crate::log::note;
use crate::options;
use crate::protocol::{Buffer, MAX_BUFFERS, Reply, Request, Share};
use crate::server::{self, Connection, NO_BUFFER, WRITE_TIMEOUT};

/// The option that sets [`timeout`], named in messages.
pub const TIMEOUT_SETTING: &str = "MEMSAVER_IPC_TIMEOUT_MS";

/// How long an owner waits for its importers, and an importer for an owner.
pub fn timeout() -> Duration {
    options::get().ipc_timeout
}

/// How the importers of an export follow the owner's pauses and resumes. Each delivery has its
/// own ids (an export is named by its delivery and its id) and its own requests on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Delivery {
    /// The owner's couriers bring every importer to the owner's state ([`Share::Release`],
    /// [`Share::Rebuild`]), and the owner's pause and resume wait for them: the allocator's
    /// allocations (given as CUDA IPC handles, or as tokens to layers that map them
    /// themselves), opened and closed with [`Request::Shared`], answered [`Reply::Shared`]. The
    /// ids are the allocator's.
    Courier,
    /// Importers release their imports in their own pause, which every process of the group
    /// makes, and tell the owner ([`Request::Released`]); at their resume they open the next
    /// generation ([`Request::Import`], answered [`Reply::Export`]). The owner's pause waits
    /// until every importer that maps a generation of it has released or is gone
    /// ([`wait_released`]). A layer's own buffers, served through
    /// [`crate::server::Service::Buffers`]; the ids are the layer's.
    Collective,
}

/// An export: its delivery and its id there.
type Id = (Delivery, u64);

/// The owner's memory of one export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Memory {
    /// Mapped: opens are served.
    Resident,
    /// Released by a pause: opens are answered `NotReady` until the resume.
    Paused,
}

/// What one importer holds of one export, as far as the owner knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Has {
    /// It maps that generation of the memory.
    Mapped(u64),
    /// It released its mapping of that generation (the address stays reserved there).
    Released(u64),
}

/// One importer of one export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Importer {
    /// Its imports not closed yet: each new import (an open of [`Buffer::generation`] 0) counts
    /// one, each `Close` one less; a rebuild's open counts none. (Collective imports are never
    /// closed: the importer is forgotten with the export, or when it exits.)
    imports: u32,
    has: Has,
}

/// One allocation or buffer this process exported.
struct Export {
    key: u64,
    tag: String,
    size: u64,
    /// Times the owner re-created its memory (each resume after a pause).
    generation: u64,
    memory: Memory,
    importers: BTreeMap<Identity, Importer>,
    /// The current generation's memory, exported once ([`Allocations::export_kept`]): the
    /// driver takes about 1.5 ms to export a 1 GiB handle the first time and tens of
    /// microseconds after, so the fd is made when the handle is given and copies of it are
    /// handed out (for at most [`MAX_KEPT_FDS`] exports at a time). An exported fd keeps the
    /// memory alive: it is dropped before a pause releases the memory and when the allocation
    /// is freed. Only a [`Delivery::Courier`] export keeps one (its pause marks it paused
    /// before the release).
    fd: Option<ExportedMemory>,
}

impl Export {
    /// What every importer should hold now.
    fn wanted(&self) -> Has {
        match self.memory {
            Memory::Resident => Has::Mapped(self.generation),
            Memory::Paused => Has::Released(self.generation),
        }
    }

    fn buffer(&self, id: u64) -> Buffer {
        Buffer {
            id,
            key: self.key,
            generation: self.generation,
        }
    }
}

/// A freed [`Delivery::Collective`] export that importers may still name (module doc,
/// "Tombstones"): opens of it are answered [`Reply::Gone`].
#[derive(Clone, Debug, PartialEq, Eq)]
struct Tomb {
    key: u64,
    /// The importers it had when it was freed that have not closed their import of it nor
    /// exited: while there is one, the tombstone stays.
    importers: BTreeSet<Identity>,
    /// The ledger's count of tombstones laid when this one was: the smallest goes first when
    /// there are more than [`MAX_TOMBS`].
    laid: u64,
}

/// At most this many tombstones are kept ([`Tomb`]); one is a few dozen bytes.
pub const MAX_TOMBS: usize = 4096;

/// What an item ([`Buffer`]: id and key) names in the ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Named {
    /// An export there is, with that key.
    Export,
    /// A freed export whose tombstone carries that key.
    Tomb,
    /// Nothing this process gave out (or nothing any more).
    Nothing,
}

/// Where one importer stands with the couriers; an importer without one is idle (it holds what
/// it should, as far as the last courier saw).
///
/// ```text
///   idle ──dispatch──► Queued ──a free courier, from not_before──► Carrying ──converged──► idle
///                        ▲                                            │ └──exited──► forgotten
///                        └──── stopped, or failed: after its backoff ─┘
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Errand {
    /// Waiting for a courier, to be tried from `not_before` on; couriers take the waiting
    /// importer of the smallest `turn` whose time has come (a requeued one gets a new turn: the
    /// end of the line). `backoff`: the wait after its next failure.
    Queued {
        not_before: Instant,
        turn: u64,
        backoff: Duration,
    },
    /// A courier carries the ledger's state to it; only that courier changes this errand.
    Carrying { backoff: Duration },
}

/// At most this many courier threads run at once in this process: more importers behind wait
/// for a free one ([`Errand::Queued`]).
pub const MAX_COURIERS: usize = 8;
/// A courier's first wait before it tries an importer again; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// Everything the owner side keeps, under one lock ([`LEDGER`]).
#[derive(Default)]
struct Ledger {
    exports: HashMap<Id, Export>,
    /// The importers a courier works for (queued or carried), each with its [`Errand`].
    errands: BTreeMap<Identity, Errand>,
    /// The last `turn` given to a queued importer ([`Errand::Queued`]).
    turns: u64,
    /// Courier threads running (at most [`MAX_COURIERS`]).
    couriers: usize,
    /// The last failure of each importer's courier, for the owner's report.
    failures: BTreeMap<Identity, String>,
    /// Tombstones of freed collective exports, by the export's id (an id given again to a new
    /// export, with a new key, may have one too).
    tombs: HashMap<Id, Vec<Tomb>>,
    /// Tombstones laid so far ([`Tomb::laid`]).
    laid: u64,
    /// Changes of the collective exports' state so far (pauses and resumes that marked some),
    /// published for the importers ([`crate::epoch`]) and given with each answer.
    epoch: u64,
    /// Why the owner's last resume of its collective exports failed, while it left some
    /// paused, and the importers told so: an open waiting for one of those is answered with
    /// it at once ([`Reply::Error`]) instead of at the end of its wait, once per importer (its
    /// next open, a retry that may come before the owner's own, waits for the owner's next
    /// resume as usual). Cleared when a resume starts.
    resume_failed: Option<(String, BTreeSet<Identity>)>,
    /// Importers of collective exports whose own pause failed, leaving imports mapped, with
    /// their error ([`Request::PauseFailed`]): a pause stops waiting for them and names them
    /// with it, once. Forgotten then, or at the importer's next notice or open (it went on).
    pause_failed: BTreeMap<Identity, String>,
}

impl Ledger {
    /// What `who` holds of the [`Delivery::Courier`] exports that differs from what it should:
    /// buffers for its courier to release and to map.
    fn behind(&self, who: &Identity) -> (Vec<Buffer>, Vec<Buffer>) {
        let (mut release, mut map) = (Vec::new(), Vec::new());
        for ((delivery, id), e) in &self.exports {
            if *delivery != Delivery::Courier {
                continue;
            }
            let Some(i) = e.importers.get(who) else {
                continue;
            };
            match (i.has, e.wanted()) {
                (has, want) if has == want => {}
                (_, Has::Released(_)) => release.push(e.buffer(*id)),
                (_, Has::Mapped(_)) => map.push(e.buffer(*id)),
            }
        }
        release.sort_by_key(|b| b.id);
        map.sort_by_key(|b| b.id);
        (release, map)
    }

    /// Export `id`, recorded (resident, generation 0, a new key) if it is not yet.
    fn add(&mut self, id: Id, tag: &str, size: u64) -> Result<&mut Export> {
        Ok(match self.exports.entry(id) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let key = identity::new_key()
                    .map_err(|e| Error::Other(format!("cannot draw a key for an export: {e}")))?;
                v.insert(Export {
                    key,
                    tag: tag.to_owned(),
                    size,
                    generation: 0,
                    memory: Memory::Resident,
                    importers: BTreeMap::new(),
                    fd: None,
                })
            }
        })
    }

    /// What `b` names among the exports of `delivery` and their tombstones. Compares the key
    /// with both (the time taken says nothing of which one matched, nor of the key's bits).
    fn named(&self, delivery: Delivery, b: &Buffer) -> Named {
        let export = self
            .exports
            .get(&(delivery, b.id))
            .is_some_and(|e| same_key(e.key, b));
        let tomb = self
            .tombs
            .get(&(delivery, b.id))
            .is_some_and(|ts| ts.iter().fold(false, |found, t| found | same_key(t.key, b)));
        match (export, tomb) {
            (true, _) => Named::Export,
            (false, true) => Named::Tomb,
            (false, false) => Named::Nothing,
        }
    }

    /// Export `id`'s memory was freed: the export is forgotten with any fd kept of it, and
    /// buried ([`Ledger::bury`]). Whether there was one.
    fn free(&mut self, id: Id) -> bool {
        let Some(mut e) = self.exports.remove(&id) else {
            return false;
        };
        drop_kept_fd(&mut e);
        self.bury(id, &e);
        if id.0 == Delivery::Collective && e.memory == Memory::Paused {
            self.publish();
        }
        true
    }

    /// Export `id`'s memory was freed and the export `e` forgotten: a collective export that
    /// importers still hold leaves a tombstone of its key with them, the oldest tombstone
    /// going first beyond [`MAX_TOMBS`].
    fn bury(&mut self, id: Id, e: &Export) {
        if id.0 != Delivery::Collective || e.importers.is_empty() {
            return;
        }
        if self.tombs.values().map(Vec::len).sum::<usize>() >= MAX_TOMBS {
            self.drop_oldest_tomb();
        }
        self.laid += 1;
        self.tombs.entry(id).or_default().push(Tomb {
            key: e.key,
            importers: e.importers.keys().copied().collect(),
            laid: self.laid,
        });
    }

    /// Drops the oldest tombstone (more than [`MAX_TOMBS`]): its importers' opens of it are
    /// refused from now on.
    fn drop_oldest_tomb(&mut self) {
        let oldest = self
            .tombs
            .iter()
            .flat_map(|(id, ts)| ts.iter().enumerate().map(move |(i, t)| (t.laid, *id, i)))
            .min();
        let Some((_, id, i)) = oldest else { return };
        let ts = self.tombs.get_mut(&id).expect("found above");
        let t = ts.remove(i);
        if ts.is_empty() {
            self.tombs.remove(&id);
        }
        tracing::warn!(
            id = id.1,
            importers = t.importers.len(),
            "memsaver: more than {MAX_TOMBS} freed exports are still held by importers; the \
             oldest is forgotten, and their opens of it are refused"
        );
    }

    /// `who` can no longer name the freed export `id` with `b`'s key (it closed its import):
    /// it leaves that tombstone, which goes with its last importer.
    fn leave(&mut self, who: &Identity, id: Id, b: &Buffer) {
        let Some(ts) = self.tombs.get_mut(&id) else {
            return;
        };
        let Some(i) = ts.iter().position(|t| same_key(t.key, b)) else {
            return;
        };
        ts[i].importers.remove(who);
        if ts[i].importers.is_empty() {
            ts.remove(i);
        }
        if ts.is_empty() {
            self.tombs.remove(&id);
        }
    }

    /// Moves the exports `ids` of `delivery` to `memory` (a resume: their next generation);
    /// returns their importers. Collective exports moved raise the epoch, published.
    fn mark(&mut self, delivery: Delivery, ids: &[u64], memory: Memory) -> BTreeSet<Identity> {
        let mut importers = BTreeSet::new();
        let mut moved = false;
        for id in ids {
            let Some(e) = self.exports.get_mut(&(delivery, *id)) else {
                continue;
            };
            match memory {
                // The memory is about to be released: no fd may keep it.
                Memory::Paused => drop_kept_fd(e),
                Memory::Resident => e.generation += 1,
            }
            e.memory = memory;
            moved = true;
            importers.extend(e.importers.keys().copied());
        }
        if moved && delivery == Delivery::Collective {
            self.epoch += 1;
            self.publish();
        }
        importers
    }

    /// Publishes the epoch, and whether a collective export is paused ([`crate::epoch`]).
    fn publish(&self) {
        let paused = self
            .exports
            .iter()
            .any(|((d, _), e)| *d == Delivery::Collective && e.memory == Memory::Paused);
        crate::epoch::publish(crate::epoch::Word {
            epoch: self.epoch,
            paused,
        });
    }

    /// The importers that map a generation of a paused [`Delivery::Collective`] export, the
    /// current one or one an earlier pause gave up on (a stopped importer's, say: its memory
    /// is not free either), with those exports' ids (what a collective pause waits for and
    /// reports), less the importers that `running` says exited; second, every importer of a
    /// collective export or of a tombstone that exited (nobody else finds those: no courier
    /// reaches them).
    fn holders(&self, running: impl Fn(&Identity) -> bool) -> (Holders, Vec<Identity>) {
        let mut holders = Holders::new();
        let mut importers: BTreeSet<Identity> = self
            .tombs
            .values()
            .flatten()
            .flat_map(|t| t.importers.iter().copied())
            .collect();
        for ((delivery, id), e) in &self.exports {
            if *delivery != Delivery::Collective {
                continue;
            }
            importers.extend(e.importers.keys().copied());
            if e.memory != Memory::Paused {
                continue;
            }
            for (who, i) in &e.importers {
                if matches!(i.has, Has::Mapped(_)) {
                    holders.entry(*who).or_default().push(*id);
                }
            }
        }
        let exited: Vec<Identity> = importers.into_iter().filter(|w| !running(w)).collect();
        for who in &exited {
            holders.remove(who);
        }
        for ids in holders.values_mut() {
            ids.sort_unstable();
        }
        (holders, exited)
    }

    /// `from` says it released its imports `items` of [`Delivery::Collective`] exports: each
    /// one named with its key whose generation it is recorded to map is now released. Anything
    /// else (another generation, a wrong key) changes nothing.
    fn released(&mut self, from: &Identity, items: &[Buffer]) {
        self.pause_failed.remove(from);
        for b in items {
            if let Some(e) = self.exports.get_mut(&(Delivery::Collective, b.id))
                && same_key(e.key, b)
                && let Some(i) = e.importers.get_mut(from)
                && i.has == Has::Mapped(b.generation)
            {
                i.has = Has::Released(b.generation);
            }
        }
    }

    /// `from` closed its imports of `items`, which it no longer maps: of courier exports
    /// (closed handles, deregistrations) one import fewer each, of collective ones (its NCCL
    /// freed them) it is no importer any more. An item that names a tombstone's key (the owner
    /// freed it first, as when both sides destroy a communicator) takes `from` off the
    /// tombstone: it can name it no more. An item whose id no export of either kind has any
    /// more, and no tombstone with its key, is skipped: there is nothing to close. An item whose
    /// id is known but whose key matches no export of that id nor a tombstone (ids of the two
    /// kinds may be equal) refuses the whole close: nothing changes and the answer is false.
    fn closed(&mut self, from: &Identity, items: &[Buffer]) -> bool {
        let mut named = Vec::with_capacity(items.len());
        let mut buried = Vec::new();
        for b in items {
            let kinds = [Delivery::Courier, Delivery::Collective];
            if let Some(d) = kinds
                .into_iter()
                .find(|d| self.named(*d, b) == Named::Export)
            {
                named.push((d, b.id));
            } else if self.named(Delivery::Collective, b) == Named::Tomb {
                buried.push(*b);
            } else if kinds.iter().any(|d| self.exports.contains_key(&(*d, b.id))) {
                return false;
            } else {
                tracing::debug!(importer = from.pid, id = b.id, "a close of a freed buffer");
            }
        }
        for b in buried {
            self.leave(from, (Delivery::Collective, b.id), &b);
            tracing::debug!(importer = from.pid, id = b.id, "a close of a buried buffer");
        }
        for (delivery, id) in named {
            let e = self.exports.get_mut(&(delivery, id)).expect("found above");
            match delivery {
                Delivery::Courier => forget_import(e, from),
                Delivery::Collective => {
                    e.importers.remove(from);
                }
            }
            tracing::debug!(importer = from.pid, id, ?delivery, "served a close");
        }
        true
    }

    /// `from` did not receive `answers` (to `items`, in order): a courier export's new import
    /// was not made, and a collective importer recorded as mapping what the answer gave holds
    /// nothing of it (a pause must not wait for it).
    fn undelivered(
        &mut self,
        delivery: Delivery,
        from: &Identity,
        items: &[Buffer],
        answers: &[Answer],
    ) {
        for (b, (reply, fd)) in items.iter().zip(answers) {
            let (Some(_), Some(e)) = (fd, self.exports.get_mut(&(delivery, b.id))) else {
                continue;
            };
            match (delivery, reply) {
                // A new import that was not delivered was not made (a rebuild's counted
                // nothing).
                (Delivery::Courier, _) if b.generation == 0 => forget_import(e, from),
                (Delivery::Collective, Reply::Export { generation, .. })
                    if e.importers.get(from).map(|i| i.has) == Some(Has::Mapped(*generation)) =>
                {
                    e.importers.remove(from);
                }
                _ => {}
            }
        }
    }

    /// Forgets `who` as an importer of everything, tombstones included: it exited, so its
    /// mappings went with it, and it names nothing any more.
    fn forget(&mut self, who: &Identity) {
        for e in self.exports.values_mut() {
            e.importers.remove(who);
        }
        for ts in self.tombs.values_mut() {
            for t in ts.iter_mut() {
                t.importers.remove(who);
            }
            ts.retain(|t| !t.importers.is_empty());
        }
        self.tombs.retain(|_, ts| !ts.is_empty());
        self.failures.remove(who);
        self.pause_failed.remove(who);
        self.errands.remove(who);
    }

    /// Queues `who` for a courier, to be tried at once: an idle importer joins the end of the
    /// line, a queued one keeps its turn (and backoff) but waits no more; a carried one is
    /// left to its courier, which reads the ledger again before it lets go.
    fn queue_now(&mut self, who: Identity, now: Instant) {
        match self.errands.get_mut(&who) {
            None => {
                let turn = self.next_turn();
                self.errands.insert(
                    who,
                    Errand::Queued {
                        not_before: now,
                        turn,
                        backoff: FIRST_BACKOFF,
                    },
                );
            }
            Some(Errand::Queued { not_before, .. }) => *not_before = now,
            Some(Errand::Carrying { .. }) => {}
        }
    }

    fn next_turn(&mut self) -> u64 {
        self.turns += 1;
        self.turns
    }

    /// The queued importer whose time has come with the smallest turn, now carried; else when
    /// the first time to come is (`None`: nobody is queued).
    fn take(&mut self, now: Instant) -> Result<Identity, Option<Instant>> {
        let (mut first, mut soonest) = (None, None::<Instant>);
        for (who, errand) in &self.errands {
            if let Errand::Queued {
                not_before, turn, ..
            } = *errand
            {
                if not_before <= now {
                    if first.is_none_or(|(t, _)| turn < t) {
                        first = Some((turn, *who));
                    }
                } else if soonest.is_none_or(|s| not_before < s) {
                    soonest = Some(not_before);
                }
            }
        }
        let Some((_, who)) = first else {
            return Err(soonest);
        };
        if let Some(e) = self.errands.get_mut(&who)
            && let Errand::Queued { backoff, .. } = *e
        {
            *e = Errand::Carrying { backoff };
        }
        Ok(who)
    }

    /// `who`'s courier lets go of it (carried → queued): it is tried again after its backoff,
    /// at the end of the line, and waits twice as long after its next failure.
    fn requeue(&mut self, who: &Identity, now: Instant) {
        let turn = self.next_turn();
        if let Some(e) = self.errands.get_mut(who)
            && let Errand::Carrying { backoff } = *e
        {
            *e = Errand::Queued {
                not_before: now + backoff,
                turn,
                backoff: (backoff * 2).min(MAX_BACKOFF),
            };
        }
    }

    /// `who` took what its courier sent: its next failure waits [`FIRST_BACKOFF`] again.
    fn answered(&mut self, who: &Identity) {
        if let Some(Errand::Carrying { backoff }) = self.errands.get_mut(who) {
            *backoff = FIRST_BACKOFF;
        }
    }

    /// `who` holds what it should: its courier lets go of it (carried → idle).
    fn converged(&mut self, who: &Identity) {
        if matches!(self.errands.get(who), Some(Errand::Carrying { .. })) {
            self.errands.remove(who);
        }
        self.failures.remove(who);
    }
}

/// This process's exports; [`SETTLED`] is notified whenever an importer's state changes,
/// [`QUEUED`] whenever an importer is queued for a courier to be tried at once.
static LEDGER: LazyLock<Mutex<Ledger>> = LazyLock::new(Default::default);
static SETTLED: Condvar = Condvar::new();
static QUEUED: Condvar = Condvar::new();

/// At most this many exported fds are kept ([`Export::fd`]), so that a process sharing many
/// allocations stays far from its open-file limit (1024 by default); the others are exported
/// at each open, as they were before being kept.
const MAX_KEPT_FDS: usize = 256;

/// Exported fds kept now (changed under [`LEDGER`]).
static KEPT_FDS: AtomicUsize = AtomicUsize::new(0);

/// Drops the exported fd `e` keeps, if any.
fn drop_kept_fd(e: &mut Export) {
    if e.fd.take().is_some() {
        KEPT_FDS.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The handle of the memsaver allocation holding `ptr`, or `Ok(None)` when memsaver did not
/// allocate it (the caller forwards to the real runtime).
pub fn handle_of(ptr: u64) -> Result<Option<IpcHandle>> {
    let Some(a) = memsaver_allocator::global_if_started() else {
        return Ok(None);
    };
    let shared = match a.share(ptr) {
        Ok(s) => s,
        Err(memsaver_allocator::Error::UnknownPointer { .. }) => return Ok(None),
        Err(e) => return Err(Error::Other(e.to_string())),
    };
    // Importers answer the owner's release and rebuild requests on this server, and open
    // through it.
    server::ensure_server().map_err(|e| {
        Error::Other(format!(
            "cannot share memsaver memory with other processes: this process cannot serve its socket: {e}"
        ))
    })?;
    let key = {
        let mut l = LEDGER.lock();
        let e = l.add(
            (Delivery::Courier, shared.id),
            &shared.tag,
            shared.size as u64,
        )?;
        // Exported now, so that the receiver's open only copies the fd (a failure here is
        // the open's to report).
        if e.memory == Memory::Resident {
            let _ = Allocations::export_kept(a, shared.id, &mut e.fd);
        }
        e.key
    };
    Ok(Some(IpcHandle {
        owner: identity::me(),
        group: group::try_fix().map_err(Error::Option)?,
        id: shared.id,
        key,
        size: shared.size as u64,
    }))
}

/// Records export `id` of `delivery`, memory of tag `tag` of `size` bytes, if it is not
/// recorded yet (resident, generation 0, a new key): returns its key and generation, which the
/// token or handle given to importers carries.
pub fn add(delivery: Delivery, id: u64, tag: &str, size: u64) -> Result<(u64, u64)> {
    let mut l = LEDGER.lock();
    let e = l.add((delivery, id), tag, size)?;
    Ok((e.key, e.generation))
}

/// The memory of export `id` of `delivery` is gone for good (freed): the export is forgotten
/// with any fd kept of it, so its token or handle opens nothing any more; its importers keep
/// what they map. A collective export that importers hold leaves a tombstone ([`Tomb`]):
/// their next open of it is answered [`Reply::Gone`].
pub fn forget(delivery: Delivery, id: u64) {
    if LEDGER.lock().free((delivery, id)) {
        SETTLED.notify_all();
    }
}

/// The owner's pause released the memory of its [`Delivery::Collective`] exports `ids`: they
/// are paused (opens wait for the resume), and [`wait_released`] waits for their importers.
pub fn paused(ids: &[u64]) {
    LEDGER
        .lock()
        .mark(Delivery::Collective, ids, Memory::Paused);
}

/// The owner's resume re-created the memory of its [`Delivery::Collective`] exports `ids`:
/// each starts its next generation, which importers open at their resume.
pub fn resumed(ids: &[u64]) {
    LEDGER
        .lock()
        .mark(Delivery::Collective, ids, Memory::Resident);
}

/// The owner's resume of its [`Delivery::Collective`] exports starts: a failure of the one
/// before is forgotten (opens wait for this one).
pub fn resume_started() {
    LEDGER.lock().resume_failed = None;
}

/// The owner's resume of its [`Delivery::Collective`] exports failed (`why`, the error it
/// returns), leaving some paused: until the next resume starts, each importer's open of those
/// is answered with `why` at once instead of at the end of its wait, the first time.
pub fn resume_failed(why: String) {
    LEDGER.lock().resume_failed = Some((why, BTreeSet::new()));
}

/// Importers that still map a generation of paused exports, by identity, with the ids of
/// those exports.
pub type Holders = BTreeMap<Identity, Vec<u64>>;

/// How often [`wait_released`] looks for importers that exited (a release wakes it at once).
const EXIT_POLL: Duration = Duration::from_millis(2);

/// What a collective pause's wait found: the importers still holding, and the errors of
/// those whose own pause failed ([`Request::PauseFailed`]).
pub type Held = (Holders, BTreeMap<Identity, String>);

/// A collective pause's wait: until no live importer maps a generation of a paused
/// [`Delivery::Collective`] export (also those paused by an earlier pause that did not
/// complete), every one that still does said its own pause failed, or `deadline`. Importers
/// that exited are forgotten (their mappings went with them). Returns those still holding;
/// progress lines (naming `setting`) say `describe(holders)`, called with no lock of this
/// module held.
pub fn wait_released(
    deadline: Instant,
    setting: &'static str,
    describe: &dyn Fn(&Holders) -> String,
) -> Held {
    let mut progress = Progress::new(deadline, setting);
    let mut l = LEDGER.lock();
    loop {
        let (holders, exited) = l.holders(identity::is_running);
        for who in &exited {
            l.forget(who);
        }
        let failed: BTreeMap<Identity, String> = holders
            .keys()
            .filter_map(|w| Some((*w, l.pause_failed.get(w)?.clone())))
            .collect();
        if failed.len() == holders.len() || Instant::now() >= deadline {
            // Each failure is reported once: the next pause (a retry, maybe before the
            // importer's own) waits for the importer as usual.
            for who in failed.keys() {
                l.pause_failed.remove(who);
            }
            return (holders, failed);
        }
        parking_lot::MutexGuard::unlocked(&mut l, || progress.say(|| describe(&holders)));
        let poll = Instant::now() + EXIT_POLL;
        SETTLED.wait_until(&mut l, progress.next().min(poll));
    }
}

/// The owner's answer to `from`'s word that its own pause failed, leaving imports of
/// [`Delivery::Collective`] exports mapped ([`Request::PauseFailed`]).
pub fn serve_pause_failed(conn: &Connection, from: &Identity, message: String) {
    LEDGER.lock().pause_failed.insert(*from, message);
    SETTLED.notify_all();
    let _ = conn.send(&Reply::Done, None, Instant::now() + WRITE_TIMEOUT);
}

/// The owner's answer to `from`'s notice that it released its imports `items` of
/// [`Delivery::Collective`] exports ([`Request::Released`]).
pub fn serve_released(conn: &Connection, from: &Identity, items: &[Buffer]) {
    LEDGER.lock().released(from, items);
    SETTLED.notify_all();
    let _ = conn.send(&Reply::Done, None, Instant::now() + WRITE_TIMEOUT);
}

/// Whether `key` is the key `b` carries (compared without branching on its bits).
fn same_key(key: u64, b: &Buffer) -> bool {
    std::hint::black_box(key ^ b.key) == 0
}

/// One answer of an owner to an open: the reply, with the fd it carries.
type Answer = (Reply, Option<OwnedFd>);

/// The memory behind a layer's exports, as the owner's one serve path reads it for one batch
/// of answers: held under the layer's lock, if it has one, which comes before [`LEDGER`].
pub trait Backing {
    /// Export `id`'s memory now: an fd of it, with where the export lies in it (`offset`) and
    /// the size of the memory the fd is (`handle_size`); `Ok(None)` while it is not there
    /// (released, being restored). `kept` is the export's slot for an fd kept across answers
    /// ([`Export::fd`]): the ledger drops it when a pause marks the export paused, so only a
    /// layer whose pause marks its exports before releasing them (the couriers' allocations)
    /// may keep one.
    fn export(
        &mut self,
        id: u64,
        kept: &mut Option<ExportedMemory>,
    ) -> Result<Option<ExportedMemory>, String>;

    /// Whether export `id` stays resident whatever the owner's pauses ask: it keeps its
    /// generation, and is served as it is whatever generation an importer asks.
    fn stays(&self, _id: u64) -> bool {
        false
    }
}

/// A layer's exports as the owner's one serve path ([`serve_opens`]) sees them: which of the
/// ledger's exports they are, and the memory behind them. The ledger's allocations
/// ([`Delivery::Courier`]) are one; a layer that exports memory of its own
/// ([`Delivery::Collective`]) is another.
pub trait Exports {
    fn delivery(&self) -> Delivery;
    /// The memory behind the exports, for one batch of answers (holding the layer's lock).
    fn backing(&self) -> Box<dyn Backing + '_>;
}

/// Whether every buffer of `items` is an export of `delivery` or a tombstone of one, with its
/// key. Looks at every item (the time taken must not say where the first wrong one is).
fn known(delivery: Delivery, items: &[Buffer]) -> bool {
    let l = LEDGER.lock();
    items
        .iter()
        .fold(true, |ok, b| ok & (l.named(delivery, b) != Named::Nothing))
}

/// The owner's one serve path for opens: every item must name an export of `exports` with its
/// key, or the tombstone of one freed while importers held it, or the whole request is refused
/// (saying nothing of which item or which part was wrong); then one reply per item, in order,
/// each as soon as it can be answered (a freed one at once: [`Reply::Gone`]), until `wait` has
/// passed (the rest are answered `NotReady`). A reply that cannot be delivered is undone.
pub fn serve_opens(
    conn: &Connection,
    from: &Identity,
    items: &[Buffer],
    wait: Duration,
    exports: &dyn Exports,
) {
    let delivery = exports.delivery();
    if !known(delivery, items) {
        conn.refuse(NO_BUFFER);
        return;
    }
    let deadline = Instant::now() + wait;
    let write_by = deadline + WRITE_TIMEOUT;
    let mut next = 0;
    while next < items.len() {
        let answers = {
            let mut backing = exports.backing();
            answer(
                &mut LEDGER.lock(),
                delivery,
                from,
                &items[next..],
                &mut *backing,
            )
        };
        for (i, (reply, fd)) in answers.iter().enumerate() {
            if conn
                .send(reply, fd.as_ref().map(|f| f.as_fd()), write_by)
                .is_err()
            {
                undelivered(delivery, from, &items[next + i..], &answers[i..]);
                return;
            }
        }
        next += answers.len();
        if next < items.len() {
            if Instant::now() >= deadline {
                for r in &items[next..] {
                    if conn
                        .send(&Reply::NotReady { id: r.id }, None, write_by)
                        .is_err()
                    {
                        return;
                    }
                }
                return;
            }
            std::thread::sleep(Duration::from_micros(500));
        }
    }
}

/// Answers `items` in order (under [`LEDGER`] and the layer's lock, held by `backing`), as many
/// as can be answered now: each once its export is resident at least at the generation asked
/// (or stays resident), an answer that must wait for the owner's resume ending the list; one
/// whose tombstone carries its key is gone; records `from` as an importer of each one given.
fn answer(
    l: &mut Ledger,
    delivery: Delivery,
    from: &Identity,
    items: &[Buffer],
    backing: &mut dyn Backing,
) -> Vec<Answer> {
    let mut out = Vec::with_capacity(items.len());
    l.pause_failed.remove(from);
    // Whether `from` is yet to hear of the owner's failed resume.
    let tell = l
        .resume_failed
        .as_ref()
        .is_some_and(|(_, told)| !told.contains(from));
    let mut told = false;
    for b in items {
        match l.named(delivery, b) {
            Named::Export => {}
            Named::Tomb => {
                tracing::debug!(importer = from.pid, id = b.id, "answered a buried open");
                out.push((Reply::Gone { id: b.id }, None));
                continue;
            }
            Named::Nothing => {
                // Its memory was freed (and the export forgotten) since it was checked, while
                // nobody imported it: no tombstone.
                out.push((Reply::Failed { id: b.id }, None));
                continue;
            }
        }
        let e = l.exports.get_mut(&(delivery, b.id)).expect("named above");
        let ready = e.memory == Memory::Resident && e.generation >= b.generation;
        if !(ready || backing.stays(b.id)) {
            if let (true, Some((why, _)), Memory::Paused) = (tell, &l.resume_failed, e.memory) {
                // The owner's resume failed: no generation comes until it resumes again.
                let message = why.clone();
                out.push((Reply::Error { status: 0, message }, None));
                told = true;
                continue;
            }
            break;
        }
        let m = match backing.export(b.id, &mut e.fd) {
            Ok(Some(m)) => m,
            Ok(None) => break,
            Err(err) => {
                note(format!(
                    "cannot export memsaver memory to process {}: {err}",
                    from.pid
                ));
                out.push((Reply::Failed { id: b.id }, None));
                continue;
            }
        };
        let generation = e.generation;
        let i = e.importers.entry(*from).or_insert(Importer {
            imports: 0,
            has: Has::Mapped(generation),
        });
        if b.generation == 0 || i.imports == 0 {
            i.imports += 1;
        }
        // A new import maps what it is given, and so does a collective one (it acknowledges
        // nothing else); a courier's rebuild is acknowledged by the rebuild's answer.
        if b.generation == 0 || delivery == Delivery::Collective {
            i.has = Has::Mapped(generation);
        }
        tracing::debug!(
            importer = from.pid,
            imports = i.imports,
            id = b.id,
            generation,
            "served an open"
        );
        let reply = match delivery {
            Delivery::Courier => Reply::Shared {
                id: b.id,
                generation,
                size: e.size,
                offset: m.offset,
                handle_size: m.handle_size as u64,
            },
            Delivery::Collective => Reply::Export {
                id: b.id,
                generation,
                offset: m.offset,
                size: m.handle_size as u64,
                epoch: l.epoch,
            },
        };
        out.push((reply, Some(m.fd)));
    }
    if told && let Some((_, who)) = &mut l.resume_failed {
        who.insert(*from);
    }
    out
}

/// `from` did not receive `answers` (to `items`, in order: it is gone, or gave up): it holds
/// none of them ([`Ledger::undelivered`]).
fn undelivered(delivery: Delivery, from: &Identity, items: &[Buffer], answers: &[Answer]) {
    LEDGER.lock().undelivered(delivery, from, items, answers);
    SETTLED.notify_all();
}

/// The ledger's allocations as [`Exports`]: their memory is the allocator's.
struct Allocations;

impl Exports for Allocations {
    fn delivery(&self) -> Delivery {
        Delivery::Courier
    }

    fn backing(&self) -> Box<dyn Backing + '_> {
        Box::new(AllocationBacking(memsaver_allocator::start_global()))
    }
}

/// The allocator's memory behind the ledger's allocations. Read under [`LEDGER`]: a pause marks
/// the export paused under it before it releases anything, so the handle read here stays
/// valid until the fd is made.
struct AllocationBacking(memsaver_allocator::Result<&'static Allocator>);

impl Allocations {
    /// A copy of allocation `id`'s exported fd, exporting it first if it is not kept in `kept`
    /// (`Ok(None)` while the allocation is not resident). Called under [`LEDGER`].
    fn export_kept(
        a: &Allocator,
        id: u64,
        kept: &mut Option<ExportedMemory>,
    ) -> Result<Option<ExportedMemory>, String> {
        if kept.is_none() {
            let Some(m) = a.export_shared(id).map_err(|e| e.to_string())? else {
                return Ok(None);
            };
            if KEPT_FDS.load(Ordering::Relaxed) >= MAX_KEPT_FDS {
                return Ok(Some(m));
            }
            KEPT_FDS.fetch_add(1, Ordering::Relaxed);
            *kept = Some(m);
        }
        let Some(m) = kept else { return Ok(None) };
        let fd =
            m.fd.try_clone()
                .map_err(|err| format!("cannot copy an exported fd: {err}"))?;
        Ok(Some(ExportedMemory {
            fd,
            offset: m.offset,
            handle_size: m.handle_size,
        }))
    }
}

impl Backing for AllocationBacking {
    fn export(
        &mut self,
        id: u64,
        kept: &mut Option<ExportedMemory>,
    ) -> Result<Option<ExportedMemory>, String> {
        let a = self.0.as_ref().map_err(|e| e.to_string())?;
        Allocations::export_kept(a, id, kept)
    }
}

/// The owner's answers to `from`: opens ([`serve_opens`]) and closes.
pub(crate) fn serve(conn: &Connection, from: Identity, op: Share, buffers: &[Buffer]) {
    if op != Share::Close {
        return serve_opens(conn, &from, buffers, Duration::ZERO, &Allocations);
    }
    let closed = LEDGER.lock().closed(&from, buffers);
    if !closed {
        conn.refuse(NO_BUFFER);
        return;
    }
    SETTLED.notify_all();
    let _ = conn.send(&Reply::Done, None, Instant::now() + WRITE_TIMEOUT);
}

/// One import fewer of `e` by `who`.
fn forget_import(e: &mut Export, who: &Identity) {
    if let Some(i) = e.importers.get_mut(who) {
        i.imports = i.imports.saturating_sub(1);
        if i.imports == 0 {
            e.importers.remove(who);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Couriers.

/// Queues `who` for a courier to be tried at once (under [`LEDGER`]), and starts one more
/// courier thread while fewer run than [`MAX_COURIERS`] and than importers they work for. A
/// thread that cannot start is recorded as the importer's failure; it stays queued (the
/// couriers running take it, or the next dispatch starts one).
fn dispatch(l: &mut Ledger, who: Identity) {
    l.queue_now(who, Instant::now());
    QUEUED.notify_all();
    if l.couriers >= MAX_COURIERS.min(l.errands.len()) {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("memsaver-courier".into())
        .spawn(courier);
    match spawned {
        Ok(_) => l.couriers += 1,
        Err(e) => {
            l.failures
                .insert(who, format!("cannot start a thread to reach it: {e}"));
        }
    }
}

/// A courier thread: takes the queued importers in turn ([`Ledger::take`]) and carries the
/// ledger's state to each ([`carry`]); waits while every queued importer waits out its
/// backoff, and ends when more couriers run than importers they work for.
fn courier() {
    let group = group::id();
    let mut l = LEDGER.lock();
    loop {
        let now = Instant::now();
        match l.take(now) {
            Ok(who) => parking_lot::MutexGuard::unlocked(&mut l, || carry(group, who)),
            Err(_) if l.couriers > l.errands.len() => {
                l.couriers -= 1;
                return;
            }
            Err(soonest) => {
                let until = soonest.unwrap_or(now + MAX_BACKOFF);
                QUEUED.wait_until(&mut l, until);
            }
        }
    }
}

/// Carries the ledger's state to importer `who` ([`Errand::Carrying`]) until it holds what it
/// should (then idle), or has exited (forgotten). One that is stopped, or whose exchange fails,
/// is queued again after its backoff: its courier takes the next importer meanwhile.
fn carry(group: i64, who: Identity) {
    loop {
        let (release, map) = {
            let mut l = LEDGER.lock();
            let behind = l.behind(&who);
            if behind.0.is_empty() && behind.1.is_empty() {
                l.converged(&who);
                drop(l);
                SETTLED.notify_all();
                return;
            }
            behind
        };
        // A stopped importer takes no request: it is tried again later rather than sent
        // connections that wait in its socket's backlog (its report says it is stopped).
        if stopped(&who) && identity::is_running(&who) {
            let mut l = LEDGER.lock();
            l.failures.remove(&who);
            l.requeue(&who, Instant::now());
            return;
        }
        let mut failed = None;
        for (op, buffers) in [(Share::Release, release), (Share::Rebuild, map)] {
            for chunk in buffers.chunks(MAX_BUFFERS) {
                if let Err(e) = deliver(group, &who, op, chunk) {
                    failed = Some(e);
                }
            }
        }
        let Some(e) = failed else {
            LEDGER.lock().answered(&who);
            continue;
        };
        // Gone: its socket, named by its whole identity, refuses connections or is not there
        // (this also tells a dead importer from a new process that got its pid within the same
        // clock tick); or its pid now belongs to a later process.
        if e.gone() || !identity::is_running(&who) {
            // A dead importer holds nothing: its mappings went with it.
            LEDGER.lock().forget(&who);
            SETTLED.notify_all();
            return;
        }
        tracing::debug!(importer = who.pid, error = %e, "an importer is behind");
        let mut l = LEDGER.lock();
        l.failures.insert(who, e.to_string());
        l.requeue(&who, Instant::now());
        drop(l);
        SETTLED.notify_all();
        return;
    }
}

/// Whether process `who` is stopped (SIGSTOP, a debugger).
fn stopped(who: &Identity) -> bool {
    let state = memsaver_allocator::process::stat(&who.pid.to_string()).map(|(s, _)| s);
    matches!(state, Some('T' | 't'))
}

/// Sends `op` of `buffers` to `who` and records what it acknowledged.
fn deliver(group: i64, who: &Identity, op: Share, buffers: &[Buffer]) -> Result<()> {
    let request = Request::Shared {
        from: identity::me(),
        to: *who,
        group,
        op,
        buffers: buffers.to_vec(),
    };
    let reply = client::exchange(group, who, request, 1, timeout())?;
    match reply.into_iter().next() {
        Some((Reply::Done, _)) => {}
        Some((Reply::Error { message, .. }, _)) => return Err(Error::Other(message)),
        other => {
            return Err(Error::Wire {
                pid: who.pid,
                what: format!("answered {other:?}"),
            });
        }
    }
    let mut l = LEDGER.lock();
    for b in buffers {
        // Only what was sent is acknowledged: a newer state waits for the next round.
        if let Some(i) = l
            .exports
            .get_mut(&(Delivery::Courier, b.id))
            .and_then(|e| e.importers.get_mut(who))
        {
            i.has = match op {
                Share::Release => Has::Released(b.generation),
                _ => Has::Mapped(b.generation),
            };
        }
    }
    drop(l);
    SETTLED.notify_all();
    Ok(())
}

/// The allocator's [`memsaver_allocator::Sharing`]: releases and rebuilds of importers.
pub struct Owner;

impl Owner {
    /// Moves the exports `ids` to `memory` (a resume: the next generation), starts the couriers
    /// of their importers and waits until every importer holds what it should, or the deadline.
    /// `Err` says which processes are behind, what they hold, and why.
    fn transition(&self, ids: &[u64], memory: Memory) -> Result<(), String> {
        let mut l = LEDGER.lock();
        let importers = l.mark(Delivery::Courier, ids, memory);
        for who in &importers {
            dispatch(&mut l, *who);
        }
        let deadline = Instant::now() + timeout();
        let mut progress = Progress::new(deadline, TIMEOUT_SETTING);
        let group = group::id();
        loop {
            let behind: Vec<Identity> = importers
                .iter()
                .copied()
                .filter(|who| {
                    ids.iter().any(|id| {
                        l.exports.get(&(Delivery::Courier, *id)).is_some_and(|e| {
                            e.importers.get(who).is_some_and(|i| i.has != e.wanted())
                        })
                    })
                })
                .collect();
            if behind.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(report(&l, ids, &behind, memory, group));
            }
            SETTLED.wait_until(&mut l, progress.next());
            progress.say(|| {
                let who: Vec<String> = behind
                    .iter()
                    .map(|w| format!("process {} (group {group})", w.pid))
                    .collect();
                format!(
                    "waiting for processes that map memsaver memory of this one to {}: {}",
                    what(memory),
                    listed(&who)
                )
            });
        }
    }
}

fn what(memory: Memory) -> &'static str {
    match memory {
        Memory::Paused => "release it",
        Memory::Resident => "map it again",
    }
}

/// The message of a transition that importers `behind` did not follow by the deadline.
fn report(l: &Ledger, ids: &[u64], behind: &[Identity], memory: Memory, group: i64) -> String {
    let lines: Vec<String> = behind
        .iter()
        .map(|who| {
            let (mut n, mut bytes, mut tags) = (0, 0, BTreeSet::new());
            for id in ids {
                if let Some(e) = l.exports.get(&(Delivery::Courier, *id))
                    && e.importers.get(who).is_some_and(|i| i.has != e.wanted())
                {
                    n += 1;
                    bytes += e.size;
                    tags.insert(e.tag.as_str());
                }
            }
            let why = l.failures.get(who).cloned().unwrap_or_else(|| {
                let stopped = if stopped(who) { " (it is stopped)" } else { "" };
                format!("no answer within {} ms{stopped}", timeout().as_millis())
            });
            format!(
                "process {} (group {group}) did not {} {n} buffer(s) of {} MiB of tag(s) {}: {why}",
                who.pid,
                match memory {
                    Memory::Paused => "release",
                    Memory::Resident => "map again",
                },
                bytes.div_ceil(1 << 20),
                tags.into_iter().collect::<Vec<_>>().join(", ")
            )
        })
        .collect();
    let consequence = match memory {
        Memory::Paused => {
            "this process's pause is done, but their mappings keep that memory in use"
        }
        Memory::Resident => {
            "this process's resume is done; they map the memory again once they can, and \
             reading it there before that faults"
        }
    };
    format!(
        "{consequence} ({} process(es) behind after {} ms, {TIMEOUT_SETTING}): {}",
        behind.len(),
        timeout().as_millis(),
        lines.join("; ")
    )
}

/// This process's own second mappings of its shared allocations, made by a layer above
/// (nccl-hook: NCCL retains the handle of a buffer it registers as a window and maps it again
/// in its own address space). They hold the memory as an importer's would: the owner releases
/// them before its memory goes and maps them again once the memory is back, with its
/// importers, and a failure is reported as theirs is.
pub trait Aliases: Sync {
    /// Unmaps and releases this process's other holds on the memory of allocations `ids`
    /// (their addresses stay reserved), once no queued work uses them.
    fn release(&self, ids: &[u64]) -> Result<(), String>;
    /// Maps the new memory of allocations `ids` where those holds were.
    fn rebuild(&self, ids: &[u64]) -> Result<(), String>;
}

/// The registered [`Aliases`] (linked in by the layers above).
#[linkme::distributed_slice]
pub static ALIASES: [&'static dyn Aliases];

/// `step` on every registered [`Aliases`], then `peers`: every error of either, joined.
fn with_aliases(
    step: impl Fn(&dyn Aliases) -> Result<(), String>,
    peers: impl FnOnce() -> Result<(), String>,
) -> Result<(), String> {
    let mut errors: Vec<String> = ALIASES.iter().filter_map(|a| step(*a).err()).collect();
    errors.extend(peers().err());
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}

impl memsaver_allocator::Sharing for Owner {
    fn before_release(&self, ids: &[u64]) -> Result<(), String> {
        with_aliases(|a| a.release(ids), || self.transition(ids, Memory::Paused))
    }

    fn after_resume(&self, ids: &[u64]) -> Result<(), String> {
        with_aliases(
            |a| a.rebuild(ids),
            || self.transition(ids, Memory::Resident),
        )
    }

    fn freed(&self, id: u64) {
        forget(Delivery::Courier, id);
    }
}

#[linkme::distributed_slice(memsaver_allocator::START_HOOKS)]
static START: StartHook = StartHook {
    name: "memsaver-ipc shared memory",
    order: 0,
    run: register,
};

fn register(a: &'static Allocator) -> Result<(), String> {
    a.set_sharing(Arc::new(Owner));
    Ok(())
}

/// What [`exports`] reports of one tag's exports.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct ExportStats {
    pub handles: u64,
    pub bytes: u64,
    /// Importers, counted once per export they import.
    pub importers: u64,
    /// Bytes of this tag's paused exports that some importer still maps (its pause did not
    /// free them).
    pub held_while_paused: u64,
    /// Imports of this tag's exports that do not hold what the owner's state says (not yet
    /// released, or not yet mapped again): their importers' couriers are still at work, or
    /// (collective exports) the importers have not paused or resumed yet.
    pub imports_behind: u64,
}

/// This process's exports, per tag, of either delivery (exports whose memory was freed are
/// forgotten here).
pub fn exports() -> BTreeMap<String, ExportStats> {
    let mut out: BTreeMap<String, ExportStats> = BTreeMap::new();
    let l = LEDGER.lock();
    for e in l.exports.values() {
        let s = out.entry(e.tag.clone()).or_default();
        s.handles += 1;
        s.bytes += e.size;
        s.importers += e.importers.len() as u64;
        s.imports_behind += e.importers.values().filter(|i| i.has != e.wanted()).count() as u64;
        if e.memory == Memory::Paused
            && e.importers
                .values()
                .any(|i| matches!(i.has, Has::Mapped(_)))
        {
            s.held_while_paused += e.size;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn importer(pid: u32) -> Identity {
        Identity {
            pid,
            start: 1,
            nonce: 2,
        }
    }

    #[test]
    fn couriers_take_queued_importers_in_turn_and_a_requeued_one_goes_last_after_its_backoff() {
        let mut l = Ledger::default();
        let t0 = Instant::now();
        for pid in [3, 1, 2] {
            l.queue_now(importer(pid), t0);
        }
        assert_eq!(l.take(t0), Ok(importer(3)), "first queued, first taken");
        assert_eq!(
            l.errands[&importer(3)],
            Errand::Carrying {
                backoff: FIRST_BACKOFF
            }
        );
        // Queued again while carried: left to its courier.
        l.queue_now(importer(3), t0);
        assert!(matches!(l.errands[&importer(3)], Errand::Carrying { .. }));
        // Stopped or failing: back in the line, at its end, after its backoff, which doubles.
        l.requeue(&importer(3), t0);
        assert!(matches!(
            l.errands[&importer(3)],
            Errand::Queued { not_before, backoff, .. }
                if not_before == t0 + FIRST_BACKOFF && backoff == 2 * FIRST_BACKOFF
        ));
        assert_eq!(l.take(t0), Ok(importer(1)));
        assert_eq!(l.take(t0), Ok(importer(2)));
        // Only importer 3 waits, for its backoff.
        assert_eq!(l.take(t0), Err(Some(t0 + FIRST_BACKOFF)));
        assert_eq!(l.take(t0 + FIRST_BACKOFF), Ok(importer(3)));
        l.requeue(&importer(3), t0);
        // A new dispatch tries it at once, keeping its backoff.
        l.queue_now(importer(3), t0);
        assert_eq!(l.take(t0), Ok(importer(3)));
        assert_eq!(
            l.errands[&importer(3)],
            Errand::Carrying {
                backoff: 4 * FIRST_BACKOFF
            }
        );
        // Answered: the next failure waits the first backoff again; converged: idle.
        l.answered(&importer(3));
        assert_eq!(
            l.errands[&importer(3)],
            Errand::Carrying {
                backoff: FIRST_BACKOFF
            }
        );
        l.converged(&importer(3));
        l.forget(&importer(1));
        l.converged(&importer(2));
        assert!(l.errands.is_empty());
        assert_eq!(l.take(t0), Err(None));
    }

    #[test]
    fn a_backoff_stops_doubling_at_its_limit() {
        let mut l = Ledger::default();
        let t0 = Instant::now();
        l.queue_now(importer(1), t0);
        let mut t = t0;
        for _ in 0..20 {
            assert_eq!(l.take(t), Ok(importer(1)));
            l.requeue(&importer(1), t);
            let Errand::Queued { not_before, .. } = l.errands[&importer(1)] else {
                panic!("queued");
            };
            assert!(not_before <= t + MAX_BACKOFF);
            t = not_before;
        }
        assert!(t >= t0 + 10 * MAX_BACKOFF);
    }

    /// A layer's memory for [`answer`]: every export there (an fd of `/dev/null`), those in
    /// `stays` staying resident through pauses, those in `away` not there (being restored).
    #[derive(Default)]
    struct Layer {
        stays: Vec<u64>,
        away: Vec<u64>,
    }

    impl Backing for Layer {
        fn export(
            &mut self,
            id: u64,
            _kept: &mut Option<ExportedMemory>,
        ) -> Result<Option<ExportedMemory>, String> {
            if self.away.contains(&id) {
                return Ok(None);
            }
            let f = std::fs::File::open("/dev/null").map_err(|e| e.to_string())?;
            Ok(Some(ExportedMemory {
                fd: f.into(),
                offset: 4096,
                handle_size: 3 << 20,
            }))
        }

        fn stays(&self, id: u64) -> bool {
            self.stays.contains(&id)
        }
    }

    const C: Delivery = Delivery::Collective;

    /// A ledger with collective exports `ids` (1 MiB each), and each one's item at generation 0.
    /// A courier export `id` of `l`, opened by importer `who`: the item naming it.
    fn opened_courier(l: &mut Ledger, id: u64, who: u32, layer: &mut Layer) -> Buffer {
        let key = l.add((Delivery::Courier, id), "t", 1).unwrap().key;
        let courier = Buffer {
            id,
            key,
            generation: 0,
        };
        answer(l, Delivery::Courier, &importer(who), &[courier], layer);
        courier
    }

    fn collective(ids: &[u64]) -> (Ledger, Vec<Buffer>) {
        let mut l = Ledger::default();
        let items = ids
            .iter()
            .map(|&id| {
                let key = l.add((C, id), "t", 1 << 20).unwrap().key;
                Buffer {
                    id,
                    key,
                    generation: 0,
                }
            })
            .collect();
        (l, items)
    }

    fn has(l: &Ledger, id: Id, who: u32) -> Option<Has> {
        l.exports[&id].importers.get(&importer(who)).map(|i| i.has)
    }

    #[test]
    fn a_collective_open_is_served_at_the_generation_asked_or_later_and_recorded_mapped() {
        let (mut l, items) = collective(&[1, 2]);
        let mut layer = Layer::default();
        let a = answer(&mut l, C, &importer(5), &items, &mut layer);
        assert!(matches!(
            a.as_slice(),
            [
                (Reply::Export { id: 1, generation: 0, offset: 4096, size, epoch: 0 }, Some(_)),
                (Reply::Export { id: 2, generation: 0, .. }, Some(_)),
            ] if *size == 3 << 20
        ));
        assert_eq!(has(&l, (C, 1), 5), Some(Has::Mapped(0)));
        // Paused: nothing is answered (the serve path waits), nothing is recorded.
        l.mark(C, &[1, 2], Memory::Paused);
        assert!(answer(&mut l, C, &importer(6), &items, &mut layer).is_empty());
        assert_eq!(has(&l, (C, 1), 6), None);
        // Its resume overtook the owner's pause: it asks generation 1, the owner is at 0.
        l.mark(C, &[1, 2], Memory::Resident);
        l.mark(C, &[2], Memory::Paused);
        let next: Vec<Buffer> = items
            .iter()
            .map(|b| Buffer {
                generation: 1,
                ..*b
            })
            .collect();
        // Export 1 is at generation 1 now and answered; export 2 (paused again) ends the list.
        let a = answer(&mut l, C, &importer(5), &next, &mut layer);
        assert!(matches!(
            a.as_slice(),
            [(
                Reply::Export {
                    id: 1,
                    generation: 1,
                    ..
                },
                _
            )]
        ));
        assert_eq!(
            has(&l, (C, 1), 5),
            Some(Has::Mapped(1)),
            "its fetch maps it"
        );
        // A buffer the owner's pauses keep is served as it is, whatever generation is asked.
        layer.stays.push(2);
        let a = answer(&mut l, C, &importer(5), &next[1..], &mut layer);
        assert!(matches!(
            a.as_slice(),
            [(
                Reply::Export {
                    id: 2,
                    generation: 1,
                    ..
                },
                _
            )]
        ));
        // Memory not there yet (being restored): waited for too.
        layer.away.push(1);
        assert!(answer(&mut l, C, &importer(7), &next[..1], &mut layer).is_empty());
        // An export forgotten since the request was checked: failed, the rest answered.
        l.exports.remove(&(C, 1));
        layer.away.clear();
        let a = answer(&mut l, C, &importer(5), &next, &mut layer);
        assert!(matches!(
            a.as_slice(),
            [
                (Reply::Failed { id: 1 }, None),
                (Reply::Export { id: 2, .. }, Some(_))
            ]
        ));
    }

    /// Each pause and each resume that moves collective exports raises the epoch once (a
    /// courier export's do not), and an answer carries the epoch of its moment. After a resume
    /// that failed, an importer's open waiting for an export it left paused is answered with
    /// the failure at once, once, until the next resume starts; a resident export is served as
    /// usual meanwhile.
    #[test]
    fn epochs_count_the_collective_marks_and_a_failed_resume_answers_its_waiting_opens() {
        let (mut l, items) = collective(&[1, 2]);
        let mut layer = Layer::default();
        let next = at(&items, 1);
        l.mark(C, &[1, 2], Memory::Paused);
        l.mark(Delivery::Courier, &[1], Memory::Paused);
        l.mark(C, &[9], Memory::Paused);
        assert_eq!(l.epoch, 1, "one collective pause that marked something");
        l.mark(C, &[1], Memory::Resident);
        assert_eq!(l.epoch, 2);
        l.resume_failed = Some(("out of device memory".into(), BTreeSet::new()));
        let a = answer(&mut l, C, &importer(5), &next, &mut layer);
        assert!(
            matches!(
                a.as_slice(),
                [
                    (Reply::Export { id: 1, generation: 1, epoch: 2, .. }, Some(_)),
                    (Reply::Error { message, .. }, None),
                ] if message == "out of device memory"
            ),
            "{a:?}"
        );
        assert_eq!(has(&l, (C, 2), 5), None, "nothing served of export 2");
        // Told once: its next open (a retry that came before the owner's) waits for the
        // owner's next resume; another importer is told.
        assert!(answer(&mut l, C, &importer(5), &next[1..], &mut layer).is_empty());
        let a = answer(&mut l, C, &importer(6), &next[1..], &mut layer);
        assert!(
            matches!(a.as_slice(), [(Reply::Error { .. }, None)]),
            "{a:?}"
        );
        // The next resume started: opens wait for it.
        l.resume_failed = None;
        assert!(answer(&mut l, C, &importer(6), &next[1..], &mut layer).is_empty());
    }

    /// An importer that hung up while the owner wrote its answers: the collective importer
    /// recorded as mapping what it was given is forgotten (the next pause waits for nobody),
    /// one that maps an earlier generation it was not given keeps its record, and a courier
    /// export's new import is not counted.
    #[test]
    fn an_answer_not_delivered_is_undone() {
        let (mut l, items) = collective(&[1, 2]);
        let mut layer = Layer::default();
        answer(&mut l, C, &importer(6), &items, &mut layer);
        let a = answer(&mut l, C, &importer(5), &items, &mut layer);
        assert_eq!(has(&l, (C, 1), 5), Some(Has::Mapped(0)));
        // Importer 6's fetch of generation 1 after a cycle is answered but not delivered.
        l.mark(C, &[1, 2], Memory::Paused);
        l.mark(C, &[1, 2], Memory::Resident);
        let next = at(&items, 1);
        let late = answer(&mut l, C, &importer(6), &next[..1], &mut layer);
        assert_eq!(has(&l, (C, 1), 6), Some(Has::Mapped(1)));
        l.undelivered(C, &importer(6), &next[..1], &late);
        assert_eq!(
            has(&l, (C, 1), 6),
            None,
            "it holds nothing of what it was not given"
        );
        assert_eq!(
            has(&l, (C, 2), 6),
            Some(Has::Mapped(0)),
            "not in this answer"
        );
        // Generation 0's answers to 5, undelivered now that 5 is recorded at generation 0:
        // forgotten too; a later pause waits only for 6's old generation of export 2.
        l.undelivered(C, &importer(5), &items, &a);
        l.mark(C, &[1, 2], Memory::Paused);
        assert_eq!(
            l.holders(|_| true).0,
            Holders::from([(importer(6), vec![2])])
        );
        // A courier export's new import that was not delivered is not counted.
        let mut courier_layer = Layer::default();
        let b = opened_courier(&mut l, 7, 9, &mut courier_layer);
        let again = answer(
            &mut l,
            Delivery::Courier,
            &importer(9),
            &[b],
            &mut courier_layer,
        );
        let imports =
            |l: &Ledger| l.exports[&(Delivery::Courier, 7)].importers[&importer(9)].imports;
        assert_eq!(imports(&l), 2);
        l.undelivered(Delivery::Courier, &importer(9), &[b], &again);
        assert_eq!(imports(&l), 1);
    }

    #[test]
    fn a_courier_rebuild_is_recorded_by_its_acknowledgement_not_by_the_open() {
        let mut l = Ledger::default();
        let key = l.add((Delivery::Courier, 1), "t", 1 << 20).unwrap().key;
        let mut layer = Layer::default();
        let open = Buffer {
            id: 1,
            key,
            generation: 0,
        };
        let a = answer(&mut l, Delivery::Courier, &importer(5), &[open], &mut layer);
        assert!(
            matches!(a.as_slice(), [(Reply::Shared { id: 1, size, .. }, Some(_))] if *size == 1 << 20)
        );
        l.mark(Delivery::Courier, &[1], Memory::Paused);
        l.exports
            .get_mut(&(Delivery::Courier, 1))
            .unwrap()
            .importers
            .get_mut(&importer(5))
            .unwrap()
            .has = Has::Released(0);
        l.mark(Delivery::Courier, &[1], Memory::Resident);
        let rebuild = Buffer {
            generation: 1,
            ..open
        };
        answer(
            &mut l,
            Delivery::Courier,
            &importer(5),
            &[rebuild],
            &mut layer,
        );
        assert_eq!(has(&l, (Delivery::Courier, 1), 5), Some(Has::Released(0)));
        assert_eq!(
            l.exports[&(Delivery::Courier, 1)].importers[&importer(5)].imports,
            1
        );
    }

    #[test]
    fn a_collective_pause_waits_for_live_importers_of_any_generation_it_released() {
        let (mut l, items) = collective(&[1, 2]);
        let mut layer = Layer::default();
        for who in [5, 6, 7, 8] {
            answer(&mut l, C, &importer(who), &items, &mut layer);
        }
        // A courier export paused with an importer mapping it: the couriers' business.
        opened_courier(&mut l, 1, 9, &mut layer);
        l.mark(Delivery::Courier, &[1], Memory::Paused);
        // Nothing paused yet: nobody holds anything a pause waits for.
        assert_eq!(l.holders(|_| true), (Holders::new(), vec![]));
        l.mark(C, &[1, 2], Memory::Paused);
        // 6 released both, 7 released one, 8 exited; 6 exited too: found, to be forgotten.
        // (9, the courier export's importer, is its courier's to find.)
        l.released(&importer(6), &items);
        l.released(&importer(7), &items[..1]);
        let (holders, exited) = l.holders(|who| ![6, 8, 9].contains(&who.pid));
        assert_eq!(
            holders,
            Holders::from([(importer(5), vec![1, 2]), (importer(7), vec![2])])
        );
        assert_eq!(exited, vec![importer(6), importer(8)]);
        // The owner resumed without them (a pause that failed): they still map the older
        // generation, whose memory is not free while they do, so the next pause waits for
        // them too (and names them); 7 is gone meanwhile.
        l.mark(C, &[1, 2], Memory::Resident);
        l.mark(C, &[1, 2], Memory::Paused);
        let (holders, _) = l.holders(|who| ![6, 7, 8].contains(&who.pid));
        assert_eq!(holders, Holders::from([(importer(5), vec![1, 2])]));
        // Its notice of the generation it maps lets go of it.
        l.released(&importer(5), &items);
        let (holders, _) = l.holders(|who| ![6, 8].contains(&who.pid));
        assert_eq!(holders, Holders::from([(importer(7), vec![2])]));
    }

    #[test]
    fn a_release_notice_counts_only_for_the_generation_mapped_and_with_the_key() {
        let (mut l, items) = collective(&[1]);
        answer(&mut l, C, &importer(5), &items, &mut Layer::default());
        l.mark(C, &[1], Memory::Paused);
        let wrong_key = Buffer {
            key: items[0].key ^ 1,
            ..items[0]
        };
        let other_generation = Buffer {
            generation: 1,
            ..items[0]
        };
        l.released(&importer(5), &[wrong_key, other_generation]);
        l.released(&importer(6), &items);
        assert_eq!(has(&l, (C, 1), 5), Some(Has::Mapped(0)));
        assert_eq!(
            has(&l, (C, 1), 6),
            None,
            "not an importer: nothing recorded"
        );
        l.released(&importer(5), &items);
        assert_eq!(has(&l, (C, 1), 5), Some(Has::Released(0)));
    }

    #[test]
    fn a_close_forgets_a_collective_importer_only_with_the_buffers_key() {
        let (mut l, items) = collective(&[1]);
        answer(&mut l, C, &importer(5), &items, &mut Layer::default());
        let wrong_key = Buffer {
            key: items[0].key ^ 1,
            ..items[0]
        };
        assert!(!l.closed(&importer(5), &[wrong_key]), "refused");
        assert!(
            !l.closed(&importer(5), &[Buffer { id: 9, ..items[0] }, wrong_key]),
            "one item with a wrong key refuses the whole close"
        );
        assert_eq!(has(&l, (C, 1), 5), Some(Has::Mapped(0)), "nothing changed");
        assert!(
            l.closed(&importer(5), &[Buffer { id: 9, ..items[0] }]),
            "a close of a buffer the owner freed already has nothing to do"
        );
        assert_eq!(has(&l, (C, 1), 5), Some(Has::Mapped(0)), "nothing changed");
        // A courier export with the same id: a close with the collective key leaves it be.
        let courier = l.add((Delivery::Courier, 1), "t", 1 << 20).unwrap().key;
        let open = Buffer {
            key: courier,
            ..items[0]
        };
        answer(
            &mut l,
            Delivery::Courier,
            &importer(5),
            &[open],
            &mut Layer::default(),
        );
        let courier_has = has(&l, (Delivery::Courier, 1), 5);
        assert!(courier_has.is_some());
        assert!(l.closed(&importer(5), &items));
        assert_eq!(has(&l, (C, 1), 5), None, "no importer any more");
        assert_eq!(
            has(&l, (Delivery::Courier, 1), 5),
            courier_has,
            "the other kind's"
        );
    }

    /// Items `items` at `generation`.
    fn at(items: &[Buffer], generation: u64) -> Vec<Buffer> {
        items.iter().map(|b| Buffer { generation, ..*b }).collect()
    }

    #[test]
    fn a_buffer_freed_while_importers_hold_it_is_answered_gone_and_the_others_served() {
        let (mut l, items) = collective(&[1, 2]);
        let mut layer = Layer::default();
        answer(&mut l, C, &importer(5), &items, &mut layer);
        l.mark(C, &[1, 2], Memory::Paused);
        l.released(&importer(5), &items);
        // The owner's NCCL frees buffer 1 while paused; its resume brings back buffer 2.
        assert!(l.free((C, 1)));
        l.mark(C, &[2], Memory::Resident);
        let next = at(&items, 1);
        assert_eq!(l.named(C, &next[0]), Named::Tomb);
        let a = answer(&mut l, C, &importer(5), &next, &mut layer);
        assert!(
            matches!(
                a.as_slice(),
                [
                    (Reply::Gone { id: 1 }, None),
                    (
                        Reply::Export {
                            id: 2,
                            generation: 1,
                            ..
                        },
                        Some(_)
                    ),
                ]
            ),
            "{a:?}"
        );
        assert_eq!(has(&l, (C, 2), 5), Some(Has::Mapped(1)));
        // No right to name it: a wrong key, an id never given out, a freed courier export.
        let wrong_key = Buffer {
            key: items[0].key ^ 1,
            ..next[0]
        };
        assert_eq!(l.named(C, &wrong_key), Named::Nothing);
        assert_eq!(l.named(C, &Buffer { id: 9, ..next[0] }), Named::Nothing);
        let courier = opened_courier(&mut l, 3, 5, &mut layer);
        assert!(l.free((Delivery::Courier, 3)));
        assert_eq!(l.named(Delivery::Courier, &courier), Named::Nothing);
        // A buffer nobody imported leaves nothing behind either.
        let key = l.add((C, 4), "t", 1).unwrap().key;
        assert!(l.free((C, 4)));
        assert_eq!(l.tombs.len(), 1, "only buffer 1's: {:?}", l.tombs.keys());
        assert_eq!(
            l.named(
                C,
                &Buffer {
                    id: 4,
                    key,
                    generation: 0
                }
            ),
            Named::Nothing
        );
    }

    #[test]
    fn a_tombstone_goes_when_its_last_importer_closed_its_import_or_exited() {
        let (mut l, items) = collective(&[1]);
        let mut layer = Layer::default();
        for who in [5, 6, 7] {
            answer(&mut l, C, &importer(who), &items, &mut layer);
        }
        assert!(l.free((C, 1)));
        // 5's NCCL frees its import: a close at the generation it mapped last.
        assert!(l.closed(&importer(5), &items));
        assert_eq!(
            l.tombs[&(C, 1)][0].importers,
            BTreeSet::from([importer(6), importer(7)])
        );
        // A close naming the buried id with another key takes nobody off: no export has the id
        // and no tombstone the key, so it is skipped.
        let wrong_key = Buffer {
            key: items[0].key ^ 1,
            ..items[0]
        };
        assert!(l.closed(&importer(6), &[wrong_key]));
        assert_eq!(l.tombs[&(C, 1)][0].importers.len(), 2);
        // 6 exits: the next collective pause finds it and forgets it.
        let (holders, exited) = l.holders(|who| who.pid != 6);
        assert_eq!(
            (holders, exited.clone()),
            (Holders::new(), vec![importer(6)])
        );
        l.forget(&importer(6));
        assert_eq!(l.named(C, &items[0]), Named::Tomb, "7 may still name it");
        assert!(l.closed(&importer(7), &items));
        assert!(l.tombs.is_empty(), "nobody can name it any more");
        assert_eq!(l.named(C, &items[0]), Named::Nothing);
    }

    #[test]
    fn an_id_given_again_names_the_new_export_with_its_key_and_the_tombstone_with_the_old() {
        let (mut l, old) = collective(&[1]);
        let mut layer = Layer::default();
        answer(&mut l, C, &importer(5), &old, &mut layer);
        assert!(l.free((C, 1)));
        let key = l.add((C, 1), "t", 1 << 20).unwrap().key;
        let new = Buffer {
            id: 1,
            key,
            generation: 0,
        };
        assert_eq!(l.named(C, &old[0]), Named::Tomb);
        assert_eq!(l.named(C, &new), Named::Export);
        let a = answer(&mut l, C, &importer(6), &[old[0], new], &mut layer);
        assert!(
            matches!(
                a.as_slice(),
                [
                    (Reply::Gone { id: 1 }, None),
                    (Reply::Export { id: 1, .. }, Some(_))
                ]
            ),
            "{a:?}"
        );
        // A close of the old import leaves the new export's importers be.
        assert!(l.closed(&importer(5), &old));
        assert!(l.tombs.is_empty());
        assert_eq!(has(&l, (C, 1), 6), Some(Has::Mapped(0)));
    }

    #[test]
    fn tombstones_are_capped_and_the_oldest_goes_first() {
        let mut l = Ledger::default();
        let mut layer = Layer::default();
        let mut first = None;
        for id in 0..=MAX_TOMBS as u64 {
            let key = l.add((C, id), "t", 1).unwrap().key;
            let b = Buffer {
                id,
                key,
                generation: 0,
            };
            answer(&mut l, C, &importer(5), &[b], &mut layer);
            assert!(l.free((C, id)));
            first.get_or_insert(b);
            assert_eq!(l.named(C, &b), Named::Tomb, "the latest is kept");
        }
        assert_eq!(l.tombs.values().map(Vec::len).sum::<usize>(), MAX_TOMBS);
        assert_eq!(
            l.named(C, &first.unwrap()),
            Named::Nothing,
            "the oldest went"
        );
    }

    /// An importer whose fetch failed after the owner served a later generation than the one it
    /// asked (the owner paused and resumed again while it stayed paused) names, in its notice,
    /// the generation served: the owner records it released, and its next pause waits for
    /// nobody. A notice naming the generation asked (as before) changes nothing there.
    #[test]
    fn a_failed_fetch_tells_the_owner_the_generation_it_served() {
        let me = importer(5);
        // Both pause (5 releases generation 0); the owner resumes and pauses alone, then
        // resumes again, buffer 2 not restored yet. 5 asks for the generation after the one it
        // mapped: buffer 1 is served at 2; buffer 2 is not there by the owner's wait. Returns
        // the owner's ledger, what 5 asked, and the owner's replies.
        let served_later = || {
            let (mut l, items) = collective(&[1, 2]);
            let mut layer = Layer::default();
            answer(&mut l, C, &me, &items, &mut layer);
            l.mark(C, &[1, 2], Memory::Paused);
            l.released(&me, &items);
            for memory in [Memory::Resident, Memory::Paused, Memory::Resident] {
                l.mark(C, &[1, 2], memory);
            }
            layer.away.push(2);
            let asks = at(&items, 1);
            let mut replies = answer(&mut l, C, &me, &asks, &mut layer);
            replies.push((Reply::NotReady { id: 2 }, None));
            (l, asks, replies)
        };
        // Whom the owner's next pause waits for once 5's notice reached it.
        let waited_for = |mut l: Ledger, notice: &[Buffer]| {
            l.released(&me, notice);
            l.mark(C, &[1, 2], Memory::Paused);
            l.holders(|_| true).0
        };
        let (l, asks, replies) = served_later();
        assert_eq!(has(&l, (C, 1), 5), Some(Has::Mapped(2)));
        let failed = client::answers(me.pid, &asks, replies, None, Duration::from_secs(1))
            .expect_err("buffer 2 was not served");
        assert!(
            failed
                .error
                .to_string()
                .contains("did not restore buffer 0x2"),
            "{}",
            failed.error
        );
        assert_eq!(
            failed.release,
            vec![
                Buffer {
                    generation: 2,
                    ..asks[0]
                },
                asks[1]
            ]
        );
        assert_eq!(waited_for(l, &failed.release), Holders::new());
        // The notice as it was sent before, of the generations asked: the owner still counts
        // 5 as mapping buffer 1, and its pause would wait for 5 until its timeout.
        let (l, asks, _) = served_later();
        assert_eq!(waited_for(l, &asks), Holders::from([(me, vec![1])]));
    }

    #[test]
    fn couriers_never_carry_a_collective_export() {
        let (mut l, items) = collective(&[1]);
        answer(&mut l, C, &importer(5), &items, &mut Layer::default());
        l.mark(C, &[1], Memory::Paused);
        assert_eq!(l.behind(&importer(5)), (vec![], vec![]));
        assert_eq!(
            l.mark(C, &[1], Memory::Resident),
            BTreeSet::from([importer(5)])
        );
        assert_eq!(l.behind(&importer(5)), (vec![], vec![]));
    }
}
