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
//!   block's number in the index. One launch per piece, and no copy per block.
//! * `memsaver_unpack` writes each slot back at its block, after a `cuMemsetD8Async` of the
//!   whole piece.
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

use std::ffi::{CStr, c_void};

use crate::device::Device;
use crate::driver::sys::{
    CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
};
use crate::driver::{Driver, DriverError, Function};

/// Bytes of one block: the unit a packed backup keeps or drops.
pub const BLOCK: usize = 4096;
/// Threads of a thread block (x 16 bytes = one block).
const THREADS: u32 = 256;
/// Thread blocks per multiprocessor of a launch (each loops over the blocks it is given).
const PER_SM: u32 = 8;
/// Pieces smaller than this are copied whole (the launch would cost more than it saves).
pub const MIN_LEN: usize = 64 << 10;

/// The kernels' PTX, NUL-terminated for `cuModuleLoadData`.
const PTX: &str = concat!(include_str!("../kernels/pack.ptx"), "\0");

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
        let slots = cap.saturating_sub(8) / (BLOCK + 4);
        let count_at = cap.saturating_sub(8);
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
    /// cannot be used.
    pub fn of<'a>(d: &Driver, dev: &'a Device) -> Option<&'a Kernels> {
        dev.packing
            .get_or_init(|| match Self::load(d, dev) {
                Ok(k) => Some(k),
                Err(why) => {
                    tracing::info!(
                        device = dev.ordinal,
                        why,
                        "memsaver: backups are copied whole on this device (no packing)"
                    );
                    None
                }
            })
            .as_ref()
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
            let m = d.load_module(image)?;
            // The module is never unloaded: it stays for the life of the process.
            let pack = d.function(&m, name(b"memsaver_pack\0"))?;
            let unpack = d.function(&m, name(b"memsaver_unpack\0"))?;
            Ok::<_, DriverError>(Kernels {
                pack,
                unpack,
                grid: (sms.max(1) as u32) * PER_SM,
            })
        })
        .map_err(|e| format!("the packing kernels did not load ({e})"))
    }

    /// Queues the packing of `len` bytes at `src` into the host buffer `buf` of `cap` bytes,
    /// on the device's stream (the context of `dev` current). The count is in the buffer once
    /// the stream reaches this point ([`count`]).
    ///
    /// # Safety
    /// `src..src+len` is mapped device memory, `buf..buf+cap` registered host memory, and both
    /// stay so, untouched by the host, until the launch completes.
    pub unsafe fn pack(
        &self,
        d: &Driver,
        dev: &Device,
        src: u64,
        len: usize,
        buf: *mut u8,
        cap: usize,
    ) -> Result<(), DriverError> {
        let l = Layout::of(cap);
        let base = buf as u64;
        let (mut src, mut len) = (src, len as u64);
        let (mut dst, mut index) = (base, base + l.index_at as u64);
        let (mut count, mut slots) = (base + l.count_at as u64, l.slots as u32);
        let blocks = len.div_ceil(BLOCK as u64).max(1);
        let grid = (self.grid as u64).min(blocks) as u32;
        let mut params: [*mut c_void; 6] = [
            (&raw mut src).cast(),
            (&raw mut len).cast(),
            (&raw mut dst).cast(),
            (&raw mut index).cast(),
            (&raw mut count).cast(),
            (&raw mut slots).cast(),
        ];
        // SAFETY: the parameters are memsaver_pack's, in order; the rest is the caller's.
        unsafe { d.launch(self.pack, grid, THREADS, dev.stream, &mut params) }
    }

    /// Queues zero-filling `len` bytes at `dst` and putting back the `count` blocks packed in
    /// `buf` (`cap` bytes), on the device's stream (the context of `dev` current).
    ///
    /// # Safety
    /// `dst..dst+len` is mapped device memory, `buf..buf+cap` registered host memory holding a
    /// packed backup of `count` blocks of that memory, and both stay so until the launch
    /// completes.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn unpack(
        &self,
        d: &Driver,
        dev: &Device,
        dst: u64,
        len: usize,
        buf: *const u8,
        cap: usize,
        count: u32,
    ) -> Result<(), DriverError> {
        // SAFETY: mapped, per the caller.
        unsafe { d.memset_d8_async(dst, 0, len, dev.stream) }?;
        if count == 0 {
            return Ok(());
        }
        let l = Layout::of(cap);
        let (mut dst, mut len) = (dst, len as u64);
        let (mut src, mut index, mut count) = (buf as u64, buf as u64 + l.index_at as u64, count);
        let grid = self.grid.min(count);
        let mut params: [*mut c_void; 5] = [
            (&raw mut dst).cast(),
            (&raw mut len).cast(),
            (&raw mut src).cast(),
            (&raw mut index).cast(),
            (&raw mut count).cast(),
        ];
        // SAFETY: the parameters are memsaver_unpack's, in order; the rest is the caller's.
        unsafe { d.launch(self.unpack, grid, THREADS, dev.stream, &mut params) }
    }
}

/// The count a completed [`Kernels::pack`] left in `buf` (`cap` bytes).
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
        for cap in [64 << 10, (2 << 20) + 4096, 2 << 20, 196 << 20] {
            let l = Layout::of(cap);
            assert!(
                l.slots * BLOCK <= l.index_at,
                "{cap}: slots run into the index"
            );
            assert_eq!(l.index_at + 4 * l.slots, l.count_at, "{cap}");
            assert_eq!(l.count_at + 8, cap, "{cap}");
            // One more slot would not fit.
            assert!(
                (l.slots + 1) * (BLOCK + 4) + 8 > cap,
                "{cap}: a slot left unused"
            );
        }
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
