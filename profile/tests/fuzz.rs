//! Fuzzing the profile loader (proptest, a bounded number of cases so it runs in `make test`):
//! whatever bytes it is given, it never panics, and every error names a real position.

use memsaver_profile::{Profile, ProfileError, parse_bytes};
use proptest::prelude::*;

const EXAMPLE: &str = include_str!("../../docs/examples/verl_grpo.yaml");

/// The checks every outcome must pass.
fn check(r: Result<Profile, ProfileError>) {
    match r {
        Ok(p) => {
            // A profile that parses also serialises: the binding hands this JSON to Python.
            serde_json::to_string(&p.to_json()).expect("a parsed profile serialises");
        }
        Err(e) => {
            let (line, column) = e.position.expect("an error in given bytes has a position");
            assert!(line >= 1 && column >= 1, "{e}");
            assert!(!e.message.is_empty(), "{e}");
        }
    }
}

/// Pieces profiles are made of, so that generated texts get past the YAML layer and reach
/// the schema's checks.
fn token() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec![
        "version: 1",
        "version: 2",
        "tags:",
        "stages:",
        "  weights: {backup: cpu}",
        "  kv_cache: {backup: discard}",
        "  nccl: {}",
        "  x: {backup: tape}",
        "  sleep:",
        "  wake:",
        "    - pause: [kv_cache, weights]",
        "    - resume: [nccl, weights]",
        "    - call: sync_weights",
        "    - assert: {free_gib_at_least: 1}",
        "    - assert: {released: [kv_cache]}",
        "    - pause: []",
        "    - unknown: 1",
        "- ",
        ": ",
        "{",
        "}",
        "[",
        "]",
        "\t",
        "  ",
        "\n",
        "#",
        "&a",
        "*a",
        "!!binary",
        "'",
        "\"",
        "\u{feff}",
        "\u{0}",
        "~",
        "null",
        "-1",
        "1e309",
    ])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..4096)) {
        check(parse_bytes(&bytes, "fuzz.yaml"));
    }

    #[test]
    fn profile_shaped_texts_never_panic(parts in prop::collection::vec(token(), 0..48)) {
        check(parse_bytes(parts.join("\n").as_bytes(), "fuzz.yaml"));
    }

    #[test]
    fn mutations_of_a_real_profile_never_panic(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..16)
    ) {
        let mut bytes = EXAMPLE.as_bytes().to_vec();
        for (at, byte, kind) in edits {
            let i = at.index(bytes.len() + 1);
            match kind {
                0 if i < bytes.len() => bytes[i] = byte,
                1 if i < bytes.len() => {
                    bytes.remove(i);
                }
                _ => bytes.insert(i, byte),
            }
        }
        check(parse_bytes(&bytes, "fuzz.yaml"));
    }
}

#[test]
fn the_example_parses() {
    check(parse_bytes(EXAMPLE.as_bytes(), "verl_grpo.yaml"));
    assert!(parse_bytes(EXAMPLE.as_bytes(), "verl_grpo.yaml").is_ok());
}
