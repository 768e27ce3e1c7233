use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use memsaver_allocator::ExportedMemory;

use super::ledger::*;
use super::requests;
use super::serve::*;
use crate::identity::Identity;
use crate::protocol::{Buffer, Reply};

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
    ) -> crate::Result<Option<ExportedMemory>> {
        if self.away.contains(&id) {
            return Ok(None);
        }
        let f = std::fs::File::open("/dev/null").map_err(|source| crate::Error::Io {
            what: "/dev/null".into(),
            source,
        })?;
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
    let imports = |l: &Ledger| l.exports[&(Delivery::Courier, 7)].importers[&importer(9)].imports;
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
    let failed = requests::answers(me.pid, &asks, replies, None, Duration::from_secs(1))
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
