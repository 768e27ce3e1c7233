use super::*;

const GOOD: &str = "version: 1
tags:
  weights: {backup: cpu}
  kv_cache: {}
  nccl: {}
stages:
  sleep:
    - pause: [kv_cache, weights, nccl]
    - assert: {released: kv_cache}
  wake:
    - resume: [nccl, weights]
    - call: sync_weights
    - resume: [kv_cache]
    - assert: {free_gib_at_least: 1.5, device: 1}
";

#[test]
fn parses_a_complete_profile() {
    let p = parse(GOOD, "p.yaml").unwrap();
    assert_eq!(
        p.tags[2],
        TagDecl {
            name: "weights".into(),
            backup: Policy::Cpu
        }
    );
    assert_eq!(p.tags[0].backup, Policy::Discard);
    let wake = p.stages.iter().find(|s| s.name == "wake").unwrap();
    assert_eq!(
        wake.steps[1],
        Step {
            line: 12,
            column: 7,
            action: Action::Call {
                name: "sync_weights".into()
            }
        }
    );
    assert_eq!(
        wake.steps[3].action,
        Action::AssertFree {
            device: 1,
            bytes: 3 << 29
        }
    );
    assert_eq!(p.callbacks(), ["sync_weights"]);
}

#[test]
fn json_carries_typed_steps_descriptions_and_callbacks() {
    let v = parse(GOOD, "p.yaml").unwrap().to_json();
    assert_eq!(v["file"], "p.yaml");
    assert_eq!(v["callbacks"], json!(["sync_weights"]));
    assert_eq!(v["tags"][2], json!({"name": "weights", "backup": "cpu"}));
    let sleep = &v["stages"][0];
    assert_eq!(sleep["name"], "sleep");
    assert_eq!(sleep["callbacks"], json!([]));
    assert_eq!(
        sleep["steps"][1],
        json!({"op": "assert_released", "tag": "kv_cache", "line": 9, "column": 7,
               "description": "assert kv_cache released"})
    );
    let wake = &v["stages"][1];
    assert_eq!(wake["callbacks"], json!(["sync_weights"]));
    assert_eq!(
        wake["steps"][0],
        json!({"op": "resume", "tags": ["nccl", "weights"], "line": 11, "column": 7,
               "description": "resume nccl, weights"})
    );
    assert_eq!(
        wake["steps"][3]["description"],
        "assert free >= 1.50 GiB on device 1"
    );
}

fn err(text: &str) -> ProfileError {
    parse(text, "bad.yaml").unwrap_err()
}

#[test]
fn errors_name_file_line_column_and_what_was_expected() {
    let e = err("version: 1\nstagez: {}\n");
    assert_eq!(e.position, Some((2, 1)));
    assert!(
        e.to_string()
            .starts_with("bad.yaml:2:1: unknown field `stagez`"),
        "{e}"
    );

    let e = err("version: 2\nstages: {s: [{call: x}]}\n");
    assert_eq!(e.position, Some((1, 10)));
    assert!(e.message.contains("unsupported profile version 2"), "{e}");

    let e = err("version: 1\ntags: {a: {}}\nstages:\n  s:\n    - pause: [a, b]\n");
    assert_eq!(e.position, Some((5, 18)));
    assert!(
        e.message.contains("tag 'b' is not declared") && e.message.contains("declared: a"),
        "{e}"
    );

    let e = err("version: 1\ntags: {a: {backup: tape}}\nstages: {s: [{pause: [a]}]}\n");
    assert!(e.message.contains("unknown backup policy 'tape'"), "{e}");
    assert_eq!(e.position, Some((2, 20)));

    let e = err("version: 1\nstages:\n  s:\n    - pauze: [a]\n");
    assert_eq!(e.position, Some((4, 7)));
    assert!(
        e.message
            .contains("unknown variant `pauze`, expected one of"),
        "{e}"
    );

    let e = err(
        "version: 1\ntags: {a: {}}\nstages:\n  s:\n    - assert: {free_gib_at_least: 1, released: a}\n",
    );
    assert_eq!(e.position, Some((5, 7)));
    assert!(e.message.contains("either `free_gib_at_least"), "{e}");

    let e = err("version: 1\nstages: {}\n");
    assert!(e.message.contains("`stages` is empty"), "{e}");
    assert_eq!(e.position, Some((2, 9)));
    let e = err("version: 1\nstages: {s: []}\n");
    assert!(e.message.contains("stage 's' has no steps"), "{e}");
    assert_eq!(e.position, Some((2, 13)));
    let e = err("version: 1\ntags: {a: {}}\nstages: {s: [{pause: []}]}\n");
    assert!(e.message.contains("at least one tag"), "{e}");
    assert_eq!(e.position.map(|p| p.0), Some(3));
    let e = err("version: 1\nstages: {s: [{call: 'a b'}]}\n");
    assert!(e.message.contains("callback name"), "{e}");
    assert_eq!(e.position.map(|p| p.0), Some(2));
}

