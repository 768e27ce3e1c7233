//! NCCL's registration of memsaver memory, on the importer's side: a peer's tensor that NCCL
//! registered (`ncclCommRegister`, or a buffer of a collective captured in a CUDA graph) and
//! this process imported and mapped follows the owner's tag.
//!
//! The owner's NCCL retains the handle of the tensor's memory and exports it; memsaver hands NCCL a
//! token naming the allocation (`crate::interpose::sharing`), and this process's import trades it
//! for the fd through `memsaver_ipc::shared`, so the owner tracks this process as an importer like
//! any CUDA IPC receiver. The mapping is NCCL's, recorded in the registry
//! ([`registry::Kind::Registered`]). When the owner pauses the tag, its release request comes here
//! ([`Holder::release`]): the mapping is unmapped and the imported handle released, the addresses
//! stay reserved and recorded, and the owner's memory is really freed. When it resumes,
//! [`Holder::rebuild`] maps the new memory at the same addresses, with the access NCCL granted.
//! This process's own `nccl` tag leaves these imports alone.
//!
//! On the owner's side, NCCL may hold the memory of a registered allocation itself: a window
//! (`ncclCommWindowRegister`) retains the allocation's handle for its life and maps it again in
//! NCCL's own address space. Those holds ([`Registration::Retained`]) are this process's own
//! aliases of the memory ([`Aliases`]): the tag's pause releases the retained handle and
//! unmaps NCCL's mappings of it before the memory goes (else the memory stays allocated, and
//! after the resume NCCL would read the old memory there), and its resume maps the new memory
//! at the same addresses.
//!
//! An allocation first exported while it was part of a run (one physical allocation behind
//! several allocations, made by a resume) is exported as the run, which NCCL maps whole; every
//! later generation is the allocation's own memory, mapped at the allocation's place inside
//! NCCL's mapping (its *window*), so the address NCCL uses never changes.

use memsaver_allocator::driver::{Driver, Handle};
use memsaver_allocator::steps::{Op, Place, Steps};
use memsaver_allocator::{Allocator, Device};
use memsaver_ipc::Error as IpcError;
use memsaver_ipc::identity::Identity;
use memsaver_ipc::protocol::Buffer;
use memsaver_ipc::shared::{self, ALIASES, Aliases, HOLDERS, Holder, ImportStats};

use crate::registry::{self, Kind, Range, Ranges, Registration, Registry, State};
use crate::tag::local::device_of;

/// The imports of peers' memsaver memory that NCCL registered.
struct Registered;

#[linkme::distributed_slice(HOLDERS)]
static HOLDER: &'static dyn Holder = &Registered;

/// NCCL's holds on this process's own registered allocations (the owner's side).
struct Retained;

#[linkme::distributed_slice(ALIASES)]
static ALIAS: &'static dyn Aliases = &Retained;

/// NCCL's retained handles of allocations `ids` (virtual handle, allocation), those released by
/// the tag's pause (`paused`) or those holding memory now.
fn retained(reg: &Registry, ids: &[u64], paused: bool) -> Vec<(u64, u64)> {
    let mut vhs: Vec<(u64, u64)> = reg
        .physicals
        .iter()
        .filter_map(|(vh, p)| match p.registration {
            Some(Registration::Retained { id, .. })
                if ids.contains(&id) && (p.state() == State::TagPaused) == paused =>
            {
                Some((*vh, id))
            }
            _ => None,
        })
        .collect();
    vhs.sort_unstable();
    vhs
}

/// The context of an error that left NCCL's own mapping of a registered buffer of this process
/// without the resumed memory.
const NOT_REMAPPED: &str = "NCCL's own mapping of a registered buffer could not be mapped again";

