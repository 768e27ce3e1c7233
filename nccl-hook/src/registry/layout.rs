//! Where NCCL's buffers and imports lie in the address space: this process's own buffers
//! carved side by side from memsaver's arenas (so that a resume can back adjacent buffers with
//! one physical allocation, a run), and each owner's buffers imported at the same distance
//! from the start of their block as in the owner (so that an importer maps an owner's run
//! whole). Methods of [`Registry`], under its lock.

use memsaver_allocator::driver::sys::{CUdeviceptr, CUmemAllocationProp};

use super::{Real, Registry, Run};

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
/// whole ([`crate::tag::restore`]).
pub(crate) const MIRROR_BLOCK: u64 = 64 << 30;

impl Registry {
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
        let at = self.take_own(len, align, false, reserve)?;
        self.handed.insert(at, Handed { len, own: true });
        Some(at)
    }

    /// Takes `len` bytes aligned to `align` from the own arenas ([`Registry::carve_own`]),
    /// without handing them to NCCL. For a `chunk`, only space of its arena that no chunk had
    /// before (above the arena's chunk floor, which it then raises).
    fn take_own(
        &mut self,
        len: u64,
        align: u64,
        chunk: bool,
        reserve: impl FnOnce(u64, u64) -> Option<CUdeviceptr>,
    ) -> Option<CUdeviceptr> {
        let align = align.max(1);
        let arenas = &self.own_arenas;
        let floor = |start: CUdeviceptr| match arenas.range(..=start).next_back() {
            Some((_, &floor)) if chunk => floor.max(start),
            _ => start,
        };
        let fits = |(start, free): (&CUdeviceptr, &u64)| {
            let at = floor(*start).next_multiple_of(align);
            (at + len <= start + free).then_some((*start, *free, at))
        };
        let found = match self.own_free.iter().find_map(fits) {
            Some(f) => f,
            None => {
                let size = OWN_ARENA.max(len.next_multiple_of(1 << 30));
                let base = reserve(size, (1 << 30).max(align))?;
                self.own_free.insert(base, size);
                self.own_arenas.insert(base, base);
                (base, size, base.next_multiple_of(align))
            }
        };
        let (start, free, at) = found;
        if chunk && let Some((_, floor)) = self.own_arenas.range_mut(..=start).next_back() {
            *floor = at + len;
        }
        self.own_free.remove(&start);
        if at > start {
            self.own_free.insert(start, at - start);
        }
        if start + free > at + len {
            self.own_free.insert(at + len, start + free - (at + len));
        }
        Some(at)
    }

    /// Gives `[start, start + len)` back to the own arenas, merged with its free neighbours in
    /// the same arena (two arenas the driver placed side by side stay apart).
    fn give_back(&mut self, start: CUdeviceptr, len: u64) {
        let (mut start, mut len) = (start, len);
        if !self.own_arenas.contains_key(&start)
            && let Some((&s, &l)) = self.own_free.range(..start).next_back()
            && s + l == start
        {
            self.own_free.remove(&s);
            (start, len) = (s, l + len);
        }
        if !self.own_arenas.contains_key(&(start + len))
            && let Some(next) = self.own_free.remove(&(start + len))
        {
            len += next;
        }
        self.own_free.insert(start, len);
    }

    /// NCCL freed its reservation at `ptr` (or a run that covered it went): `true` when the
    /// range was memsaver's (an own arena's space is free again, merged with its free
    /// neighbours; an import's place is forgotten), `false` when it is the driver's to free.
    pub fn free_range(&mut self, ptr: CUdeviceptr) -> bool {
        let Some(h) = self.handed.remove(&ptr) else {
            return false;
        };
        if h.own {
            self.give_back(ptr, h.len);
        }
        true
    }

    /// An address for NCCL's new own buffer of `len` bytes with properties `prop`, carved at
    /// its creation from the chunk open for those properties: the chunk's next free space, or
    /// a new chunk of `chunk` bytes (at least `len`) taken from the own arenas, aligned to its
    /// size rounded up to a power of two (so that it never crosses a block of
    /// [`MIRROR_BLOCK`]), whose memory `make(base, size)` creates and maps, returning the
    /// driver's handle. The buffer is handed out and counted live in the chunk's run. Returns
    /// (the chunk's base, the buffer's address), or `None` when no chunk can be made (the
    /// caller creates the buffer alone).
    pub fn carve_in_chunk(
        &mut self,
        len: u64,
        prop: &CUmemAllocationProp,
        chunk: u64,
        reserve: impl FnOnce(u64, u64) -> Option<CUdeviceptr>,
        make: impl FnOnce(CUdeviceptr, u64) -> Option<Real>,
    ) -> Option<(CUdeviceptr, CUdeviceptr)> {
        let open = self
            .open_chunks
            .iter()
            .find(|(p, _)| p == prop)
            .map(|c| c.1);
        if let Some(base) = open
            && let Some(run) = self.runs.get_mut(&base)
            && let Some((at, free)) = run.spare
            && free >= len
        {
            run.spare = (free > len).then_some((at + len, free - len));
            run.live += 1;
            self.handed.insert(at, Handed { len, own: true });
            return Some((base, at));
        }
        let size = chunk.max(len);
        // Never where a chunk was before: a peer may still map a chunk whose buffers were all
        // freed here (its NCCL has not freed its imports yet), and a new chunk at that address
        // would look to it like the old one, whose mapping its imports of the new one would
        // then join.
        let base = self.take_own(size, size.next_power_of_two(), true, reserve)?;
        let Some(real) = make(base, size) else {
            self.give_back(base, size);
            return None;
        };
        // The open one is full: no buffer is carved from it any more (its spare stays with it
        // while it is mapped).
        self.open_chunks.retain(|(p, _)| p != prop);
        let mut run = Run::new(size, real, 1);
        run.spare = (size > len).then_some((base + len, size - len));
        self.runs.insert(base, run);
        self.open_chunks.push((*prop, base));
        self.handed.insert(base, Handed { len, own: true });
        Some((base, base))
    }

    /// The run at `base` (`run`, out of `runs`) is unmapped: no buffer is carved from it any
    /// more, and the space it never handed out is free again.
    pub fn run_unmapped(&mut self, base: CUdeviceptr, run: &Run) {
        self.open_chunks.retain(|c| c.1 != base);
        if let Some((at, len)) = run.spare {
            self.give_back(at, len);
        }
    }

    /// Whether `[ptr, ptr + size)` lies inside one range reserved for an owner's layout.
    pub fn in_mirror(&self, ptr: CUdeviceptr, size: u64) -> bool {
        self.mirrors
            .values()
            .any(|base| ptr >= *base && ptr + size <= base + MIRROR_BLOCK)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// Two arenas the driver placed side by side: space freed at the start of the second does
    /// not merge with the free end of the first, so no buffer is carved across both (the
    /// driver maps a range only inside one reservation).
    #[test]
    fn free_space_does_not_merge_across_arenas_side_by_side() {
        let mut reg = Registry::default();
        let x = 0x1000_0000_0000;
        let arenas = std::cell::Cell::new(0u64);
        let reserve = |size: u64, _| {
            let at = x + arenas.get();
            arenas.set(arenas.get() + size);
            Some(at)
        };
        let m = 2 << 20;
        assert_eq!(reg.carve_own(OWN_ARENA - m, m, reserve), Some(x));
        // The first arena's last m is free; 2m do not fit there: the second arena, adjacent.
        let second = reg.carve_own(2 * m, m, reserve).unwrap();
        assert_eq!(second, x + OWN_ARENA);
        assert!(reg.free_range(second));
        let at = reg.carve_own(2 * m, m, |_, _| None).unwrap();
        assert!(
            at >= x + OWN_ARENA || at + 2 * m <= x + OWN_ARENA,
            "carved across the two arenas at {at:#x}"
        );
        assert_eq!(reg.carve_own(m, m, |_, _| None), Some(x + OWN_ARENA - m));
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

    /// Buffers of one set of properties are carved side by side from their chunk; one that
    /// does not fit opens the next chunk (the first one's rest stays with it while it is
    /// mapped); other properties get a chunk of their own; a chunk that cannot be made gives
    /// its space back; an unmapped chunk's rest is free again.
    #[test]
    fn buffers_are_carved_from_chunks_made_ahead_one_per_set_of_properties() {
        let mut reg = Registry::default();
        let reserve = |_: u64, _: u64| Some(0x1000_0000_0000);
        let (m, chunk) = (2 << 20, 8 << 20);
        let dev = |id| CUmemAllocationProp {
            location: memsaver_allocator::driver::sys::CUmemLocation {
                type_: memsaver_allocator::driver::sys::CU_MEM_LOCATION_TYPE_DEVICE,
                id,
            },
            ..Default::default()
        };
        let made = std::cell::RefCell::new(Vec::new());
        let make = |base: u64, size: u64| {
            made.borrow_mut().push((base, size));
            Some(made.borrow().len() as Real)
        };
        let (base, a) = reg
            .carve_in_chunk(m, &dev(0), chunk, reserve, make)
            .unwrap();
        let (_, b) = reg
            .carve_in_chunk(2 * m, &dev(0), chunk, reserve, make)
            .unwrap();
        assert_eq!(
            (a, b),
            (base, base + m),
            "side by side from the chunk's start"
        );
        assert!(
            base.is_multiple_of(chunk),
            "aligned to its size: never across a block"
        );
        assert_eq!(*made.borrow(), vec![(base, chunk)]);
        assert_eq!(
            (reg.runs[&base].live, reg.runs[&base].spare),
            (2, Some((b + 2 * m, m)))
        );
        // Another device's buffer: a chunk of its own, carved after the first.
        let (other, _) = reg
            .carve_in_chunk(m, &dev(1), chunk, reserve, make)
            .unwrap();
        assert!(other >= base + chunk);
        // Does not fit in the first chunk's rest: the next chunk; the rest stays reserved.
        let (next, c) = reg
            .carve_in_chunk(2 * m, &dev(0), chunk, reserve, make)
            .unwrap();
        assert_eq!((c, made.borrow().len()), (next, 3));
        assert_eq!(reg.runs[&base].spare, Some((b + 2 * m, m)));
        assert!(
            !reg.own_free.contains_key(&(b + 2 * m)),
            "mapped: not handed out"
        );
        // Once unmapped, the chunk's rest is free again.
        let run = reg.runs.remove(&base).unwrap();
        reg.run_unmapped(base, &run);
        assert_eq!(reg.own_free.get(&(b + 2 * m)), Some(&m));
        // A chunk that cannot be made: its space goes back, the caller creates the buffer alone.
        let free_before = reg.own_free.clone();
        let full = reg.carve_in_chunk(8 * m, &dev(0), chunk, reserve, |_, _| None);
        assert_eq!(full, None);
        assert_eq!(reg.own_free, free_before);
        // Every buffer of the first chunk freed: its space is free again, for NCCL's buffers
        // alone, but a new chunk never goes where a chunk was (a peer may still map the old
        // one there).
        for at in [a, b] {
            reg.free_range(at);
        }
        let opened: Vec<u64> = reg.open_chunks.iter().map(|c| c.1).collect();
        reg.open_chunks.clear();
        let (again, _) = reg
            .carve_in_chunk(m, &dev(0), chunk, reserve, make)
            .unwrap();
        assert!(
            ![base, other, next].contains(&again) && !opened.contains(&again),
            "a new chunk at {again:#x}, where one was"
        );
        assert_eq!(
            reg.carve_own(chunk, m, reserve),
            Some(base),
            "alone: the lowest free"
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
}
