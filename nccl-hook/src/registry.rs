//! What NCCL holds: every VMM handle it created or imported and every mapping it made.
//!
//! NCCL never sees the driver's handles: the `cuMemCreate`/`cuMemImportFromShareableHandle`
//! wrappers hand it a *virtual* handle, and every wrapper that takes a handle translates it.
//! That is what lets pause release the physical memory and resume create new memory behind
//! the same virtual handle, at the same addresses, without NCCL noticing. Queries NCCL makes
//! about a paused range (`cuMemRetainAllocationHandle`, `cuMemGetAddressRange`) are answered
//! from here, so destroying a communicator while paused works.
//!
//! These are the records the interposition writes ([`crate::vmm`]) and the `nccl` tag's pause
//! and resume ([`crate::provider`]) and the memory it serves to peers ([`crate::exports`]) work
//! on: records and their lock only, below everything else in this crate (it imports no module
//! of it). Who imports an exported buffer, its key and its generation are not NCCL's: the
//! owner's ledger (`memsaver_ipc::exported`) keeps them, as it does for every export.

use std::collections::{BTreeMap, HashMap, HashSet};

use parking_lot::{Mutex, MutexGuard};
use serde::Serialize;

use memsaver_allocator::driver::sys::*;

/// The tag of NCCL's memory.
pub(crate) const TAG: &str = "nccl";

/// Virtual handles are `VH_BASE | n`: never 0, and recognisable in logs.
const VH_BASE: u64 = 0x6d73_0000_0000_0000;

/// Address space reserved at once for NCCL's own buffers ([`Registry::carve_own`]).
pub(crate) const OWN_ARENA: u64 = 64 << 30;

/// A range of memsaver's reservations that NCCL reserved, and from where.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Handed {
    pub len: u64,
    /// Carved from the own arenas (its space goes back there), or placed in an owner's layout
    /// (its space stays that owner's).
    pub own: bool,
}

/// Importers lay out their imports of one owner as the owner lays its buffers out, block by
/// block of the owner's addresses: an importer reserves one range of this size (addresses
/// only) per block of an owner it imports from, and places each import at the buffer's offset
/// in its block. An owner's run never crosses a block boundary, so that an importer can map it
/// whole ([`crate::local`]).
pub(crate) const MIRROR_BLOCK: u64 = 64 << 30;

/// What kind of memory a handle is, which decides whether pause may release it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Device memory NCCL created here.
    Device,
    /// Host memory (`HOST`/`HOST_NUMA` locations): not device memory, stays.
    Host,
    /// Created with a FABRIC handle type (multi-node NVLink): stays.
    Fabric,
    /// A peer process's memory imported here.
    Imported,
    /// This process's memsaver memory (an allocation of a tag, not NCCL's) whose handle NCCL
    /// retained to register the buffer: it stays as it is here; its own tag pauses it.
    Tagged,
    /// A peer's memsaver memory that NCCL registered, imported and mapped here: it follows the
    /// owner's tag ([`Registration::Imported`]), not this process's `nccl` tag.
    Registered,
}

/// What NCCL's registration of memsaver memory (`ncclCommRegister`, graph registration) made
/// of a handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Registration {
    /// Owner side ([`Kind::Tagged`]): NCCL retained the handle of the allocation at `at`,
    /// allocation `id` of the allocator (marked shared: NCCL may export it, and the handle
    /// and NCCL's own mappings of it are released and rebuilt around the tag's pause and
    /// resume, `crate::registered`).
    Retained { at: u64, id: u64 },
    /// Importer side ([`Kind::Registered`]): allocation `id` of `owner` (its key from the
    /// token), at `offset` in the memory NCCL mapped first. `window` is where the current
    /// generation is mapped, relative to each of NCCL's mappings of it, when that is not the
    /// whole mapping (the owner's memory was re-created smaller: a first export of a run).
    Imported {
        owner: memsaver_ipc::identity::Identity,
        group: i64,
        id: u64,
        key: u64,
        offset: u64,
        window: Option<(u64, u64)>,
    },
}

/// The driver's handle behind a virtual one.
pub(crate) type Real = CUmemGenericAllocationHandle;

/// Why a handle stays resident whatever a pause asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Keep {
    /// Host memory NCCL created through the VMM API (`HOST`/`HOST_NUMA` locations).
    Host,
    /// Created with a FABRIC handle type (multi-node NVLink).
    Fabric,
    /// Given to a NIC (GPUDirect RDMA, dmabuf) or bound to a multicast object: the reason.
    Pinned(&'static str),
    /// Exported as a plain driver fd (tokens off, or memsaver could not serve peers): its
    /// importers are unknown.
    ExportedRaw,
    /// Imported from a plain fd: there is no owner to follow.
    PlainImport,
    /// Memory of a memsaver tag that NCCL retained: that tag pauses it.
    Tagged,
    /// A peer's host memory (NCCL's shared-memory transport), which its owner keeps.
    PeerHost,
}

impl Keep {
    pub fn reason(self) -> &'static str {
        match self {
            Keep::Host => "host memory",
            Keep::Fabric => "FABRIC handle",
            Keep::Pinned(why) => why,
            Keep::ExportedRaw => "exported as a plain fd (MEMSAVER_NCCL_TOKENS=0)",
            Keep::PlainImport => {
                "imported from a plain fd (the owner is not preloaded, or MEMSAVER_NCCL_TOKENS=0)"
            }
            Keep::PeerHost => "a peer's host memory",
            Keep::Tagged => "memory of a memsaver tag (its tag pauses it)",
        }
    }
}

/// Where one of NCCL's handles stands. Only the transitions of [`Physical`] change it
/// (docs/architecture.md draws them):
///
/// ```text
/// tagged:  Kept(Tagged) ──tag_paused──► TagPaused ──tag_resumed──► Kept(Tagged)
/// own:     Resident ──release──► Paused ──claim──► Resuming ──resumed──► Resident
///             │                    ▲                  │
///             └─keep─► Kept        └──── unclaim ─────┘ (out of memory, a failed map)
/// import:  Mapped(g) ──release──► Released(g) ──remapped(g')──► Mapped(g')
///                                       │
///                                       └──orphaned──► Orphaned(g) (the owner freed it)
/// ```
///
/// A pause holds the registry lock for its whole local step, so no handle is ever seen half
/// paused; a resume drops it between batches, so the handles it has claimed and not yet
/// restored are `Resuming`: the peer server serves them only once restored, and NCCL may free
/// one meanwhile (the resume skips it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum State {
    /// Created here; its memory is mapped.
    Resident(Real),
    /// Stays resident whatever a pause asks (own or imported).
    Kept(Real, Keep),
    /// Created here; released by a pause, its contents in its backup (if its policy keeps
    /// them).
    Paused,
    /// Created here; claimed by the resume in progress, not restored yet.
    Resuming,
    /// A peer's buffer imported here and mapped: the owner's generation it maps.
    Mapped(Real, u64),
    /// A peer's buffer released by a pause: the owner's generation it mapped last.
    Released(u64),
    /// Memory of a memsaver tag that NCCL retained ([`Kind::Tagged`]), while its tag is paused:
    /// the driver's handle NCCL held and NCCL's own mappings of it are released (their
    /// addresses stay reserved and recorded); the tag's resume maps the new memory there.
    TagPaused,
    /// A released import whose owner freed the buffer meanwhile (it answered a resume's fetch
    /// `Gone`): nothing to map ever again, nothing held; NCCL frees the import in its own time.
    /// The owner's generation it mapped last.
    Orphaned(u64),
}

