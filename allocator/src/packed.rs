//! Packed backups: a pause copies only the 4 KiB blocks of a piece that hold a non-zero byte,
//! and a resume zero-fills the piece and puts those blocks back. Zero blocks come back as
//! zeros, so the round trip is exact whatever the memory holds; what it saves is the copy of
//! memory that holds nothing (NCCL rounds each of its ~100 small device structures per
//! communicator up to its own 2 MiB granule: about 1 KiB live in each).
//!
//! Two kernels do it (`kernels/pack.cu`, shipped as the PTX beside it and loaded through the
//! driver at a device's first packed copy; nothing is built from CUDA at install):
//!
//! * `memsaver_pack` reads the piece on the device, and each thread block that finds a
//!   non-zero block takes the next slot and writes the block there, straight into the pinned
//!   host backup (the device writes registered host memory at its host address), with the
//!   block's number in the index. No copy per block.
//! * `memsaver_unpack` writes each slot back at its block, once the piece is zero-filled
//!   (`cuMemsetD8Async`: of the piece, or of the run of pieces the caller filled at once).
//!
//! A launch serves a batch of up to [`MAX_PIECES`] pieces of one device, described in its
//! parameters ([`PackBatch`], [`UnpackBatch`]: the kernels' ABI, which the fake driver reads
//! too), so a pause or a resume launches once per batch, not once per buffer ([`Batches`]): a
//! pause queues its pieces and launches when a batch is full or when it first waits for one of
//! them, then waits once per device; a resume launches at the end of each device's restores.
//!
//! The layout of a backup of `cap` bytes ([`Layout::of`]): slots of [`BLOCK`] bytes from the
//! start, the index (`u32` per slot) before the last 8 bytes, and the count of non-zero
//! blocks in those last bytes. A piece with more non-zero blocks than slots is copied whole
//! instead, as is every piece where packing cannot be used ([`Kernels::of`]: the PTX does not
//! load on this driver, or the device does not reach registered host memory at its host
//! address; a backup partly pinned or pageable; a piece under [`MIN_LEN`]).
//!
//! Every launch on a device goes on memsaver's stream of that device, so no two run at once:
//! the counters of the pack kernel serve one launch at a time.

use std::collections::BTreeMap;
use std::ffi::{CStr, c_void};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::backup::HostBuffer;
use crate::device::Device;
use crate::driver::sys::{
    CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
};
use crate::driver::{Driver, DriverError, Function};

/// Bytes of one block: the unit a packed backup keeps or drops.
pub const BLOCK: usize = 4096;
/// Pieces one launch serves at most (`MAX_PIECES` of `pack.cu`).
pub const MAX_PIECES: usize = 64;
/// Threads of a thread block (x 16 bytes = one block).
const THREADS: u32 = 256;
/// Thread blocks per multiprocessor of a launch (each loops over the blocks it is given).
const PER_SM: u32 = 8;
/// Pieces smaller than this are copied whole (a slot and its index cost more than they save).
pub const MIN_LEN: usize = 64 << 10;

/// The bytes a packed backup of a `len`-byte piece starts with: room for a sixteenth of its
/// blocks, at least 64 KiB, never more than `len`. A pause that finds more blocks holding
/// something grows it to `len` once (pinning on the critical path), and later pauses reuse it.
pub fn start_len(len: usize) -> usize {
    (len / 16).max(MIN_LEN).next_multiple_of(BLOCK).min(len)
}

/// The kernels' PTX, NUL-terminated for `cuModuleLoadData`.
const PTX: &str = concat!(include_str!("../kernels/pack.ptx"), "\0");

/// One piece of a [`PackBatch`] (`PackPiece` of `pack.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PackPiece {
    /// The piece's device memory, and its length.
    pub src: u64,
    pub len: u64,
    /// Its backup: slots, index, count ([`Layout`]), and how many slots.
    pub dst: u64,
    pub index: u64,
    pub count: u64,
    pub slots: u32,
    /// Its first block in the batch (the blocks of the pieces before it).
    pub first: u32,
}

/// The one parameter of `memsaver_pack`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PackBatch {
    pub piece: [PackPiece; MAX_PIECES],
    pub pieces: u32,
    /// Blocks of all pieces.
    pub blocks: u32,
}

