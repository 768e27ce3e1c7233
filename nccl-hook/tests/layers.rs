//! The module layering of nccl-hook and memsaver-ipc (docs/architecture.md, "Module map"),
//! checked on the sources (`memsaver_test_support::layers` says how imports are read): no
//! module imports another that imports it back (directly or not), and nccl-hook's
//! interposition never reaches the `nccl` tag's pause and resume, the owner's server or the
//! crate root above it. The allocator core's layering is checked in `allocator/tests`.
//! Also that docs/architecture.md's module map names every module file of the crates.

use memsaver_test_support::layers::{cycles, graph, missing_from_module_map, reach};

fn src(crate_dir: &str) -> std::path::PathBuf {
    memsaver_test_support::layers::src(env!("CARGO_MANIFEST_DIR"), crate_dir)
}

#[test]
fn nccl_hook_has_no_import_cycle() {
    let g = graph(&src("nccl-hook"));
    assert!(
        g.contains_key("vmm") && g["vmm"].contains("registry"),
        "{g:?}"
    );
    assert!(
        g["vmm"].contains("tokens") && !reach(&g, "tokens").contains("vmm"),
        "the wrappers use the tokens, never the other way round: {g:#?}"
    );
    assert_eq!(cycles(&g), Vec::<String>::new(), "{g:#?}");
}

#[test]
fn interposition_depends_on_nothing_above_it() {
    let g = graph(&src("nccl-hook"));
    let above = [
        "provider",
        "local",
        "exports",
        "peer",
        "registered",
        "catchup",
        "lib",
    ];
    for m in [
        "interpose",
        "procaddr",
        "vmm",
        "tokens",
        "graphs",
        "guard",
        "amem",
        "appmem",
        "epochs",
        "dl",
        "registry",
    ] {
        let bad: Vec<&str> = above
            .iter()
            .copied()
            .filter(|a| reach(&g, m).contains(*a))
            .collect();
        assert!(bad.is_empty(), "{m} reaches {bad:?}: {g:#?}");
    }
    assert!(
        g["registry"].is_empty(),
        "the registry imports no module: {g:#?}"
    );
}

#[test]
fn ipc_has_no_import_cycle() {
    let g = graph(&src("ipc"));
    assert!(
        g.contains_key("server") && g["control"].contains("server"),
        "{g:?}"
    );
    assert_eq!(cycles(&g), Vec::<String>::new(), "{g:#?}");
}

#[test]
fn the_module_map_names_every_module_file() {
    for krate in ["allocator", "ipc", "nccl-hook", "torch-shim", "profile"] {
        let missing = missing_from_module_map(&src(krate));
        assert_eq!(
            missing,
            Vec::<String>::new(),
            "{krate}: files that docs/architecture.md's module map does not name"
        );
    }
}