#[test]
fn every_content_error_has_a_real_position() {
    for text in [
        "",
        "\n",
        "version: 1\n",
        "stages: {s: [{call: x}]}\n",
        "- a\n- b\n",
        "version: 1\ntags: {'bad tag': {}}\nstages: {s: [{call: x}]}\n",
        "version: 1\ntags: {a: {}, a: {}}\nstages: {s: [{call: x}]}\n",
        "version: x\nstages: {s: [{call: x}]}\n",
        "version: 1\nstages: {s: [{assert: {}}]}\n",
        "version: 1\nstages: {s: [{pause: [a], resume: [a]}]}\n",
        "\tversion: 1\n",
    ] {
        let e = err(text);
        let (line, column) = e.position.unwrap_or((0, 0));
        assert!(line >= 1 && column >= 1, "{text:?} gave {e}");
        assert!(!e.to_string().contains(":0:"), "{text:?} gave {e}");
    }
}

#[test]
fn an_invalid_tag_name_points_at_the_name() {
    let e = err("version: 1\ntags:\n  ok: {}\n  'bad tag': {}\nstages: {s: [{call: x}]}\n");
    assert_eq!(e.position, Some((4, 3)), "{e}");
    assert!(
        e.message
            .contains("in `tags`: invalid argument: invalid tag"),
        "{e}"
    );
}

#[test]
fn bytes_that_are_not_utf8_or_too_many_are_refused_with_a_position() {
    let e = parse_bytes(b"version: 1\nstages:\n  s\xff: []\n", "x.yaml").unwrap_err();
    assert_eq!(e.position, Some((3, 4)), "{e}");
    assert!(
        e.message
            .contains("not UTF-8 text (byte 0xff at offset 22)"),
        "{e}"
    );

    let zeros = vec![0u8; MAX_BYTES + 1];
    let e = parse_bytes(&zeros, "/dev/zero").unwrap_err();
    assert_eq!(e.position, Some((1, MAX_BYTES as u64 + 1)));
    assert!(
        e.to_string()
            .starts_with("/dev/zero:1:1048577: the file is larger than 1024 KiB"),
        "{e}"
    );
}

#[test]
fn load_reads_a_bounded_prefix_and_names_unreadable_files() {
    let e = load(Path::new("/dev/zero")).unwrap_err();
    assert!(e.message.contains("larger than 1024 KiB"), "{e}");

    let e = load(Path::new("/nonexistent/p.yaml")).unwrap_err();
    assert_eq!(e.position, None);
    assert!(
        e.to_string()
            .starts_with("/nonexistent/p.yaml: cannot read the profile: No such file"),
        "{e}"
    );

    let dir = std::env::temp_dir().join(format!("memsaver-profile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("p.yaml");
    std::fs::write(&f, GOOD).unwrap();
    assert_eq!(load(&f).unwrap().file, f.display().to_string());
    let e = load(&dir).unwrap_err();
    assert!(e.message.contains("cannot read the profile"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