/// A transition that the handle's state does not allow (a bug of memsaver's, reported
/// instead of acted on).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BadTransition {
    pub transition: &'static str,
    pub from: State,
}

impl std::fmt::Display for BadTransition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "internal: an NCCL handle in state {:?} cannot take '{}'",
            self.from, self.transition
        )
    }
}

impl From<BadTransition> for memsaver_allocator::Error {
    fn from(e: BadTransition) -> Self {
        memsaver_allocator::Error::InvalidArgument(e.to_string())
    }
}

pub(crate) struct Physical {
    state: State,
    /// Bytes (for imports: learnt when mapped).
    pub size: u64,
    pub prop: CUmemAllocationProp,
    pub kind: Kind,
    /// References NCCL holds (create/import = 1, each retain + 1, each release - 1).
    pub refs: u32,
    /// Exported to another process at least once (through a token, see
    /// `memsaver_ipc::token`, or raw). A buffer exported through a token is also an export of
    /// the owner's ledger (`memsaver_ipc::exported`, [`Delivery::Collective`], by its virtual
    /// handle), which holds its key, its generation and its importers.
    ///
    /// [`Delivery::Collective`]: memsaver_ipc::shared::Delivery::Collective
    pub exported: bool,
    /// For an import: where the buffer lies in the memory its owner served (offset, size of
    /// that memory): (0, the buffer's size) when the owner backs it alone.
    pub served: (u64, u64),
    /// For an import: the owner and its buffer (`None` when imported from a plain fd).
    pub source: Option<Source>,
    /// Contents while paused (its first `backup_len` bytes), kept for reuse across cycles
    /// while retention is on.
    pub backup: Option<memsaver_allocator::Backup>,
    pub backup_len: u64,
    /// For [`Kind::Tagged`] and [`Kind::Registered`]: what the registration made of it.
    pub registration: Option<Registration>,
    /// Own memory that a resume backed with a [`Run`] it shares with its neighbours: the
    /// run's base (a key of [`Registry::runs`]). Set exactly while resident in the run.
    pub run: Option<CUdeviceptr>,
}

/// Where an import comes from.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Source {
    pub owner: u32,
    pub vh: u64,
    /// The buffer's key, from its token.
    pub key: u64,
}

impl Source {
    /// What names this import's buffer at the owner, in `generation`.
    pub fn item(&self, generation: u64) -> memsaver_ipc::protocol::Buffer {
        memsaver_ipc::protocol::Buffer {
            id: self.vh,
            key: self.key,
            generation,
        }
    }
}

impl Physical {
    fn with_state(state: State, size: u64, prop: CUmemAllocationProp, kind: Kind) -> Self {
        Self {
            state,
            size,
            prop,
            kind,
            refs: 1,
            exported: false,
            served: (0, 0),
            source: None,
            backup: None,
            backup_len: 0,
            registration: None,
            run: None,
        }
    }

    /// Memory NCCL created here: device memory is `Resident`, host and FABRIC memory `Kept`.
    pub fn created(real: Real, size: u64, prop: CUmemAllocationProp, kind: Kind) -> Self {
        let state = match kind {
            Kind::Host => State::Kept(real, Keep::Host),
            Kind::Fabric => State::Kept(real, Keep::Fabric),
            Kind::Device | Kind::Imported | Kind::Registered => State::Resident(real),
            Kind::Tagged => State::Kept(real, Keep::Tagged),
        };
        Self::with_state(state, size, prop, kind)
    }

    /// The handle of memsaver memory at `at` that NCCL retained (`Kept`: its tag pauses it).
    pub fn retained(real: Real, size: u64, prop: CUmemAllocationProp, at: u64, id: u64) -> Self {
        let mut p = Self::created(real, size, prop, Kind::Tagged);
        p.registration = Some(Registration::Retained { at, id });
        p
    }

    /// A peer's memsaver memory NCCL registered, imported here at the owner's `generation`
    /// (`Mapped`: the owner's release and rebuild move it, [`crate::registered`]).
    pub fn registered(
        real: Real,
        prop: CUmemAllocationProp,
        registration: Registration,
        generation: u64,
    ) -> Self {
        let mut p = Self::with_state(State::Mapped(real, generation), 0, prop, Kind::Registered);
        p.registration = Some(registration);
        p
    }

    /// A peer's memory NCCL imported here (its size is learnt when mapped): `Mapped` at the
    /// owner's generation when it came through a token, `Kept` when there is no owner to
    /// follow (a plain fd) or it is the owner's host memory.
    pub fn imported(real: Real, prop: CUmemAllocationProp, source: Option<(Source, u64)>) -> Self {
        let mut p = Self::with_state(State::Resident(real), 0, prop, Kind::Imported);
        p.state = match source {
            None => State::Kept(real, Keep::PlainImport),
            Some(_) if p.is_host() => State::Kept(real, Keep::PeerHost),
            Some((_, generation)) => State::Mapped(real, generation),
        };
        p.source = source.map(|(s, _)| s);
        p
    }

    pub fn state(&self) -> State {
        self.state
    }

    /// The driver's handle while the memory is there (`Resident`, `Kept`, `Mapped`).
    pub fn real(&self) -> Option<Real> {
        match self.state {
            State::Resident(r) | State::Kept(r, _) | State::Mapped(r, _) => Some(r),
            State::Paused
            | State::Resuming
            | State::Released(_)
            | State::Orphaned(_)
            | State::TagPaused => None,
        }
    }

