//! The owner's side of NCCL's shared buffers: the handler that `memsaver_ipc`'s server routes
//! peers' imports and release notices to ([`Service::Buffers`]), and the memory behind them.
//!
//! Who imports what, each buffer's key and generation, and whether it is paused are the
//! owner's ledger's (`memsaver_ipc::exported`, [`Delivery::Collective`], each buffer by its
//! virtual handle): the opens go through the ledger's one serve path
//! ([`memsaver_ipc::shared::serve_opens`]), as the opens of allocations shared through CUDA
//! IPC handles do, and the notices are recorded there. This module only says what the ledger
//! cannot know: the fd of a buffer's memory now (its own handle's, or its run's, with where
//! the buffer lies in it), read from the registry under its lock, and which buffers stay
//! resident through pauses.

use std::collections::{HashMap, HashSet};
use std::os::fd::OwnedFd;

use memsaver_allocator::ExportedMemory;
use memsaver_allocator::driver::{Driver, Handle};
use memsaver_ipc::Error as IpcError;
use memsaver_ipc::protocol::Request;
use memsaver_ipc::server::{self, Connection, Handler, Route, Service};
use memsaver_ipc::shared::{self, Backing, Delivery, Exports};

use crate::registry;
use crate::tag::peer;

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
                shared::serve_opens(&conn, &from, &buffers, peer::timeout(), &exports);
            }
            Request::Released { from, buffers, .. } => {
                shared::serve_released(&conn, &from, &buffers);
            }
            Request::PauseFailed { from, message, .. } => {
                shared::serve_pause_failed(&conn, &from, message);
            }
            Request::Control { .. } | Request::Shared { .. } => {
                conn.refuse("not a request for buffers")
            }
        }
    }
}

/// NCCL's buffers as the ledger's serve path sees them: a buffer still being restored is
/// waited for (up to the `nccl` timeout), every item answerable now under one hold of the
/// registry lock, so that a process busy resuming serves a peer's hundreds of buffers in one go.
struct Buffers {
    /// The driver whatever the options say: a peer's import must be served (taken before the
    /// registry lock: this may start the allocator).
    driver: memsaver_allocator::Result<&'static Driver>,
}

impl Exports for Buffers {
    fn delivery(&self) -> Delivery {
        Delivery::Collective
    }

    fn backing(&self) -> Box<dyn Backing + '_> {
        let reg = registry::lock();
        let staying = reg.runs_that_stay();
        Box::new(Held {
            reg,
            staying,
            in_runs: None,
            exported: HashMap::new(),
            driver: &self.driver,
        })
    }
}

/// The registry, held for one batch of answers.
struct Held<'a> {
    reg: parking_lot::MappedMutexGuard<'static, registry::Registry>,
    /// The runs that pauses keep whole ([`registry::Registry::runs_that_stay`]).
    staying: HashSet<u64>,
    /// Where the buffers of runs lie in them, read at the first one served: a peer asks for
    /// hundreds of buffers of one run at once.
    in_runs: Option<registry::RunPlaces>,
    /// The buffers of one run share its memory: exported once per batch, its fd copied for the
    /// others.
    exported: HashMap<registry::Real, OwnedFd>,
    driver: &'a memsaver_allocator::Result<&'static Driver>,
}

impl Backing for Held<'_> {
    fn export(
        &mut self,
        vh: u64,
        _kept: &mut Option<ExportedMemory>,
    ) -> memsaver_ipc::Result<Option<ExportedMemory>> {
        if self.reg.retired.contains_key(&vh) {
            // Its export stays only for the owner's pause to wait for its importers.
            return Err(IpcError::CannotExport {
                why: "NCCL freed this buffer",
            });
        }
        let reg = &self.reg;
        let in_runs = self.in_runs.get_or_insert_with(|| reg.run_places());
        let Some((h, offset, size)) = reg.served_layout(vh, in_runs) else {
            return Ok(None); // released, or not restored yet
        };
        let copy = |fd: &OwnedFd| {
            fd.try_clone().map_err(|source| IpcError::Io {
                what: "cannot copy an exported fd".into(),
                source,
            })
        };
        let fd = match self.exported.get(&h) {
            Some(fd) => copy(fd)?,
            None => {
                let d = self
                    .driver
                    .as_ref()
                    .map_err(|e| IpcError::Allocator(e.clone()))?;
                let fd = d
                    .export_fd(Handle(h))
                    .map_err(|e| IpcError::Allocator(e.into()))?;
                let copy = copy(&fd)?;
                self.exported.insert(h, fd);
                copy
            }
        };
        Ok(Some(ExportedMemory {
            fd,
            offset,
            handle_size: size as usize,
        }))
    }

    /// A buffer that stays resident through pauses (host memory, given to a NIC, ..., or in a
    /// run with such a buffer, which pauses keep whole) keeps its generation. So does a buffer
    /// NCCL freed inside a run ([`registry::Retired`]): no generation of it will come, and an
    /// open of it is answered at once (its export fails) instead of at the timeout.
    fn stays(&self, vh: u64) -> bool {
        self.reg.retired.contains_key(&vh)
            || self.reg.physicals.get(&vh).is_some_and(|p| {
                p.pausable().is_err() || p.run.is_some_and(|base| self.staying.contains(&base))
            })
    }
}
