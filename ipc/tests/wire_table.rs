//! The wire table has one copy, the module documentation of `src/protocol.rs`: every kind byte
//! the code encodes and decodes (`const NAME: u8 = 0x..`) has exactly one row there, every row
//! names a kind the code knows, and docs/security.md points to it instead of keeping a table of
//! its own.

use std::collections::BTreeSet;
use std::path::Path;

fn read(rel: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The kind bytes of `const NAME: u8 = 0x..;` lines.
fn kinds_in_code(src: &str) -> BTreeSet<String> {
    src.lines()
        .filter_map(|l| {
            let rest = l.trim().strip_prefix("const ")?;
            let (_, value) = rest.split_once(": u8 = ")?;
            Some(value.trim_end_matches(';').to_lowercase())
        })
        .collect()
}

/// The kind column of the table rows (`| 0x.. |`) of `text`, each as often as it appears.
fn rows(text: &str, prefix: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix(prefix))
        .filter_map(|l| l.trim_start().strip_prefix("| 0x"))
        .map(|l| format!("0x{}", &l[..2]).to_lowercase())
        .collect()
}

#[test]
fn protocol_rs_lists_every_kind_once_and_only_those() {
    let src = read("src/protocol.rs");
    let code = kinds_in_code(&src);
    assert!(code.len() >= 19, "the kinds were read: {code:?}");
    let table = rows(&src, "//!");
    let listed: BTreeSet<String> = table.iter().cloned().collect();
    assert_eq!(table.len(), listed.len(), "a kind listed twice: {table:?}");
    assert_eq!(listed, code, "the table and the code disagree");
}

#[test]
fn no_other_copy_of_the_table() {
    let security = read("../docs/security.md");
    assert_eq!(
        rows(&security, ""),
        Vec::<String>::new(),
        "docs/security.md keeps a table"
    );
    assert!(
        security.contains("ipc/src/protocol.rs"),
        "docs/security.md points to the table"
    );
}