/// One piece of an [`UnpackBatch`] (`UnpackPiece` of `pack.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct UnpackPiece {
    pub dst: u64,
    pub len: u64,
    pub src: u64,
    pub index: u64,
    pub count: u32,
    /// Its first slot in the batch (the slots of the pieces before it).
    pub first: u32,
}

/// The one parameter of `memsaver_unpack`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct UnpackBatch {
    pub piece: [UnpackPiece; MAX_PIECES],
    pub pieces: u32,
    /// Slots of all pieces.
    pub slots: u32,
}

// What pack.cu's structs take (x86-64 and aarch64), within the 4 KiB of kernel parameters that
// PTX ISA 7.0 allows.
const _: () = assert!(std::mem::size_of::<PackBatch>() == 64 * 48 + 8);
const _: () = assert!(std::mem::size_of::<UnpackBatch>() == 64 * 40 + 8);
const _: () = assert!(std::mem::size_of::<PackBatch>() <= 4096);

/// Where a packed backup keeps what, in a host buffer of `cap` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Slots: blocks the buffer holds.
    pub slots: usize,
    /// Where the index starts.
    pub index_at: usize,
    /// Where the count is.
    pub count_at: usize,
}

impl Layout {
    pub fn of(cap: usize) -> Self {
        // The count on 8 bytes and the index on 4, whatever `cap` is.
        let count_at = cap.saturating_sub(8) & !7;
        let slots = count_at / (BLOCK + 4);
        Self {
            slots,
            index_at: count_at - 4 * slots,
            count_at,
        }
    }

    /// Bytes a pause with `count` non-zero blocks copies (blocks and their index).
    pub fn copied(count: usize) -> u64 {
        (count * (BLOCK + 4)) as u64
    }
}

/// The packing kernels of one device, loaded at its first packed copy.
pub(crate) struct Kernels {
    pack: Function,
    unpack: Function,
    /// Thread blocks per launch at most.
    grid: u32,
}

impl Kernels {
    /// The device's kernels, loaded on first use; `None` (said once per device) where packing
    /// cannot be used. Loaded into the device's primary context, which lives as long as the
    /// process, and so do they.
    pub fn of(d: &Driver, dev: &Device) -> Option<&'static Kernels> {
        static LOADED: Mutex<BTreeMap<i32, Option<&'static Kernels>>> = Mutex::new(BTreeMap::new());
        // Held across the first load of a device's module only; nothing else is taken under it.
        let mut loaded = LOADED.lock();
        if let Some(k) = loaded.get(&dev.ordinal) {
            return *k;
        }
        let k = match Self::load(d, dev) {
            Ok(k) => Some(&*Box::leak(Box::new(k))),
            Err(why) => {
                tracing::info!(
                    device = dev.ordinal,
                    why,
                    "memsaver: backups are copied whole on this device (no packing)"
                );
                None
            }
        };
        loaded.insert(dev.ordinal, k);
        k
    }

    fn load(d: &Driver, dev: &Device) -> Result<Kernels, String> {
        let reaches = d
            .attribute(
                dev.ordinal,
                CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
            )
            .map_err(|e| e.to_string())?;
        if reaches != 1 {
            return Err(
                "the device does not reach registered host memory at its host address".into(),
            );
        }
        let sms = d
            .attribute(dev.ordinal, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| e.to_string())?;
        let image = CStr::from_bytes_with_nul(PTX.as_bytes()).expect("one NUL, at the end");
        let name = |n: &'static [u8]| CStr::from_bytes_with_nul(n).expect("NUL-terminated");
        d.with_context(dev.ctx, || {
            // The module is never unloaded: it stays for the life of the process.
            let m = d.load_module(image)?;
            Ok::<_, DriverError>(Kernels {
                pack: d.function(&m, name(b"memsaver_pack\0"))?,
                unpack: d.function(&m, name(b"memsaver_unpack\0"))?,
                grid: (sms.max(1) as u32) * PER_SM,
            })
        })
        .map_err(|e| format!("the packing kernels did not load ({e})"))
    }

    /// Launches `batch` on `kernel` of `dev` with a grid for `units` blocks or slots.
    ///
    /// # Safety
    /// `T` is the kernel's parameter; what it points to stays valid until the launch completes.
    unsafe fn launch<T>(
        d: &Driver,
        dev: &Device,
        kernel: fn(&Kernels) -> Function,
        batch: &mut T,
        units: u32,
    ) -> Result<(), DriverError> {
        let k = Kernels::of(d, dev).expect("loaded: a batch is opened only where they are");
        let (kernel, grid) = (kernel(k), k.grid.min(units.max(1)));
        let mut params: [*mut c_void; 1] = [(batch as *mut T).cast()];
        // SAFETY: per this function's contract.
        d.with_context(dev.ctx, || unsafe {
            d.launch(kernel, grid, THREADS, dev.stream, &mut params)
        })
    }
}

