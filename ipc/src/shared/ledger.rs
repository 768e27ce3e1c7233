//! One topic: the owner's **ledger** of what this process exported and who imports it, and the
//! two ways importers follow the owner's pauses and resumes ([`Delivery`]): the **couriers**
//! that carry them to every importer, or the importers' own **collective** pause, which the
//! owner waits for.
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
//! [`Delivery::Collective`]: nobody carries anything; every importer releases its imports in its
//! own pause and says so ([`Request::Released`](crate::protocol::Request::Released)), and opens the
//! next generation at its resume. The owner's pause marks what it released ([`paused`]) and waits
//! until the ledger says every importer that maps a generation of it has released it, is gone or
//! said its own pause failed ([`wait_released`]); its resume starts the next generation
//! ([`resumed`]). Each pause and resume raises the owner's epoch ([`crate::epoch`]), which lets an
//! importer that did not follow see it for itself.
//!
//! **Tombstones.** When the memory of a [`Delivery::Collective`] export is freed (its layer's NCCL
//! destroyed a communicator, say) while importers still hold imports of it, mapped or released by a
//! pause, the ledger keeps a [`Tomb`] of its id and key with those importers. An open that names it
//! is answered [`Reply::Gone`]: the importer drops that import and maps the owner's other buffers,
//! where otherwise its whole request would be refused, as a request naming an id or key the owner
//! never gave out still is (no right to name it). A tombstone lasts while one of its importers
//! could still name it: each one leaves it when it closes its import
//! ([`Share::Close`](crate::protocol::Share::Close): its own NCCL freed it) or exits, and the last
//! one to leave takes it away. At most [`MAX_TOMBS`] are kept: beyond that the oldest goes
//! (logged), and its importers' opens of it are refused as before (their resumes fail naming the
//! owner until their NCCL frees the import). [`Delivery::Courier`] exports need none: couriers
//! carry only the exports there are, so importers never open again what the owner freed, and a
//! first open of a freed allocation is refused.
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
use std::os::fd::OwnedFd;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use memsaver_allocator::ExportedMemory;
use parking_lot::{Condvar, Mutex};

use crate::deadline::Progress;
use crate::error::{Error, Result};
use crate::identity::{self, Identity};
use crate::protocol::{Buffer, Reply};
use crate::server::{Connection, WRITE_TIMEOUT};

/// How the importers of an export follow the owner's pauses and resumes. Each delivery has its
/// own ids (an export is named by its delivery and its id) and its own requests on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Delivery {
    /// The owner's couriers bring every importer to the owner's state
    /// ([`Share::Release`](crate::protocol::Share::Release),
    /// [`Share::Rebuild`](crate::protocol::Share::Rebuild)), and the owner's pause and resume wait
    /// for them: the allocator's allocations (given as CUDA IPC handles, or as tokens to layers
    /// that map them themselves), opened and closed with
    /// [`Request::Shared`](crate::protocol::Request::Shared), answered [`Reply::Shared`]. The ids
    /// are the allocator's.
    Courier,
    /// Importers release their imports in their own pause, which every process of the group makes,
    /// and tell the owner ([`Request::Released`](crate::protocol::Request::Released)); at their
    /// resume they open the next generation ([`Request::Import`](crate::protocol::Request::Import),
    /// answered [`Reply::Export`]). The owner's pause waits until every importer that maps a
    /// generation of it has released or is gone ([`wait_released`]). A layer's own buffers, served
    /// through [`crate::server::Service::Buffers`]; the ids are the layer's.
    Collective,
}

/// An export: its delivery and its id there.
pub(super) type Id = (Delivery, u64);

/// The owner's memory of one export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Memory {
    /// Mapped: opens are served.
    Resident,
    /// Released by a pause: opens are answered `NotReady` until the resume.
    Paused,
}

/// What one importer holds of one export, as far as the owner knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Has {
    /// It maps that generation of the memory.
    Mapped(u64),
    /// It released its mapping of that generation (the address stays reserved there).
    Released(u64),
}

/// One importer of one export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Importer {
    /// Its imports not closed yet: each new import (an open of [`Buffer::generation`] 0) counts
    /// one, each `Close` one less; a rebuild's open counts none. (Collective imports are never
    /// closed: the importer is forgotten with the export, or when it exits.)
    pub(super) imports: u32,
    pub(super) has: Has,
}

