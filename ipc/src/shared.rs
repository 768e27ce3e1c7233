//! Memory memsaver allocated, opened by other processes through CUDA IPC handles
//! (`cudaIpcGetMemHandle` / `cudaIpcOpenMemHandle` / `cudaIpcCloseMemHandle`, which
//! libmemsaver.so interposes): an import of it follows its owner's tag.
//!
//! **The handle** ([`IpcHandle`], the 64 bytes of a `cudaIpcMemHandle_t`): magic `MSIP`,
//! version, the owner's identity (pid, start time, nonce) and group, the allocation's id there,
//! its **key** (64 random bits the owner drew when it first gave a handle of the allocation;
//! only the handle carries it) and its size. An owner refuses a request that names an
//! allocation it does not have with that key, whatever else it says: a forged handle, or one
//! of an allocation since freed, opens nothing.
//!
//! **Owner** ([`handle_of`], [`Owner`]): giving a handle marks the allocation shared in the
//! core (`Allocator::share`: a resume gives it a physical allocation of its own), starts this
//! process's server and records the export. An importer's [`Share::Open`] is answered with a
//! new fd of the physical memory ([`Reply::Shared`]) and the importer is recorded;
//! [`Share::Close`] forgets it. The core calls [`Owner`] (the allocator's
//! [`memsaver_allocator::Sharing`], registered by the start hook here) around each transition:
//! before a pause releases shared allocations, every importer is asked to unmap and release
//! its imports ([`Share::Release`]), all at once and waited for under one deadline
//! (`MEMSAVER_IPC_TIMEOUT_MS`, [`crate::deadline::PerPeer`]); an importer that exited counts as
//! released and is forgotten; one that does not answer in time is reported. After a resume
//! restored them, every importer is told to map the new generation ([`Share::Rebuild`]).
//!
//! **Importer** ([`open`], [`close`]): an open asks the owner for the fd, imports it, reserves
//! address space for the whole physical allocation, maps it and grants the calling thread's
//! device access; the pointer handed out never changes. Opening a handle again gives the same
//! pointer (counted; the last close releases it). On [`Share::Release`] the import is unmapped
//! and its handle released (the address stays reserved; [`imports`] shows it paused); on
//! [`Share::Rebuild`] the importer asks the owner for the new fd and maps it at the same place.
//!
//! **Imports another layer maps** ([`Holder`], [`HOLDERS`]): NCCL registers user buffers by
//! retaining the handle of the memory, exporting it and having each peer import and map it
//! itself. nccl-hook hands NCCL a token naming the allocation ([`crate::token::Names::Allocation`]),
//! the peer's nccl-hook trades it for the fd here ([`open_for_holder`]: an import the owner
//! tracks like an open handle), and registers a [`Holder`] that the owner's release and
//! rebuild reach for the imports it maps.
//!
//! Lock order: the core's `transition`, then [`EXPORTS`], then the core's `table`; [`IMPORTS`]
//! is held across an importer's exchange with an owner (an open, a rebuild) and never while
//! this process waits for its own importers. No lock here is held while waiting for a peer that
//! might wait for it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::{Arc, LazyLock};
use std::time::Instant;

use memsaver_allocator::driver::Handle;
use memsaver_allocator::{Allocator, Error, ExportedMemory, StartHook};
use parking_lot::Mutex;

use crate::client;
use crate::deadline::{Outcome, PerPeer};
use crate::group;
use crate::identity::{self, Identity};
use crate::log::note;
use crate::protocol::{Buffer, Reply, Request, Share};
use crate::server::{self, Connection, Handler, NO_BUFFER, Route, Service, WRITE_TIMEOUT};
use crate::token::{Names, Token};

/// Bytes of a `cudaIpcMemHandle_t`.
pub const HANDLE_BYTES: usize = 64;
const MAGIC: [u8; 4] = *b"MSIP";
const VERSION: u16 = 1;

/// The option that sets [`timeout`], named in progress lines.
pub const TIMEOUT_SETTING: &str = "MEMSAVER_IPC_TIMEOUT_MS";

/// How long an owner waits for its importers, and an importer for an owner.
pub fn timeout() -> std::time::Duration {
    crate::options::get().ipc_timeout
}

