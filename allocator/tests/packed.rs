//! Packed backups (`MEMSAVER_PACK`, `packed.rs`) on the fake driver, whose fresh device memory
//! holds junk in this test process (`FAKE_CUDA_FRESH=junk`): only the 4 KiB blocks that hold
//! something are copied, by the packing kernel and no `cuMemcpy`, and a resume gives back every
//! byte, the zeros too; where the device cannot reach registered host memory, or a backup has
//! more non-zero blocks than room, it is copied whole.

mod common;

use std::sync::{Arc, Once};

use common::*;
use memsaver_allocator::driver::Handle;
use memsaver_allocator::options::Pack;
use memsaver_allocator::steps::{Memory, Op, Piece, Place};
use memsaver_allocator::{Backup, Options, Policy, packed};

const BLOCK: usize = 4096;

/// Fresh device memory holds junk in this process, set before the fake driver reads its knobs
/// (every test calls this, or [`junk_allocator`], first).
fn junk() {
    static JUNK: Once = Once::new();
    JUNK.call_once(|| {
        // SAFETY: before the first driver load of this process, which every test waits for
        // here; nothing else in the process reads the environment meanwhile.
        unsafe { std::env::set_var("FAKE_CUDA_FRESH", "junk") };
    });
}

fn junk_allocator(pack: Pack) -> TestAllocator {
    junk();
    allocator_with(&Options {
        pack,
        // Backups pinned whole at the first pause (prepared ones may be pinned in part then).
        backup_prepare_limit: 0,
        ..Options::default()
    })
}

/// The fake driver's transfers: bytes copied to host and to device by `cuMemcpy*`, bytes its
/// kernels wrote to and read from host memory, pack and unpack launches.
fn transfers() -> [u64; 6] {
    type Stats = unsafe extern "C" fn(*mut u64, usize) -> usize;
    // SAFETY: the fake driver's `fakecuda_transfer_stats`, of that signature.
    let f: Stats = unsafe { std::mem::transmute(fake_fn("fakecuda_transfer_stats")) };
    let mut out = [0u64; 6];
    // SAFETY: `out` has room for 6.
    assert_eq!(unsafe { f(out.as_mut_ptr(), 6) }, 6);
    out
}

fn delta(before: [u64; 6]) -> [u64; 6] {
    let after = transfers();
    std::array::from_fn(|i| after[i] - before[i])
}

/// Device memory at `ptr` (the fake driver's is host memory at the same address).
fn bytes(ptr: u64, len: usize) -> &'static mut [u8] {
    // SAFETY: the callers pass resident memory mapped read-write.
    unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) }
}

/// Writes `what` at each offset of `at` into zeroed memory, returning the image.
fn shape(ptr: u64, len: usize, at: &[(usize, &[u8])]) -> Vec<u8> {
    let m = bytes(ptr, len);
    m.fill(0);
    for (off, what) in at {
        m[*off..*off + what.len()].copy_from_slice(what);
    }
    m.to_vec()
}

#[test]
fn a_pause_copies_only_the_blocks_that_hold_something_and_resume_gives_back_every_byte() {
    let a = junk_allocator(Pack::All);
    let len = 8 * MIB;
    let p = a.malloc(len, 0, "weights", Policy::Cpu).unwrap();
    // Block 0, the last of the first granule, one byte at the end of block 767 and the last
    // byte of the allocation: 4 blocks of 2048.
    let mut image = shape(
        p,
        len,
        &[
            (0, b"first"),
            (2 * MIB - 100, b"end of a granule"),
            (3 * MIB - 1, b"x"),
            (len - 1, b"z"),
        ],
    );
    let t = transfers();
    let r = a.pause(&["weights"]).unwrap();
    let d = delta(t);
    assert_eq!(d[4], 1, "one packing launch: {d:?}");
    assert_eq!(d[0], 0, "no cuMemcpy: {d:?}");
    assert_eq!(
        d[2],
        4 * (BLOCK as u64 + 4),
        "4 blocks and their index: {d:?}"
    );
    assert_eq!(
        r.copied_bytes,
        4 * (BLOCK as u64 + 4),
        "the report counts what crossed"
    );
    let backup = a.stats().tag("weights").unwrap().usage.backup_bytes;
    assert_eq!(backup, (len / 16) as u64, "a packed backup starts at 1/16");
    a.resume(&["weights"]).unwrap();
    let d = delta(t);
    assert_eq!((d[5], d[1]), (1, 0), "one unpack, no cuMemcpy: {d:?}");
    assert!(
        bytes(p, len) == image.as_slice(),
        "contents differ after resume"
    );

    // Between two pauses, a block turns zero and another turns non-zero.
    bytes(p, len)[..5].fill(0);
    image[..5].fill(0);
    bytes(p, len)[5 * MIB + 7] = 9;
    image[5 * MIB + 7] = 9;
    let t = transfers();
    let r = a.pause(&["weights"]).unwrap();
    assert_eq!(r.copied_bytes, 4 * (BLOCK as u64 + 4), "{:?}", delta(t));
    a.resume(&["weights"]).unwrap();
    assert!(
        bytes(p, len) == image.as_slice(),
        "contents differ after the second cycle"
    );

    // Nothing at all: nothing copied, zeros come back.
    bytes(p, len).fill(0);
    let r = a.pause(&["weights"]).unwrap();
    assert_eq!(r.copied_bytes, 0);
    a.resume(&["weights"]).unwrap();
    assert!(
        bytes(p, len).iter().all(|&b| b == 0),
        "zeros come back as zeros"
    );
    a.free(p).unwrap();
}

