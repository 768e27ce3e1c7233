//! One of NCCL's handles and its state machine: what kind of memory it is, where it stands
//! (resident, paused, resuming, kept, imported and released, ...) and the only transitions
//! that change that (docs/architecture.md draws them).

use memsaver_allocator::driver::sys::*;

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
    /// resume, `crate::tag::registered`).
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
/// chunk:   Resident (in a chunk) ──rebacked──► Resident (memory of its own: NCCL reserved
///          its range elsewhere); an import joining its run's mapping: Mapped(g) ──joined──►
///          Mapped(g) (through the run's handle)
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
    /// Memory backed by a [`Run`](super::Run) it shares with its neighbours: the run's base (a
    /// key of [`Registry::runs`](super::Registry::runs)). Set exactly while resident (own) or
    /// mapped (an import) in the run: own memory from a resume, or from its creation in a
    /// chunk; an import whose owner serves such memory.
    pub run: Option<CUdeviceptr>,
    /// Own memory carved in a chunk at its creation, until NCCL maps it there.
    pub carved: Option<Carved>,
}

/// Where NCCL's new buffer lies in the chunk it was carved from
/// ([`Registry::carve_in_chunk`](super::Registry::carve_in_chunk)), until NCCL maps it there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Carved {
    pub at: CUdeviceptr,
    /// NCCL's `cuMemAddressReserve` returned it: the range is NCCL's to free. Until then it is
    /// memsaver's, and goes with the run if NCCL never reserves it.
    pub reserved: bool,
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
            carved: None,
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
    /// (`Mapped`: the owner's release and rebuild move it, [`crate::tag::registered`]).
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

    /// `Resident` in a chunk → `Resident` in memory of its own (`real`): NCCL could not use
    /// the place carved for it.
    pub fn rebacked(&mut self, real: Real) -> Result<(), BadTransition> {
        match self.state {
            State::Resident(_) => {
                self.state = State::Resident(real);
                self.run = None;
                self.carved = None;
                Ok(())
            }
            _ => Err(self.bad("rebacked")),
        }
    }

    /// `Mapped(g)` → `Mapped(g)` through `real`: an import that joins the mapping of the run
    /// its owner serves it in. Returns the driver's handle it had, for the caller to release.
    pub fn joined(&mut self, real: Real) -> Result<Real, BadTransition> {
        match self.state {
            State::Mapped(old, g) => {
                self.state = State::Mapped(real, g);
                Ok(old)
            }
            _ => Err(self.bad("joined")),
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

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::registry::VH_BASE;

    fn prop(location: std::ffi::c_uint) -> CUmemAllocationProp {
        let mut p = CUmemAllocationProp::default();
        p.location.type_ = location;
        p
    }

    pub(crate) fn own() -> Physical {
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
        let transitions: [(&str, Transition); 11] = [
            ("keep", |p| p.keep(Keep::ExportedRaw)),
            ("rebacked", |p| p.rebacked(1)),
            ("joined", |p| p.joined(1).map(|_| ())),
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
            (State::Resident(7), "rebacked"),
            (State::Mapped(7, 1), "joined"),
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
