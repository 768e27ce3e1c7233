//! What the `nccl` tag's pause and resume share about this process's own memory and its
//! mappings of peers' memory: the backup policy, the places of a handle's mappings, the device
//! whose context handles it, and what a failure left. Pause step 1 is [`crate::tag::release`],
//! resume step 1 [`crate::tag::restore`], both on the engine's steps
//! (`memsaver_allocator::steps`, shared with every tag); the order of the steps and the
//! exchanges with peers are [`crate::tag::provider`]'s and [`crate::tag::peer`]'s; the kernel
//! stack limit NCCL made the driver raise is [`crate::interpose::graphs`]'.
//!
//! What is backed up: the `nccl` tag's policy (`MEMSAVER_NCCL_BACKUP`, pinned by default).
//! `headers` backs up only the first [`HEADER_BYTES`](crate::options::HEADER_BYTES) of the buffers
//! NCCL shares with peers: NCCL lays those out as a 4 KiB control block
//! (`ncclSendMem`/`ncclRecvMem`: head and tail step counters, FIFOs) followed by the
//! LL/LL128/Simple staging buffers, whose contents live only within one collective. Resume zeroes
//! what follows the headers ([`Steps::zero`](memsaver_allocator::steps::Steps::zero)), as NCCL's
//! zeroed allocation left it: fresh memory may hold bytes that pass for a flag.

use std::collections::BTreeMap;
use std::sync::Arc;

use memsaver_allocator::Policy;
use memsaver_allocator::steps::Place;
use memsaver_ipc::protocol::Buffer;

use crate::registry::{self, Kind, Range, Ranges, Registry, TAG};

/// How much of NCCL's memory pause copies to host memory (`MEMSAVER_NCCL_BACKUP`).
pub(crate) use crate::options::NcclBackup as Backup;

impl Backup {
    /// The policy NCCL's buffers are backed up with: chosen as a region's is, pinned by
    /// default.
    pub(crate) fn policy(self) -> Policy {
        match self {
            Backup::Cpu | Backup::All | Backup::Headers => Policy::Cpu,
            Backup::Mmap => Policy::Mmap,
            Backup::Disk => Policy::Disk,
            Backup::Discard => Policy::Discard,
        }
    }
}

/// The tag's name, as the engine's pieces carry it.
pub(crate) fn tag() -> Arc<str> {
    static TAG_ARC: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| TAG.into());
    TAG_ARC.clone()
}

/// The places of a handle's mappings, with the access NCCL granted (replayed on resume).
pub(crate) fn places(rs: &[Range]) -> Vec<Place<'_>> {
    rs.iter()
        .map(|(ptr, size, access)| Place {
            ptr: *ptr,
            size: *size as usize,
            access: Some(access),
        })
        .collect()
}

/// The device whose context handles `vh` here: for an import, the device NCCL granted access
/// to (the owner's device may not even be visible in this process); else its location.
pub(crate) fn device_of(reg: &Registry, ranges: &Ranges, vh: u64) -> i32 {
    let p = &reg.physicals[&vh];
    if matches!(p.kind, Kind::Imported | Kind::Registered)
        && let Some(d) = ranges
            .get(&vh)
            .into_iter()
            .flatten()
            .flat_map(|(_, _, access)| access.iter())
            .find(|a| {
                a.location.type_ == memsaver_allocator::driver::sys::CU_MEM_LOCATION_TYPE_DEVICE
            })
    {
        return d.location.id;
    }
    p.device()
}

/// `vhs` grouped by the device whose context handles them, in handle order.
pub(crate) fn by_device(
    reg: &Registry,
    ranges: &Ranges,
    vhs: impl IntoIterator<Item = u64>,
) -> BTreeMap<i32, Vec<u64>> {
    let mut out = BTreeMap::<i32, Vec<u64>>::new();
    for vh in vhs {
        out.entry(device_of(reg, ranges, vh)).or_default().push(vh);
    }
    for v in out.values_mut() {
        v.sort_unstable();
    }
    out
}

/// Released imports to tell their owners about: owner -> the items naming them there.
pub(crate) type Notices = BTreeMap<u32, Vec<Buffer>>;

/// `op`'s failure `e`, with how many handles it `left` as they were.
pub(crate) fn incomplete(
    op: &'static str,
    e: memsaver_allocator::Error,
    left: impl Fn(&registry::Physical) -> bool,
) -> memsaver_allocator::Error {
    let failed = registry::lock()
        .physicals
        .values()
        .filter(|p| left(p))
        .count();
    memsaver_allocator::Error::Incomplete {
        op,
        tags: vec![registry::TAG.into()],
        failed,
        first: Box::new(e),
    }
}

/// What this process holds of a peer's memory, or a peer of this process's: for messages.
#[derive(Default)]
pub(crate) struct Holding {
    pub(crate) buffers: usize,
    pub(crate) bytes: u64,
    pub(crate) devices: std::collections::BTreeSet<i32>,
}

impl Holding {
    pub(crate) fn add(&mut self, p: &registry::Physical) {
        self.count(p.size, p.device());
    }

    /// One buffer of `size` bytes on `device`.
    pub(crate) fn count(&mut self, size: u64, device: i32) {
        self.buffers += 1;
        self.bytes += size;
        self.devices.insert(device);
    }
}

impl std::fmt::Display for Holding {
    /// `2 buffers (8 MiB) on device 0`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (n, s) = (self.buffers, if self.buffers == 1 { "" } else { "s" });
        let bytes = if self.bytes.is_multiple_of(1 << 20) {
            format!("{} MiB", self.bytes >> 20)
        } else {
            format!("{} bytes", self.bytes)
        };
        let devs: Vec<String> = self.devices.iter().map(i32::to_string).collect();
        let d = if devs.len() == 1 { "device" } else { "devices" };
        write!(f, "{n} buffer{s} ({bytes}) on {d} {}", devs.join(", "))
    }
}