/// One allocation or buffer this process exported.
pub(super) struct Export {
    pub(super) key: u64,
    pub(super) tag: String,
    pub(super) size: u64,
    /// Times the owner re-created its memory (each resume after a pause).
    pub(super) generation: u64,
    pub(super) memory: Memory,
    pub(super) importers: BTreeMap<Identity, Importer>,
    /// The current generation's memory, exported once
    /// ([`Allocations::export_kept`](super::serve::Allocations::export_kept)): the driver takes
    /// about 1.5 ms to export a 1 GiB handle the first time and tens of microseconds after, so the
    /// fd is made when the handle is given and copies of it are handed out (for at most
    /// [`MAX_KEPT_FDS`] exports at a time). An exported fd keeps the memory alive: it is dropped
    /// before a pause releases the memory and when the allocation is freed. Only a
    /// [`Delivery::Courier`] export keeps one (its pause marks it paused before the release).
    pub(super) fd: Option<ExportedMemory>,
}

impl Export {
    /// What every importer should hold now.
    pub(super) fn wanted(&self) -> Has {
        match self.memory {
            Memory::Resident => Has::Mapped(self.generation),
            Memory::Paused => Has::Released(self.generation),
        }
    }

    pub(super) fn buffer(&self, id: u64) -> Buffer {
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
pub(super) struct Tomb {
    pub(super) key: u64,
    /// The importers it had when it was freed that have not closed their import of it nor
    /// exited: while there is one, the tombstone stays.
    pub(super) importers: BTreeSet<Identity>,
    /// The ledger's count of tombstones laid when this one was: the smallest goes first when
    /// there are more than [`MAX_TOMBS`].
    pub(super) laid: u64,
}

/// At most this many tombstones are kept ([`Tomb`]); one is a few dozen bytes.
pub const MAX_TOMBS: usize = 4096;

/// What an item ([`Buffer`]: id and key) names in the ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Named {
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
pub(super) enum Errand {
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
pub(super) const FIRST_BACKOFF: Duration = Duration::from_millis(10);
pub(super) const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// Everything the owner side keeps, under one lock ([`LEDGER`]).
#[derive(Default)]
pub(super) struct Ledger {
    pub(super) exports: HashMap<Id, Export>,
    /// The importers a courier works for (queued or carried), each with its [`Errand`].
    pub(super) errands: BTreeMap<Identity, Errand>,
    /// The last `turn` given to a queued importer ([`Errand::Queued`]).
    pub(super) turns: u64,
    /// Courier threads running (at most [`MAX_COURIERS`]).
    pub(super) couriers: usize,
    /// The last failure of each importer's courier, for the owner's report.
    pub(super) failures: BTreeMap<Identity, String>,
    /// Tombstones of freed collective exports, by the export's id (an id given again to a new
    /// export, with a new key, may have one too).
    pub(super) tombs: HashMap<Id, Vec<Tomb>>,
    /// Tombstones laid so far ([`Tomb::laid`]).
    pub(super) laid: u64,
    /// Changes of the collective exports' state so far (pauses and resumes that marked some),
    /// published for the importers ([`crate::epoch`]) and given with each answer.
    pub(super) epoch: u64,
    /// Why the owner's last resume of its collective exports failed, while it left some
    /// paused, and the importers told so: an open waiting for one of those is answered with
    /// it at once ([`Reply::Error`]) instead of at the end of its wait, once per importer (its
    /// next open, a retry that may come before the owner's own, waits for the owner's next
    /// resume as usual). Cleared when a resume starts.
    pub(super) resume_failed: Option<(String, BTreeSet<Identity>)>,
    /// Importers of collective exports whose own pause failed, leaving imports mapped, with their
    /// error ([`Request::PauseFailed`](crate::protocol::Request::PauseFailed)): a pause stops
    /// waiting for them and names them with it, once. Forgotten then, or at the importer's next
    /// notice or open (it went on).
    pub(super) pause_failed: BTreeMap<Identity, String>,
}

impl Ledger {
    /// What `who` holds of the [`Delivery::Courier`] exports that differs from what it should:
    /// buffers for its courier to release and to map.
    pub(super) fn behind(&self, who: &Identity) -> (Vec<Buffer>, Vec<Buffer>) {
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
    pub(super) fn add(&mut self, id: Id, tag: &str, size: u64) -> Result<&mut Export> {
        Ok(match self.exports.entry(id) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let key = identity::new_key().map_err(|source| Error::Io {
                    what: "cannot draw a key for an export".into(),
                    source,
                })?;
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
    pub(super) fn named(&self, delivery: Delivery, b: &Buffer) -> Named {
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
    pub(super) fn free(&mut self, id: Id) -> bool {
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
    pub(super) fn bury(&mut self, id: Id, e: &Export) {
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
    pub(super) fn drop_oldest_tomb(&mut self) {
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
    pub(super) fn leave(&mut self, who: &Identity, id: Id, b: &Buffer) {
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
    pub(super) fn mark(
        &mut self,
        delivery: Delivery,
        ids: &[u64],
        memory: Memory,
    ) -> BTreeSet<Identity> {
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
    pub(super) fn publish(&self) {
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
    pub(super) fn holders(&self, running: impl Fn(&Identity) -> bool) -> (Holders, Vec<Identity>) {
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
    pub(super) fn released(&mut self, from: &Identity, items: &[Buffer]) {
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
    pub(super) fn closed(&mut self, from: &Identity, items: &[Buffer]) -> bool {
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
    pub(super) fn undelivered(
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
    pub(super) fn forget(&mut self, who: &Identity) {
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
    pub(super) fn queue_now(&mut self, who: Identity, now: Instant) {
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

    pub(super) fn next_turn(&mut self) -> u64 {
        self.turns += 1;
        self.turns
    }

    /// The queued importer whose time has come with the smallest turn, now carried; else when
    /// the first time to come is (`None`: nobody is queued).
    pub(super) fn take(&mut self, now: Instant) -> Result<Identity, Option<Instant>> {
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
    pub(super) fn requeue(&mut self, who: &Identity, now: Instant) {
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
    pub(super) fn answered(&mut self, who: &Identity) {
        if let Some(Errand::Carrying { backoff }) = self.errands.get_mut(who) {
            *backoff = FIRST_BACKOFF;
        }
    }

    /// `who` holds what it should: its courier lets go of it (carried → idle).
    pub(super) fn converged(&mut self, who: &Identity) {
        if matches!(self.errands.get(who), Some(Errand::Carrying { .. })) {
            self.errands.remove(who);
        }
        self.failures.remove(who);
    }
}

/// One answer of an owner to an open: the reply, with the fd it carries.
pub(super) type Answer = (Reply, Option<OwnedFd>);

/// Whether `key` is the key `b` carries (compared without branching on its bits).
pub(super) fn same_key(key: u64, b: &Buffer) -> bool {
    std::hint::black_box(key ^ b.key) == 0
}

/// One import fewer of `e` by `who`.
pub(super) fn forget_import(e: &mut Export, who: &Identity) {
    if let Some(i) = e.importers.get_mut(who) {
        i.imports = i.imports.saturating_sub(1);
        if i.imports == 0 {
            e.importers.remove(who);
        }
    }
}

/// This process's exports; [`SETTLED`] is notified whenever an importer's state changes,
/// [`QUEUED`] whenever an importer is queued for a courier to be tried at once.
pub(super) static LEDGER: LazyLock<Mutex<Ledger>> = LazyLock::new(Default::default);
pub(super) static SETTLED: Condvar = Condvar::new();
pub(super) static QUEUED: Condvar = Condvar::new();

/// At most this many exported fds are kept ([`Export::fd`]), so that a process sharing many
/// allocations stays far from its open-file limit (1024 by default); the others are exported
/// at each open, as they were before being kept.
pub(super) const MAX_KEPT_FDS: usize = 256;

/// Exported fds kept now (changed under [`LEDGER`]).
pub(super) static KEPT_FDS: AtomicUsize = AtomicUsize::new(0);

/// Drops the exported fd `e` keeps, if any.
pub(super) fn drop_kept_fd(e: &mut Export) {
    if e.fd.take().is_some() {
        KEPT_FDS.fetch_sub(1, Ordering::Relaxed);
    }
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
pub(super) const EXIT_POLL: Duration = Duration::from_millis(2);

/// What a collective pause's wait found: the importers still holding, and the errors of
/// those whose own pause failed ([`Request::PauseFailed`](crate::protocol::Request::PauseFailed)).
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
/// [`Delivery::Collective`] exports mapped
/// ([`Request::PauseFailed`](crate::protocol::Request::PauseFailed)).
pub fn serve_pause_failed(conn: &Connection, from: &Identity, message: String) {
    LEDGER.lock().pause_failed.insert(*from, message);
    SETTLED.notify_all();
    let _ = conn.send(&Reply::Done, None, Instant::now() + WRITE_TIMEOUT);
}

/// The owner's answer to `from`'s notice that it released its imports `items` of
/// [`Delivery::Collective`] exports ([`Request::Released`](crate::protocol::Request::Released)).
pub fn serve_released(conn: &Connection, from: &Identity, items: &[Buffer]) {
    LEDGER.lock().released(from, items);
    SETTLED.notify_all();
    let _ = conn.send(&Reply::Done, None, Instant::now() + WRITE_TIMEOUT);
}
