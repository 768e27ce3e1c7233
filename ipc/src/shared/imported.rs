//! The importer's side of memory shared with other processes: CUDA IPC opens of memsaver
//! memory ([`open`], [`close`]), opens for a layer that maps the memory itself ([`Holder`],
//! [`open_for_holder`]), and the answers to owners' releases and rebuilds ([`serve`]).
//!
//! Each open import is in one state, changed only by the transitions below (under [`IMPORTS`]):
//!
//! ```text
//!   open ──► Mapped(g) ──release(r), r >= g──► Released(g) ──rebuild(n), n > g──► Mapped(n)
//!              │   ▲                                 │
//!              │   └──rebuild(n), n > g: remapped────┘ (a Mapped(g) that missed the release)
//!              └──────────── last close (either state) ──► Closed (forgotten)
//! ```
//!
//! A release older than the generation mapped, or a rebuild of a generation already mapped, is
//! stale (an owner's courier that retried, a request that waited while this process was
//! stopped) and changes nothing. The pointer handed out never changes. A release or rebuild
//! waits for this process's queued work (a release) or asks the owner for its memory (a
//! rebuild), so they run on a small pool of threads of their own ([`POOL_THREADS`]; at most
//! [`POOL_QUEUED`] wait, more are refused as busy and the owner's courier asks again).

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::LazyLock;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::time::Instant;

use memsaver_allocator::Allocator;
use memsaver_allocator::driver::Handle;
use parking_lot::Mutex;

use super::handle::{HANDLE_BYTES, IpcHandle};
use super::requests;
use crate::client;
use crate::error::{Error, Result};
use crate::group;
use crate::identity::{self, Identity};
use crate::log::note;
use crate::options::timeout;
use crate::protocol::{Buffer, Reply, Request, Share};
use crate::server::{self, BUSY, Connection, WRITE_TIMEOUT};
use crate::token::{Names, Token};

/// Where an open import stands (see the module documentation).
enum State {
    /// Generation `generation` of the owner's memory, imported as `handle` and mapped at
    /// `[at, at + len)` inside the reserved range.
    Mapped {
        generation: u64,
        handle: Handle,
        at: u64,
        len: usize,
    },
    /// The mapping of `generation` was released; the range stays reserved.
    Released { generation: u64 },
}

/// One open handle in this process.
struct Import {
    owner: Identity,
    group: i64,
    id: u64,
    key: u64,
    /// The allocation's size, as its owner said (not as the handle said).
    size: u64,
    /// The pointer handed out (never changes).
    ptr: u64,
    /// The address range reserved for it (the physical allocation it lay in when first opened).
    reserved: (u64, usize),
    /// The device it is mapped for (the caller's current device at open).
    device: i32,
    state: State,
    /// Opens not closed yet.
    opens: u32,
}

impl Import {
    fn generation(&self) -> u64 {
        match self.state {
            State::Mapped { generation, .. } | State::Released { generation } => generation,
        }
    }

    fn buffer(&self) -> Buffer {
        Buffer {
            id: self.id,
            key: self.key,
            generation: self.generation(),
        }
    }

    /// `Mapped(g)` -> `Released(g)` for a release of generation `r >= g`; anything else is
    /// stale or done already.
    fn release(&mut self, a: &Allocator, r: u64) {
        let State::Mapped {
            generation,
            handle,
            at,
            len,
        } = self.state
        else {
            return;
        };
        if r < generation {
            return; // older than what this process maps
        }
        let d = a.driver();
        let ctx = a.device(self.device).map(|dev| dev.ctx);
        let work = || {
            // No queued kernel of this process may still use the memory.
            d.synchronize()?;
            // SAFETY: mapped by this module, and the device is synchronised; touching it
            // later is the caller's mistake, as touching a paused tensor.
            unsafe { d.unmap(at, len) }
        };
        let r = match ctx {
            Ok(ctx) => d.with_context(ctx, work),
            Err(_) => work(),
        };
        if let Err(e) = r {
            note(format!(
                "cannot unmap memory opened from process {}: {e}",
                self.owner.pid
            ));
        }
        let _ = d.release(handle);
        self.state = State::Released { generation };
    }

