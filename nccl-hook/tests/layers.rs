//! The module layering of nccl-hook and memsaver-ipc (docs/architecture.md, "Module map"),
//! checked on the sources: no module imports another that imports it back (directly or
//! not), and nccl-hook's interposition never reaches the `nccl` tag's pause and resume, the
//! owner's server or the crate root above it.
//!
//! A module's imports are the `crate::<module>` paths in its code (comments and its test
//! module left out); the crate root's are the `<module>::` paths in `lib.rs`, and a
//! `crate::<item>` path that names no module is an import of the crate root.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

type Graph = BTreeMap<String, BTreeSet<String>>;

/// The source without comments and without its `#[cfg(test)]` module.
fn code(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap_or_default();
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Identifiers that follow `prefix` in `text` (`crate::` -> `registry`, ...).
fn after(text: &str, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find(prefix) {
        let before = rest[..i].chars().next_back();
        rest = &rest[i + prefix.len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // part of a longer path (`memsaver_ipc::...` for prefix `ipc::`)
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        out.push(name);
        // `use crate::{a, b::c}`: every name of the group.
        if prefix == "crate::" && rest.starts_with('{') {
            let group = &rest[1..rest.find('}').unwrap_or(rest.len())];
            for part in group.split(',') {
                let first: String = part
                    .trim()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                out.push(first);
            }
        }
    }
    out.retain(|n| !n.is_empty());
    out
}

/// Each module of `src` (file stem; `lib` for the root) and the modules it imports.
fn graph(src: &Path) -> Graph {
    let mut files = BTreeMap::new();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "rs") {
            let stem = p.file_stem().unwrap().to_string_lossy().into_owned();
            files.insert(stem, code(&std::fs::read_to_string(&p).unwrap()));
        }
    }
    let modules: BTreeSet<String> = files.keys().cloned().collect();
    let mut g = Graph::new();
    for (m, text) in &files {
        let mut deps = BTreeSet::new();
        for name in after(text, "crate::") {
            deps.insert(if modules.contains(&name) {
                name
            } else {
                "lib".to_owned()
            });
        }
        if m == "lib" {
            for name in modules.iter().filter(|n| *n != "lib") {
                if !after(text, &format!("{name}::")).is_empty() {
                    deps.insert(name.clone());
                }
            }
        }
        deps.remove(m);
        g.insert(m.clone(), deps);
    }
    g
}

/// Every module `m` reaches through its imports.
fn reach(g: &Graph, m: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut todo = vec![m.to_owned()];
    while let Some(n) = todo.pop() {
        for d in g.get(&n).into_iter().flatten() {
            if seen.insert(d.clone()) {
                todo.push(d.clone());
            }
        }
    }
    seen
}

/// The import cycles: each module that reaches itself, with the path back.
fn cycles(g: &Graph) -> Vec<String> {
    g.keys()
        .filter(|m| reach(g, m).contains(*m))
        .map(|m| {
            let back: Vec<&String> = g[m].iter().filter(|d| reach(g, d).contains(m)).collect();
            format!("{m} -> {back:?} -> ... -> {m}")
        })
        .collect()
}

fn src(crate_dir: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(crate_dir)
        .join("src")
}

#[test]
fn the_parser_sees_imports_and_cycles() {
    let text =
        code("use crate::{a, b::C};\n// crate::z\nfn f() { crate::c::g(); memsaver_x::d::h(); }");
    assert_eq!(after(&text, "crate::"), ["a", "b", "c"]);
    let mut g = Graph::new();
    g.insert("a".into(), ["b".to_owned()].into());
    g.insert("b".into(), ["a".to_owned()].into());
    g.insert("c".into(), ["a".to_owned()].into());
    assert_eq!(cycles(&g).len(), 2, "{:?}", cycles(&g));
}

#[test]
fn nccl_hook_has_no_import_cycle() {
    let g = graph(&src("nccl-hook"));
    assert!(
        g.contains_key("vmm") && g["vmm"].contains("registry"),
        "{g:?}"
    );
    assert_eq!(cycles(&g), Vec::<String>::new(), "{g:#?}");
}

#[test]
fn interposition_depends_on_nothing_above_it() {
    let g = graph(&src("nccl-hook"));
    let above = ["provider", "local", "exports", "peer", "registered", "lib"];
    for m in [
        "interpose",
        "procaddr",
        "vmm",
        "graphs",
        "guard",
        "amem",
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
        "the ledger imports no module: {g:#?}"
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