#[test]
fn a_backup_with_more_blocks_than_room_is_copied_whole() {
    let a = junk_allocator(Pack::All);
    let len = 2 * MIB;
    let p = a.malloc(len, 0, "dense", Policy::Cpu).unwrap();
    fill(p, len, 3);
    let t = transfers();
    let r = a.pause(&["dense"]).unwrap();
    let d = delta(t);
    // The packing found every block non-zero, more than a backup of the same size holds with
    // its index: the memory was then copied whole.
    assert_eq!((d[4], d[0]), (1, len as u64), "{d:?}");
    assert_eq!(r.copied_bytes, len as u64);
    let backup = a.stats().tag("dense").unwrap().usage.backup_bytes;
    assert_eq!(
        backup, len as u64,
        "the backup grew to the allocation's size"
    );
    a.resume(&["dense"]).unwrap();
    assert_eq!(delta(t)[1], len as u64, "restored by a whole copy");
    assert!(check(p, len, 3));
    // Sparse again: packed into the grown backup, nothing allocated.
    let image = shape(p, len, &[(7, b"sparse")]);
    let r = a.pause(&["dense"]).unwrap();
    assert_eq!(r.copied_bytes, BLOCK as u64 + 4);
    a.resume(&["dense"]).unwrap();
    assert!(bytes(p, len) == image.as_slice());
    a.free(p).unwrap();
}

#[test]
fn tags_other_than_nccl_copy_whole_unless_asked() {
    let a = junk_allocator(Pack::Nccl);
    let p = a.malloc(2 * MIB, 0, "weights", Policy::Cpu).unwrap();
    let image = shape(p, 2 * MIB, &[(0, b"only this")]);
    let t = transfers();
    let r = a.pause(&["weights"]).unwrap();
    assert_eq!((delta(t)[4], r.copied_bytes), (0, 2 * MIB as u64));
    a.resume(&["weights"]).unwrap();
    assert!(bytes(p, 2 * MIB) == image.as_slice());
    a.free(p).unwrap();
}

/// A piece whose backed-up prefix ends inside a block (as `headers` keeps a prefix of NCCL's
/// buffers), through the steps every tag uses: that block comes back to its last byte, and
/// nothing after the prefix is written.
#[test]
fn a_prefix_whose_last_block_is_partial_comes_back_exact() {
    let a = junk_allocator(Pack::All);
    let d = driver();
    let dev = a.device(0).unwrap();
    let size = 2 * MIB;
    let len = 64 * 1024 + 1000; // the prefix a pause keeps: 16 blocks and 1000 bytes
    let ptr = d.reserve(size, 0, 0).unwrap();
    let h = d.create(0, size, false).unwrap();
    // SAFETY: a fresh reservation of `size` bytes and a handle of that size.
    unsafe { d.map(ptr, size, h, 0) }.unwrap();
    let image = shape(
        ptr,
        size,
        &[
            (5, b"head"),
            (64 * 1024 + 999, b"L"),
            (64 * 1024 + 1000, b"after"),
        ],
    );
    let place = [Place {
        ptr,
        size,
        access: None,
    }];
    let mut piece = Piece::new(
        1 << 40,
        Arc::from("prefix"),
        dev.clone(),
        Policy::Cpu,
        ptr,
        len,
        None,
    )
    .packed(true);
    let t = transfers();
    let mut steps = a.steps(Op::Pause);
    steps.copy_out(&mut piece).unwrap();
    steps.copied(&mut piece).unwrap();
    assert!(
        matches!(piece.backup, Some(Backup::Packed(_, 2))),
        "2 blocks packed"
    );
    assert_eq!(steps.copied_bytes(), 2 * (BLOCK as u64 + 4));
    // SAFETY: mapped above; the copy is done.
    unsafe { steps.unmap(&dev, &place) }.unwrap();
    steps.release(h, ptr);
    drop(steps);
    let mut steps = a.steps(Op::Resume);
    let h: Handle = steps
        .map_fresh(&dev, Memory::Plain, size, &place, "prefix")
        .unwrap();
    steps.copy_in(&piece).unwrap();
    steps.finish(&dev).unwrap();
    let m = bytes(ptr, size);
    assert!(
        m[..len] == image[..len],
        "the prefix differs after the round trip"
    );
    assert!(
        m[len..].iter().all(|&b| b == 0xA5),
        "bytes after the prefix were written: fresh memory's junk must stay"
    );
    assert_eq!(delta(t)[0..2], [0, 0], "no cuMemcpy either way");
    drop(steps);
    // SAFETY: mapped by map_fresh; nothing uses it.
    unsafe { d.unmap(ptr, size) }.unwrap();
    d.release(h).unwrap();
    // SAFETY: the reservation made above, nothing mapped in it.
    unsafe { d.address_free(ptr, size) }.unwrap();
}