    /// To `Mapped(n)` with the owner's memory of generation `n >= want`, unless a generation at
    /// least `want` is mapped already.
    fn rebuild(&mut self, a: &Allocator, want: u64) -> Result<()> {
        if matches!(self.state, State::Mapped { generation, .. } if generation >= want) {
            return Ok(());
        }
        // A Mapped(g < want) that missed the release lets go of the old memory first.
        self.release(a, want);
        let b = Buffer {
            generation: want,
            ..self.buffer()
        };
        let o = fetch(self.group, &self.owner, b)?;
        // The allocation stays where it was: its new memory starts `offset` before.
        let (base, reserved) = self.reserved;
        let at = self
            .ptr
            .checked_sub(o.offset)
            .filter(|at| *at >= base && at + o.handle_size as u64 <= base + reserved as u64);
        let Some(at) = at else {
            return Err(Error::Layout {
                pid: self.owner.pid,
            });
        };
        let handle =
            map_fd(a, &o.fd, at, o.handle_size, self.device).map_err(|source| Error::Map {
                pid: self.owner.pid,
                source,
            })?;
        self.state = State::Mapped {
            generation: o.generation,
            handle,
            at,
            len: o.handle_size,
        };
        Ok(())
    }
}

/// This process's imports, by the pointer handed out. Held across an import's exchange with
/// its owner (an open, a rebuild), never while this process waits for its own importers.
static IMPORTS: LazyLock<Mutex<BTreeMap<u64, Import>>> = LazyLock::new(Default::default);

/// Imports of memsaver memory that a layer above maps itself (nccl-hook: a peer's buffer NCCL
/// registered): the owner's release and rebuild of each allocation reach them here. Each
/// returns whether it holds the buffer at all, and, as [`State`]'s transitions, ignores a
/// release older than the generation it maps.
pub trait Holder: Sync {
    /// Unmaps and releases what this process maps of generation `b.generation` or older of
    /// allocation `b` of `owner` (its addresses stay reserved), once no queued work of this
    /// process uses it.
    fn release(&self, owner: &Identity, b: &Buffer) -> Result<bool>;
    /// Maps generation `b.generation` of it again where it was, asking the owner for the new
    /// memory with [`fetch`].
    fn rebuild(&self, owner: &Identity, group: i64, b: &Buffer) -> Result<bool>;
    /// What it holds, for [`imports`].
    fn imports(&self) -> Vec<ImportStats>;
}

