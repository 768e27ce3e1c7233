//! The owner's side of NCCL's shared buffers: the handler that `memsaver_ipc`'s server routes
//! peers' imports and releases to ([`Service::Buffers`]). It serves the real fds of this
//! process's exported buffers from the registry, under its lock, and records who imports what.
//!
//! An import names each buffer by its virtual handle and must carry the buffer's key, which
//! only the buffer's token gives (`crate::vmm`'s export wrapper hands out tokens).

use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use memsaver_allocator::driver::Handle;
use memsaver_ipc::identity::Identity;
use memsaver_ipc::log::note;
use memsaver_ipc::protocol::{Buffer, Reply, Request};
use memsaver_ipc::server::{self, Connection, Handler, NO_BUFFER, Route, Service, WRITE_TIMEOUT};

use crate::{peer, registry};

/// NCCL's exported buffers, served to the peers that import them.
struct Exports;

#[linkme::distributed_slice(server::ROUTES)]
static ROUTE: Route = Route {
    service: Service::Buffers,
    handler: &Exports,
};

impl Handler for Exports {
    fn handle(&self, conn: Connection, request: Request) {
        match request {
            Request::Import { from, buffers, .. } => {
                let _ = answer(&conn, from, &buffers);
            }
            Request::Released { from, buffers, .. } => {
                let mut reg = registry::lock();
                for i in &buffers {
                    if let Some(p) = reg.physicals.get_mut(&i.id)
                        && names(p, i)
                        && p.generation == i.generation
                    {
                        p.importers.remove(&from);
                    }
                }
                drop(reg);
                let _ = conn.send(&Reply::Done, None, Instant::now() + WRITE_TIMEOUT);
            }
            Request::Control { .. } | Request::Shared { .. } => {
                conn.refuse("not a request for buffers")
            }
        }
    }
}

/// Whether `i` names buffer `p`: `p` was exported with a token, whose key `i` carries. The
/// keys are compared without branching on their bits.
fn names(p: &registry::Physical, i: &Buffer) -> bool {
    p.key
        .is_some_and(|key| std::hint::black_box(key ^ i.key) == 0)
}

/// Answers `items` in order: the real fd of each buffer once its generation is at least the
/// one asked for (waiting for an owner still resuming, up to the timeout), recording `pid` as
/// an importer. Every item must name a buffer of this process with its key, or the whole
/// request is refused, saying nothing of which item or which part of it was wrong. Every item
/// already answerable is answered under one hold of the registry lock, so that a process busy
/// resuming serves a peer's hundreds of buffers in one go.
fn answer(conn: &Connection, from: Identity, items: &[Buffer]) -> std::io::Result<()> {
    let pid = from.pid;
    let deadline = Instant::now() + peer::timeout();
    let write_by = deadline + WRITE_TIMEOUT;
    let known = {
        let reg = registry::lock();
        // Every item looked at: the time taken does not say where the first wrong one is.
        items.iter().fold(true, |ok, i| {
            ok & reg.physicals.get(&i.id).is_some_and(|p| names(p, i))
        })
    };
    if !known {
        conn.refuse(NO_BUFFER);
        return Ok(());
    }
    // Before the registry lock: this may start the allocator. The driver whatever the options
    // say: a peer's import must be served.
    let driver = memsaver_allocator::global_driver();
    let mut next = 0;
    while next < items.len() {
        let mut replies: Vec<(Reply, Option<OwnedFd>)> = Vec::new();
        {
            let mut reg = registry::lock();
            for r in &items[next..] {
                let Some(p) = reg.physicals.get_mut(&r.id) else {
                    // Freed by NCCL while this request waited.
                    replies.push((Reply::Failed { id: r.id }, None));
                    continue;
                };
                // A buffer that stays resident through pauses (host memory, given to a NIC,
                // ...) keeps its generation: serve it as it is. Otherwise wait until the owner
                // has re-created the generation asked for.
                let stays = p.pausable().is_err();
                let Some(h) = p.real().filter(|_| stays || p.generation >= r.generation) else {
                    break; // not restored yet: answers go out in order, wait
                };
                match driver.clone().and_then(|d| Ok(d.export_fd(Handle(h))?)) {
                    Ok(fd) => {
                        p.importers.insert(from);
                        let reply = Reply::Export {
                            id: r.id,
                            generation: p.generation,
                        };
                        replies.push((reply, Some(fd)));
                    }
                    Err(e) => {
                        note(format!(
                            "cannot export an NCCL buffer to process {pid}: {e}"
                        ));
                        replies.push((Reply::Failed { id: r.id }, None));
                    }
                }
            }
        }
        for (i, (reply, fd)) in replies.iter().enumerate() {
            let sent = conn.send(reply, fd.as_ref().map(|f| f.as_fd()), write_by);
            if let Err(e) = sent {
                // The importer is gone (or gave up waiting): it holds none of the fds not
                // delivered, so it must not stay registered for them (its owner's next pause
                // would wait for it).
                unregister(&from, &replies[i..]);
                return Err(e);
            }
        }
        next += replies.len();
        if next < items.len() {
            if Instant::now() >= deadline {
                for r in &items[next..] {
                    conn.send(&Reply::NotReady { id: r.id }, None, write_by)?;
                }
                return Ok(());
            }
            std::thread::sleep(Duration::from_micros(500));
        }
    }
    Ok(())
}

/// Forgets `pid` as an importer of the buffers of `replies` that carried an fd.
fn unregister(from: &Identity, replies: &[(Reply, Option<OwnedFd>)]) {
    let mut reg = registry::lock();
    for (reply, _) in replies {
        if let Reply::Export { id, generation } = reply
            && let Some(p) = reg.physicals.get_mut(id)
            && p.generation == *generation
        {
            p.importers.remove(from);
        }
    }
}