    /// Whether pause may release it, and if not, why.
    pub fn pausable(&self) -> Result<(), &'static str> {
        match self.state {
            State::Kept(_, why) => Err(why.reason()),
            _ => Ok(()),
        }
    }

    /// Own memory released by a pause and not restored yet (`Paused` or `Resuming`).
    pub fn is_paused_own(&self) -> bool {
        matches!(self.state, State::Paused | State::Resuming)
    }

    fn bad(&self, transition: &'static str) -> BadTransition {
        BadTransition {
            transition,
            from: self.state,
        }
    }

    /// `Resident` → `Kept(why)`: it must stay resident from now on. A handle kept already
    /// keeps its first reason; a paused one cannot be given away (the caller checked).
    pub fn keep(&mut self, why: Keep) -> Result<(), BadTransition> {
        match self.state {
            State::Resident(r) => {
                self.state = State::Kept(r, why);
                Ok(())
            }
            State::Kept(..) => Ok(()),
            _ => Err(self.bad("keep")),
        }
    }

    /// Pause: `Resident` → `Paused`, `Mapped(g)` → `Released(g)`. Returns the driver's
    /// handle, for the caller to release once its mappings are gone.
    pub fn release(&mut self) -> Result<Real, BadTransition> {
        match self.state {
            State::Resident(r) => {
                self.state = State::Paused;
                self.run = None;
                Ok(r)
            }
            State::Mapped(r, g) => {
                self.state = State::Released(g);
                self.run = None;
                Ok(r)
            }
            _ => Err(self.bad("release")),
        }
    }

    /// Its tag's pause released the memory NCCL retained: `Kept(_, Tagged)` → `TagPaused`.
    /// Returns the driver's handle, for the caller to release once its mappings are gone.
    pub fn tag_paused(&mut self) -> Result<Real, BadTransition> {
        match self.state {
            State::Kept(r, Keep::Tagged) => {
                self.state = State::TagPaused;
                Ok(r)
            }
            _ => Err(self.bad("tag_paused")),
        }
    }

    /// Its tag's resume mapped the new memory `real` where NCCL's mappings were: `TagPaused`
    /// → `Kept(real, Tagged)`.
    pub fn tag_resumed(&mut self, real: Real) -> Result<(), BadTransition> {
        match self.state {
            State::TagPaused => {
                self.state = State::Kept(real, Keep::Tagged);
                Ok(())
            }
            _ => Err(self.bad("tag_resumed")),
        }
    }

    /// Resume claims it: `Paused` → `Resuming`.
    pub fn claim(&mut self) -> Result<(), BadTransition> {
        match self.state {
            State::Paused => {
                self.state = State::Resuming;
                Ok(())
            }
            _ => Err(self.bad("claim")),
        }
    }

    /// Resume could not restore it: `Resuming` → `Paused` (its backup kept).
    pub fn unclaim(&mut self) -> Result<(), BadTransition> {
        match self.state {
            State::Resuming => {
                self.state = State::Paused;
                Ok(())
            }
            _ => Err(self.bad("unclaim")),
        }
    }

    /// Resume restored it in new memory `real`: `Resuming` → `Resident`. (An exported buffer
    /// starts a new generation in the owner's ledger: the resume tells it.)
    pub fn resumed(&mut self, real: Real) -> Result<(), BadTransition> {
        match self.state {
            State::Resuming => {
                self.state = State::Resident(real);
                Ok(())
            }
            _ => Err(self.bad("resumed")),
        }
    }

    /// Resume mapped the owner's generation `g` of a released import: `Released` →
    /// `Mapped(g)`.
    pub fn remapped(&mut self, real: Real, generation: u64) -> Result<(), BadTransition> {
        match self.state {
            State::Released(_) => {
                self.state = State::Mapped(real, generation);
                Ok(())
            }
            _ => Err(self.bad("remapped")),
        }
    }

    /// The owner freed the buffer of a released import: `Released(g)` → `Orphaned(g)`. Resumes
    /// fetch it no more.
    pub fn orphaned(&mut self) -> Result<(), BadTransition> {
        match self.state {
            State::Released(g) => {
                self.state = State::Orphaned(g);
                Ok(())
            }
            _ => Err(self.bad("orphaned")),
        }
    }

    /// The owner's generation an import maps, released last, or mapped last before its owner
    /// freed it: what names the import at its owner when NCCL frees it.
    pub fn imported_generation(&self) -> Option<u64> {
        match self.state {
            State::Mapped(_, g) | State::Released(g) | State::Orphaned(g) => Some(g),
            _ => None,
        }
    }

    /// The owner's generation a released import mapped last (the next to fetch is the one
    /// after it).
    pub fn released_generation(&self) -> Option<u64> {
        match self.state {
            State::Released(g) => Some(g),
            _ => None,
        }
    }

    /// The owner's generation an import maps now.
    pub fn mapped_generation(&self) -> Option<u64> {
        match self.state {
            State::Mapped(_, g) => Some(g),
            _ => None,
        }
    }

    /// Where a registered import's current generation is mapped inside each of NCCL's
    /// mappings of it, when that is not the whole mapping ([`Registration::Imported`]).
    pub fn window(&self) -> Option<(u64, u64)> {
        match self.registration {
            Some(Registration::Imported { window, .. }) => window,
            _ => None,
        }
    }

    /// Given to a NIC or bound to multicast.
    pub fn is_pinned(&self) -> bool {
        matches!(self.state, State::Kept(_, Keep::Pinned(_)))
    }

    pub fn device(&self) -> i32 {
        self.prop.location.id
    }

    /// Whether the memory lives in host memory (known for imports from the driver's answer).
    pub fn is_host(&self) -> bool {
        matches!(
            self.prop.location.type_,
            CU_MEM_LOCATION_TYPE_HOST
                | CU_MEM_LOCATION_TYPE_HOST_NUMA
                | CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT
        )
    }
}

/// The range that holds memory in NCCL's mapping at `ptr` of `size` bytes: all of it, or the
/// `window` (offset, length) of a registered import ([`Physical::window`]).
pub(crate) fn in_window(ptr: u64, size: u64, window: Option<(u64, u64)>) -> (u64, u64) {
    window.map_or((ptr, size), |(off, len)| (ptr + off, len))
}

pub(crate) struct Mapping {
    pub size: u64,
    pub vh: u64,
    /// The access NCCL granted with cuMemSetAccess, replayed on resume.
    pub access: Vec<CUmemAccessDesc>,
}

/// One mapping of a handle: (address, size, the access NCCL granted).
pub(crate) type Range = (CUdeviceptr, u64, Vec<CUmemAccessDesc>);

/// The address of each run member's mapping in its run, by virtual handle
/// ([`Registry::run_places`]).
pub(crate) type RunPlaces = HashMap<u64, CUdeviceptr>;

/// One physical allocation a resume mapped across adjacent own buffers of NCCL's (one
/// `cuMemCreate`, `cuMemMap` and `cuMemSetAccess` instead of one per buffer: the driver's cost
/// is per physical allocation). It lives until the next pause or until NCCL has freed all its
/// buffers; a buffer NCCL frees before that keeps its address range reserved and its bytes
/// held (`dead`), since part of a mapping cannot be unmapped.
pub(crate) struct Run {
    pub size: u64,
    pub real: Real,
    /// Buffers of the run NCCL still holds.
    pub live: usize,
    /// Reservations NCCL freed inside the run: freed with the driver once the run is unmapped.
    pub dead: Vec<(CUdeviceptr, u64)>,
    /// For a run of imports that NCCL placed elsewhere than their owner's layout: the ranges
    /// memsaver reserved around them so that the run maps whole; freed with the driver once
    /// the run is unmapped.
    pub around: Vec<(CUdeviceptr, u64)>,
}

