//! The C ABI is defined once, in this crate's source: the crate doc of `src/lib.rs`, the
//! exported functions with their doc comments, and `Status` (`src/status.rs`). Two files are
//! generated from it and checked in:
//!
//! * `include/memsaver.h`, by cbindgen (`cbindgen.toml`), with lib.rs's crate doc as its opening
//!   comment and the status enum rendered from `Status::ALL`;
//! * `python/src/abi.rs`, the Python binding's copy of the status enum (its `error.rs` maps
//!   every variant to an exception with an exhaustive match, so a new status does not compile
//!   until it has one) and the list of functions it resolves with `dlsym`.
//!
//! Each test regenerates its file and fails when the checked-in copy differs; with
//! `WRITE_ABI_FILES=1` (`make abi`) it writes the file instead.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use memsaver::Status;

/// Exported functions the Python binding does not call: torch's `CUDAPluggableAllocator`
/// resolves them by name (`python/memsaver/_torch.py`).
const NOT_FOR_PYTHON: &[&str] = &["memsaver_torch_malloc", "memsaver_torch_free"];

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Compares `path` with `generated`, or writes it under `WRITE_ABI_FILES=1`.
fn check_or_write(path: &Path, generated: &str) {
    if std::env::var_os("WRITE_ABI_FILES").is_some_and(|v| v == "1") {
        std::fs::write(path, generated).unwrap();
        return;
    }
    let current = std::fs::read_to_string(path).unwrap_or_default();
    if current != generated {
        let line = current
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| current.lines().count().min(generated.lines().count()));
        panic!(
            "{} is out of date with the C ABI's Rust source (first difference at line {}): run \
             `make abi` and commit the result\n--- checked in: {:?}\n+++ generated:  {:?}",
            path.display(),
            line + 1,
            current.lines().nth(line).unwrap_or("<end of file>"),
            generated.lines().nth(line).unwrap_or("<end of file>"),
        );
    }
}

/// The crate doc of `src/lib.rs` (its `//!` lines), without the comment markers.
fn crate_doc() -> Vec<String> {
    let src = std::fs::read_to_string(crate_dir().join("src/lib.rs")).unwrap();
    src.lines()
        .map_while(|l| l.strip_prefix("//!"))
        .map(|l| l.strip_prefix(' ').unwrap_or(l).to_owned())
        .collect()
}

/// A C block comment of `lines`, indented by `indent`.
fn c_comment(lines: &[String], indent: &str) -> String {
    let mut out = String::new();
    if let [one] = lines {
        writeln!(out, "{indent}/* {one} */").unwrap();
        return out;
    }
    writeln!(out, "{indent}/*").unwrap();
    for l in lines {
        let l = l.trim_end();
        if l.is_empty() {
            writeln!(out, "{indent} *").unwrap();
        } else {
            writeln!(out, "{indent} * {l}").unwrap();
        }
    }
    writeln!(out, "{indent} */").unwrap();
    out
}

fn status_doc(s: Status) -> Vec<String> {
    s.doc()
        .iter()
        .map(|l| l.strip_prefix(' ').unwrap_or(l).to_owned())
        .collect()
}

/// `typedef enum memsaver_status { ... } memsaver_status;` from `Status::ALL`.
fn c_status_enum() -> String {
    let mut out = c_comment(
        &[
            "Status codes (`Status` in status.rs). Stable: new codes are added, never renumbered."
                .into(),
        ],
        "",
    );
    out.push_str("typedef enum memsaver_status {\n");
    for &s in Status::ALL {
        out.push_str(&c_comment(&status_doc(s), "    "));
        writeln!(out, "    {} = {},", s.c_name(), s as i32).unwrap();
    }
    out.push_str("} memsaver_status;\n");
    out
}

fn generate_header() -> String {
    let dir = crate_dir();
    let mut config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).unwrap();
    config.header = Some(c_comment(&crate_doc(), "").trim_end().to_owned());
    config.after_includes = Some(format!("\n{}", c_status_enum().trim_end()));
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen cannot read the C ABI's source");
    let mut out = Vec::new();
    bindings.write(&mut out);
    String::from_utf8(out).unwrap()
}

#[test]
fn c_header_is_generated_from_the_rust_source() {
    check_or_write(&crate_dir().join("include/memsaver.h"), &generate_header());
}

/// A Rust type as the binding spells it (`*mut *mut c_void`, `usize`, `c_int`).
fn rust_type(ty: &syn::Type) -> String {
    match ty {
        syn::Type::Ptr(p) => {
            let m = if p.mutability.is_some() {
                "mut"
            } else {
                "const"
            };
            format!("*{m} {}", rust_type(&p.elem))
        }
        syn::Type::Path(p) if p.qself.is_none() => {
            // The binding imports `c_char`, `c_int` and `c_void` from std::ffi.
            p.path.segments.last().unwrap().ident.to_string()
        }
        other => panic!("a C ABI argument of an unexpected type: {other:?}"),
    }
}