/// A backup whose blocks outnumber its room first (the backup starts at 1/16 of the piece):
/// it grows to the piece's size and the memory is copied whole, then packed again later.
#[test]
fn a_small_packed_backup_grows_when_the_memory_fills() {
    let a = junk_allocator(Pack::All);
    let len = 4 * MIB;
    let p = a.malloc(len, 0, "grows", Policy::Cpu).unwrap();
    let image = shape(p, len, &[(0, b"a")]);
    a.pause(&["grows"]).unwrap();
    a.resume(&["grows"]).unwrap();
    assert!(bytes(p, len) == image.as_slice());
    let backup = |a: &TestAllocator| a.stats().tag("grows").unwrap().usage.backup_bytes;
    assert_eq!(backup(&a), (len / 16) as u64);
    fill(p, len, 9);
    let t = transfers();
    let r = a.pause(&["grows"]).unwrap();
    assert_eq!(
        (r.copied_bytes, delta(t)[0]),
        (len as u64, len as u64),
        "copied whole"
    );
    assert_eq!(backup(&a), len as u64);
    a.resume(&["grows"]).unwrap();
    assert!(check(p, len, 9));
    a.free(p).unwrap();
}

/// Where the device does not reach registered host memory at its host address, backups are
/// copied whole (run in a child process of this test binary, whose fake driver says so).
#[test]
fn whole_copies_where_the_device_cannot_reach_host_memory() {
    if std::env::var_os("PACKED_CHILD").is_none() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "whole_copies_where_the_device_cannot_reach_host_memory",
            ])
            .env("PACKED_CHILD", "1")
            .env("FAKE_CUDA_HOST_POINTER", "0")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && text.contains("1 passed"), "{text}");
        return;
    }
    let a = junk_allocator(Pack::All);
    let p = a.malloc(2 * MIB, 0, "weights", Policy::Cpu).unwrap();
    let image = shape(p, 2 * MIB, &[(0, b"only this")]);
    let t = transfers();
    let r = a.pause(&["weights"]).unwrap();
    let d = delta(t);
    assert_eq!(
        (d[4], d[0], r.copied_bytes),
        (0, 2 * MIB as u64, 2 * MIB as u64),
        "{d:?}"
    );
    a.resume(&["weights"]).unwrap();
    assert!(bytes(p, 2 * MIB) == image.as_slice());
    a.free(p).unwrap();
}

/// One launch packs up to 64 pieces of a device, and a pause waits once for them all: 100
/// allocations take 2 launches each way, not 100.
#[test]
fn pieces_are_packed_and_put_back_in_batches() {
    let a = junk_allocator(Pack::All);
    let ptrs: Vec<u64> = (0..100)
        .map(|_| a.malloc(2 * MIB, 0, "many", Policy::Cpu).unwrap())
        .collect();
    let images: Vec<Vec<u8>> = ptrs
        .iter()
        .enumerate()
        .map(|(i, &p)| shape(p, 2 * MIB, &[(i * 4096, &[i as u8 + 1; 10])]))
        .collect();
    let t = transfers();
    let r = a.pause(&["many"]).unwrap();
    let d = delta(t);
    assert_eq!(
        (d[4], d[0]),
        (2, 0),
        "two packing launches, no cuMemcpy: {d:?}"
    );
    assert_eq!(r.copied_bytes, 100 * (BLOCK as u64 + 4));
    a.resume(&["many"]).unwrap();
    assert_eq!(delta(t)[5], 2, "two unpack launches");
    for (p, image) in ptrs.iter().zip(&images) {
        assert!(
            bytes(*p, 2 * MIB) == image.as_slice(),
            "contents differ at {p:#x}"
        );
    }
    for p in ptrs {
        a.free(p).unwrap();
    }
}

