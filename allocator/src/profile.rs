//! Staged pause/resume profiles in YAML: the schema, parsing and validation.
//!
//! ```yaml
//! version: 1
//! tags:                      # every tag the stages name, with its policy
//!   weights: {backup: cpu}
//!   kv_cache: {backup: discard}  # discard, cpu, mmap or disk
//!   nccl: {}                 # NCCL's own memory (always backed up)
//! stages:
//!   wake:
//!     - resume: [nccl, weights]
//!     - call: sync_weights   # a callback the application provides
//!     - resume: [kv_cache]
//!     - assert: {free_gib_at_least: 10, device: 0}
//!     - assert: {released: some_tag}
//! ```
//!
//! Unknown keys, unknown step kinds, tags a stage names but `tags` does not declare, empty
//! stages and malformed assertions are errors that name the file, line and column. Running a
//! profile is the Python package's job (`memsaver.load_profile`), since steps call back into
//! the application.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use serde_saphyr::Spanned;

use crate::types::Policy;

/// The schema version this build reads.
pub const VERSION: u32 = 1;

/// A parsed, validated profile.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Profile {
    pub version: u32,
    /// Declared tags in name order.
    pub tags: Vec<TagDecl>,
    /// Stages in name order.
    pub stages: Vec<Stage>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TagDecl {
    pub name: String,
    pub backup: Policy,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Stage {
    pub name: String,
    pub steps: Vec<Step>,
}

/// One step, with the line it starts on (for messages while running).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Step {
    pub line: u64,
    #[serde(flatten)]
    pub action: Action,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Action {
    Pause { tags: Vec<String> },
    Resume { tags: Vec<String> },
    Call { name: String },
    AssertFree { device: i32, bytes: u64 },
    AssertReleased { tag: String },
}

/// A profile that does not parse or validate: where, and what was expected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProfileError {
    pub file: String,
    pub line: u64,
    pub column: u64,
    pub message: String,
}

impl fmt::Display for ProfileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}",
            self.file, self.line, self.column, self.message
        )
    }
}