/// The registered [`Holder`]s (linked in by the layers above).
#[linkme::distributed_slice]
pub static HOLDERS: [&'static dyn Holder];

/// What an owner gave for an allocation: the fd of its memory, its generation, the
/// allocation's size and its offset in the physical allocation of `handle_size` bytes.
pub struct Opened {
    pub fd: OwnedFd,
    pub generation: u64,
    pub size: u64,
    pub offset: u64,
    pub handle_size: usize,
}

/// The checks of every open: not this very process's memory, and the same group (which this
/// fixes for the process), with this process's server running to answer the owner's release
/// and rebuild.
fn check_owner(owner: &Identity, group: i64, how: &'static str) -> Result<()> {
    let pid = owner.pid;
    // The options this process uses to import, checked now (an importer may never have
    // allocated through memsaver, which checks them all).
    crate::options::ipc_timeout()?;
    let mine = group::try_fix()?;
    if *owner == identity::me() {
        return Err(Error::OwnMemory { how });
    }
    if group != mine {
        return Err(Error::OtherGroup {
            pid,
            theirs: group,
            mine,
        });
    }
    server::ensure_server().map_err(|source| Error::CannotServe {
        doing: "cannot import memsaver memory of another process",
        source,
    })
}

/// Opens the allocation a token names for a [`Holder`] that maps it itself: the same checks
/// as [`open`], then [`fetch`].
pub fn open_for_holder(t: &Token) -> Result<Opened> {
    if t.names != Names::Allocation {
        return Err(Error::NotAnAllocation);
    }
    let owner = t.owner();
    check_owner(&owner, t.group, "an import of a token")?;
    let want = Buffer {
        id: t.buffer,
        key: t.key,
        generation: t.generation,
    };
    fetch(t.group, &owner, want)
}

/// Asks `owner` for the fd of allocation `b` (at least generation `b.generation`; 0 for a new
/// import, which the owner counts).
pub fn fetch(group: i64, owner: &Identity, b: Buffer) -> Result<Opened> {
    let request = Request::Shared {
        from: identity::me(),
        to: *owner,
        group,
        op: Share::Open,
        buffers: vec![b],
    };
    let pid = owner.pid;
    let replies = client::exchange(group, owner, request, 1, timeout()).map_err(|e| match e {
        // Alive elsewhere (another pid namespace, user, or a later process with the pid), or
        // it answered: not an exit, whatever this namespace's /proc says.
        Error::NotThatProcess(_) | Error::Refused { .. } | Error::Busy { .. } => e,
        e if e.gone() || !identity::is_running(owner) => Error::OwnerExited {
            pid,
            cause: Box::new(e),
        },
        e => e,
    })?;
    match replies.into_iter().next() {
        Some((
            Reply::Shared {
                id,
                generation,
                size,
                offset,
                handle_size,
            },
            Some(fd),
        )) if id == b.id
            && offset
                .checked_add(size)
                .is_some_and(|end| end <= handle_size) =>
        {
            Ok(Opened {
                fd,
                generation,
                size,
                offset,
                handle_size: handle_size as usize,
            })
        }
        Some((Reply::NotReady { .. }, _)) => Err(Error::Paused { pid }),
        Some((Reply::Failed { .. }, _)) => Err(Error::ExportFailed {
            pid,
            what: "this memory".into(),
        }),
        other => Err(Error::Wire {
            pid,
            what: format!("answered {other:?}"),
        }),
    }
}

/// Imports `fd` and maps it at `at` for `device`; the handle on success.
fn map_fd(
    a: &Allocator,
    fd: &OwnedFd,
    at: u64,
    len: usize,
    device: i32,
) -> memsaver_allocator::Result<Handle> {
    let d = a.driver();
    let dev = a.device(device)?;
    let h = d.import_fd(fd.as_raw_fd())?;
    // SAFETY: `[at, at+len)` lies in a range this module reserved, with nothing mapped in it.
    let mapped = d.with_context(dev.ctx, || unsafe { d.map(at, len, h, device) });
    if let Err(e) = mapped {
        let _ = d.release(h);
        return Err(e.into());
    }
    Ok(h)
}

/// `cudaIpcOpenMemHandle` of memsaver's handle `bytes`: `Ok(None)` when `bytes` is not one
/// (the caller forwards to the real runtime), else the pointer or why not.
pub fn open(bytes: &[u8; HANDLE_BYTES]) -> Result<Option<u64>> {
    let Some(h) = IpcHandle::decode(bytes) else {
        return Ok(None);
    };
    let pid = h.owner.pid;
    check_owner(&h.owner, h.group, "cudaIpcOpenMemHandle")?;
    let a = memsaver_allocator::start_global()?;
    // Held across the exchange: the owner's release of this import waits until it is recorded.
    let mut imports = IMPORTS.lock();
    // Opened already with this very handle: the same pointer, unless the owner paused it (a
    // fresh open is refused then too). Another key is not this import's handle: the owner
    // judges it below.
    if let Some((&ptr, i)) = imports
        .iter_mut()
        .find(|(_, i)| i.owner == h.owner && i.id == h.id && i.key == h.key)
    {
        if matches!(i.state, State::Released { .. }) {
            return Err(Error::Paused { pid });
        }
        i.opens += 1;
        return Ok(Some(ptr));
    }
    let want = Buffer {
        id: h.id,
        key: h.key,
        generation: 0,
    };
    let started = Instant::now();
    let o = fetch(h.group, &h.owner, want)?;
    let fetched = started.elapsed();
    let mapped = (|| -> memsaver_allocator::Result<_> {
        let device = a.driver().current_device().unwrap_or(0);
        let gran = a.granularity(device)?;
        let ctx = a.device(device)?.ctx;
        let base = a
            .driver()
            .with_context(ctx, || a.driver().reserve(o.handle_size, gran, 0))?;
        match map_fd(a, &o.fd, base, o.handle_size, device) {
            Ok(handle) => Ok((device, base, handle)),
            Err(e) => {
                // SAFETY: reserved above, nothing mapped.
                let _ = unsafe { a.driver().address_free(base, o.handle_size) };
                Err(e)
            }
        }
    })();
    let (device, base, handle) = match mapped {
        Ok(m) => m,
        Err(e) => {
            drop(imports);
            let _ = close_imports(h.group, &h.owner, &[want]);
            return Err(Error::Map { pid, source: e });
        }
    };
    tracing::debug!(
        owner = pid,
        bytes = o.handle_size,
        fetch_us = fetched.as_micros() as u64,
        map_us = (started.elapsed() - fetched).as_micros() as u64,
        "opened memsaver memory of another process"
    );
    let ptr = base + o.offset;
    imports.insert(
        ptr,
        Import {
            owner: h.owner,
            group: h.group,
            id: h.id,
            key: h.key,
            size: o.size,
            ptr,
            reserved: (base, o.handle_size),
            device,
            state: State::Mapped {
                generation: o.generation,
                handle,
                at: base,
                len: o.handle_size,
            },
            opens: 1,
        },
    );
    Ok(Some(ptr))
}

/// Tells `owner` that this process holds one import fewer of each of `buffers` (a close, or a
/// [`Holder`]'s import went): once none is left, the owner's next pause does not wait for this
/// process. An owner that exited needs no notice.
pub fn close_imports(group: i64, owner: &Identity, buffers: &[Buffer]) -> Result<()> {
    for chunk in buffers.chunks(crate::protocol::MAX_BUFFERS) {
        let request = Request::Shared {
            from: identity::me(),
            to: *owner,
            group,
            op: Share::Close,
            buffers: chunk.to_vec(),
        };
        match client::exchange(group, owner, request, 1, timeout()) {
            Ok(_) => {}
            Err(e) if e.gone() || !identity::is_running(owner) => return Ok(()),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

type Closing = (i64, Identity, Buffer);

/// The queue of [`close_later`], served by one thread.
static CLOSER: Mutex<Option<std::sync::mpsc::Sender<Closing>>> = Mutex::new(None);

/// [`close_imports`] from a thread of its own, for a caller that must not wait (NCCL's
/// deregistration): the closes queued meanwhile go together, one request per owner, so that
/// destroying a communicator with hundreds of registrations does not flood the owners.
pub fn close_later(group: i64, owner: Identity, b: Buffer) {
    let mut tx = CLOSER.lock();
    if tx.is_none() {
        let (send, receive) = std::sync::mpsc::channel::<Closing>();
        let spawned = std::thread::Builder::new()
            .name("memsaver-close".into())
            .spawn(move || {
                while let Ok(first) = receive.recv() {
                    let mut per: BTreeMap<(i64, Identity), Vec<Buffer>> = BTreeMap::new();
                    for (group, owner, b) in std::iter::once(first).chain(receive.try_iter()) {
                        per.entry((group, owner)).or_default().push(b);
                    }
                    for ((group, owner), buffers) in per {
                        // Not told, the owner asks this process to release what it no longer
                        // holds at its next pause, which is answered at once.
                        if let Err(e) = close_imports(group, &owner, &buffers) {
                            tracing::debug!(
                                "process {} was not told of {} closed import(s): {e}",
                                owner.pid,
                                buffers.len()
                            );
                        }
                    }
                }
            });
        match spawned {
            Ok(_) => *tx = Some(send),
            Err(e) => note(format!("cannot start the thread that closes imports: {e}")),
        }
    }
    if let Some(tx) = tx.as_ref() {
        let _ = tx.send((group, owner, b));
    }
}

/// [`close_later`] for an import of the buffer `b` of the process with pid `owner`, known from
/// one of its tokens (a layer that maps imports itself names owners by pid): nothing when no
/// token of that pid was seen.
pub fn close_later_of(group: i64, owner: u32, b: Buffer) {
    match requests::owner_identity(owner) {
        Ok(who) => close_later(group, who, b),
        Err(e) => tracing::debug!("an import of process {owner} went untold: {e}"),
    }
}

/// `cudaIpcCloseMemHandle(ptr)`: `None` when `ptr` is not an import of memsaver memory.
pub fn close(ptr: u64) -> Option<Result<()>> {
    let mut imports = IMPORTS.lock();
    let i = imports.get_mut(&ptr)?;
    i.opens -= 1;
    if i.opens > 0 {
        return Some(Ok(()));
    }
    let mut i = imports.remove(&ptr).expect("found above");
    drop(imports);
    let a = match memsaver_allocator::start_global() {
        Ok(a) => a,
        Err(e) => return Some(Err(e.into())),
    };
    i.release(a, u64::MAX);
    // SAFETY: reserved by `open`, nothing mapped in it any more.
    let _ = unsafe { a.driver().address_free(i.reserved.0, i.reserved.1) };
    // The memory is released here either way.
    Some(
        close_imports(i.group, &i.owner, &[i.buffer()]).map_err(|e| Error::NotTold {
            pid: i.owner.pid,
            cause: Box::new(e),
        }),
    )
}

// ---------------------------------------------------------------------------------------------
// Owners' releases and rebuilds.

/// Threads that carry out owners' releases and rebuilds.
pub const POOL_THREADS: usize = 4;
/// Releases and rebuilds waiting for a thread; more are refused as busy.
pub const POOL_QUEUED: usize = 64;

type Job = (Connection, Identity, i64, Share, Vec<Buffer>);

/// The pool's queue (started with the first request).
static POOL: LazyLock<Option<SyncSender<Job>>> = LazyLock::new(|| {
    let (tx, rx) = std::sync::mpsc::sync_channel::<Job>(POOL_QUEUED);
    let rx = std::sync::Arc::new(Mutex::new(rx));
    let mut started = 0;
    for _ in 0..POOL_THREADS {
        let rx: std::sync::Arc<Mutex<Receiver<Job>>> = rx.clone();
        let spawned = std::thread::Builder::new()
            .name("memsaver-import".into())
            .spawn(move || {
                loop {
                    let job = rx.lock().recv();
                    let Ok((conn, from, group, op, buffers)) = job else {
                        return;
                    };
                    answer(&conn, from, group, op, &buffers);
                }
            });
        match spawned {
            Ok(_) => started += 1,
            Err(e) => note(format!("cannot start a thread to answer owners: {e}")),
        }
    }
    (started > 0).then_some(tx)
});

/// Queues an owner's release or rebuild for the pool, or refuses it as busy.
pub(crate) fn serve(conn: Connection, from: Identity, group: i64, op: Share, buffers: Vec<Buffer>) {
    let Some(tx) = POOL.as_ref() else {
        conn.refuse("this process cannot start threads to answer owners");
        return;
    };
    if let Err(TrySendError::Full(job) | TrySendError::Disconnected(job)) =
        tx.try_send((conn, from, group, op, buffers))
    {
        job.0.refuse(BUSY);
    }
}

/// Carries out an owner's release or rebuild of `buffers` (each import's transition, then the
/// holders') and answers `Done`, or the first error.
fn answer(conn: &Connection, from: Identity, group: i64, op: Share, buffers: &[Buffer]) {
    let write_by = Instant::now() + WRITE_TIMEOUT;
    let a = match memsaver_allocator::start_global() {
        Ok(a) => a,
        Err(e) => {
            let reply = Reply::Error {
                status: 0,
                message: e.to_string(),
            };
            let _ = conn.send(&reply, None, write_by);
            return;
        }
    };
    let mut failed = Vec::new();
    {
        let mut imports = IMPORTS.lock();
        for b in buffers {
            let found = imports
                .values_mut()
                .find(|i| i.owner == from && i.id == b.id && i.key == b.key);
            // Not found: closed meanwhile, or only a holder's.
            let Some(i) = found else { continue };
            match op {
                Share::Release => i.release(a, b.generation),
                _ => {
                    if let Err(e) = i.rebuild(a, b.generation) {
                        failed.push(e);
                    }
                }
            }
        }
    }
    // A process may also map the same memory through a holder (NCCL registered it).
    for b in buffers {
        for h in HOLDERS {
            let r = match op {
                Share::Release => h.release(&from, b),
                _ => h.rebuild(&from, group, b),
            };
            if let Err(e) = r {
                failed.push(e);
            }
        }
    }
    let reply = match failed.into_iter().next() {
        None => Reply::Done,
        Some(e) => Reply::Error {
            status: 0,
            message: e.to_string(),
        },
    };
    let _ = conn.send(&reply, None, write_by);
}

/// What [`imports`] reports of one import.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ImportStats {
    pub owner_pid: u32,
    pub bytes: u64,
    pub paused: bool,
    /// Opens not closed yet (CUDA IPC), or mappings (NCCL).
    pub opens: u32,
    /// Who opened it: `"cuda_ipc"` (a `cudaIpcOpenMemHandle`) or `"nccl"` (NCCL's registration
    /// of a peer's buffer).
    pub via: &'static str,
}

/// This process's open imports of other processes' memsaver memory.
pub fn imports() -> Vec<ImportStats> {
    let mut out: Vec<ImportStats> = IMPORTS
        .lock()
        .values()
        .map(|i| ImportStats {
            owner_pid: i.owner.pid,
            bytes: i.size,
            paused: matches!(i.state, State::Released { .. }),
            opens: i.opens,
            via: "cuda_ipc",
        })
        .collect();
    for h in HOLDERS {
        out.extend(h.imports());
    }
    out
}