/// A whole backup kept across cycles serves the next pause: nothing is pinned again.
#[test]
fn a_kept_whole_backup_serves_the_next_pause() {
    let a = junk_allocator(Pack::Nccl);
    let p = a.malloc(4 * MIB, 0, "kept", Policy::Cpu).unwrap();
    fill(p, 4 * MIB, 5);
    a.pause(&["kept"]).unwrap();
    a.resume(&["kept"]).unwrap();
    let before = fake_calls();
    a.pause(&["kept"]).unwrap();
    let after = fake_calls();
    for k in ["host_alloc", "host_register", "host_unregister"] {
        assert_eq!(kind(&after, k), kind(&before, k), "{k} in the second pause");
    }
    a.resume(&["kept"]).unwrap();
    assert!(check(p, 4 * MIB, 5));
    a.free(p).unwrap();
}

/// A packed backup prepared in the background (as the `nccl` tag asks for a sixteenth of each
/// buffer) and taken by a pause before it was pinned cannot be packed into, since the kernel
/// reaches only registered host memory, and it is too small for a whole copy: the piece is
/// copied whole, as pageable memory into a backup of its size, with no launch and no pinning
/// call, and every byte comes back.
#[test]
fn a_small_packed_backup_not_pinned_yet_is_replaced_by_a_whole_one() {
    junk();
    let a = allocator_with(&Options {
        pack: Pack::All,
        ..Options::default()
    });
    let d = driver();
    let dev = a.device(0).unwrap();
    let size = 4 * MIB;
    let key = 1 << 41;
    let held = HeldPinning::new(PinHold::AtEntry);
    a.prepare_backup(key + 1, 0, size);
    assert_eq!(
        wait_pinning_held(1),
        1,
        "the thread waits in another backup's first step"
    );
    a.prepare_backup(key, 0, packed::start_len(size));

    let ptr = d.reserve(size, 0, 0).unwrap();
    let h = d.create(0, size, false).unwrap();
    // SAFETY: a fresh reservation of `size` bytes and a handle of that size.
    unsafe { d.map(ptr, size, h, 0) }.unwrap();
    let image = shape(ptr, size, &[(7, b"head"), (3 * MIB + 5, b"tail")]);
    let place = [Place {
        ptr,
        size,
        access: None,
    }];
    let mut piece = Piece::new(
        key,
        Arc::from("small"),
        dev.clone(),
        Policy::Cpu,
        ptr,
        size,
        None,
    )
    .packed(true);
    let (calls, t) = (fake_calls(), transfers());
    let mut steps = a.steps(Op::Pause);
    steps.copy_out(&mut piece).unwrap();
    steps.copied(&mut piece).unwrap();
    let dt = delta(t);
    assert_eq!(
        (dt[4], dt[0]),
        (0, size as u64),
        "copied whole, no launch: {dt:?}"
    );
    assert!(
        matches!(&piece.backup, Some(Backup::Host(b)) if b.len() == size),
        "a backup of the piece's size"
    );
    let after = fake_calls();
    for k in ["host_alloc", "host_register"] {
        assert_eq!(kind(&after, k), kind(&calls, k), "{k} in the pause");
    }
    assert_eq!(fake_pin_hold(), [1, 0], "the thread is still held");
    // SAFETY: mapped above; the copy is done.
    unsafe { steps.unmap(&dev, &place) }.unwrap();
    steps.release(h, ptr);
    drop(steps);

    let mut steps = a.steps(Op::Resume);
    let h: Handle = steps
        .map_fresh(&dev, Memory::Plain, size, &place, "small")
        .unwrap();
    steps.copy_in(&piece).unwrap();
    steps.finish(&dev).unwrap();
    drop(steps);
    assert!(bytes(ptr, size) == image.as_slice(), "every byte back");
    drop(held);
    drop(piece);
    // SAFETY: mapped by map_fresh; nothing uses it.
    unsafe { d.unmap(ptr, size) }.unwrap();
    d.release(h).unwrap();
    // SAFETY: the reservation made above, nothing mapped in it.
    unsafe { d.address_free(ptr, size) }.unwrap();
}
