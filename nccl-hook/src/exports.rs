//! The owner's side of NCCL's shared buffers: the handler that `memsaver_ipc`'s server routes
//! peers' imports and releases to ([`Service::Buffers`]). It serves the real fds of this
//! process's exported buffers from the registry, under its lock, and records who imports what.
//!
//! An import names each buffer by its virtual handle and must carry the buffer's key, which
//! only the buffer's token gives (`crate::vmm`'s export wrapper hands out tokens). The opens
//! go through the owner's one serve path (`memsaver_ipc::exported::serve_opens`), as the opens
//! of allocations shared through CUDA IPC handles do.

use std::collections::HashMap;
use std::time::Instant;

use memsaver_allocator::driver::Handle;
use memsaver_ipc::exported::{Answer, Exports, same_key, serve_opens};
use memsaver_ipc::identity::Identity;
use memsaver_ipc::log::note;
use memsaver_ipc::protocol::{Buffer, Reply, Request};
use memsaver_ipc::server::{self, Connection, Handler, Route, Service, WRITE_TIMEOUT};

use crate::{peer, registry};

/// NCCL's exported buffers, served to the peers that import them.
struct Served;

#[linkme::distributed_slice(server::ROUTES)]
static ROUTE: Route = Route {
    service: Service::Buffers,
    handler: &Served,
};

impl Handler for Served {
    fn handle(&self, conn: Connection, request: Request) {
        match request {
            Request::Import { from, buffers, .. } => {
                let exports = Buffers {
                    driver: memsaver_allocator::global_driver(),
                };
                serve_opens(&conn, &from, &buffers, peer::timeout(), &exports);
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

/// Whether `i` names buffer `p`: `p` was exported with a token, whose key `i` carries.
fn names(p: &registry::Physical, i: &Buffer) -> bool {
    p.key.is_some_and(|key| same_key(key, i))
}

/// NCCL's buffers as the owner's one serve path sees them ([`serve_opens`]): each answered
/// with the real fd of its memory once its generation is at least the one asked for (a buffer
/// still being restored is waited for, up to the `nccl` timeout), every item answerable now
/// under one hold of the registry lock, so that a process busy resuming serves a peer's
/// hundreds of buffers in one go.
struct Buffers {
    /// The driver whatever the options say: a peer's import must be served (taken before the
    /// registry lock: this may start the allocator).
    driver: memsaver_allocator::Result<&'static memsaver_allocator::driver::Driver>,
}

impl Exports for Buffers {
    fn known(&self, items: &[Buffer]) -> bool {
        let reg = registry::lock();
        items.iter().fold(true, |ok, i| {
            ok & reg.physicals.get(&i.id).is_some_and(|p| names(p, i))
        })
    }

    fn answer_ready(&self, from: &Identity, items: &[Buffer]) -> Vec<Answer> {
        let mut reg = registry::lock();
        let mut out = Vec::new();
        // The buffers of one run share its memory: exported once, its fd copied for the others.
        let mut exported: HashMap<registry::Real, std::os::fd::OwnedFd> = HashMap::new();
        let staying = reg.runs_that_stay();
        for r in items {
            let Some(p) = reg.physicals.get(&r.id) else {
                // Freed by NCCL while this request waited.
                out.push((Reply::Failed { id: r.id }, None));
                continue;
            };
            // A buffer that stays resident through pauses (host memory, given to a NIC, ...,
            // or in a run with such a buffer, which pauses keep whole) keeps its generation:
            // serve it as it is. Otherwise wait until the owner has re-created the generation
            // asked for.
            let stays = p.pausable().is_err() || p.run.is_some_and(|base| staying.contains(&base));
            if !(stays || p.generation >= r.generation) {
                break; // not restored yet: answers go out in order, wait
            }
            let Some((h, offset, size)) = reg.served_layout(r.id) else {
                break; // not restored yet
            };
            let fd = match exported.get(&h) {
                Some(fd) => fd.try_clone().map_err(|e| e.to_string()),
                None => self
                    .driver
                    .as_ref()
                    .map_err(|e| e.to_string())
                    .and_then(|d| d.export_fd(Handle(h)).map_err(|e| e.to_string()))
                    .and_then(|fd| {
                        let copy = fd.try_clone().map_err(|e| e.to_string());
                        exported.insert(h, fd);
                        copy
                    }),
            };
            let p = reg.physicals.get_mut(&r.id).expect("seen above");
            match fd {
                Ok(fd) => {
                    p.importers.insert(*from);
                    let reply = Reply::Export {
                        id: r.id,
                        generation: p.generation,
                        offset,
                        size,
                    };
                    out.push((reply, Some(fd)));
                }
                Err(e) => {
                    note(format!(
                        "cannot export an NCCL buffer to process {}: {e}",
                        from.pid
                    ));
                    out.push((Reply::Failed { id: r.id }, None));
                }
            }
        }
        out
    }

    fn undelivered(&self, from: &Identity, _items: &[Buffer], answers: &[Answer]) {
        let mut reg = registry::lock();
        for (reply, _) in answers {
            if let Reply::Export { id, generation, .. } = reply
                && let Some(p) = reg.physicals.get_mut(id)
                && p.generation == *generation
            {
                p.importers.remove(from);
            }
        }
    }
}
