//! Exports and imports between processes (`memsaver_ipc`): tokens instead of fds.
//!
//! When NCCL exports one of its buffers as a POSIX fd, [`crate::interpose::sharing`]'s wrapper
//! hands it a token naming the buffer ([`for_buffer`]) instead of the driver's fd; the importer's
//! memsaver recognises the token ([`read`]) and trades it with the owner for the real fd
//! ([`import`]), so the owner learns who imports what (`memsaver_ipc::token`,
//! [`crate::tag::exports`]). Memsaver memory that NCCL registers gets a token naming the allocation
//! ([`for_allocation`]), opened through `memsaver_ipc::shared` ([`open_registered`]), so its
//! imports follow the allocation's tag. An export that could not get a token falls back to a plain
//! fd and is recorded ([`fallback_reason`]).
//!
//! This module makes and reads the tokens and talks to the owners; the driver calls, and
//! NCCL's out-pointers, stay in `sharing`. It imports the registry and the options, never the
//! wrappers.

use std::ffi::{c_uint, c_void};
use std::os::fd::{OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::options;
use crate::registry::{self, Physical, Registration, Source};
use memsaver_allocator::driver::sys::{
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, CUmemAllocationProp, CUmemGenericAllocationHandle,
};
use memsaver_ipc::shared::{self, Delivery, Opened, requests};
use memsaver_ipc::token::{self, Names, Token};
use memsaver_ipc::{group, server};

/// Whether exports hand out tokens (every process of the job must then be preloaded).
/// `MEMSAVER_NCCL_TOKENS=0` turns them off: NCCL gets driver fds, and exported buffers and
/// imports stay resident on pause. An invalid value means the default here (an export cannot
/// fail on our account) and fails every pause.
pub(crate) fn enabled() -> bool {
    options::get().nccl_tokens
}

/// A token for NCCL's buffer `vh` (the physical `p`, mapped at `place` here), whose importers
/// then trade it with this process for the real fd, and lay it out as this process does
/// ([`registry::MIRROR_BLOCK`]); the buffer is an export of the owner's ledger
/// (`memsaver_ipc::exported`, [`Delivery::Collective`]), which gives its key and generation.
/// `None` when none can be made (this process cannot serve its peers): recorded
/// ([`fallback_reason`]), and the caller exports a plain fd.
pub(crate) fn for_buffer(
    vh: CUmemGenericAllocationHandle,
    p: &Physical,
    place: u64,
) -> Option<OwnedFd> {
    let made = server::ensure_server()
        .map_err(|e| e.to_string())
        .and_then(|()| {
            shared::add(Delivery::Collective, vh, registry::TAG, p.size).map_err(|e| e.to_string())
        })
        .and_then(|(key, generation)| {
            let token =
                Token::own(Names::Buffer, group::id(), vh, key, generation).at(place, p.size);
            token::make(token).map_err(|e| e.to_string())
        });
    match made {
        Ok(fd) => Some(fd),
        Err(e) => {
            // Recorded: stats show it, and pause says so (it cannot free this buffer).
            record_fallback(&e.to_string());
            tracing::warn!(error = %e, "memsaver: no token for an NCCL export; it will stay resident");
            None
        }
    }
}

/// A token naming the memsaver allocation at `at`, which NCCL registers and exports, so that
/// the peers' imports follow the allocation's tag (`memsaver_ipc::shared`). `None` when none
/// can be made (tokens off, this process cannot serve its socket), with the reason logged: a
/// plain fd would let the peers' imports keep the old memory across a pause and map stale
/// memory after the resume, so the caller fails the export.
pub(crate) fn for_allocation(at: u64) -> Option<OwnedFd> {
    let made = if enabled() {
        memsaver_ipc::shared::handle_of(at)
            .map_err(|e| e.to_string())
            .and_then(|handle| {
                let handle = handle.ok_or("it is no longer allocated")?;
                let token = Token::own(Names::Allocation, handle.group, handle.id, handle.key, 0);
                token::make(token).map_err(|e| format!("cannot make a token: {e}"))
            })
    } else {
        Err(
            "MEMSAVER_NCCL_TOKENS=0 is set, and a plain fd would let peers keep and later \
             read stale memory across a pause"
                .into(),
        )
    };
    made.map_err(|e| {
        let tag = memsaver_allocator::global_if_started()
            .and_then(|a| a.allocation_at(at))
            .map_or_else(String::new, |(_, tag, _)| format!(" of tag '{tag}'"));
        tracing::error!(
            "memsaver: NCCL cannot share the buffer at {at:#x}{tag} it registers with its peers: {e}. \
             Fix that, or turn NCCL's buffer registration off (NCCL_LOCAL_REGISTER=0, \
             NCCL_GRAPH_REGISTER=0)"
        );
    })
    .ok()
}

/// The token NCCL passes to an import (`os_handle` of `handle_type`), if it is one.
pub(crate) fn read(handle_type: c_uint, os_handle: *mut c_void) -> Option<Token> {
    (handle_type == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        .then(|| token::read(os_handle as isize as RawFd))
        .flatten()
}

/// Whether `t` names a memsaver allocation (one NCCL registered), not an NCCL buffer.
pub(crate) fn names_allocation(t: &Token) -> bool {
    t.names == Names::Allocation
}

/// What the import of an NCCL buffer's token got: the owner's real fd, where the import comes
/// from, the generation served, and where the buffer lies in the memory the fd is (offset,
/// size of that memory).
pub(crate) struct Imported {
    pub(crate) fd: OwnedFd,
    pub(crate) source: Source,
    pub(crate) generation: u64,
    pub(crate) served: (u64, u64),
}

/// The import of NCCL buffer token `t` (the owner waits up to `MEMSAVER_NCCL_TIMEOUT_MS` for
/// a buffer still resuming). Refused while this process holds imports of another process with
/// the token's pid; `None` then, and on any failure, with the reason logged.
pub(crate) fn import(t: &Token) -> Option<Imported> {
    let r = requests::import(t, options::get().nccl_timeout, |pid| {
        registry::lock()
            .physicals
            .values()
            .any(|p| p.source.is_some_and(|s| s.owner == pid))
    });
    match r {
        Ok(served) => Some({
            crate::interpose::epochs::served(t.group, &t.owner(), served.epoch);
            Imported {
                fd: served.fd,
                source: Source {
                    owner: t.pid,
                    vh: t.buffer,
                    key: t.key,
                },
                generation: served.generation,
                served: (served.offset, served.size),
            }
        }),
        Err(e) => {
            tracing::error!(
                "memsaver: cannot import an NCCL buffer of process {}: {e}",
                t.pid
            );
            None
        }
    }
}

/// Opens the allocation token `t` names (a peer's memsaver memory NCCL registered) through
/// `memsaver_ipc::shared`, which records this process as an importer, so the owner's pause
/// releases the import and its resume maps it again ([`crate::tag::registered`]). `None` on a
/// failure, with the reason logged.
pub(crate) fn open_registered(t: &Token) -> Option<Opened> {
    memsaver_ipc::shared::open_for_holder(t)
        .map_err(|e| {
            tracing::error!(
                "memsaver: cannot import a buffer of process {} that NCCL registered: {e}",
                t.pid
            );
        })
        .ok()
}

/// The driver refused the import of `t` after [`open_registered`]: the owner counted an
/// import that never was, and hears that it went.
pub(crate) fn not_imported(t: &Token) {
    let b = memsaver_ipc::protocol::Buffer {
        id: t.buffer,
        key: t.key,
        generation: t.generation,
    };
    memsaver_ipc::shared::close_later(t.group, t.owner(), b);
}

/// The registry's record of the import of `t`, opened as `opened` and imported by the driver
/// as `h` with properties `prop`.
pub(crate) fn registered(
    h: CUmemGenericAllocationHandle,
    prop: CUmemAllocationProp,
    t: &Token,
    opened: &Opened,
) -> Physical {
    let registration = Registration::Imported {
        owner: t.owner(),
        group: t.group,
        id: t.buffer,
        key: t.key,
        offset: opened.offset,
        window: None,
    };
    let mut p = Physical::registered(h, prop, registration, opened.generation);
    p.size = opened.handle_size as u64;
    p
}

/// The registry just forgot `p`: an import of a peer's memory (a registered buffer, or one of
/// its own NCCL buffers) tells its owner, which stops counting this process as its importer
/// (in the background: NCCL's free path does not wait for the owner), so that the owner's
/// next pause does not wait for a release this process will never send. Sent for a member of
/// an imported run too: the run's other members, still recorded, keep the owner waiting for
/// the run's mapping, and for an import whose owner freed the buffer first (orphaned): the
/// owner keeps a tombstone of the buffer while an importer may name it, and this close takes
/// this process off it. Nothing for any other physical object.
pub(crate) fn import_gone(p: &Physical) {
    let generation = p.imported_generation();
    if let Some(Registration::Imported {
        owner,
        group,
        id,
        key,
        ..
    }) = p.registration
    {
        let b = memsaver_ipc::protocol::Buffer {
            id,
            key,
            generation: generation.unwrap_or(0),
        };
        tracing::debug!(owner = owner.pid, id, "a registered import went");
        memsaver_ipc::shared::close_later(group, owner, b);
    } else if let (Some(s), Some(g)) = (p.source, generation) {
        tracing::debug!(
            owner = s.owner,
            id = s.vh,
            "an import of a peer's NCCL buffer went"
        );
        memsaver_ipc::shared::imported::close_later_of(
            memsaver_ipc::group::id(),
            s.owner,
            s.item(g),
        );
    }
}

/// Why NCCL exports of this process are plain fds instead of tokens, and how many: set by the
/// first export that could not get a token (the server could not start: a runtime directory
/// that is not private, a link in its path, ...).
static FALLBACK: Mutex<Option<String>> = Mutex::new(None);
static FALLBACK_EXPORTS: AtomicU64 = AtomicU64::new(0);

/// Records that an export fell back to a plain fd because of `why`.
fn record_fallback(why: &str) {
    FALLBACK_EXPORTS.fetch_add(1, Ordering::Relaxed);
    FALLBACK.lock().get_or_insert_with(|| why.to_owned());
}

/// Exports that fell back to plain fds (they and their imports stay resident on pause).
pub(crate) fn fallback_exports() -> u64 {
    FALLBACK_EXPORTS.load(Ordering::Relaxed)
}

/// Why NCCL's exports could not be shared through memsaver, and what to do, when at least
/// one fell back: pause('nccl') cannot free those buffers and should fail with this.
pub(crate) fn fallback_reason() -> Option<String> {
    let why = FALLBACK.lock().clone()?;
    Some(format!(
        "{} NCCL buffer(s) of this process were exported as plain fds, which stay resident on \
         pause (as do the peers' imports of them), because memsaver could not serve its \
         peers: {why}. Fix that, then restart the job",
        fallback_exports()
    ))
}