impl std::error::Error for ProfileError {}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProfile {
    version: Spanned<u32>,
    #[serde(default)]
    tags: BTreeMap<String, RawTag>,
    stages: BTreeMap<String, Spanned<Vec<Spanned<RawStep>>>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTag {
    #[serde(default)]
    backup: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
enum RawStep {
    Pause(Vec<Spanned<String>>),
    Resume(Vec<Spanned<String>>),
    Call(Spanned<String>),
    Assert(RawAssert),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAssert {
    free_gib_at_least: Option<f64>,
    device: Option<i32>,
    released: Option<Spanned<String>>,
}

fn at<T>(file: &str, s: &Spanned<T>, message: impl Into<String>) -> ProfileError {
    ProfileError {
        file: file.to_owned(),
        line: s.referenced.line(),
        column: s.referenced.column(),
        message: message.into(),
    }
}

/// Parses and validates the profile text of `file` (the name is used in messages only).
pub fn parse(text: &str, file: &str) -> Result<Profile, ProfileError> {
    let raw: RawProfile = serde_saphyr::from_str(text).map_err(|e| {
        let (line, column) = e.location().map_or((0, 0), |l| (l.line(), l.column()));
        let full = e.to_string().replace("<input>", file);
        // The first line repeats the position; keep the reason and the source excerpt.
        let message = match full.split_once('\n') {
            Some((first, rest)) => {
                // "error: line L column C: reason"
                let reason = first
                    .split_once(": ")
                    .and_then(|(_, r)| r.split_once(": ").map(|(_, m)| m))
                    .unwrap_or(first);
                format!("{reason}\n{rest}")
            }
            None => full,
        };
        ProfileError {
            file: file.to_owned(),
            line,
            column,
            message,
        }
    })?;
    if raw.version.value != VERSION {
        return Err(at(
            file,
            &raw.version,
            format!(
                "unsupported profile version {}; this memsaver reads version {VERSION}",
                raw.version.value
            ),
        ));
    }
    let mut tags = Vec::new();
    for (name, t) in &raw.tags {
        crate::allocator::validate_tag(name).map_err(|e| ProfileError {
            file: file.to_owned(),
            line: 0,
            column: 0,
            message: format!("in `tags`: {e}"),
        })?;
        let backup = match &t.backup {
            None => Policy::Discard,
            Some(b) => b.value.parse().map_err(|_: crate::Error| {
                let msg = format!(
                    "unknown backup policy '{}'; expected {}",
                    b.value,
                    Policy::accepted()
                );
                at(file, b, msg)
            })?,
        };
        tags.push(TagDecl {
            name: name.clone(),
            backup,
        });
    }
    let declared = |s: &Spanned<String>| -> Result<String, ProfileError> {
        if raw.tags.contains_key(&s.value) {
            Ok(s.value.clone())
        } else {
            let known: Vec<&str> = raw.tags.keys().map(String::as_str).collect();
            Err(at(
                file,
                s,
                format!(
                    "tag '{}' is not declared under `tags` (declared: {})",
                    s.value,
                    if known.is_empty() {
                        "none".to_string()
                    } else {
                        known.join(", ")
                    }
                ),
            ))
        }
    };
    if raw.stages.is_empty() {
        return Err(ProfileError {
            file: file.to_owned(),
            line: 1,
            column: 1,
            message: "`stages` is empty: declare at least one stage".into(),
        });
    }
    let mut stages = Vec::new();
    for (name, steps) in &raw.stages {
        if steps.value.is_empty() {
            return Err(at(file, steps, format!("stage '{name}' has no steps")));
        }
        let mut out = Vec::new();
        for step in &steps.value {
            let line = step.referenced.line();
            let tag_list = |v: &Vec<Spanned<String>>| -> Result<Vec<String>, ProfileError> {
                if v.is_empty() {
                    return Err(at(file, step, "expected at least one tag"));
                }
                v.iter().map(declared).collect()
            };
            let action = match &step.value {
                RawStep::Pause(v) => Action::Pause { tags: tag_list(v)? },
                RawStep::Resume(v) => Action::Resume { tags: tag_list(v)? },
                RawStep::Call(c) => {
                    let ok = !c.value.is_empty()
                        && c.value
                            .chars()
                            .all(|ch| ch.is_ascii_alphanumeric() || ch == '_');
                    if !ok {
                        return Err(at(
                            file,
                            c,
                            format!("callback name {:?}: use letters, digits and '_'", c.value),
                        ));
                    }
                    Action::Call {
                        name: c.value.clone(),
                    }
                }
                RawStep::Assert(a) => match (a.free_gib_at_least, &a.released) {
                    (Some(gib), None) if gib >= 0.0 && gib.is_finite() => Action::AssertFree {
                        device: a.device.unwrap_or(0),
                        bytes: (gib * (1u64 << 30) as f64) as u64,
                    },
                    (None, Some(t)) if a.device.is_none() => {
                        Action::AssertReleased { tag: declared(t)? }
                    }
                    _ => {
                        return Err(at(
                            file,
                            step,
                            "an assert takes either `free_gib_at_least: N` (N >= 0, optional `device`) or `released: TAG`",
                        ));
                    }
                },
            };
            out.push(Step { line, action });
        }
        stages.push(Stage {
            name: name.clone(),
            steps: out,
        });
    }
    Ok(Profile {
        version: VERSION,
        tags,
        stages,
    })
}

#[cfg(test)]
mod tests {
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
    }

    fn err(text: &str) -> ProfileError {
        parse(text, "bad.yaml").unwrap_err()
    }

    #[test]
    fn errors_name_file_line_column_and_what_was_expected() {
        let e = err("version: 1\nstagez: {}\n");
        assert_eq!((e.line, e.column), (2, 1));
        assert!(
            e.to_string()
                .starts_with("bad.yaml:2:1: unknown field `stagez`"),
            "{e}"
        );

        let e = err("version: 2\nstages: {s: [{call: x}]}\n");
        assert_eq!(e.line, 1);
        assert!(e.message.contains("unsupported profile version 2"), "{e}");

        let e = err("version: 1\ntags: {a: {}}\nstages:\n  s:\n    - pause: [a, b]\n");
        assert_eq!((e.line, e.column), (5, 18));
        assert!(
            e.message.contains("tag 'b' is not declared") && e.message.contains("declared: a"),
            "{e}"
        );

        let e = err("version: 1\ntags: {a: {backup: tape}}\nstages: {s: [{pause: [a]}]}\n");
        assert!(e.message.contains("unknown backup policy 'tape'"), "{e}");

        let e = err("version: 1\nstages:\n  s:\n    - pauze: [a]\n");
        assert_eq!((e.line, e.column), (4, 7));
        assert!(
            e.message
                .contains("unknown variant `pauze`, expected one of"),
            "{e}"
        );

        let e = err(
            "version: 1\ntags: {a: {}}\nstages:\n  s:\n    - assert: {free_gib_at_least: 1, released: a}\n",
        );
        assert_eq!(e.line, 5);
        assert!(e.message.contains("either `free_gib_at_least"), "{e}");

        assert!(
            err("version: 1\nstages: {}\n")
                .message
                .contains("`stages` is empty")
        );
        assert!(
            err("version: 1\nstages: {s: []}\n")
                .message
                .contains("stage 's' has no steps")
        );
        assert!(
            err("version: 1\ntags: {a: {}}\nstages: {s: [{pause: []}]}\n")
                .message
                .contains("at least one tag")
        );
        assert!(
            err("version: 1\nstages: {s: [{call: 'a b'}]}\n")
                .message
                .contains("callback name")
        );
    }
}
