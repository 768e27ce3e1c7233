//! One topic: the couriers, the threads that carry the owner's state to the importers of
//! [`Delivery::Courier`] exports (the ledger's doc says how; [`MAX_COURIERS`] at most, each
//! importer behind waiting for one in turn with its backoff).

use std::time::Instant;

use super::ledger::*;
use crate::client;
use crate::error::{Error, Result};
use crate::group;
use crate::identity::{self, Identity};
use crate::options::timeout;
use crate::protocol::{Buffer, MAX_BUFFERS, Reply, Request, Share};

/// Queues `who` for a courier to be tried at once (under [`LEDGER`]), and starts one more
/// courier thread while fewer run than [`MAX_COURIERS`] and than importers they work for. A
/// thread that cannot start is recorded as the importer's failure; it stays queued (the
/// couriers running take it, or the next dispatch starts one).
pub(super) fn dispatch(l: &mut Ledger, who: Identity) {
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
pub(super) fn courier() {
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
pub(super) fn carry(group: i64, who: Identity) {
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
pub(super) fn stopped(who: &Identity) -> bool {
    let state = memsaver_allocator::process::stat(&who.pid.to_string()).map(|(s, _)| s);
    matches!(state, Some('T' | 't'))
}

/// Sends `op` of `buffers` to `who` and records what it acknowledged.
pub(super) fn deliver(group: i64, who: &Identity, op: Share, buffers: &[Buffer]) -> Result<()> {
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
        Some((Reply::Error { message, .. }, _)) => {
            return Err(Error::ImporterFailed {
                pid: who.pid,
                message,
            });
        }
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
