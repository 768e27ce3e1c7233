//! One topic: the owner's one serve path. An importer's open or close names exports by id and
//! key ([`Buffer`]); [`serve_opens`] checks every item against the ledger, answers each
//! (exported memory, `NotReady` while paused, `Gone` for a tombstone) through the layer's
//! [`Backing`], records what each importer now holds, and undoes what was not delivered. The
//! allocator's allocations are one [`Exports`] ([`serve`], for CUDA IPC handles and tokens);
//! nccl-hook's buffers are another.

use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use memsaver_allocator::{Allocator, ExportedMemory};

use super::handle::IpcHandle;
use super::ledger::*;
use crate::error::{Error, Result};
use crate::group;
use crate::identity::{self, Identity};
use crate::log::note;
use crate::protocol::{Buffer, Reply, Share};
use crate::server::{self, Connection, NO_BUFFER, WRITE_TIMEOUT};

/// The handle of the memsaver allocation holding `ptr`, or `Ok(None)` when memsaver did not
/// allocate it (the caller forwards to the real runtime).
pub fn handle_of(ptr: u64) -> Result<Option<IpcHandle>> {
    let Some(a) = memsaver_allocator::global_if_started() else {
        return Ok(None);
    };
    let shared = match a.share(ptr) {
        Ok(s) => s,
        Err(memsaver_allocator::Error::UnknownPointer { .. }) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    // Importers answer the owner's release and rebuild requests on this server, and open
    // through it.
    server::ensure_server().map_err(|source| Error::CannotServe {
        doing: "cannot share memsaver memory with other processes",
        source,
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
        group: group::try_fix()?,
        id: shared.id,
        key,
        size: shared.size as u64,
    }))
}

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
    ) -> Result<Option<ExportedMemory>>;

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
pub(super) fn known(delivery: Delivery, items: &[Buffer]) -> bool {
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
    let started = Instant::now();
    let deadline = started + wait;
    let write_by = deadline + WRITE_TIMEOUT;
    let mut next = 0;
    let mut rounds = 0;
    let (mut answering, mut sending) = (Duration::ZERO, Duration::ZERO);
    while next < items.len() {
        rounds += 1;
        let t = Instant::now();
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
        answering += t.elapsed();
        let t = Instant::now();
        for (i, (reply, fd)) in answers.iter().enumerate() {
            if conn
                .send(reply, fd.as_ref().map(|f| f.as_fd()), write_by)
                .is_err()
            {
                undelivered(delivery, from, &items[next + i..], &answers[i..]);
                return;
            }
        }
        sending += t.elapsed();
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
    tracing::debug!(
        importer = from.pid,
        buffers = items.len(),
        rounds,
        answer_ms = answering.as_secs_f64() * 1e3,
        send_ms = sending.as_secs_f64() * 1e3,
        ms = started.elapsed().as_secs_f64() * 1e3,
        "served a peer's opens"
    );
}

/// Answers `items` in order (under [`LEDGER`] and the layer's lock, held by `backing`), as many
/// as can be answered now: each once its export is resident at least at the generation asked
/// (or stays resident), an answer that must wait for the owner's resume ending the list; one
/// whose tombstone carries its key is gone; records `from` as an importer of each one given.
pub(super) fn answer(
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
pub(super) fn undelivered(
    delivery: Delivery,
    from: &Identity,
    items: &[Buffer],
    answers: &[Answer],
) {
    LEDGER.lock().undelivered(delivery, from, items, answers);
    SETTLED.notify_all();
}

/// The ledger's allocations as [`Exports`]: their memory is the allocator's.
pub(super) struct Allocations;

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
pub(super) struct AllocationBacking(memsaver_allocator::Result<&'static Allocator>);

impl Allocations {
    /// A copy of allocation `id`'s exported fd, exporting it first if it is not kept in `kept`
    /// (`Ok(None)` while the allocation is not resident). Called under [`LEDGER`].
    fn export_kept(
        a: &Allocator,
        id: u64,
        kept: &mut Option<ExportedMemory>,
    ) -> Result<Option<ExportedMemory>> {
        if kept.is_none() {
            let Some(m) = a.export_shared(id)? else {
                return Ok(None);
            };
            if KEPT_FDS.load(Ordering::Relaxed) >= MAX_KEPT_FDS {
                return Ok(Some(m));
            }
            KEPT_FDS.fetch_add(1, Ordering::Relaxed);
            *kept = Some(m);
        }
        let Some(m) = kept else { return Ok(None) };
        let fd = m.fd.try_clone().map_err(|source| Error::Io {
            what: "cannot copy an exported fd".into(),
            source,
        })?;
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
    ) -> Result<Option<ExportedMemory>> {
        let a = self.0.as_ref().map_err(|e| Error::Allocator(e.clone()))?;
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
