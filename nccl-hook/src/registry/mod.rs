//! What NCCL holds: every VMM handle it created or imported and every mapping it made.
//!
//! NCCL never sees the driver's handles: the `cuMemCreate`/`cuMemImportFromShareableHandle`
//! wrappers hand it a *virtual* handle, and every wrapper that takes a handle translates it.
//! That is what lets pause release the physical memory and resume create new memory behind
//! the same virtual handle, at the same addresses, without NCCL noticing. Queries NCCL makes
//! about a paused range (`cuMemRetainAllocationHandle`, `cuMemGetAddressRange`) are answered
//! from here, so destroying a communicator while paused works.
//!
//! These are the records the interposition writes ([`crate::interpose::vmm`]) and the `nccl` tag's
//! pause and resume ([`crate::tag::provider`]) and the memory it serves to peers
//! ([`crate::tag::exports`]) work on: records and their lock only, below everything else in this
//! crate (it imports no module of it). Who imports an exported buffer, its key and its generation
//! are not NCCL's: the owner's ledger (`memsaver_ipc::exported`) keeps them, as it does for every
//! export.

use std::collections::{BTreeMap, HashMap, HashSet};

use parking_lot::{Mutex, MutexGuard};
use serde::Serialize;

use memsaver_allocator::driver::sys::*;

mod layout;
mod physical;

pub(crate) use layout::{Handed, MIRROR_BLOCK};
pub(crate) use physical::*;

/// The tag of NCCL's memory.
pub(crate) const TAG: &str = "nccl";

/// Virtual handles are `VH_BASE | n`: never 0, and recognisable in logs.
const VH_BASE: u64 = 0x6d73_0000_0000_0000;

pub(crate) struct Mapping {
    pub size: u64,
    pub vh: u64,
    /// The access NCCL granted with cuMemSetAccess, replayed on resume.
    pub access: Vec<CUmemAccessDesc>,
}

/// One mapping of a handle: (address, size, the access NCCL granted).
pub(crate) type Range = (CUdeviceptr, u64, Vec<CUmemAccessDesc>);

/// Hashes memsaver's virtual handles (its own sequential numbers, never chosen by anyone
/// else) with one multiply. A pause and a resume look up each of NCCL's thousands of buffers
/// several times under the registry lock; with the standard library's SipHash that was about
/// a fifth of a microsecond per lookup, milliseconds per pause at 16 communicators.
#[derive(Default, Clone, Copy)]
pub(crate) struct HandleHasher(u64);

impl std::hash::Hasher for HandleHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }

    fn write_u64(&mut self, v: u64) {
        // Fibonacci hashing: the product's high bits, which the table uses, mix every bit of
        // the key.
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// A map keyed by virtual handle.
pub(crate) type ByHandle<V> = HashMap<u64, V, std::hash::BuildHasherDefault<HandleHasher>>;

/// Each handle's mappings ([`Registry::ranges_by_handle`]).
pub(crate) type Ranges = ByHandle<Vec<Range>>;

/// The address of each run member's mapping in its run, by virtual handle
/// ([`Registry::run_places`]).
pub(crate) type RunPlaces = ByHandle<CUdeviceptr>;

/// One physical allocation mapped across adjacent buffers of NCCL's (one `cuMemCreate`,
/// `cuMemMap` and `cuMemSetAccess` instead of one per buffer: the driver's cost is per
/// physical allocation): made by a resume for own buffers, made ahead for own buffers as a
/// chunk they are carved from at their creation ([`Registry::carve_in_chunk`]), or an owner's
/// run that an importer maps whole. It lives until the next pause or until NCCL has freed all
/// its buffers; a buffer NCCL frees before that keeps its address range reserved and its bytes
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
    /// For a chunk: the space at its end no buffer was carved from yet (address, bytes),
    /// given back to the own arenas once the run is unmapped.
    pub spare: Option<(CUdeviceptr, u64)>,
    /// The access granted over the whole run in answer to NCCL's `cuMemSetAccess` of its
    /// buffers (the driver grants access only to whole mappings).
    pub access: Vec<CUmemAccessDesc>,
    /// For a run of imports mapped at their first import: the owner and the generation it
    /// served, which further imports of that run join.
    pub source: Option<(u32, u64)>,
}

impl Run {
    /// A run of `live` buffers over `size` bytes of the driver's handle `real`.
    pub fn new(size: u64, real: Real, live: usize) -> Self {
        Run {
            size,
            real,
            live,
            dead: Vec::new(),
            around: Vec::new(),
            spare: None,
            access: Vec::new(),
            source: None,
        }
    }
}