/// An exported buffer that NCCL freed while it was in a resident [`Run`] whose other buffers
/// NCCL still holds (one communicator destroyed while the others live, say).
///
/// A run is one physical allocation, and every importer of any of its buffers maps it whole,
/// once: the freed buffer's importers still hold all of the run's memory, the live buffers'
/// too. So its export is not forgotten at the free, as a lone buffer's is: it stays in the
/// owner's ledger (never served again: `crate::exports` answers an open of it `Failed` at
/// once) and here, and goes through the pause's phases with its run: the pause that releases
/// the run (its work) marks it paused with the run's buffers and waits for its importers as
/// for theirs; once that wait finds nobody holding (the pause settles), it is forgotten:
///
/// ```text
///  NCCL frees it ──► Retired(run: Some(base)) ──the pause releases the run──► Retired(run: None)
///                      │ NCCL frees the run's              │ that pause's wait finds nobody
///                      │ last buffer                       │ holding, or a resume (which
///                      ▼                                   ▼ rebuilds the run without it)
///                    forgotten, with the run             forgotten
/// ```
///
/// Once the run's last buffer goes, this process holds nothing of the memory, and the export
/// is forgotten as a lone buffer's is at its free (what its importers still map is theirs to
/// free). A resume forgets what a failed pause left: the rebuilt run is a new generation,
/// which no importer of the freed buffer maps (the ledger waits only for importers of the
/// current one). Its bytes are held in the run (`Run::dead`, `freed_held_bytes`) until the run
/// is released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Retired {
    /// The buffer's bytes and device, for the messages that name what an importer holds.
    pub size: u64,
    pub device: i32,
    /// The run whose memory its importers map, while this process has it mapped (a key of
    /// [`Registry::runs`]); `None` once a pause released it.
    pub run: Option<CUdeviceptr>,
}

/// What the driver must still be told once NCCL let go of a buffer ([`Registry::collect`]):
/// the handle to release, or, for the last buffer of a run, the run to unmap and release.
pub(crate) enum Gone {
    Handle(Physical),
    /// The last buffer of the run at `base`, and the [`Retired`] buffers of that run, whose
    /// exports go with it.
    Run {
        base: CUdeviceptr,
        run: Run,
        last: Physical,
        retired: Vec<u64>,
    },
    /// A buffer of a run that other buffers still use: only the record went (an exported one
    /// is [`Retired`]).
    Member(Physical),
}

impl Gone {
    /// The record that went.
    pub fn physical(&self) -> &Physical {
        match self {
            Gone::Handle(p) | Gone::Run { last: p, .. } | Gone::Member(p) => p,
        }
    }
}

#[derive(Default)]
pub(crate) struct Registry {
    pub physicals: HashMap<u64, Physical>,
    /// By base address.
    pub mappings: BTreeMap<CUdeviceptr, Mapping>,
    /// By base address.
    pub runs: BTreeMap<CUdeviceptr, Run>,
    /// Ranges reserved for owners' layouts, one per block of an owner's addresses
    /// ([`MIRROR_BLOCK`]): (owner, block) -> base.
    pub mirrors: HashMap<(u32, u64), CUdeviceptr>,
    /// Address space memsaver reserved for NCCL's own buffers ([`OWN_ARENA`] each), and the
    /// parts of it not handed out, by start: NCCL's buffers are carved from it lowest address
    /// first, so that the buffers NCCL allocates one after another are adjacent and a resume
    /// can back them with one run, whatever else the process maps meanwhile.
    pub own_free: BTreeMap<CUdeviceptr, u64>,
    /// Ranges of memsaver's reservations handed to NCCL as its reservations: NCCL's own
    /// buffers' (from the own arenas) and its imports' (in the owners' layouts).
    pub handed: BTreeMap<CUdeviceptr, Handed>,
    /// Exported buffers NCCL freed inside runs, whose exports stay until their importers
    /// let go of the run ([`Retired`]), by virtual handle.
    pub retired: HashMap<u64, Retired>,
    next: u64,
    pub multicast_objects: u64,
}

/// Guards the registry. Held by NCCL's wrapped calls (one call each, bookkeeping and their
/// driver call; a reservation NCCL asks for may reserve memsaver's address space for NCCL's
/// buffers or for an owner's layout, 64 GiB of addresses, under it), by the `nccl` pause for its whole local step (so NCCL cannot map or unmap
/// memory while it is being paused), by resume per batch of handles (handed over fairly
/// between batches so the peer server can answer), by the peer server per batch of answers,
/// and by `stats`; never while waiting for a peer. Under it only the allocator's `devices`
/// (the copy stream) is taken; never `GRAPHS`, and never the start of the allocator (which
/// takes `external`, a lock before this one).
static REGISTRY: Mutex<Option<Registry>> = Mutex::new(None);

/// Held while an import of a peer's registered buffer is being made (from the owner's answer
/// until the import is recorded) and while an owner's release or rebuild of such imports runs,
/// before the registry lock: a release that arrives while an import is under way waits until
/// it is recorded, and then releases it.
pub(crate) static REGISTERING: Mutex<()> = Mutex::new(());

pub(crate) fn lock() -> parking_lot::MappedMutexGuard<'static, Registry> {
    MutexGuard::map(REGISTRY.lock(), |r| r.get_or_insert_with(Registry::default))
}

impl Registry {
    pub fn insert(&mut self, p: Physical) -> u64 {
        self.next += 1;
        let vh = VH_BASE | self.next;
        self.physicals.insert(vh, p);
        vh
    }

    /// What an owner serves of its buffer `vh`: the driver's handle of its memory now and
    /// where the buffer lies in it (offset, size of that memory): a run's (where `in_runs`
    /// says it is mapped), or its own.
    pub fn served_layout(&self, vh: u64, in_runs: &RunPlaces) -> Option<(Real, u64, u64)> {
        let p = self.physicals.get(&vh)?;
        let real = p.real()?;
        Some(
            match p.run.and_then(|base| Some((base, self.runs.get(&base)?))) {
                Some((base, run)) => (real, in_runs.get(&vh)? - base, run.size),
                None => (real, 0, p.size),
            },
        )
    }

    /// Where each buffer of a run is mapped in it, read once for a batch of
    /// [`Registry::served_layout`] calls (the mappings are keyed by address, not by buffer).
    pub fn run_places(&self) -> RunPlaces {
        let mut out = RunPlaces::new();
        for (&base, run) in &self.runs {
            for (&at, m) in self.mappings.range(base..base + run.size) {
                out.entry(m.vh).or_insert(at);
            }
        }
        out
    }

    /// The runs that hold a buffer that must stay resident (given to a NIC, bound to
    /// multicast, ...), by base: pauses keep such a run whole.
    pub fn runs_that_stay(&self) -> HashSet<CUdeviceptr> {
        self.physicals
            .values()
            .filter(|p| p.pausable().is_err())
            .filter_map(|p| p.run)
            .collect()
    }

    /// The address of the first mapping of `vh`, 0 if it has none.
    pub fn place_of(&self, vh: u64) -> u64 {
        self.mappings
            .iter()
            .find(|(_, m)| m.vh == vh)
            .map_or(0, |(ptr, _)| *ptr)
    }