impl Aliases for Retained {
    fn release(&self, ids: &[u64]) -> memsaver_ipc::Result<()> {
        let a = memsaver_allocator::global()?;
        let mut reg = registry::lock();
        let steps = a.steps(Op::Pause);
        let mut synced = Vec::new();
        let mut first_error = None;
        for (vh, _) in retained(&reg, ids, false) {
            let ranges = reg.ranges_by_handle();
            let rs = ranges.get(&vh).map_or(&[][..], Vec::as_slice);
            let r = device(a, &reg, &ranges, vh).and_then(|dev| {
                if !synced.contains(&dev.ordinal) {
                    // No kernel of this process may still use the memory through NCCL's mapping.
                    steps.synchronize(&dev)?;
                    synced.push(dev.ordinal);
                }
                // SAFETY: NCCL's own mappings of the allocation, mapped now; the device is idle.
                unsafe { steps.unmap(&dev, &places(rs, None)) }
            });
            if let Err(source) = r {
                first_error.get_or_insert(IpcError::Hold {
                    what: "NCCL's own mapping of a registered buffer",
                    source,
                });
                continue;
            }
            let p = reg.physicals.get_mut(&vh).expect("listed under this lock");
            match p.tag_paused() {
                Ok(real) => steps.release(Handle(real), rs.first().map_or(0, |r| r.0)),
                Err(e) => {
                    first_error.get_or_insert(IpcError::Allocator(e.into()));
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    fn rebuild(&self, ids: &[u64]) -> memsaver_ipc::Result<()> {
        let a = memsaver_allocator::global()?;
        let d = a.driver();
        let mut reg = registry::lock();
        let steps = a.steps(Op::Resume);
        let mut first_error = None;
        for (vh, id) in retained(&reg, ids, true) {
            let ranges = reg.ranges_by_handle();
            let rs = ranges.get(&vh).map_or(&[][..], Vec::as_slice);
            // A handle of the allocation's new memory, NCCL's to hold as it held the old one.
            let r = device(a, &reg, &ranges, vh)
                .map_err(|source| IpcError::Hold {
                    what: NOT_REMAPPED,
                    source,
                })
                .and_then(|dev| {
                    let mem = a.export_shared(id)?.ok_or(IpcError::CannotExport {
                        why: "the allocation is not resident",
                    })?;
                    map_fd(d, &steps, &dev, &mem.fd, &places(rs, None)).map_err(|source| {
                        IpcError::Hold {
                            what: NOT_REMAPPED,
                            source,
                        }
                    })
                });
            match r {
                Ok(h) => {
                    let p = reg.physicals.get_mut(&vh).expect("listed under this lock");
                    if let Err(e) = p.tag_resumed(h.0) {
                        first_error.get_or_insert(IpcError::Allocator(e.into()));
                    }
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// The registered imports of allocation `b` of `owner`.
fn matching(reg: &Registry, owner: &Identity, b: &Buffer) -> Vec<u64> {
    let mut vhs: Vec<u64> = reg
        .physicals
        .iter()
        .filter(|(_, p)| {
            matches!(p.registration, Some(Registration::Imported { owner: o, id, key, .. })
                if o == *owner && id == b.id && key == b.key)
        })
        .map(|(vh, _)| *vh)
        .collect();
    vhs.sort_unstable();
    vhs
}

/// Where `window` puts the memory in each of NCCL's mappings `rs`.
fn places(rs: &[Range], window: Option<(u64, u64)>) -> Vec<Place<'_>> {
    rs.iter()
        .map(|(ptr, size, access)| {
            let (at, len) = registry::in_window(*ptr, *size, window);
            Place {
                ptr: at,
                size: len as usize,
                access: Some(access),
            }
        })
        .collect()
}

/// Imports the memory of `fd` on `dev` and maps it at `places` (NCCL's mappings, with the
/// access NCCL granted); the handle is released again when it cannot be mapped.
fn map_fd(
    d: &Driver,
    steps: &Steps<'_>,
    dev: &Device,
    fd: &std::os::fd::OwnedFd,
    places: &[Place<'_>],
) -> memsaver_allocator::Result<Handle> {
    let raw = std::os::fd::AsRawFd::as_raw_fd(fd);
    let h = d.with_context(dev.ctx, || d.import_fd(raw))?;
    steps.map_handle(dev, h, places).inspect_err(|_| {
        let _ = d.release(h);
    })?;
    Ok(h)
}

/// Unmaps the mapped import `vh` and releases its handle: `Mapped` → `Released`. `synced`:
/// the devices already synchronised by this release.
fn release_one(
    steps: &Steps<'_>,
    a: &Allocator,
    reg: &mut Registry,
    vh: u64,
    synced: &mut Vec<i32>,
) -> memsaver_allocator::Result<()> {
    let ranges = reg.ranges_by_handle();
    let rs = ranges.get(&vh).map_or(&[][..], Vec::as_slice);
    let dev = device(a, reg, &ranges, vh)?;
    let pl = places(rs, reg.physicals[&vh].window());
    if !synced.contains(&dev.ordinal) {
        // No kernel of this process may still use the owner's memory.
        steps.synchronize(&dev)?;
        synced.push(dev.ordinal);
    }
    // SAFETY: NCCL's mappings of the import, mapped now; the device is idle.
    unsafe { steps.unmap(&dev, &pl) }?;
    let p = reg.physicals.get_mut(&vh).expect("matched under this lock");
    let real = p.release()?;
    steps.release(Handle(real), pl.first().map_or(0, |p| p.ptr));
    Ok(())
}

fn device(
    a: &Allocator,
    reg: &Registry,
    ranges: &Ranges,
    vh: u64,
) -> memsaver_allocator::Result<std::sync::Arc<Device>> {
    a.device(device_of(reg, ranges, vh))
}

impl Holder for Registered {
    fn release(&self, owner: &Identity, b: &Buffer) -> memsaver_ipc::Result<bool> {
        // Before the registry lock: this may start the allocator.
        let a = memsaver_allocator::global()?;
        let _registering = registry::REGISTERING.lock();
        let mut reg = registry::lock();
        let vhs = matching(&reg, owner, b);
        let steps = a.steps(Op::Pause);
        let mut synced = Vec::new();
        let mut first_error = None;
        for &vh in &vhs {
            // A release older than the generation mapped is stale (a retried request).
            if reg.physicals[&vh]
                .mapped_generation()
                .is_some_and(|g| g <= b.generation)
                && let Err(e) = release_one(&steps, a, &mut reg, vh, &mut synced)
            {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(!vhs.is_empty()), |e| Err(e.into()))
    }

    fn rebuild(&self, owner: &Identity, group: i64, b: &Buffer) -> memsaver_ipc::Result<bool> {
        let a = memsaver_allocator::global()?;
        let behind = |reg: &Registry| -> Vec<u64> {
            matching(reg, owner, b)
                .into_iter()
                .filter(|vh| {
                    let p = &reg.physicals[vh];
                    p.released_generation().is_some()
                        || p.mapped_generation().is_some_and(|g| g < b.generation)
                })
                .collect()
        };
        let _registering = registry::REGISTERING.lock();
        let (any, todo) = {
            let reg = registry::lock();
            (!matching(&reg, owner, b).is_empty(), behind(&reg))
        };
        if todo.is_empty() {
            return Ok(any);
        }
        // Not under the registry lock: the owner serves this while it waits for us.
        let shared::Opened {
            fd,
            generation,
            offset,
            handle_size: len,
            ..
        } = shared::fetch(group, owner, *b)?;
        let d = a.driver();
        let mut reg = registry::lock();
        let release_steps = a.steps(Op::Pause);
        let steps = a.steps(Op::Resume);
        let mut synced = Vec::new();
        let mut first_error = None;
        for vh in behind(&reg) {
            if reg.physicals[&vh].mapped_generation().is_some()
                && let Err(e) = release_one(&release_steps, a, &mut reg, vh, &mut synced)
            {
                first_error.get_or_insert(e.into());
                continue;
            }
            let ranges = reg.ranges_by_handle();
            let rs = ranges.get(&vh).map_or(&[][..], Vec::as_slice);
            let Some(Registration::Imported { offset: first, .. }) =
                reg.physicals[&vh].registration
            else {
                continue;
            };
            // The allocation stays where NCCL saw it first: its new memory starts `offset`
            // into what is exported now.
            let fits = |(_, size, _): &Range| {
                first
                    .checked_sub(offset)
                    .is_some_and(|off| off + len as u64 <= *size)
            };
            if !rs.iter().all(fits) {
                first_error.get_or_insert(IpcError::Layout { pid: owner.pid });
                continue;
            }
            let off = first - offset;
            let win = rs
                .first()
                .is_some_and(|(_, size, _)| off != 0 || len as u64 != *size)
                .then_some((off, len as u64));
            let r = device(a, &reg, &ranges, vh)
                .and_then(|dev| map_fd(d, &steps, &dev, &fd, &places(rs, win)));
            match r {
                Ok(h) => {
                    let p = reg.physicals.get_mut(&vh).expect("matched under this lock");
                    if let Some(Registration::Imported { window, .. }) = &mut p.registration {
                        *window = win;
                    }
                    if let Err(e) = p.remapped(h.0, generation) {
                        first_error.get_or_insert(IpcError::Allocator(e.into()));
                    }
                }
                Err(e) => {
                    first_error.get_or_insert(e.into());
                }
            }
        }
        first_error.map_or(Ok(true), Err)
    }

    fn imports(&self) -> Vec<ImportStats> {
        let reg = registry::lock();
        let mut mappings = std::collections::HashMap::<u64, u32>::new();
        for m in reg.mappings.values() {
            *mappings.entry(m.vh).or_default() += 1;
        }
        reg.physicals
            .iter()
            .filter(|(_, p)| p.kind == Kind::Registered)
            .filter_map(|(vh, p)| match p.registration {
                Some(Registration::Imported { owner, .. }) => Some(ImportStats {
                    owner_pid: owner.pid,
                    bytes: p.size,
                    paused: p.real().is_none(),
                    opens: mappings.get(vh).copied().unwrap_or(0),
                    via: "nccl",
                }),
                _ => None,
            })
            .collect()
    }
}
