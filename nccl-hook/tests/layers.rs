//! The module layering of nccl-hook and memsaver-ipc (docs/architecture.md, "Module map"),
//! checked on the sources (`memsaver_test_support::layers` says how imports are read).
//!
//! nccl-hook's layers are its folders, top to bottom [`LAYERS`]: each reaches only the layers
//! below it and the base files (`options.rs`), never one above or the crate root; the files of
//! one folder import no file that imports them back. memsaver-ipc has no import cycle. Also
//! that docs/architecture.md's module map names every module file of the crates. The allocator
//! core's layering is checked in `allocator/tests`.

use memsaver_test_support::layers::{
    cycles, folder_graph, folders, graph, missing_from_module_map, reach,
};

fn src(crate_dir: &str) -> std::path::PathBuf {
    memsaver_test_support::layers::src(env!("CARGO_MANIFEST_DIR"), crate_dir)
}

/// nccl-hook's folders, top to bottom: the `nccl` tag's pause and resume, the interposition
/// that records what NCCL does, the records both share.
const LAYERS: [&str; 3] = ["tag", "interpose", "registry"];

#[test]
fn every_folder_of_nccl_hook_is_a_layer_that_reaches_only_those_below_it() {
    let src = src("nccl-hook");
    let mut layers = LAYERS.map(String::from).to_vec();
    layers.sort();
    assert_eq!(
        folders(&src),
        layers,
        "a new folder is a layer: place it in LAYERS"
    );
    let g = graph(&src);
    for (i, layer) in LAYERS.iter().enumerate() {
        let above: Vec<&str> = LAYERS[..i].iter().copied().chain(["lib"]).collect();
        let bad: Vec<&str> = above
            .into_iter()
            .filter(|a| reach(&g, layer).contains(*a))
            .collect();
        assert!(bad.is_empty(), "{layer} reaches {bad:?}: {g:#?}");
    }
    assert!(
        g["registry"].is_empty() && g["options"].is_empty(),
        "the records and the options import nothing of the crate: {g:#?}"
    );
    assert!(
        g["tag"].contains("interpose") && g["interpose"].contains("registry"),
        "{g:#?}"
    );
}

#[test]
fn nccl_hook_has_no_import_cycle() {
    let src = src("nccl-hook");
    let g = graph(&src);
    assert_eq!(cycles(&g), Vec::<String>::new(), "{g:#?}");
    for folder in folders(&src) {
        let inner = folder_graph(&src, &folder);
        assert_eq!(cycles(&inner), Vec::<String>::new(), "{folder}: {inner:#?}");
    }
    let interpose = folder_graph(&src, "interpose");
    assert!(
        interpose["vmm"].contains("tokens") && !reach(&interpose, "tokens").contains("vmm"),
        "the wrappers use the tokens, never the other way round: {interpose:#?}"
    );
    let tag = folder_graph(&src, "tag");
    assert!(
        tag["provider"].contains("release") && tag["restore"].contains("local"),
        "{tag:#?}"
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