/// A CUDA IPC handle of memory memsaver owns (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcHandle {
    pub owner: Identity,
    pub group: i64,
    pub id: u64,
    pub key: u64,
    pub size: u64,
}

impl IpcHandle {
    pub fn encode(&self) -> [u8; HANDLE_BYTES] {
        let mut b = [0u8; HANDLE_BYTES];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[8..12].copy_from_slice(&self.owner.pid.to_le_bytes());
        b[12..20].copy_from_slice(&self.owner.start.to_le_bytes());
        b[20..28].copy_from_slice(&self.owner.nonce.to_le_bytes());
        b[28..36].copy_from_slice(&self.group.to_le_bytes());
        b[36..44].copy_from_slice(&self.id.to_le_bytes());
        b[44..52].copy_from_slice(&self.key.to_le_bytes());
        b[52..60].copy_from_slice(&self.size.to_le_bytes());
        b
    }

    /// The handle `b` spells, or `None` when it is not one of memsaver's (a handle of the real
    /// CUDA runtime, or one with a version or reserved bytes this build does not know).
    pub fn decode(b: &[u8; HANDLE_BYTES]) -> Option<Self> {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if b[0..4] != MAGIC
            || u16::from_le_bytes([b[4], b[5]]) != VERSION
            || b[6..8] != [0, 0]
            || b[60..64] != [0; 4]
        {
            return None;
        }
        Some(Self {
            owner: Identity {
                pid: u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
                start: u64_at(12),
                nonce: u64_at(20),
            },
            group: u64_at(28) as i64,
            id: u64_at(36),
            key: u64_at(44),
            size: u64_at(52),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// The owner's side.

/// One allocation this process gave a handle of.
struct Export {
    key: u64,
    tag: String,
    size: u64,
    /// Times the owner re-created its memory (each resume after a pause).
    generation: u64,
    /// Between a pause's release and the resume's rebuild: opens are answered `NotReady`.
    paused: bool,
    /// The processes that import it, by pid, and how many imports each holds (a process may
    /// open a handle and have NCCL register the buffer, or register it on several
    /// communicators): each new import ([`Buffer::generation`] 0 in its `Open`) counts one,
    /// each `Close` one less; a rebuild's `Open` counts none.
    importers: BTreeMap<u32, (Identity, u32)>,
    /// The current generation's memory, exported once ([`cached_export`]): the driver takes
    /// about 1.5 ms to export a 1 GiB handle the first time and tens of microseconds after, so
    /// the fd is made when the handle is given and copies of it are handed out (for at most
    /// [`MAX_KEPT_FDS`] exports at a time). An exported fd keeps the memory alive: it is dropped
    /// before a pause releases the memory and when the allocation is freed.
    fd: Option<ExportedMemory>,
}

/// At most this many exported fds are kept ([`Export::fd`]), so that a process sharing many
/// allocations stays far from its open-file limit (1024 by default); the others are exported
/// at each open, as they were before being kept.
const MAX_KEPT_FDS: usize = 256;

/// Exported fds kept now (changed under [`EXPORTS`]).
static KEPT_FDS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Drops the exported fd `e` keeps, if any.
fn drop_kept_fd(e: &mut Export) {
    if e.fd.take().is_some() {
        KEPT_FDS.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A copy of export `id`'s fd, exporting it first if it is not kept (`Ok(None)` while the
/// allocation is not resident). Called under [`EXPORTS`].
fn cached_export(a: &Allocator, id: u64, e: &mut Export) -> Result<Option<ExportedMemory>, String> {
    if e.fd.is_none() {
        let Some(m) = a.export_shared(id).map_err(|e| e.to_string())? else {
            return Ok(None);
        };
        if KEPT_FDS.load(std::sync::atomic::Ordering::Relaxed) >= MAX_KEPT_FDS {
            return Ok(Some(m));
        }
        KEPT_FDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        e.fd = Some(m);
    }
    let Some(m) = &e.fd else { return Ok(None) };
    let fd =
        m.fd.try_clone()
            .map_err(|err| format!("cannot copy an exported fd: {err}"))?;
    Ok(Some(ExportedMemory {
        fd,
        offset: m.offset,
        handle_size: m.handle_size,
    }))
}

/// This process's exports, by allocation id.
static EXPORTS: LazyLock<Mutex<HashMap<u64, Export>>> = LazyLock::new(Default::default);

/// The handle of the memsaver allocation holding `ptr`, or `Ok(None)` when memsaver did not
/// allocate it (the caller forwards to the real runtime).
pub fn handle_of(ptr: u64) -> Result<Option<IpcHandle>, String> {
    let Some(a) = memsaver_allocator::global_if_started() else {
        return Ok(None);
    };
    let shared = match a.share(ptr) {
        Ok(s) => s,
        Err(Error::UnknownPointer { .. }) => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    // Importers answer the owner's release and rebuild requests on this server, and open
    // through it.
    server::ensure_server().map_err(|e| {
        format!("cannot share memsaver memory with other processes: this process cannot serve its socket: {e}")
    })?;
    let key = {
        let mut ex = EXPORTS.lock();
        let e = match ex.entry(shared.id) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let key = identity::new_key()
                    .map_err(|e| format!("cannot draw a key for a CUDA IPC handle: {e}"))?;
                v.insert(Export {
                    key,
                    tag: shared.tag.clone(),
                    size: shared.size as u64,
                    generation: 0,
                    paused: false,
                    importers: BTreeMap::new(),
                    fd: None,
                })
            }
        };
        // Exported now, so that the receiver's open only copies the fd (a failure here is
        // the open's to report).
        if !e.paused {
            let _ = cached_export(a, shared.id, e);
        }
        e.key
    };
    Ok(Some(IpcHandle {
        owner: identity::me(),
        group: group::fix(),
        id: shared.id,
        key,
        size: shared.size as u64,
    }))
}

/// Whether `b` names export `e` (the key compared without branching on its bits).
fn names(e: &Export, b: &Buffer) -> bool {
    std::hint::black_box(e.key ^ b.key) == 0
}

/// The owner's answers: opens and closes of its exports.
fn serve_owner(conn: &Connection, from: Identity, op: Share, buffers: &[Buffer]) {
    let known = {
        // A freed allocation's export is forgotten (`Sharing::freed`): its handles open nothing.
        let ex = EXPORTS.lock();
        buffers.iter().fold(true, |ok, b| {
            ok & ex.get(&b.id).is_some_and(|e| names(e, b))
        })
    };
    if !known {
        conn.refuse(NO_BUFFER);
        return;
    }
    let write_by = Instant::now() + WRITE_TIMEOUT;
    if op == Share::Close {
        let mut ex = EXPORTS.lock();
        for b in buffers {
            if let Some(e) = ex.get_mut(&b.id) {
                forget_import(e, from.pid);
                tracing::debug!(importer = from.pid, id = b.id, "served a close");
            }
        }
        drop(ex);
        let _ = conn.send(&Reply::Done, None, write_by);
        return;
    }
    let allocator = memsaver_allocator::start_global();
    for b in buffers {
        // Under EXPORTS: a pause marks the export paused under it before it releases anything,
        // so the handle read here stays valid until the fd is made.
        let (reply, fd): (Reply, Option<OwnedFd>) = {
            let mut ex = EXPORTS.lock();
            let Some(e) = ex.get_mut(&b.id) else {
                // Its allocation was freed (and the export forgotten) since the check above.
                let reply = Reply::Failed { id: b.id };
                let _ = conn.send(&reply, None, write_by);
                continue;
            };
            if e.paused || e.generation < b.generation {
                (Reply::NotReady { id: b.id }, None)
            } else {
                match allocator
                    .as_ref()
                    .map_err(|e| e.to_string())
                    .and_then(|a| cached_export(a, b.id, e))
                {
                    Ok(Some(m)) => {
                        let count = &mut e.importers.entry(from.pid).or_insert((from, 0)).1;
                        if b.generation == 0 || *count == 0 {
                            *count += 1;
                        }
                        tracing::debug!(
                            importer = from.pid,
                            imports = *count,
                            id = b.id,
                            generation = b.generation,
                            "served an open"
                        );
                        let reply = Reply::Shared {
                            id: b.id,
                            generation: e.generation,
                            offset: m.offset,
                            handle_size: m.handle_size as u64,
                        };
                        (reply, Some(m.fd))
                    }
                    Ok(None) => (Reply::NotReady { id: b.id }, None),
                    Err(err) => {
                        note(format!(
                            "cannot export memsaver memory to process {}: {err}",
                            from.pid
                        ));
                        (Reply::Failed { id: b.id }, None)
                    }
                }
            }
        };
        if conn
            .send(&reply, fd.as_ref().map(|f| f.as_fd()), write_by)
            .is_err()
        {
            // The importer is gone or gave up: it holds none of what was not delivered.
            if fd.is_some()
                && b.generation == 0
                && let Some(e) = EXPORTS.lock().get_mut(&b.id)
            {
                forget_import(e, from.pid);
            }
            return;
        }
    }
}

/// One import fewer of `e` by `pid`.
fn forget_import(e: &mut Export, pid: u32) {
    if let Some((_, count)) = e.importers.get_mut(&pid) {
        *count = count.saturating_sub(1);
        if *count == 0 {
            e.importers.remove(&pid);
        }
    }
}

/// The allocator's [`memsaver_allocator::Sharing`]: releases and rebuilds of importers.
pub struct Owner;

impl Owner {
    /// Sends `op` for the exports `ids` to each of their importers at once and waits for them
    /// under one deadline. Returns the pids that exited (forgotten as importers).
    fn tell_importers(&self, ids: &[u64], op: Share, pausing: bool) {
        let group = group::id();
        let mut per: BTreeMap<u32, (Identity, Vec<Buffer>)> = BTreeMap::new();
        {
            let mut ex = EXPORTS.lock();
            for id in ids {
                let Some(e) = ex.get_mut(id) else { continue };
                if pausing {
                    e.paused = true;
                    // The memory is about to be released: no fd may keep it.
                    drop_kept_fd(e);
                } else {
                    e.paused = false;
                    e.generation += 1;
                }
                for (pid, (who, _)) in &e.importers {
                    per.entry(*pid)
                        .or_insert_with(|| (*who, Vec::new()))
                        .1
                        .push(Buffer {
                            id: *id,
                            key: e.key,
                            generation: e.generation,
                        });
                }
            }
        }
        if per.is_empty() {
            return;
        }
        let what = if pausing {
            "release memsaver memory it maps"
        } else {
            "map memsaver memory again"
        };
        let deadline = Instant::now() + timeout();
        let wait = timeout();
        let outcomes = PerPeer::start(
            "ipc-owner",
            TIMEOUT_SETTING,
            per.clone(),
            deadline,
            move |_pid, (who, buffers): (Identity, Vec<Buffer>)| {
                let request = Request::Shared {
                    from: identity::me(),
                    to: who,
                    group,
                    op,
                    buffers,
                };
                match client::exchange(group, &who, request, 1, wait) {
                    Ok(replies) => match replies.into_iter().next() {
                        Some((Reply::Done, _)) => Ok(()),
                        Some((Reply::Error { message, .. }, _)) => Err(message),
                        other => Err(format!("answered {other:?}")),
                    },
                    Err(e) if !identity::is_running(&who) => Err(format!("exited ({e})")),
                    Err(e) => Err(e),
                }
            },
            |_pid, _r| {},
        )
        .finish(
            deadline,
            &format!(
                "waiting for processes that map memsaver memory of this one to {}",
                if pausing {
                    "release it"
                } else {
                    "map it again"
                }
            ),
            group,
        );
        let mut gone = BTreeSet::new();
        for (pid, o) in outcomes {
            let who = per[&pid].0;
            match o {
                Outcome::Done(Ok(())) => {}
                Outcome::Done(Err(_)) | Outcome::NoAnswer | Outcome::NotStarted(_)
                    if !identity::is_running(&who) =>
                {
                    // A dead importer holds nothing: its mappings went with it.
                    gone.insert(pid);
                }
                Outcome::Done(Err(e)) => {
                    tracing::warn!("memsaver: process {pid} (group {group}) could not {what}: {e}")
                }
                Outcome::NoAnswer => tracing::warn!(
                    "memsaver: process {pid} (group {group}) did not {what} within {} ms ({TIMEOUT_SETTING}); its mapping may keep the old memory alive",
                    timeout().as_millis()
                ),
                Outcome::NotStarted(e) => {
                    tracing::warn!("memsaver: cannot ask process {pid} to {what}: {e}")
                }
            }
        }
        if !gone.is_empty() {
            let mut ex = EXPORTS.lock();
            for e in ex.values_mut() {
                e.importers.retain(|pid, _| !gone.contains(pid));
            }
        }
    }
}

impl memsaver_allocator::Sharing for Owner {
    fn before_release(&self, ids: &[u64]) -> Result<(), String> {
        self.tell_importers(ids, Share::Release, true);
        Ok(())
    }

    fn after_resume(&self, ids: &[u64]) -> Result<(), String> {
        self.tell_importers(ids, Share::Rebuild, false);
        Ok(())
    }

    fn freed(&self, id: u64) {
        // Forgotten with its fd: a handle of a freed allocation opens nothing, and the importers
        // keep what they map.
        if let Some(mut e) = EXPORTS.lock().remove(&id) {
            drop_kept_fd(&mut e);
        }
    }
}

#[linkme::distributed_slice(memsaver_allocator::START_HOOKS)]
static START: StartHook = StartHook {
    name: "memsaver-ipc shared memory",
    order: 0,
    run: register,
};

fn register(a: &'static Allocator) -> Result<(), String> {
    a.set_sharing(Arc::new(Owner));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The importer's side.

/// One open handle in this process.
struct Import {
    owner: Identity,
    group: i64,
    id: u64,
    key: u64,
    generation: u64,
    /// The allocation's size in the owner.
    size: u64,
    /// The pointer handed out (never changes).
    ptr: u64,
    /// The address range reserved for it (the physical allocation it lay in when first opened).
    reserved: (u64, usize),
    /// The device it is mapped for (the caller's current device at open).
    device: i32,
    /// The imported handle and where it is mapped, while mapped.
    mapped: Option<(Handle, u64, usize)>,
    /// Opens not closed yet.
    opens: u32,
}

/// This process's imports, by the pointer handed out.
static IMPORTS: LazyLock<Mutex<BTreeMap<u64, Import>>> = LazyLock::new(Default::default);

/// Imports of memsaver memory that a layer above maps itself (nccl-hook: a peer's buffer NCCL
/// registered): the owner's release and rebuild of each allocation reach them here. Each
/// returns whether it holds the buffer at all.
pub trait Holder: Sync {
    /// Unmaps and releases what this process maps of allocation `b` of `owner` (its addresses
    /// stay reserved), once no queued work of this process uses it.
    fn release(&self, owner: &Identity, b: &Buffer) -> Result<bool, String>;
    /// Maps generation `b.generation` of it again where it was, asking the owner for the new
    /// memory with [`fetch`].
    fn rebuild(&self, owner: &Identity, group: i64, b: &Buffer) -> Result<bool, String>;
    /// What it holds, for [`imports`].
    fn imports(&self) -> Vec<ImportStats>;
}

/// The registered [`Holder`]s (nccl-hook's).
#[linkme::distributed_slice]
pub static HOLDERS: [&'static dyn Holder];

/// What a token of an allocation ([`Names::Allocation`]) opens: the fd of the owner's memory,
/// its generation, the allocation's offset in it and its size (see [`fetch`]).
pub struct Opened {
    pub fd: OwnedFd,
    pub generation: u64,
    pub offset: u64,
    pub handle_size: usize,
}

/// Opens the allocation a token names for a [`Holder`] that maps it itself: the same checks
/// as [`open`] (the group, not this very process, this process's server running to answer
/// the owner's release and rebuild), then [`fetch`].
pub fn open_for_holder(t: &Token) -> Result<Opened, String> {
    if t.names != Names::Allocation {
        return Err("not a token of a memsaver allocation".into());
    }
    let owner = t.owner();
    let pid = owner.pid;
    if owner == identity::me() {
        return Err("the memory is this very process's own".into());
    }
    let mine = group::fix();
    if t.group != mine {
        return Err(format!(
            "the memory belongs to process {pid} of group {}, this process is in group {mine}: \
             groups do not share memory; give every process of one job the same group \
             (MEMSAVER_GROUP, memsaver.set_group or ncclSetGroupID)",
            t.group
        ));
    }
    server::ensure_server().map_err(|e| {
        format!("cannot import memsaver memory of process {pid}: this process cannot serve its socket: {e}")
    })?;
    let want = Buffer {
        id: t.buffer,
        key: t.key,
        generation: t.generation,
    };
    let (fd, generation, offset, handle_size) = fetch(t.group, &owner, want)?;
    Ok(Opened {
        fd,
        generation,
        offset,
        handle_size,
    })
}

/// Asks `owner` for the fd of allocation `b`: the reply's generation, offset and handle size.
/// The owner records this process as an importer of it.
pub fn fetch(
    group: i64,
    owner: &Identity,
    b: Buffer,
) -> Result<(OwnedFd, u64, u64, usize), String> {
    let request = Request::Shared {
        from: identity::me(),
        to: *owner,
        group,
        op: Share::Open,
        buffers: vec![b],
    };
    let pid = owner.pid;
    let replies = client::exchange(group, owner, request, 1, timeout()).map_err(|e| {
        if identity::is_running(owner) {
            e
        } else {
            format!("the owner of this memory, process {pid}, exited: {e}")
        }
    })?;
    match replies.into_iter().next() {
        Some((
            Reply::Shared {
                id,
                generation,
                offset,
                handle_size,
            },
            Some(fd),
        )) if id == b.id => Ok((fd, generation, offset, handle_size as usize)),
        Some((Reply::NotReady { .. }, _)) => Err(format!(
            "process {pid} has this memory paused: resume its tag in process {pid} first"
        )),
        Some((Reply::Failed { .. }, _)) => Err(format!(
            "process {pid} could not export this memory (its driver failed)"
        )),
        other => Err(format!("process {pid} answered {other:?}")),
    }
}

/// Imports `fd` and maps it at `at` for `device`; the handle on success.
fn map_fd(a: &Allocator, fd: &OwnedFd, at: u64, len: usize, device: i32) -> Result<Handle, String> {
    let d = a.driver();
    let dev = a.device(device).map_err(|e| e.to_string())?;
    let h = d.import_fd(fd.as_raw_fd()).map_err(|e| e.to_string())?;
    // SAFETY: `[at, at+len)` lies in a range this module reserved, with nothing mapped in it.
    let mapped = d.with_context(dev.ctx, || unsafe { d.map(at, len, h, device) });
    if let Err(e) = mapped {
        let _ = d.release(h);
        return Err(e.to_string());
    }
    Ok(h)
}

/// `cudaIpcOpenMemHandle` of memsaver's handle `bytes`: `Ok(None)` when `bytes` is not one
/// (the caller forwards to the real runtime), else the pointer or why not.
pub fn open(bytes: &[u8; HANDLE_BYTES]) -> Result<Option<u64>, String> {
    let Some(h) = IpcHandle::decode(bytes) else {
        return Ok(None);
    };
    let pid = h.owner.pid;
    if h.owner == identity::me() {
        return Err(
            "cudaIpcOpenMemHandle: this handle is of memory of this very process (use the pointer itself)".into(),
        );
    }
    let mine = group::fix();
    if h.group != mine {
        return Err(format!(
            "the memory belongs to process {pid} of group {}, this process is in group {mine}: \
             groups do not share memory; give every process of one job the same group \
             (MEMSAVER_GROUP or memsaver.set_group)",
            h.group
        ));
    }
    let a = memsaver_allocator::start_global().map_err(|e| e.to_string())?;
    server::ensure_server().map_err(|e| {
        format!("cannot open memsaver memory of process {pid}: this process cannot serve its socket: {e}")
    })?;
    // Held across the exchange: the owner's release of this import waits until it is recorded.
    let mut imports = IMPORTS.lock();
    if let Some((&ptr, i)) = imports
        .iter_mut()
        .find(|(_, i)| i.owner == h.owner && i.id == h.id)
    {
        i.opens += 1;
        return Ok(Some(ptr));
    }
    let want = Buffer {
        id: h.id,
        key: h.key,
        generation: 0,
    };
    let started = Instant::now();
    let (fd, generation, offset, handle_size) = fetch(h.group, &h.owner, want)?;
    let fetched = started.elapsed();
    let device = a.driver().current_device().unwrap_or(0);
    let gran = a.granularity(device).map_err(|e| e.to_string())?;
    let ctx = a.device(device).map_err(|e| e.to_string())?.ctx;
    let base = a
        .driver()
        .with_context(ctx, || a.driver().reserve(handle_size, gran, 0))
        .map_err(|e| e.to_string())?;
    let handle = match map_fd(a, &fd, base, handle_size, device) {
        Ok(handle) => handle,
        Err(e) => {
            // SAFETY: reserved above, nothing mapped.
            let _ = unsafe { a.driver().address_free(base, handle_size) };
            drop(imports);
            let _ = close_imports(h.group, &h.owner, &[want]);
            return Err(format!("cannot map memory of process {pid}: {e}"));
        }
    };
    tracing::debug!(
        owner = pid,
        bytes = handle_size,
        fetch_us = fetched.as_micros() as u64,
        map_us = (started.elapsed() - fetched).as_micros() as u64,
        "opened memsaver memory of another process"
    );
    let ptr = base + offset;
    imports.insert(
        ptr,
        Import {
            owner: h.owner,
            group: h.group,
            id: h.id,
            key: h.key,
            generation,
            size: h.size,
            ptr,
            reserved: (base, handle_size),
            device,
            mapped: Some((handle, base, handle_size)),
            opens: 1,
        },
    );
    Ok(Some(ptr))
}

/// Unmaps and releases an import's mapping (the address stays reserved).
fn unmap(a: &Allocator, i: &mut Import) {
    if let Some((h, at, len)) = i.mapped.take() {
        let d = a.driver();
        let ctx = a.device(i.device).map(|dev| dev.ctx);
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
                i.owner.pid
            ));
        }
        let _ = d.release(h);
    }
}

/// Tells `owner` that this process holds one import fewer of each of `buffers` (a close, or a
/// [`Holder`]'s import went): once none is left, the owner's next pause does not wait for this
/// process. An owner that exited needs no notice.
pub fn close_imports(group: i64, owner: &Identity, buffers: &[Buffer]) -> Result<(), String> {
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
            Err(_) if !identity::is_running(owner) => return Ok(()),
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
                    let mut per: BTreeMap<(i64, u32), (Identity, Vec<Buffer>)> = BTreeMap::new();
                    for (group, owner, b) in std::iter::once(first).chain(receive.try_iter()) {
                        per.entry((group, owner.pid))
                            .or_insert_with(|| (owner, Vec::new()))
                            .1
                            .push(b);
                    }
                    for ((group, pid), (owner, buffers)) in per {
                        // Not told, the owner asks this process to release what it no longer
                        // holds at its next pause, which is answered at once.
                        if let Err(e) = close_imports(group, &owner, &buffers) {
                            tracing::debug!(
                                "process {pid} was not told of {} closed import(s): {e}",
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

/// `cudaIpcCloseMemHandle(ptr)`: `None` when `ptr` is not an import of memsaver memory.
pub fn close(ptr: u64) -> Option<Result<(), String>> {
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
        Err(e) => return Some(Err(e.to_string())),
    };
    unmap(a, &mut i);
    // SAFETY: reserved by `open`, nothing mapped in it any more.
    let _ = unsafe { a.driver().address_free(i.reserved.0, i.reserved.1) };
    let b = Buffer {
        id: i.id,
        key: i.key,
        generation: i.generation,
    };
    // The memory is released here either way.
    Some(
        close_imports(i.group, &i.owner, &[b])
            .map_err(|e| format!("closed, but process {} was not told: {e}", i.owner.pid)),
    )
}

/// The importer's answers to its owners: release, rebuild.
fn serve_importer(conn: &Connection, from: Identity, group: i64, op: Share, buffers: &[Buffer]) {
    let write_by = Instant::now() + WRITE_TIMEOUT;
    let a = match memsaver_allocator::start_global() {
        Ok(a) => a,
        Err(e) => {
            let _ = conn.send(
                &Reply::Error {
                    status: 0,
                    message: e.to_string(),
                },
                None,
                write_by,
            );
            return;
        }
    };
    let mut imports = IMPORTS.lock();
    let mut failed = Vec::new();
    for b in buffers {
        let Some(i) = imports
            .values_mut()
            .find(|i| i.owner == from && i.id == b.id && i.key == b.key)
        else {
            continue; // closed meanwhile, or only a holder's
        };
        match op {
            Share::Release => unmap(a, i),
            _ => {
                if i.mapped.is_some() && i.generation >= b.generation {
                    continue;
                }
                unmap(a, i);
                let r = fetch(i.group, &i.owner, *b).and_then(|(fd, generation, offset, len)| {
                    // The allocation stays where it was: its new memory starts `offset` before.
                    let at = i.ptr.checked_sub(offset).filter(|at| {
                        *at >= i.reserved.0
                            && at + len as u64 <= i.reserved.0 + i.reserved.1 as u64
                    });
                    let Some(at) = at else {
                        return Err(format!(
                            "process {} re-created the memory in a layout that does not fit the reserved range",
                            from.pid
                        ));
                    };
                    let h = map_fd(a, &fd, at, len, i.device)?;
                    i.mapped = Some((h, at, len));
                    i.generation = generation;
                    Ok(())
                });
                if let Err(e) = r {
                    failed.push(e);
                }
            }
        }
    }
    drop(imports);
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
    let reply = match failed.first() {
        None => Reply::Done,
        Some(e) => Reply::Error {
            status: 0,
            message: e.clone(),
        },
    };
    let _ = conn.send(&reply, None, write_by);
}

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
        match op {
            Share::Open | Share::Close => serve_owner(&conn, from, op, &buffers),
            Share::Release | Share::Rebuild => {
                // Off the server's workers: a release waits for this process's queued work,
                // a rebuild asks the owner for its memory, and in a job where every process
                // imports from every other, workers waiting on each other would stall them all.
                let spawned = std::thread::Builder::new()
                    .name("memsaver-import".into())
                    .spawn(move || serve_importer(&conn, from, group, op, &buffers));
                if let Err(e) = spawned {
                    note(format!(
                        "cannot start a thread to answer process {}: {e}",
                        from.pid
                    ));
                }
            }
        }
    }
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

/// What [`exports`] reports of one tag's exports.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct ExportStats {
    pub handles: u64,
    pub bytes: u64,
    pub importers: u64,
}

/// This process's open imports of other processes' memsaver memory.
pub fn imports() -> Vec<ImportStats> {
    let mut out: Vec<ImportStats> = IMPORTS
        .lock()
        .values()
        .map(|i| ImportStats {
            owner_pid: i.owner.pid,
            bytes: i.size,
            paused: i.mapped.is_none(),
            opens: i.opens,
            via: "cuda_ipc",
        })
        .collect();
    for h in HOLDERS {
        out.extend(h.imports());
    }
    out
}

/// This process's exports, per tag (allocations freed since are forgotten here).
pub fn exports() -> BTreeMap<String, ExportStats> {
    let mut out: BTreeMap<String, ExportStats> = BTreeMap::new();
    let ex = EXPORTS.lock();
    for e in ex.values() {
        let s = out.entry(e.tag.clone()).or_default();
        s.handles += 1;
        s.bytes += e.size;
        s.importers += e.importers.len() as u64;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn handles_round_trip(pid in any::<u32>(), start in any::<u64>(), nonce in any::<u64>(),
                              group in any::<i64>(), id in any::<u64>(), key in any::<u64>(),
                              size in any::<u64>()) {
            let h = IpcHandle { owner: Identity { pid, start, nonce }, group, id, key, size };
            prop_assert_eq!(IpcHandle::decode(&h.encode()), Some(h));
        }

        /// Bytes that are not memsaver's handle (the real runtime's, or another version) are
        /// not taken for one: the caller forwards them to libcudart.
        #[test]
        fn other_bytes_are_not_a_handle(b in proptest::collection::vec(any::<u8>(), 64)) {
            let b: [u8; HANDLE_BYTES] = b.try_into().expect("64 bytes");
            if let Some(h) = IpcHandle::decode(&b) {
                prop_assert_eq!(h.encode(), b);
            }
        }
    }

    #[test]
    fn magic_version_and_reserved_bytes_are_checked() {
        let h = IpcHandle {
            owner: Identity {
                pid: 1,
                start: 2,
                nonce: 3,
            },
            group: 4,
            id: 5,
            key: 6,
            size: 7,
        };
        for at in [0, 4, 6, 60, 63] {
            let mut b = h.encode();
            b[at] ^= 0x40;
            assert_eq!(IpcHandle::decode(&b), None, "byte {at}");
        }
        assert_eq!(IpcHandle::decode(&[0; HANDLE_BYTES]), None);
    }
}
