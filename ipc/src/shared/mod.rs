//! Memory of one process mapped by others: one model for every way memsaver memory crosses
//! processes. An **owner** exports an allocation; an **importer** opens it by a handle or token
//! the owner gave, and maps it. The owner's pauses and resumes reach every importer: before the
//! owner's memory goes, importers unmap and release it; once it is back (a new generation),
//! they map it again at the same address.
//!
//! The owner's side, from the bottom up (each uses only those before it):
//! * [`handle`]: the 64-byte CUDA IPC handle of memsaver memory (an address, not a proof);
//! * `ledger`: what this process exported and who imports it ([`Delivery`], exports,
//!   importers by identity, what each holds, tombstones), and the collective deliveries' marks
//!   and waits ([`paused`], [`resumed`], [`wait_released`]);
//! * `serve`: the owner's one serve path for opens and closes ([`serve_opens`], [`Backing`],
//!   [`Exports`]; the allocator's allocations are one [`Exports`]);
//! * `couriers`: the threads that bring each importer of a courier export to the owner's state;
//! * `owner`: the allocator's [`memsaver_allocator::Sharing`] ([`Owner`]: its pauses and
//!   resumes wait for the importers), the other holds of this process ([`Aliases`]) and the
//!   figures ([`exports`]).
//!
//! The importer's side: [`imported`], its imports and their states, opens for CUDA IPC and for
//! layers that map the memory themselves ([`Holder`]: NCCL's registration of user buffers), and
//! the pool that carries out owners' releases and rebuilds; [`requests`], every request an
//! importer makes of an owner.
//!
//! This module routes [`Service::Shared`] requests to the side that serves them. Who may talk to
//! whom, and what enforces it, is docs/security.md.

mod couriers;
pub mod handle;
pub mod imported;
mod ledger;
mod owner;
pub mod requests;
mod serve;
#[cfg(test)]
mod tests;

use crate::identity::Identity;
use crate::protocol::{Buffer, Request, Share};
use crate::server::{self, Connection, Handler, Route, Service};
pub use ledger::{
    Delivery, Held, Holders, MAX_COURIERS, MAX_TOMBS, add, forget, paused, resume_failed,
    resume_started, resumed, serve_pause_failed, serve_released, wait_released,
};
pub use owner::{ALIASES, Aliases, ExportStats, Owner, exports};
pub use serve::{Backing, Exports, handle_of, serve_opens};

pub use crate::options::{TIMEOUT_SETTING, timeout};
pub use handle::{HANDLE_BYTES, IpcHandle};
pub use imported::{
    HOLDERS, Holder, ImportStats, Opened, close, close_imports, close_later, fetch, imports, open,
    open_for_holder,
};

/// The routes of [`Service::Shared`]: an owner's opens and closes, an importer's releases and
/// rebuilds.
struct Shared;

#[linkme::distributed_slice(server::ROUTES)]
static ROUTE: Route = Route {
    service: Service::Shared,
    handler: &Shared,
};

impl Handler for Shared {
    fn handle(&self, conn: Connection, request: Request) {
        let Request::Shared {
            from,
            group,
            op,
            buffers,
            ..
        } = request
        else {
            conn.refuse("not a request about shared memory");
            return;
        };
        route(conn, from, group, op, buffers);
    }
}

fn route(conn: Connection, from: Identity, group: i64, op: Share, buffers: Vec<Buffer>) {
    match op {
        Share::Open | Share::Close => serve::serve(&conn, from, op, &buffers),
        // Off the server's workers: a release waits for this process's queued work, a rebuild
        // asks the owner for its memory, and in a job where every process imports from every
        // other, workers waiting on each other would stall them all.
        Share::Release | Share::Rebuild => imported::serve(conn, from, group, op, buffers),
    }
}
