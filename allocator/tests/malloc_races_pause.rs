//! A `malloc` of a tag racing a pause of that tag: the allocation is being mapped (the fake
//! driver holds its `cuMemMap`) while the pause runs. It must not stay resident in the paused
//! tag, where no pause saw it: malloc undoes it and says the tag is paused. One test in this
//! binary: the fake driver's hold of `cuMemMap` is process-wide.

mod common;

use common::*;
use memsaver_allocator::{Error, Policy};

#[test]
fn a_malloc_mapping_while_its_tag_is_paused_is_undone() {
    let a = allocator();
    let first = a.malloc(4 * MIB, 0, "weights", Policy::Cpu).unwrap();
    fill(first, 4 * MIB, 3);
    let free_before = free_bytes(&a, 0);
    let held = HeldMaps::new();
    std::thread::scope(|s| {
        let racing = s.spawn(|| a.malloc(2 * MIB, 0, "weights", Policy::Cpu));
        assert_eq!(held.wait_held(1), 1, "the racing malloc is mapping");
        // The pause needs no cuMemMap: it runs to its end while the malloc is held.
        a.pause(&["weights"]).unwrap();
        drop(held);
        let r = racing.join().unwrap();
        assert!(matches!(r, Err(Error::TagPaused { .. })), "{r:?}");
    });
    let s = a.stats();
    let w = s.tags.iter().find(|t| t.tag == "weights").unwrap();
    assert!(w.paused);
    assert_eq!(w.usage.allocations, 1, "only the first allocation: {w:?}");
    assert_eq!(
        w.usage.resident_bytes, 0,
        "nothing resident in a paused tag: {w:?}"
    );
    assert_eq!(
        free_bytes(&a, 0),
        free_before + 4 * MIB,
        "the pause freed the first allocation and the racing one left nothing behind"
    );
    a.resume(&["weights"]).unwrap();
    assert!(check(first, 4 * MIB, 3));
}