/// An open batch: its device, its sequence number and what it holds.
struct Open<B> {
    device: Arc<Device>,
    seq: u64,
    batch: Box<B>,
}

/// The launches a transition has queued and not made yet, and those it made and has not waited
/// for, per device (see the module documentation).
#[derive(Default)]
pub(crate) struct Batches {
    pack: Option<Open<PackBatch>>,
    unpack: Option<Open<UnpackBatch>>,
    /// The sequence number of the next batch.
    next: u64,
    /// Per device: the last pack batch launched, and the last known complete.
    launched: BTreeMap<i32, u64>,
    complete: BTreeMap<i32, u64>,
}

impl Batches {
    /// Queues packing `len` bytes at `src` into the host buffer `buf`, on `dev`; returns the
    /// batch's number for [`Batches::wait`]. The count is in the buffer once that returns
    /// ([`count`]).
    ///
    /// # Safety
    /// `src..src+len` is mapped device memory and `buf` registered throughout; both stay so,
    /// `buf` untouched by the host, until [`Batches::wait`] for the number returned.
    pub unsafe fn pack(
        &mut self,
        d: &Driver,
        dev: &Arc<Device>,
        src: u64,
        len: usize,
        buf: &mut HostBuffer,
    ) -> Result<u64, DriverError> {
        let cap = buf.len();
        let blocks = len.div_ceil(BLOCK) as u32;
        if let Some(o) = &self.pack
            && (o.device.ordinal != dev.ordinal
                || o.batch.pieces as usize == MAX_PIECES
                || o.batch.blocks.checked_add(blocks).is_none())
        {
            self.launch_pack(d)?;
        }
        let seq = self.next;
        let o = self.pack.get_or_insert_with(|| Open {
            device: dev.clone(),
            seq,
            batch: Box::new(PackBatch {
                piece: [PackPiece::default(); MAX_PIECES],
                pieces: 0,
                blocks: 0,
            }),
        });
        if o.seq == seq {
            self.next += 1;
        }
        let l = Layout::of(cap);
        let base = buf.as_mut_ptr() as u64;
        let b = &mut o.batch;
        b.piece[b.pieces as usize] = PackPiece {
            src,
            len: len as u64,
            dst: base,
            index: base + l.index_at as u64,
            count: base + l.count_at as u64,
            slots: l.slots as u32,
            first: b.blocks,
        };
        b.pieces += 1;
        b.blocks += blocks;
        Ok(o.seq)
    }

    /// Launches the open pack batch, if any.
    fn launch_pack(&mut self, d: &Driver) -> Result<(), DriverError> {
        let Some(mut o) = self.pack.take() else {
            return Ok(());
        };
        let blocks = o.batch.blocks;
        // SAFETY: the batch describes pieces its callers keep valid until they wait for it.
        unsafe { Kernels::launch(d, &o.device, |k| k.pack, &mut *o.batch, blocks) }?;
        self.launched.insert(o.device.ordinal, o.seq);
        Ok(())
    }

    /// Waits until pack batch `seq` of `dev` has completed (launching it first if it is open).
    pub fn wait(&mut self, d: &Driver, dev: &Device, seq: u64) -> Result<(), DriverError> {
        if self.pack.as_ref().is_some_and(|o| o.seq == seq) {
            self.launch_pack(d)?;
        }
        if self.complete.get(&dev.ordinal).is_some_and(|&c| c >= seq) {
            return Ok(());
        }
        d.with_context(dev.ctx, || d.stream_synchronize(dev.stream))?;
        if let Some(&l) = self.launched.get(&dev.ordinal) {
            self.complete.insert(dev.ordinal, l);
        }
        Ok(())
    }