/// An exported buffer that NCCL freed while it was in a resident [`Run`] whose other buffers
/// NCCL still holds (one communicator destroyed while the others live, say).
///
/// A run is one physical allocation, and every importer of any of its buffers maps it whole,
/// once: the freed buffer's importers still hold all of the run's memory, the live buffers'
/// too. So its export is not forgotten at the free, as a lone buffer's is: it stays in the
/// owner's ledger (never served again: `crate::tag::exports` answers an open of it `Failed` at
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
    pub physicals: ByHandle<Physical>,
    /// By base address.
    pub mappings: BTreeMap<CUdeviceptr, Mapping>,
    /// By base address.
    pub runs: BTreeMap<CUdeviceptr, Run>,
    /// Ranges reserved for owners' layouts, one per block of an owner's addresses
    /// ([`MIRROR_BLOCK`]): (owner, block) -> base.
    pub mirrors: HashMap<(u32, u64), CUdeviceptr>,
    /// Address space memsaver reserved for NCCL's own buffers ([`OWN_ARENA`](layout::OWN_ARENA)
    /// each), and the parts of it not handed out, by start: NCCL's buffers are carved from it
    /// lowest address first, so that the buffers NCCL allocates one after another are adjacent and
    /// a resume can back them with one run, whatever else the process maps meanwhile.
    pub own_free: BTreeMap<CUdeviceptr, u64>,
    /// Where each own arena starts (free space is never merged across the start of one, as
    /// the driver maps a range only inside one reservation), and its chunk floor: where the
    /// last chunk made in it ends, above which the next chunk goes (never at an address a
    /// chunk had before, [`Registry::carve_in_chunk`]).
    pub own_arenas: BTreeMap<CUdeviceptr, CUdeviceptr>,
    /// Ranges of memsaver's reservations handed to NCCL as its reservations: NCCL's own
    /// buffers' (from the own arenas) and its imports' (in the owners' layouts).
    pub handed: BTreeMap<CUdeviceptr, Handed>,
    /// Exported buffers NCCL freed inside runs, whose exports stay until their importers
    /// let go of the run ([`Retired`]), by virtual handle.
    pub retired: ByHandle<Retired>,
    /// The chunk new buffers of each set of properties are carved from (a key of `runs`).
    pub open_chunks: Vec<(CUmemAllocationProp, CUdeviceptr)>,
    next: u64,
    pub multicast_objects: u64,
}

/// Guards the registry. Held by NCCL's wrapped calls (one call each, bookkeeping and their driver
/// call; a reservation NCCL asks for may reserve memsaver's address space for NCCL's buffers or for
/// an owner's layout, 64 GiB of addresses, under it), by the `nccl` pause for its whole local step
/// (so NCCL cannot map or unmap memory while it is being paused), by resume per batch of handles
/// (handed over fairly between batches so the peer server can answer), by the peer server per batch
/// of answers, and by `stats`; never while waiting for a peer. Under it only the allocator's
/// `devices` (the copy stream) is taken; never `GRAPHS`, and never the start of the allocator
/// (which takes `external`, a lock before this one).
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
        let mut out = RunPlaces::default();
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
    pub fn ranges_by_handle(&self) -> Ranges {
        let mut out = Ranges::with_capacity_and_hasher(self.physicals.len(), Default::default());
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
        // Carved and never reserved by NCCL: its range goes with the run.
        if let Some(c) = p.carved.filter(|c| !c.reserved) {
            run.dead.push((c.at, p.size));
        }
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

    /// The live run whose mapping covers any of `[ptr, ptr + size)`.
    pub fn run_over(&mut self, ptr: CUdeviceptr, size: u64) -> Option<&mut Run> {
        let (base, run) = self
            .runs
            .range_mut(..ptr.saturating_add(size))
            .next_back()?;
        (base.saturating_add(run.size) > ptr).then_some(run)
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
    /// Physical allocations a resume made for several adjacent buffers each (or chunks, made
    /// ahead for NCCL's small buffers), and the bytes of buffers NCCL freed inside them, held
    /// until the next pause or until the run is unused.
    pub runs: u64,
    pub freed_held_bytes: u64,
    /// Bytes of chunks no buffer was carved from yet: the memory chunks commit ahead of NCCL
    /// (`MEMSAVER_NCCL_CHUNK_MB`), not counted in `owned_bytes`.
    pub chunk_spare_bytes: u64,
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
    s.chunk_spare_bytes = r
        .runs
        .values()
        .filter_map(|r| r.spare)
        .map(|(_, n)| n)
        .sum();
    s
}

#[cfg(test)]
mod tests {
    use super::physical::tests::own;
    use super::*;

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
        let run = Run::new(vhs.len() as u64 * (2 << 20), 7, vhs.len());
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
}