    /// The mapping containing `addr`: (base, mapping).
    pub fn mapping_at(&self, addr: CUdeviceptr) -> Option<(CUdeviceptr, &Mapping)> {
        let (base, m) = self.mappings.range(..=addr).next_back()?;
        (addr < base + m.size).then_some((*base, m))
    }

    /// The mappings of every mapped handle, in address order (one pass over the mappings,
    /// which are keyed by address).
    pub fn ranges_by_handle(&self) -> HashMap<u64, Vec<Range>> {
        let mut out: HashMap<u64, Vec<Range>> = HashMap::new();
        for (ptr, m) in &self.mappings {
            out.entry(m.vh)
                .or_default()
                .push((*ptr, m.size, m.access.clone()));
        }
        out
    }

    /// Forgets a physical object NCCL no longer references and no mapping uses, returning
    /// what the driver must be told (outside the lock): its handle to release, or the run it
    /// was the last buffer of. An exported buffer of a run whose other buffers live is
    /// [`Retired`].
    pub fn collect(&mut self, vh: u64) -> Option<Gone> {
        let unused = self.physicals.get(&vh).is_some_and(|p| p.refs == 0)
            && !self.mappings.values().any(|m| m.vh == vh);
        if !unused {
            return None;
        }
        let p = self.physicals.remove(&vh)?;
        let Some(base) = p.run else {
            return Some(Gone::Handle(p));
        };
        // Called from NCCL's wrapped calls: a broken record is logged, never a panic.
        let Some(run) = self.runs.get_mut(&base) else {
            tracing::error!(
                base,
                "internal: an NCCL buffer names a run memsaver has no record of"
            );
            return Some(Gone::Member(p));
        };
        run.live = run.live.saturating_sub(1);
        if run.live > 0 {
            if p.exported && p.kind == Kind::Device {
                let r = Retired {
                    size: p.size,
                    device: p.device(),
                    run: Some(base),
                };
                self.retired.insert(vh, r);
            }
            return Some(Gone::Member(p));
        }
        let Some(run) = self.runs.remove(&base) else {
            return Some(Gone::Member(p));
        };
        let retired = self
            .retired
            .extract_if(|_, r| r.run == Some(base))
            .map(|(vh, _)| vh)
            .collect();
        Some(Gone::Run {
            base,
            run,
            last: p,
            retired,
        })
    }

    /// A pause released the run at `base`: its [`Retired`] buffers are released with it
    /// (their exports are paused, and the pause waits for their importers).
    pub fn run_released(&mut self, base: CUdeviceptr) {
        for r in self.retired.values_mut().filter(|r| r.run == Some(base)) {
            r.run = None;
        }
    }

    /// The [`Retired`] buffers whose run a pause released.
    pub fn retired_released(&self) -> impl Iterator<Item = u64> + '_ {
        self.retired
            .iter()
            .filter(|(_, r)| r.run.is_none())
            .map(|(vh, _)| *vh)
    }

    /// Forgets the [`Retired`] buffers whose run a pause released (a pause's wait found
    /// nobody holding them, or a resume rebuilds the runs without them), returning them.
    pub fn forget_retired_released(&mut self) -> Vec<u64> {
        self.retired
            .extract_if(|_, r| r.run.is_none())
            .map(|(vh, _)| vh)
            .collect()
    }

    /// The address for an import of `len` bytes of `owner`'s buffer at `place` (aligned to
    /// `align`): in this process's copy of the owner's layout, at the same distance from the
    /// start of its block as in the owner; the block's range is reserved with `reserve(size,
    /// alignment)` the first time. `None` when that cannot be (the reservation failed, the
    /// place is taken: the same buffer imported twice, or it crosses a block's end).
    pub fn place_import(
        &mut self,
        owner: u32,
        place: u64,
        len: u64,
        align: u64,
        reserve: impl FnOnce(u64, u64) -> Option<CUdeviceptr>,
    ) -> Option<CUdeviceptr> {
        let (block, off) = (place / MIRROR_BLOCK, place % MIRROR_BLOCK);
        if off + len > MIRROR_BLOCK {
            return None;
        }
        let base = match self.mirrors.get(&(owner, block)) {
            Some(base) => *base,
            None => {
                // Aligned as the block's start would be up to 1 GiB, so that an offset keeps
                // the alignment NCCL asked of the owner.
                let base = reserve(MIRROR_BLOCK, 1 << 30)?;
                self.mirrors.insert((owner, block), base);
                base
            }
        };
        let at = base + off;
        let taken = self
            .handed
            .range(..at + len)
            .next_back()
            .is_some_and(|(p, h)| p + h.len > at);
        if taken || (align > 1 && !at.is_multiple_of(align)) {
            return None;
        }
        self.handed.insert(at, Handed { len, own: false });
        Some(at)
    }

    /// An address range of `len` bytes aligned to `align` for NCCL's own buffer: the lowest
    /// free one in the own arenas, a new arena reserved with `reserve(size, alignment)` when
    /// none fits. `None` when that cannot be (the caller asks the driver).
    pub fn carve_own(
        &mut self,
        len: u64,
        align: u64,
        reserve: impl FnOnce(u64, u64) -> Option<CUdeviceptr>,
    ) -> Option<CUdeviceptr> {
        let align = align.max(1);
        let fits = |(start, free): (&CUdeviceptr, &u64)| {
            let at = start.next_multiple_of(align);
            (at + len <= start + free).then_some((*start, *free, at))
        };
        let found = match self.own_free.iter().find_map(fits) {
            Some(f) => f,
            None => {
                let size = OWN_ARENA.max(len.next_multiple_of(1 << 30));
                let base = reserve(size, (1 << 30).max(align))?;
                self.own_free.insert(base, size);
                (base, size, base.next_multiple_of(align))
            }
        };
        let (start, free, at) = found;
        self.own_free.remove(&start);
        if at > start {
            self.own_free.insert(start, at - start);
        }
        if start + free > at + len {
            self.own_free.insert(at + len, start + free - (at + len));
        }
        self.handed.insert(at, Handed { len, own: true });
        Some(at)
    }

    /// NCCL freed its reservation at `ptr` (or a run that covered it went): `true` when the
    /// range was memsaver's (an own arena's space is free again, merged with its free
    /// neighbours; an import's place is forgotten), `false` when it is the driver's to free.
    pub fn free_range(&mut self, ptr: CUdeviceptr) -> bool {
        let Some(h) = self.handed.remove(&ptr) else {
            return false;
        };
        if h.own {
            let (mut start, mut len) = (ptr, h.len);
            if let Some((&s, &l)) = self.own_free.range(..start).next_back()
                && s + l == start
            {
                self.own_free.remove(&s);
                (start, len) = (s, l + len);
            }
            if let Some(next) = self.own_free.remove(&(start + len)) {
                len += next;
            }
            self.own_free.insert(start, len);
        }
        true
    }

    /// Whether `[ptr, ptr + size)` lies inside one range reserved for an owner's layout.
    pub fn in_mirror(&self, ptr: CUdeviceptr, size: u64) -> bool {
        self.mirrors
            .values()
            .any(|base| ptr >= *base && ptr + size <= base + MIRROR_BLOCK)
    }

    /// The live run whose mapping covers any of `[ptr, ptr + size)`.
    pub fn run_over(&mut self, ptr: CUdeviceptr, size: u64) -> Option<&mut Run> {
        let (base, run) = self.runs.range_mut(..ptr + size).next_back()?;
        (*base + run.size > ptr).then_some(run)
    }
}

