//! The module layering of the allocator core (docs/architecture.md, "Module map"), checked on
//! the sources (`memsaver_test_support::layers` says how imports are read): no module imports
//! another that imports it back, directly or not. A module that adds methods to `Allocator`
//! (`engine`: pause and resume; `export`: sharing) sits above `allocator`; what `allocator`
//! itself needs (the steps of a transition, the sharing interface, the external tags'
//! interface) sits below it and never reaches `Allocator`.

use memsaver_test_support::layers::{Graph, cycles, graph, reach};

/// The one import that still points up, and why: `external` (the interface of external
/// tags, which `allocator` holds) names `Report`, which is defined in `engine` (above
/// `allocator`). It goes once `Report` moves below `external` (into `external.rs` or a module
/// of its own, with `engine` importing it from there); the test then fails until this
/// exception is removed.
const KNOWN_UPWARD: (&str, &str) = ("external", "engine");

/// The allocator's import graph, without [`KNOWN_UPWARD`].
fn allocator_graph() -> Graph {
    let src = memsaver_test_support::layers::src(env!("CARGO_MANIFEST_DIR"), "allocator");
    let mut g = graph(&src);
    let (from, to) = KNOWN_UPWARD;
    assert!(
        g[from].contains(to),
        "`{from}` no longer imports `{to}`: remove KNOWN_UPWARD from this test. {g:#?}"
    );
    g.get_mut(from).unwrap().remove(to);
    g
}

#[test]
fn the_allocator_has_no_import_cycle() {
    let g = allocator_graph();
    assert!(
        g.contains_key("engine") && g["engine"].contains("allocator"),
        "{g:?}"
    );
    assert!(g["options"].contains("error"), "options/ is read: {g:?}");
    assert_eq!(cycles(&g), Vec::<String>::new(), "{g:#?}");
}

#[test]
fn nothing_below_the_allocator_reaches_it() {
    let g = allocator_graph();
    for m in ["steps", "sharing", "external", "table", "types", "error"] {
        assert!(
            !reach(&g, m).contains("allocator"),
            "{m} must not reach `allocator`: {g:#?}"
        );
    }
    for m in ["driver", "units"] {
        assert_eq!(
            g.get(m),
            Some(&Default::default()),
            "{m} imports no module: {g:#?}"
        );
    }
}
