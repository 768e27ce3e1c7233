//! The module layering of a crate, read from its sources (docs/architecture.md, "Module map"):
//! which module imports which, and the import cycles. The crates' `tests/layers.rs` check
//! that there are none and that a layer reaches nothing above it.
//!
//! A module is a file of `src/` (its stem; `lib` for the root), together with the files of
//! the folder of the same name (`driver/mod.rs`, `driver/sys.rs`: the module `driver`). Its
//! imports are the `crate::<module>` paths in its code (`$crate::` in its macros too; comments
//! and its test module left out); the crate root's are the `<module>::` paths in `lib.rs`. A
//! `crate::<item>` path that names no module is an import of the module the root re-exports
//! the item from (`pub use error::Result` in `lib.rs`: `crate::Result` imports `error`), or of
//! the module that defines it as a `#[macro_export]` macro; any other is an import of the
//! crate root.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each module and the modules it imports.
pub type Graph = BTreeMap<String, BTreeSet<String>>;

/// The source without comments and without its `#[cfg(test)]` module.
pub fn code(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap_or_default();
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn ident(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// Identifiers that follow `prefix` in `text` (`crate::` -> `registry`, ...).
pub fn after(text: &str, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find(prefix) {
        let before = rest[..i].chars().next_back();
        rest = &rest[i + prefix.len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // part of a longer path (`memsaver_ipc::...` for prefix `ipc::`)
        }
        out.push(ident(rest));
        // `use crate::{a, b::c}`: every name of the group.
        if prefix.ends_with("::") && rest.starts_with('{') {
            let group = &rest[1..rest.find('}').unwrap_or(rest.len())];
            for part in group.split(',') {
                out.push(ident(part.trim()));
            }
        }
    }
    out.retain(|n| !n.is_empty());
    out
}

/// The items `lib.rs` re-exports (`pub use m::{A, b::C as D};`), each with its module.
fn reexports(lib: &str, modules: &BTreeSet<String>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for stmt in lib.split("pub use ").skip(1) {
        let stmt = &stmt[..stmt.find(';').unwrap_or(stmt.len())];
        let module = ident(stmt);
        if !modules.contains(&module) {
            continue;
        }
        let items = stmt[module.len()..].trim_start_matches("::");
        let items = items.trim_start_matches('{').trim_end_matches('}');
        for part in items.split(',') {
            // The name it is exported under: the last identifier (`a::B`, `B as C`).
            let name = part
                .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                .rfind(|w| !w.is_empty());
            if let Some(name) = name {
                out.insert(name.to_owned(), module.clone());
            }
        }
    }
    out
}

/// The `#[macro_export]` macros defined in `text`.
fn exported_macros(text: &str) -> Vec<String> {
    text.split("#[macro_export]")
        .skip(1)
        .filter_map(|rest| rest.trim_start().strip_prefix("macro_rules!"))
        .map(|rest| ident(rest.trim_start()))
        .collect()
}

/// The code of each module of the crate whose sources are in `src`.
fn modules(src: &Path) -> BTreeMap<String, String> {
    let mut files = BTreeMap::<String, String>::new();
    let mut add = |module: String, p: &Path| {
        let text = code(&std::fs::read_to_string(p).unwrap());
        files.entry(module).or_default().push_str(&text);
    };
    let mut entries: Vec<PathBuf> = std::fs::read_dir(src)
        .unwrap_or_else(|e| panic!("{}: {e}", src.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        let stem = p.file_stem().unwrap().to_string_lossy().into_owned();
        if p.is_dir() {
            let mut inner: Vec<PathBuf> = std::fs::read_dir(&p)
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|q| q.extension().is_some_and(|x| x == "rs"))
                .collect();
            inner.sort();
            for q in inner {
                add(stem.clone(), &q);
            }
        } else if p.extension().is_some_and(|x| x == "rs") {
            add(stem, &p);
        }
    }
    files
}

/// Each module of the crate whose sources are in `src`, and the modules it imports.
pub fn graph(src: &Path) -> Graph {
    let files = modules(src);
    let names: BTreeSet<String> = files.keys().cloned().collect();
    let mut owner = files
        .get("lib")
        .map(|lib| reexports(lib, &names))
        .unwrap_or_default();
    for (m, text) in &files {
        for mac in exported_macros(text) {
            owner.insert(mac, m.clone());
        }
    }
    let mut g = Graph::new();
    for (m, text) in &files {
        let mut deps = BTreeSet::new();
        for name in after(text, "crate::") {
            let module = if names.contains(&name) {
                name
            } else {
                owner
                    .get(&name)
                    .cloned()
                    .unwrap_or_else(|| "lib".to_owned())
            };
            deps.insert(module);
        }
        if m == "lib" {
            for name in names.iter().filter(|n| *n != "lib") {
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

/// The folders of `src`: each a module of several files (`driver/`), or a crate's layer.
pub fn folders(src: &Path) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(src)
        .unwrap_or_else(|e| panic!("{}: {e}", src.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    out.sort();
    out
}

/// Each file of the folder `folder` of `src` but its `mod.rs` (by stem), and the files of the
/// folder it imports: the `crate::<folder>::<file>` and `super::<file>` paths in its code.
/// `mod.rs` is the folder's face (its declarations and re-exports), left out: a path to an
/// item it re-exports counts as no import.
pub fn folder_graph(src: &Path, folder: &str) -> Graph {
    let dir = src.join(folder);
    let mut files = BTreeMap::new();
    for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.unwrap().path();
        let stem = p.file_stem().unwrap().to_string_lossy().into_owned();
        if p.extension().is_some_and(|x| x == "rs") && stem != "mod" {
            files.insert(stem, code(&std::fs::read_to_string(&p).unwrap()));
        }
    }
    let prefix = format!("crate::{folder}::");
    let mut g = Graph::new();
    for (m, text) in &files {
        let deps = after(text, &prefix)
            .into_iter()
            .chain(after(text, "super::"))
            .filter(|d| d != m && files.contains_key(d))
            .collect();
        g.insert(m.clone(), deps);
    }
    g
}

/// Every module `m` reaches through its imports.
pub fn reach(g: &Graph, m: &str) -> BTreeSet<String> {
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
pub fn cycles(g: &Graph) -> Vec<String> {
    g.keys()
        .filter(|m| reach(g, m).contains(*m))
        .map(|m| {
            let back: Vec<&String> = g[m].iter().filter(|d| reach(g, d).contains(m)).collect();
            format!("{m} -> {back:?} -> ... -> {m}")
        })
        .collect()
}

/// The `src` folder of the workspace's crate folder `crate_dir` (`"allocator"`), from the
/// manifest folder of the test's crate (`env!("CARGO_MANIFEST_DIR")`).
pub fn src(manifest_dir: &str, crate_dir: &str) -> PathBuf {
    let here = Path::new(manifest_dir);
    let root = here
        .ancestors()
        .find(|a| a.join("Cargo.toml").is_file() && a.join(crate_dir).join("src").is_dir())
        .unwrap_or_else(|| {
            panic!(
                "no workspace folder above {} has {crate_dir}/src",
                here.display()
            )
        });
    root.join(crate_dir).join("src")
}

/// The module files under `src` (relative paths) that docs/architecture.md's "Module map"
/// section does not name: every file but `lib.rs`, `mod.rs` and a folder's `tests.rs` must be
/// there by its file name (`ledger.rs`), so the map and the folders cannot drift apart.
pub fn missing_from_module_map(src: &Path) -> Vec<String> {
    let doc_path = src
        .ancestors()
        .map(|a| a.join("docs/architecture.md"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("no docs/architecture.md above {}", src.display()));
    let doc = std::fs::read_to_string(&doc_path).expect("architecture.md is readable");
    let start = doc
        .find("## Module map")
        .expect("architecture.md has a Module map");
    let end = doc[start + 2..]
        .find("\n## ")
        .map_or(doc.len(), |i| start + 2 + i);
    let map = &doc[start..end];
    let mut missing = Vec::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("src is readable") {
            let path = entry.expect("a directory entry").path();
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            if path.is_dir() {
                dirs.push(path.clone());
            } else if name.ends_with(".rs")
                && !matches!(name.as_ref(), "lib.rs" | "mod.rs" | "tests.rs")
                && !map.contains(name.as_ref())
            {
                let rel = path.strip_prefix(src).unwrap_or(&path);
                missing.push(rel.display().to_string());
            }
        }
    }
    missing.sort();
    missing
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parser_sees_imports_and_cycles() {
        let text = code(
            "use crate::{a, b::C};\n// crate::z\nfn f() { crate::c::g(); memsaver_x::d::h(); }",
        );
        assert_eq!(after(&text, "crate::"), ["a", "b", "c"]);
        let mut g = Graph::new();
        g.insert("a".into(), ["b".to_owned()].into());
        g.insert("b".into(), ["a".to_owned()].into());
        g.insert("c".into(), ["a".to_owned()].into());
        assert_eq!(cycles(&g).len(), 2, "{:?}", cycles(&g));
        // A group after a longer path, as a folder's files import each other.
        let text = code("use crate::tag::{peer, local::Restored};");
        assert_eq!(after(&text, "crate::tag::"), ["peer", "local"]);
    }

    #[test]
    fn reexported_items_and_macros_belong_to_their_module() {
        let names: BTreeSet<String> = ["error", "start", "lib"].map(String::from).into();
        let lib =
            "pub use error::{Error, Result};\npub use start::{\n    a::B as C,\n    global,\n};";
        let r = reexports(lib, &names);
        assert_eq!(r["Result"], "error");
        assert_eq!(r["C"], "start");
        assert_eq!(r["global"], "start");
        assert!(!r.contains_key("B"), "{r:?}");
        let m = "#[macro_export]\nmacro_rules! declare_options { () => {} }";
        assert_eq!(exported_macros(m), ["declare_options"]);
    }
}
