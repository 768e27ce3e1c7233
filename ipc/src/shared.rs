//! Memory of one process mapped by others: one model for every way memsaver memory crosses
//! processes. An **owner** exports an allocation; an **importer** opens it by a handle or token
//! the owner gave, and maps it. The owner's pauses and resumes reach every importer: before the
//! owner's memory goes, importers unmap and release it; once it is back (a new generation),
//! they map it again at the same address.
//!
//! * [`crate::handle`]: the 64-byte CUDA IPC handle of memsaver memory (an address, not a proof);
//! * [`crate::exported`]: the owner's ledger (exports, importers by identity, what each holds),
//!   its answers to opens and closes, and the couriers that bring importers to the owner's state;
//! * [`crate::imported`]: the importer's imports and their states, opens for CUDA IPC and for
//!   layers that map the memory themselves ([`Holder`]: NCCL's registration of user buffers), and
//!   the pool that carries out owners' releases and rebuilds.
//!
//! This module routes [`Service::Shared`] requests to the side that serves them. Who may talk to
//! whom, and what enforces it, is docs/security.md.

use crate::identity::Identity;
use crate::protocol::{Buffer, Request, Share};
use crate::server::{self, Connection, Handler, Route, Service};

pub use crate::exported::{
    ALIASES, Aliases, ExportStats, Owner, TIMEOUT_SETTING, exports, handle_of, timeout,
};
pub use crate::handle::{HANDLE_BYTES, IpcHandle};
pub use crate::imported::{
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
        Share::Open | Share::Close => crate::exported::serve(&conn, from, op, &buffers),
        // Off the server's workers: a release waits for this process's queued work, a rebuild
        // asks the owner for its memory, and in a job where every process imports from every
        // other, workers waiting on each other would stall them all.
        Share::Release | Share::Rebuild => crate::imported::serve(conn, from, group, op, buffers),
    }
}