/// `name: unsafe extern "C" fn(args) -> ret` of every exported function, in source order.
fn exported_functions() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for file in [
        "src/lib.rs",
        "src/hooks.rs",
        "src/region.rs",
        "src/status.rs",
    ] {
        let src = std::fs::read_to_string(crate_dir().join(file)).unwrap();
        let parsed = syn::parse_file(&src).unwrap();
        for item in parsed.items {
            let syn::Item::Fn(f) = item else { continue };
            let exported = f.sig.abi.is_some()
                && f.attrs.iter().any(|a| {
                    a.path().is_ident("unsafe")
                        && a.parse_args::<syn::Path>()
                            .is_ok_and(|p| p.is_ident("no_mangle"))
                });
            if !exported {
                continue;
            }
            let args: Vec<String> = f
                .sig
                .inputs
                .iter()
                .map(|a| match a {
                    syn::FnArg::Typed(t) => rust_type(&t.ty),
                    syn::FnArg::Receiver(_) => panic!("receiver in an exported function"),
                })
                .collect();
            let ret = match &f.sig.output {
                syn::ReturnType::Default => String::new(),
                syn::ReturnType::Type(_, t) => format!(" -> {}", rust_type(t)),
            };
            out.push((
                f.sig.ident.to_string(),
                format!("unsafe extern \"C\" fn({}){ret}", args.join(", ")),
            ));
        }
    }
    out
}

fn generate_python_abi() -> String {
    let mut out = String::from(
        "//! The C ABI of libmemsaver.so as the binding sees it: the status codes and the functions\n\
         //! it resolves. Generated from torch-shim/src by torch-shim/tests/abi_files.rs (`make abi`):\n\
         //! do not edit.\n\n",
    );
    out.push_str(
        "/// The status codes of the C ABI (`memsaver_status` in memsaver.h).\n\
         #[derive(Clone, Copy, Debug, PartialEq, Eq)]\n\
         pub enum Status {\n",
    );
    for &s in Status::ALL {
        for l in s.doc() {
            writeln!(out, "    ///{l}").unwrap();
        }
        writeln!(out, "    {} = {},", s.rust_name(), s as i32).unwrap();
    }
    out.push_str(
        "}\n\n\
         impl Status {\n    \
         /// The status of a code; `None` for a code this binding does not know.\n    \
         pub fn from_code(code: i32) -> Option<Self> {\n        \
         match code {\n",
    );
    for &s in Status::ALL {
        writeln!(
            out,
            "            {} => Some(Self::{}),",
            s as i32,
            s.rust_name()
        )
        .unwrap();
    }
    out.push_str("            _ => None,\n        }\n    }\n}\n\n");
    out.push_str(
        "/// Calls the macro `$m` with `name: type,` for every function of the C ABI the binding\n\
         /// calls (all but torch's pluggable-allocator entry points).\n\
         macro_rules! with_functions {\n    \
         ($m:ident) => {\n        \
         $m! {\n",
    );
    for (name, ty) in exported_functions() {
        if NOT_FOR_PYTHON.contains(&name.as_str()) || !name.starts_with("memsaver_") {
            continue;
        }
        writeln!(out, "            {name}: {ty},").unwrap();
    }
    out.push_str("        }\n    };\n}\npub(crate) use with_functions;\n");
    out
}

#[test]
fn python_abi_is_generated_from_the_rust_source() {
    let path = crate_dir().join("../python/src/abi.rs");
    check_or_write(&path, &generate_python_abi());
}

#[test]
fn every_status_has_a_c_name_and_a_unique_code() {
    let mut codes: Vec<i32> = Status::ALL.iter().map(|&s| s as i32).collect();
    assert!(codes.is_sorted(), "list the statuses by code");
    codes.dedup();
    assert_eq!(codes.len(), Status::ALL.len());
    for &s in Status::ALL {
        let expected = if s == Status::Ok {
            "MEMSAVER_OK"
        } else {
            "MEMSAVER_ERR_"
        };
        assert!(s.c_name().starts_with(expected), "{}", s.c_name());
        assert!(!s.doc().is_empty(), "{s:?} has no doc comment");
    }
}

#[test]
fn the_torch_entry_points_are_exported() {
    let names: Vec<String> = exported_functions().into_iter().map(|(n, _)| n).collect();
    for f in NOT_FOR_PYTHON {
        assert!(names.iter().any(|n| n == f), "{f} is no longer exported");
    }
}

/// The checked-in header compiles as C and as C++ (a compiler missing here is a skip, which
/// fails where every test must run: see memsaver-test-support).
#[test]
fn the_header_compiles() {
    let header = crate_dir().join("include/memsaver.h");
    for (cc, lang, std) in [("cc", "c", "-std=c99"), ("c++", "c++", "-std=c++11")] {
        let out = std::process::Command::new(cc)
            .args([
                "-fsyntax-only",
                "-Wall",
                "-Wextra",
                "-Werror",
                std,
                "-x",
                lang,
            ])
            .arg(&header)
            .output();
        let o = match out {
            Ok(o) => o,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                memsaver_test_support::skip(&format!(
                    "no {cc} on this machine: the header is not compiled as {lang}; install a C/C++ compiler"
                ));
                continue;
            }
            Err(e) => panic!("{cc}: {e}"),
        };
        assert!(
            o.status.success(),
            "{cc}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}
