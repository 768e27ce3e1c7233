//! The module layering of the allocator core (docs/architecture.md, "Module map"), checked on
//! the sources (`memsaver_test_support::layers` says how imports are read): no module imports
//! another that imports it back, directly or not. A module that adds methods to `Allocator`
//! (`engine`: pause and resume; `export`: sharing) sits above `allocator`; what `allocator`
//! itself needs (the steps of a transition, the sharing interface, the external tags'
//! interface) sits below it and never reaches `Allocator`.

use memsaver_test_support::layers::{Graph, cycles, graph, reach};

/// The allocator's import graph.
fn allocator_graph() -> Graph {
    graph(&memsaver_test_support::layers::src(
        env!("CARGO_MANIFEST_DIR"),
        "allocator",
    ))
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
