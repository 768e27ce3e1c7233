//! What NCCL holds: every VMM handle it created or imported and every mapping it made.
//!
//! NCCL never sees the driver's handles: the `cuMemCreate`/`cuMemImportFromShareableHandle`
//! wrappers hand it a *virtual* handle, and every wrapper that takes a handle translates it.
//! That is what lets pause release the physical memory and resume create new memory behind
//! the same virtual handle, at the same addresses, without NCCL noticing. Queries NCCL makes
//! about a paused range (`cuMemRetainAllocationHandle`, `cuMemGetAddressRange`) are answered
//! from here, so destroying a communicator while paused works.
//!
//! This is the ledger the interposition writes ([`crate::vmm`]) and the `nccl` tag's pause and
//! resume ([`crate::provider`]) and the owner's server ([`crate::exports`]) work on: records and
//! their lock only, below everything else in this crate (it imports no module of it).

use std::collections::{BTreeMap, HashMap, HashSet};

use parking_lot::{Mutex, MutexGuard};
use serde::Serialize;

use memsaver_allocator::backup::HostBuffer;
use memsaver_allocator::driver::sys::*;

/// Virtual handles are `VH_BASE | n`: never 0, and recognisable in logs.
const VH_BASE: u64 = 0x6d73_0000_0000_0000;

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
}

pub(crate) struct Physical {
    /// The driver's handle; `None` while paused.
    pub real: Option<CUmemGenericAllocationHandle>,
    /// Bytes (for imports: learnt when mapped).
    pub size: u64,
    pub prop: CUmemAllocationProp,
    pub kind: Kind,
    /// References NCCL holds (create/import = 1, each retain + 1, each release - 1).
    pub refs: u32,
    /// Exported to another process at least once (through a token, see `memsaver_ipc::token`).
    pub exported: bool,
    /// Exported as a driver fd (tokens off): its importers are unknown, so it stays resident.
    pub exported_raw: bool,
    /// The key a request must carry to be given this buffer (owner side): 64 random bits
    /// drawn when it is first exported through a token, which carries it (see
    /// `memsaver_ipc::token`). `None`: never exported so, and never handed out.
    pub key: Option<u64>,
    /// Processes holding an import of the current generation (owner side).
    pub importers: HashSet<u32>,
    /// Incremented each time the memory is re-created by a resume (owner side).
    pub generation: u64,
    /// For an import: the owner and its buffer (`None` when imported from a plain fd).
    pub source: Option<Source>,
    /// Why it must stay resident whatever the policy (given to a NIC, bound to multicast).
    pub pinned: Option<&'static str>,
    /// Contents while paused (its first `backup_len` bytes), kept for reuse across cycles.
    pub backup: Option<HostBuffer>,
    pub backup_len: u64,
}

/// Where an import comes from.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Source {
    pub owner: u32,
    pub vh: u64,
    /// The buffer's key, from its token.
    pub key: u64,
    /// The owner's generation this import maps.
    pub generation: u64,
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
    pub fn new(
        real: CUmemGenericAllocationHandle,
        size: u64,
        prop: CUmemAllocationProp,
        kind: Kind,
    ) -> Self {
        Self {
            real: Some(real),
            size,
            prop,
            kind,
            refs: 1,
            exported: false,
            exported_raw: false,
            key: None,
            importers: HashSet::new(),
            generation: 0,
            source: None,
            pinned: None,
            backup: None,
            backup_len: 0,
        }
    }

    /// Whether pause may release it, and if not, why.
    pub fn pausable(&self) -> Result<(), &'static str> {
        match self.kind {
            Kind::Host => Err("host memory"),
            Kind::Fabric => Err("FABRIC handle"),
            Kind::Imported if self.source.is_none() => Err(
                "imported from a plain fd (the owner is not preloaded, or MEMSAVER_NCCL_TOKENS=0)",
            ),
            // NCCL's shared-memory transport: host memory, which its owner keeps.
            Kind::Imported if self.is_host() => Err("a peer's host memory"),
            Kind::Imported => Ok(()),
            Kind::Device => match (self.pinned, self.exported_raw) {
                (Some(why), _) => Err(why),
                (None, true) => Err("exported as a plain fd (MEMSAVER_NCCL_TOKENS=0)"),
                (None, false) => Ok(()),
            },
        }
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

pub(crate) struct Mapping {
    pub size: u64,
    pub vh: u64,
    /// The access NCCL granted with cuMemSetAccess, replayed on resume.
    pub access: Vec<CUmemAccessDesc>,
}

/// One mapping of a handle: (address, size, the access NCCL granted).
pub(crate) type Range = (CUdeviceptr, u64, Vec<CUmemAccessDesc>);

#[derive(Default)]
pub(crate) struct Registry {
    pub physicals: HashMap<u64, Physical>,
    /// By base address.
    pub mappings: BTreeMap<CUdeviceptr, Mapping>,
    next: u64,
    pub multicast_objects: u64,
}

/// Guards the registry. Held by NCCL's wrapped calls (one call each, bookkeeping and their
/// driver call), by the `nccl` pause for its whole local step (so NCCL cannot map or unmap
/// memory while it is being paused), by resume per batch of handles (handed over fairly
/// between batches so the peer server can answer), by the peer server per batch of answers,
/// and by `stats`; never while waiting for a peer. Under it only the allocator's `devices`
/// (the copy stream) is taken; never `GRAPHS`, and never the start of the allocator (which
/// takes `external`, a lock before this one).
static REGISTRY: Mutex<Option<Registry>> = Mutex::new(None);

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
    /// its driver handle for the caller to release (outside the lock).
    pub fn collect(&mut self, vh: u64) -> Option<CUmemGenericAllocationHandle> {
        let unused = self.physicals.get(&vh).is_some_and(|p| p.refs == 0)
            && !self.mappings.values().any(|m| m.vh == vh);
        if unused {
            self.physicals.remove(&vh).and_then(|p| p.real)
        } else {
            None
        }
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
                if p.real.is_none() {
                    s.paused_bytes += p.size;
                }
                if p.exported {
                    s.exported_handles += 1;
                    s.exported_bytes += p.size;
                }
                if p.pinned.is_some() {
                    s.resident_pinned_bytes += p.size;
                }
            }
            Kind::Imported => {
                s.imported_bytes += p.size;
                s.imported_handles += 1;
            }
            Kind::Host => s.resident_host_bytes += p.size,
            Kind::Fabric => s.resident_fabric_bytes += p.size,
        }
    }
    s.multicast_objects = r.multicast_objects;
    s.mappings = r.mappings.len() as u64;
    s
}