/// NCCL's memory as the hook sees it, in bytes of live handles.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NcclStats {
    /// NCCL resolved its driver entry points through memsaver (libmemsaver.so was preloaded
    /// before NCCL initialised).
    pub hooked: bool,
    /// `NCCL_CUMEM_ENABLE=0`: NCCL uses cudaMalloc and legacy IPC, which no VMM hook can see.
    pub cumem_disabled: bool,
    /// The `nccl` tag is paused.
    pub paused: bool,
    /// Device memory NCCL created in this process.
    pub owned_bytes: u64,
    pub owned_handles: u64,
    /// Of those, released by the current pause.
    pub paused_bytes: u64,
    /// Of those, handles exported to other processes at least once.
    pub exported_handles: u64,
    pub exported_bytes: u64,
    /// Peers' memory this process imported and mapped.
    pub imported_bytes: u64,
    pub imported_handles: u64,
    /// Kept resident: host memory NCCL allocated through the VMM API.
    pub resident_host_bytes: u64,
    /// Kept resident: FABRIC (multi-node NVLink) handles.
    pub resident_fabric_bytes: u64,
    /// Kept resident: ranges given to a NIC (GPUDirect RDMA, dmabuf) or bound to multicast.
    pub resident_pinned_bytes: u64,
    /// Multicast (NVLS) objects created; they stay.
    pub multicast_objects: u64,
    pub mappings: u64,
    /// Physical allocations a resume made for several adjacent buffers each, and the bytes of
    /// buffers NCCL freed inside them, held until the next pause or until the run is unused.
    pub runs: u64,
    pub freed_held_bytes: u64,
    /// Bytes the last pause copied to backups, and the last resume back from them (only the
    /// blocks that hold something, where packed: `MEMSAVER_PACK`).
    pub bytes_copied_per_pause: u64,
    pub bytes_copied_per_resume: u64,
    /// Local memory the current pause freed by lowering the kernel stack size (per device:
    /// (old - new limit) x multiprocessors x threads per multiprocessor).
    pub stack_lowered_bytes: u64,
    /// Local memory the current pause kept above CUDA's default stack size, and why (per
    /// device, "device N: reason"; `None` when nothing was kept).
    pub stack_kept_bytes: u64,
    pub stack_kept_reason: Option<String>,
    /// NCCL exports handed out as plain fds because memsaver could not serve its peers (they
    /// and the peers' imports of them stay resident on pause), and why (`None`: none did).
    pub fallback_exports: u64,
    pub fallback_reason: Option<String>,
    /// Memory the application took from `ncclMemAlloc`: not NCCL's, not in the figures above.
    pub application: AppMemoryStats,
}

/// What `nccl_stats()["application"]` reports: memory the application took from `ncclMemAlloc`.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct AppMemoryStats {
    pub allocations: u64,
    pub bytes: u64,
    /// Bytes of each tag (memsaver's memory, paused and resumed with that tag).
    pub tagged_bytes: BTreeMap<String, u64>,
    /// Bytes libnccl allocated outside any region: resident, never paused.
    pub untagged_bytes: u64,
}