    /// Queues putting back the `count` blocks packed in `buf` into the zero-filled `len` bytes
    /// at `dst` on `dev`; launched when the batch is full or by [`Batches::flush_unpack`].
    ///
    /// # Safety
    /// `dst..dst+len` is mapped device memory and `buf`, registered throughout, holds a packed
    /// backup of `count` blocks of it; both stay so until the device's stream is synchronised
    /// after the flush.
    pub unsafe fn unpack(
        &mut self,
        d: &Driver,
        dev: &Arc<Device>,
        (dst, len): (u64, usize),
        buf: &HostBuffer,
        count: u32,
    ) -> Result<(), DriverError> {
        let (cap, buf) = (buf.len(), buf.as_ptr());
        if count == 0 {
            return Ok(());
        }
        if let Some(o) = &self.unpack
            && (o.device.ordinal != dev.ordinal
                || o.batch.pieces as usize == MAX_PIECES
                || o.batch.slots.checked_add(count).is_none())
        {
            let other = o.device.clone();
            self.flush_unpack(d, &other)?;
        }
        let o = self.unpack.get_or_insert_with(|| Open {
            device: dev.clone(),
            seq: 0,
            batch: Box::new(UnpackBatch {
                piece: [UnpackPiece::default(); MAX_PIECES],
                pieces: 0,
                slots: 0,
            }),
        });
        let l = Layout::of(cap);
        let b = &mut o.batch;
        b.piece[b.pieces as usize] = UnpackPiece {
            dst,
            len: len as u64,
            src: buf as u64,
            index: buf as u64 + l.index_at as u64,
            count,
            first: b.slots,
        };
        b.pieces += 1;
        b.slots += count;
        Ok(())
    }

    /// Launches the open unpack batch of `dev`, if any (before its stream is synchronised).
    pub fn flush_unpack(&mut self, d: &Driver, dev: &Device) -> Result<(), DriverError> {
        if self
            .unpack
            .as_ref()
            .is_none_or(|o| o.device.ordinal != dev.ordinal)
        {
            return Ok(());
        }
        let mut o = self.unpack.take().expect("checked above");
        let slots = o.batch.slots;
        // SAFETY: the batch describes pieces its callers keep valid until the stream is
        // synchronised, which they do after this.
        unsafe { Kernels::launch(d, &o.device, |k| k.unpack, &mut *o.batch, slots) }
    }
}

/// The count a completed pack launch left in `buf` (`cap` bytes).
///
/// # Safety
/// `buf..buf+cap` is readable, and the launch that packed into it has completed.
pub(crate) unsafe fn count(buf: *const u8, cap: usize) -> u32 {
    // SAFETY: inside the buffer, per the caller; the device wrote it, so read it as such.
    unsafe { std::ptr::read_volatile(buf.add(Layout::of(cap).count_at).cast::<u32>()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_keeps_slots_index_and_count_apart() {
        for cap in [
            64 << 10,
            (2 << 20) + 4096,
            2 << 20,
            196 << 20,
            70_001,
            70_003,
        ] {
            let l = Layout::of(cap);
            assert!(
                l.slots * BLOCK <= l.index_at,
                "{cap}: slots run into the index"
            );
            assert_eq!(l.index_at + 4 * l.slots, l.count_at, "{cap}");
            assert!(
                l.count_at + 8 <= cap && l.count_at.is_multiple_of(8),
                "{cap}"
            );
            assert!(l.index_at.is_multiple_of(4), "{cap}");
            // One more slot would not fit.
            assert!(
                (l.slots + 1) * (BLOCK + 4) + 8 > cap,
                "{cap}: a slot left unused"
            );
        }
    }

    #[test]
    fn a_packed_backup_starts_small_and_never_beyond_its_piece() {
        assert_eq!(start_len(2 << 20), 128 << 10);
        assert_eq!(start_len(64 << 10), 64 << 10);
        assert_eq!(start_len(100 << 10), 64 << 10);
        assert_eq!(start_len(40 << 10), 40 << 10);
        assert_eq!(start_len(1 << 30), 64 << 20);
    }

    #[test]
    fn the_ptx_has_both_kernels() {
        for k in ["memsaver_pack(", "memsaver_unpack("] {
            assert!(
                PTX.contains(&format!(".entry {k}")),
                "{k} missing from pack.ptx"
            );
        }
        assert!(
            PTX.contains(".version 7.0"),
            "the PTX must load on drivers from CUDA 11.0"
        );
    }
}
