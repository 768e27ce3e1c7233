//! What NCCL holds: every VMM handle it created or imported and every mapping it made,
//! recorded by the wrappers in [`crate::vmm`]. This is the metadata pause and resume of the
//! `nccl` tag are built on; today it feeds [`NcclStats`].

use std::collections::HashMap;

use parking_lot::Mutex;
use serde::Serialize;

use memsaver_allocator::driver::sys::*;

/// Why memory stays resident when `nccl` is paused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Device memory NCCL created: pausable.
    Device,
    /// Host memory (`HOST`/`HOST_NUMA` locations): not device memory, stays.
    Host,
    /// Created with a FABRIC handle type (multi-node NVLink): stays.
    Fabric,
    /// Imported from another process (a peer's buffer mapped here).
    Imported,
}

struct HandleRec {
    size: u64,
    kind: Kind,
    /// Handle references NCCL holds (create/import = 1, each retain +1, each release -1).
    refs: u32,
    exported: bool,
}

#[derive(Default)]
struct Ledger {
    handles: HashMap<CUmemGenericAllocationHandle, HandleRec>,
    /// Mappings by address: (size, handle).
    mappings: HashMap<CUdeviceptr, (u64, CUmemGenericAllocationHandle)>,
    /// Ranges handed to a NIC with cuMemGetHandleForAddressRange: address -> size.
    nic_ranges: HashMap<CUdeviceptr, u64>,
    multicast_objects: u64,
}

/// Guards the whole ledger; held only for bookkeeping, never across a driver call.
static LEDGER: Mutex<Option<Ledger>> = Mutex::new(None);

fn with<T>(f: impl FnOnce(&mut Ledger) -> T) -> T {
    let mut g = LEDGER.lock();
    f(g.get_or_insert_with(Ledger::default))
}

pub(crate) fn created(h: CUmemGenericAllocationHandle, size: usize, prop: &CUmemAllocationProp) {
    let kind = match prop.location.type_ {
        CU_MEM_LOCATION_TYPE_DEVICE
            if prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_FABRIC != 0 =>
        {
            Kind::Fabric
        }
        CU_MEM_LOCATION_TYPE_DEVICE => Kind::Device,
        _ => Kind::Host,
    };
    with(|l| {
        l.handles.insert(
            h,
            HandleRec {
                size: size as u64,
                kind,
                refs: 1,
                exported: false,
            },
        )
    });
}

pub(crate) fn imported(h: CUmemGenericAllocationHandle) {
    with(|l| {
        // The size is learnt when it is mapped (the import call does not say).
        let rec = l.handles.entry(h).or_insert(HandleRec {
            size: 0,
            kind: Kind::Imported,
            refs: 0,
            exported: false,
        });
        rec.refs += 1;
    });
}

pub(crate) fn retained(h: CUmemGenericAllocationHandle) {
    with(|l| {
        if let Some(r) = l.handles.get_mut(&h) {
            r.refs += 1;
        }
    });
}

pub(crate) fn released(h: CUmemGenericAllocationHandle) {
    with(|l| {
        if let Some(r) = l.handles.get_mut(&h) {
            r.refs = r.refs.saturating_sub(1);
            if r.refs == 0 && !l.mappings.values().any(|(_, mh)| *mh == h) {
                l.handles.remove(&h);
            }
        }
    });
}

pub(crate) fn exported(h: CUmemGenericAllocationHandle) {
    with(|l| {
        if let Some(r) = l.handles.get_mut(&h) {
            r.exported = true;
        }
    });
}

pub(crate) fn mapped(ptr: CUdeviceptr, size: usize, h: CUmemGenericAllocationHandle) {
    with(|l| {
        if let Some(r) = l.handles.get_mut(&h)
            && r.kind == Kind::Imported
        {
            r.size = r.size.max(size as u64);
        }
        l.mappings.insert(ptr, (size as u64, h));
    });
}

pub(crate) fn unmapped(ptr: CUdeviceptr) {
    with(|l| {
        if let Some((_, h)) = l.mappings.remove(&ptr)
            && l.handles.get(&h).is_some_and(|r| r.refs == 0)
            && !l.mappings.values().any(|(_, mh)| *mh == h)
        {
            l.handles.remove(&h);
        }
    });
}

pub(crate) fn nic_range(ptr: CUdeviceptr, size: usize) {
    with(|l| l.nic_ranges.insert(ptr, size as u64));
}

pub(crate) fn multicast_created() {
    with(|l| l.multicast_objects += 1);
}

/// NCCL's memory as the hook sees it, in bytes of live handles.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NcclStats {
    /// NCCL resolved its driver entry points through memsaver (libmemsaver.so was preloaded
    /// before NCCL initialised).
    pub hooked: bool,
    /// `NCCL_CUMEM_ENABLE=0`: NCCL uses cudaMalloc and legacy IPC, which no VMM hook can see.
    pub cumem_disabled: bool,
    /// Device memory NCCL created in this process (pausable).
    pub owned_bytes: u64,
    pub owned_handles: u64,
    /// Of those, handles exported to other processes at least once.
    pub exported_handles: u64,
    /// Peers' memory this process imported and mapped.
    pub imported_bytes: u64,
    pub imported_handles: u64,
    /// Kept resident: host memory NCCL allocated through the VMM API.
    pub resident_host_bytes: u64,
    /// Kept resident: FABRIC (multi-node NVLink) handles.
    pub resident_fabric_bytes: u64,
    /// Kept resident: ranges given to a NIC (GPUDirect RDMA, dmabuf).
    pub resident_nic_bytes: u64,
    /// Kept resident: multicast (NVLS) objects created.
    pub multicast_objects: u64,
    pub mappings: u64,
}

pub(crate) fn stats(hooked: bool, cumem_disabled: bool) -> NcclStats {
    with(|l| {
        let mut s = NcclStats {
            hooked,
            cumem_disabled,
            ..Default::default()
        };
        for r in l.handles.values() {
            match r.kind {
                Kind::Device => {
                    s.owned_bytes += r.size;
                    s.owned_handles += 1;
                    s.exported_handles += u64::from(r.exported);
                }
                Kind::Imported => {
                    s.imported_bytes += r.size;
                    s.imported_handles += 1;
                }
                Kind::Host => s.resident_host_bytes += r.size,
                Kind::Fabric => s.resident_fabric_bytes += r.size,
            }
        }
        s.resident_nic_bytes = l.nic_ranges.values().sum();
        s.multicast_objects = l.multicast_objects;
        s.mappings = l.mappings.len() as u64;
        s
    })
}