/// The figures of the handles and mappings recorded here (the caller adds what it knows
/// beyond them: the stack size a pause lowered, exports that fell back to plain fds).
pub(crate) fn stats(hooked: bool, cumem_disabled: bool, paused: bool) -> NcclStats {
    let r = lock();
    let mut s = NcclStats {
        hooked,
        cumem_disabled,
        paused,
        ..Default::default()
    };
    for p in r.physicals.values() {
        match p.kind {
            Kind::Device => {
                s.owned_bytes += p.size;
                s.owned_handles += 1;
                if p.is_paused_own() {
                    s.paused_bytes += p.size;
                }
                if p.exported {
                    s.exported_handles += 1;
                    s.exported_bytes += p.size;
                }
                if p.is_pinned() {
                    s.resident_pinned_bytes += p.size;
                }
            }
            Kind::Imported => {
                s.imported_bytes += p.size;
                s.imported_handles += 1;
            }
            Kind::Host => s.resident_host_bytes += p.size,
            Kind::Fabric => s.resident_fabric_bytes += p.size,
            // Memory of memsaver's tags, counted with them (`stats().shared`).
            Kind::Tagged | Kind::Registered => {}
        }
    }
    s.multicast_objects = r.multicast_objects;
    s.mappings = r.mappings.len() as u64;
    s.runs = r.runs.len() as u64;
    s.freed_held_bytes = r.runs.values().flat_map(|r| &r.dead).map(|d| d.1).sum();
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prop(location: std::ffi::c_uint) -> CUmemAllocationProp {
        let mut p = CUmemAllocationProp::default();
        p.location.type_ = location;
        p
    }

    fn own() -> Physical {
        Physical::created(7, 2 << 20, prop(CU_MEM_LOCATION_TYPE_DEVICE), Kind::Device)
    }

    fn source() -> Source {
        Source {
            owner: 42,
            vh: VH_BASE | 1,
            key: 99,
        }
    }

    fn import() -> Physical {
        Physical::imported(8, prop(CU_MEM_LOCATION_TYPE_DEVICE), Some((source(), 3)))
    }

    #[test]
    fn own_buffers_are_carved_side_by_side_and_freed_space_is_used_again() {
        let mut reg = Registry::default();
        let arenas = std::cell::Cell::new(0u64);
        let reserve = |size: u64, align: u64| {
            assert_eq!((size, align), (OWN_ARENA, 1 << 30));
            arenas.set(arenas.get() + 1);
            Some(arenas.get() * 0x1000_0000_0000)
        };
        let m = 2 << 20;
        let a = reg.carve_own(m, m, reserve).unwrap();
        let b = reg.carve_own(2 * m, m, reserve).unwrap();
        let c = reg.carve_own(m, m, reserve).unwrap();
        assert_eq!((b - a, c - b), (m, 2 * m), "one after another, adjacent");
        assert_eq!(arenas.get(), 1, "one arena for all");
        // An alignment NCCL asks is kept (the space skipped stays free).
        let d = reg.carve_own(m, 8 * m, reserve).unwrap();
        assert!(d.is_multiple_of(8 * m) && d > c);
        // Freed: the space is handed out again, merged with its free neighbours.
        assert!(reg.free_range(b) && reg.free_range(a));
        assert_eq!(reg.carve_own(3 * m, m, reserve), Some(a));
        assert!(
            !reg.free_range(a + 1),
            "not one of memsaver's ranges: the driver's"
        );
        // The arena full: another.
        let big = reg.carve_own(OWN_ARENA, m, reserve).unwrap();
        assert_eq!((arenas.get(), big), (2, 2 * 0x1000_0000_0000));
        // No address space to be had: the caller asks the driver.
        assert_eq!(reg.carve_own(OWN_ARENA, m, |_, _| None), None);
    }

    /// Freeing a range whose lower neighbour is free makes one free range of both (the test
    /// above frees the upper neighbour last, which covers only the merge with the range after).
    #[test]
    fn a_freed_range_merges_with_the_free_range_before_it() {
        let mut reg = Registry::default();
        let reserve = |_: u64, _: u64| Some(0x1000_0000_0000);
        let m = 2 << 20;
        let a = reg.carve_own(m, m, reserve).unwrap();
        let b = reg.carve_own(2 * m, m, reserve).unwrap();
        // Keeps b's end from touching the arena's free tail.
        let c = reg.carve_own(m, m, reserve).unwrap();
        assert_eq!((b - a, c - b), (m, 2 * m));
        assert!(reg.free_range(a) && reg.free_range(b));
        assert_eq!(
            reg.carve_own(3 * m, m, reserve),
            Some(a),
            "a and b are one free range"
        );
    }

    #[test]
    fn imports_are_placed_as_their_owner_lays_them_out_block_by_block() {
        let mut reg = Registry::default();
        let reserved = std::cell::RefCell::new(Vec::new());
        let reserve = |size: u64, align: u64| {
            let mut r = reserved.borrow_mut();
            r.push((size, align));
            Some(0x7000_0000_0000 + r.len() as u64 * 0x100_0000_0000)
        };
        let m = 2 << 20;
        // Owner 5's buffers at two places of one block: the same distance apart here.
        let place = 3 * MIRROR_BLOCK + 0x4000_0000;
        let a = reg.place_import(5, place, m, m, reserve).unwrap();
        let b = reg.place_import(5, place + 3 * m, m, m, reserve).unwrap();
        assert_eq!(b - a, 3 * m);
        assert_eq!(
            a % MIRROR_BLOCK,
            0x4000_0000,
            "the offset in the block is kept"
        );
        // Another owner, or another block of the same owner: another range.
        let c = reg.place_import(6, place, m, m, reserve).unwrap();
        let d = reg
            .place_import(5, place + MIRROR_BLOCK, m, m, reserve)
            .unwrap();
        assert!(c.abs_diff(a) >= MIRROR_BLOCK && d.abs_diff(a) >= MIRROR_BLOCK);
        assert_eq!(*reserved.borrow(), vec![(MIRROR_BLOCK, 1 << 30); 3]);
        // The same buffer imported twice, an overlap, a range across a block's end, an
        // alignment the place cannot give: the driver's address instead.
        assert_eq!(reg.place_import(5, place, m, m, reserve), None);
        assert_eq!(reg.place_import(5, place + m / 2, m, 1, reserve), None);
        assert_eq!(
            reg.place_import(5, 4 * MIRROR_BLOCK - m, 2 * m, m, reserve),
            None
        );
        assert_eq!(
            reg.place_import(5, place + 8 * m, m, 1 << 30, reserve),
            None
        );
        // A block whose range cannot be reserved.
        assert_eq!(reg.place_import(9, place, m, m, |_, _| None), None);
        assert!(reg.in_mirror(a, 4 * m) && !reg.in_mirror(a - MIRROR_BLOCK, m));
    }

    /// A run at `base` of own buffers (exported or not, as `exported` says), which NCCL has
    /// unmapped and released (the next `collect` of each forgets it).
    fn run_of(reg: &mut Registry, base: u64, exported: &[bool]) -> Vec<u64> {
        let vhs: Vec<u64> = exported
            .iter()
            .map(|e| {
                let mut p = own();
                (p.exported, p.run, p.refs) = (*e, Some(base), 0);
                reg.insert(p)
            })
            .collect();
        let run = Run {
            size: vhs.len() as u64 * (2 << 20),
            real: 7,
            live: vhs.len(),
            dead: Vec::new(),
            around: Vec::new(),
        };
        reg.runs.insert(base, run);
        vhs
    }

    /// A peer is served each buffer of a run as the run's memory with the buffer's offset in
    /// it (read from its mapping in the run, not from one elsewhere), and a buffer alone as
    /// its own memory.
    #[test]
    fn a_run_member_is_served_at_its_offset_in_the_run() {
        let mut reg = Registry::default();
        let (base, m) = (0x7000_0000_0000, 2 << 20);
        let vhs = run_of(&mut reg, base, &[true, false, true]);
        let map = |reg: &mut Registry, at: u64, vh: u64| {
            let access = Vec::new();
            reg.mappings.insert(
                at,
                Mapping {
                    size: m,
                    vh,
                    access,
                },
            );
        };
        for (i, vh) in vhs.iter().enumerate() {
            map(&mut reg, base + i as u64 * m, *vh);
        }
        // The last one mapped a second time, at a lower address outside the run.
        map(&mut reg, base - 4 * m, vhs[2]);
        let alone = reg.insert(own());
        map(&mut reg, base + 8 * m, alone);
        let in_runs = reg.run_places();
        assert_eq!(in_runs.len(), 3, "{in_runs:?}");
        let size = 3 * m;
        assert_eq!(reg.served_layout(vhs[0], &in_runs), Some((7, 0, size)));
        assert_eq!(reg.served_layout(vhs[2], &in_runs), Some((7, 2 * m, size)));
        assert_eq!(reg.served_layout(alone, &in_runs), Some((7, 0, m)));
        assert_eq!(reg.served_layout(VH_BASE | 999, &in_runs), None);
    }

    #[test]
    fn an_exported_buffer_freed_inside_a_live_run_is_retired_until_its_pause_settles() {
        let mut reg = Registry::default();
        let base = 0x7000_0000_0000;
        let vhs = run_of(&mut reg, base, &[true, false, true]);
        // Exported, freed while the others live: retired with its run.
        assert!(matches!(reg.collect(vhs[0]), Some(Gone::Member(_))));
        let retired = Retired {
            size: 2 << 20,
            device: 0,
            run: Some(base),
        };
        assert_eq!(reg.retired.get(&vhs[0]), Some(&retired));
        // Private: only its record goes.
        assert!(matches!(reg.collect(vhs[1]), Some(Gone::Member(_))));
        assert!(!reg.retired.contains_key(&vhs[1]));
        // While the run is resident, nothing is released, and nothing settles.
        assert_eq!(reg.retired_released().count(), 0);
        assert_eq!(reg.forget_retired_released(), Vec::<u64>::new());
        assert!(reg.retired.contains_key(&vhs[0]));
        // A pause releases the run: the retired buffer is released with it, and forgotten
        // once the pause settles.
        reg.runs.remove(&base);
        reg.run_released(base);
        assert_eq!(reg.retired_released().collect::<Vec<_>>(), vec![vhs[0]]);
        assert_eq!(reg.forget_retired_released(), vec![vhs[0]]);
        assert!(reg.retired.is_empty());
    }

    #[test]
    fn the_buffers_retired_in_a_run_go_with_its_last_buffer() {
        let mut reg = Registry::default();
        let (a, b) = (0x7000_0000_0000, 0x7100_0000_0000);
        let first = run_of(&mut reg, a, &[true, true]);
        let other = run_of(&mut reg, b, &[true, true]);
        reg.collect(first[0]);
        reg.collect(other[0]);
        match reg.collect(first[1]) {
            Some(Gone::Run {
                base, run, retired, ..
            }) => {
                assert_eq!((base, run.size, retired), (a, 4 << 20, vec![first[0]]));
            }
            _ => panic!("the run's last buffer takes the run"),
        }
        assert_eq!(
            reg.retired.keys().copied().collect::<Vec<_>>(),
            vec![other[0]],
            "another run's retired buffer stays"
        );
    }

    #[test]
    fn creation_decides_between_resident_and_kept() {
        assert_eq!(own().state(), State::Resident(7));
        let host = Physical::created(1, 1, prop(CU_MEM_LOCATION_TYPE_HOST_NUMA), Kind::Host);
        assert_eq!(host.state(), State::Kept(1, Keep::Host));
        assert_eq!(host.pausable(), Err("host memory"));
        let fabric = Physical::created(2, 1, prop(CU_MEM_LOCATION_TYPE_DEVICE), Kind::Fabric);
        assert_eq!(fabric.state(), State::Kept(2, Keep::Fabric));
        assert_eq!(import().state(), State::Mapped(8, 3));
        let plain = Physical::imported(9, prop(CU_MEM_LOCATION_TYPE_DEVICE), None);
        assert_eq!(plain.state(), State::Kept(9, Keep::PlainImport));
        assert!(plain.pausable().unwrap_err().contains("plain fd"));
        let peer_host =
            Physical::imported(10, prop(CU_MEM_LOCATION_TYPE_HOST), Some((source(), 0)));
        assert_eq!(peer_host.state(), State::Kept(10, Keep::PeerHost));
    }

    #[test]
    fn an_own_handle_pauses_and_resumes_in_new_memory() {
        let mut p = own();
        p.exported = true;
        assert_eq!(p.release(), Ok(7));
        assert_eq!(p.state(), State::Paused);
        assert_eq!(p.real(), None);
        assert!(p.is_paused_own());
        assert_eq!(p.claim(), Ok(()));
        assert_eq!(p.state(), State::Resuming);
        assert!(
            p.is_paused_own(),
            "claimed but not restored yet: still paused"
        );
        assert_eq!(p.resumed(11), Ok(()));
        assert_eq!(p.state(), State::Resident(11));
        assert_eq!(p.real(), Some(11));
    }

    #[test]
    fn a_resume_that_fails_unclaims() {
        let mut p = own();
        p.release().unwrap();
        p.claim().unwrap();
        assert_eq!(p.unclaim(), Ok(()));
        assert_eq!(p.state(), State::Paused);
        // Unclaiming what was not claimed is refused and changes nothing.
        let err = p.unclaim().unwrap_err();
        assert_eq!((err.transition, err.from), ("unclaim", State::Paused));
        assert_eq!(p.state(), State::Paused);
    }

    #[test]
    fn an_import_is_released_and_remapped_at_the_owners_new_generation() {
        let mut p = import();
        assert_eq!(p.mapped_generation(), Some(3));
        assert_eq!(p.release(), Ok(8));
        assert_eq!(p.state(), State::Released(3));
        assert_eq!(p.released_generation(), Some(3));
        assert!(!p.is_paused_own(), "an import is not own memory");
        assert_eq!(p.remapped(13, 4), Ok(()));
        assert_eq!(p.state(), State::Mapped(13, 4));
        assert_eq!(p.released_generation(), None);
    }

    #[test]
    fn a_released_import_whose_owner_freed_it_is_orphaned_and_fetched_no_more() {
        let mut p = import();
        p.release().unwrap();
        assert_eq!(p.orphaned(), Ok(()));
        assert_eq!(p.state(), State::Orphaned(3));
        assert_eq!(p.real(), None, "it holds no memory");
        assert_eq!(p.released_generation(), None, "a resume does not fetch it");
        assert_eq!(
            p.imported_generation(),
            Some(3),
            "its close names the generation it mapped last"
        );
        assert!(p.remapped(1, 4).is_err(), "nothing maps it again");
    }

    #[test]
    fn keep_turns_resident_into_kept_and_keeps_the_first_reason() {
        let mut p = own();
        assert_eq!(p.keep(Keep::Pinned("given to a NIC")), Ok(()));
        assert_eq!(p.state(), State::Kept(7, Keep::Pinned("given to a NIC")));
        assert!(p.is_pinned());
        assert_eq!(p.keep(Keep::ExportedRaw), Ok(()));
        assert_eq!(p.pausable(), Err("given to a NIC"));
        assert_eq!(p.real(), Some(7), "kept memory stays usable");
    }

    #[test]
    fn every_transition_the_state_does_not_allow_is_refused_and_changes_nothing() {
        type Transition = fn(&mut Physical) -> Result<(), BadTransition>;
        let transitions: [(&str, Transition); 9] = [
            ("keep", |p| p.keep(Keep::ExportedRaw)),
            ("release", |p| p.release().map(|_| ())),
            ("claim", Physical::claim),
            ("unclaim", Physical::unclaim),
            ("resumed", |p| p.resumed(1)),
            ("remapped", |p| p.remapped(1, 1)),
            ("orphaned", Physical::orphaned),
            ("tag_paused", |p| p.tag_paused().map(|_| ())),
            ("tag_resumed", |p| p.tag_resumed(1)),
        ];
        let states = [
            State::Resident(7),
            State::Kept(7, Keep::Host),
            State::Paused,
            State::Resuming,
            State::Mapped(7, 1),
            State::Released(1),
            State::Orphaned(1),
            State::Kept(7, Keep::Tagged),
            State::TagPaused,
        ];
        // The allowed (state, transition) pairs; everything else must be refused.
        let allowed = [
            (State::Resident(7), "keep"),
            (State::Kept(7, Keep::Host), "keep"),
            (State::Resident(7), "release"),
            (State::Mapped(7, 1), "release"),
            (State::Paused, "claim"),
            (State::Resuming, "unclaim"),
            (State::Resuming, "resumed"),
            (State::Released(1), "remapped"),
            (State::Released(1), "orphaned"),
            (State::Kept(7, Keep::Tagged), "keep"),
            (State::Kept(7, Keep::Tagged), "tag_paused"),
            (State::TagPaused, "tag_resumed"),
        ];
        for from in states {
            for (name, t) in transitions {
                let mut p = own();
                p.state = from;
                let r = t(&mut p);
                if allowed.contains(&(from, name)) {
                    assert!(r.is_ok(), "{name} from {from:?}");
                } else {
                    assert_eq!(
                        r,
                        Err(BadTransition {
                            transition: name,
                            from
                        }),
                        "{name} from {from:?}"
                    );
                    assert_eq!(p.state(), from, "a refused {name} changed {from:?}");
                }
            }
        }
    }
}
