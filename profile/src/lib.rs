//! Staged pause/resume profiles in YAML: the one definition of the schema, and reading,
//! parsing and validating a profile. The allocator core knows nothing of files; libmemsaver.so
//! (`memsaver_profile_load`, `memsaver_profile_parse`) and through it the Python package use
//! this crate, so every caller gets the same steps and the same messages.
//!
//! ```yaml
//! version: 1
//! tags:                      # every tag the stages name, with its policy
//!   weights: {backup: cpu}
//!   kv_cache: {backup: discard}  # discard, cpu, mmap or disk
//!   nccl: {}                 # NCCL's own memory (backup: MEMSAVER_NCCL_BACKUP)
//! stages:
//!   wake:
//!     - resume: [nccl, weights]
//!     - call: sync_weights   # a callback the application provides
//!     - resume: [kv_cache]
//!     - assert: {free_gib_at_least: 10, device: 0}
//!     - assert: {released: some_tag}
//! ```
//!
//! Every error names the file, a line and a column (1-based) and what was expected: unknown
//! keys, unknown step kinds, tags a stage names but `tags` does not declare, invalid tag names,
//! empty stages, malformed assertions, text that is not UTF-8 and files larger than
//! [`MAX_BYTES`]. Only a file that cannot be opened or read at all has no position. Running a
//! profile is the Python package's job (`memsaver.load_profile`), since steps call back into
//! the application; it executes the typed steps of [`Profile::to_json`] and re-validates
//! nothing.

use std::collections::HashMap;
use std::fmt;
use std::io::Read;
use std::path::Path;

use memsaver_allocator::{Policy, validate_tag};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use serde_saphyr::Spanned;

/// The schema version this build reads.
pub const VERSION: u32 = 1;

/// The largest profile file read, in bytes. Profiles are a few hundred bytes; anything larger
/// is almost certainly the wrong file (or `/dev/zero`), so reading stops there.
pub const MAX_BYTES: usize = 1 << 20;

/// A parsed, validated profile.
#[derive(Clone, Debug, PartialEq)]
pub struct Profile {
    pub version: u32,
    /// The name the profile was read under (used in messages).
    pub file: String,
    /// Declared tags in name order.
    pub tags: Vec<TagDecl>,
    /// Stages in name order.
    pub stages: Vec<Stage>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TagDecl {
    pub name: String,
    pub backup: Policy,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Stage {
    pub name: String,
    pub steps: Vec<Step>,
}

/// One step, with where it starts (for messages while running).
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub line: u64,
    pub column: u64,
    pub action: Action,
}

/// The steps a stage can take: the one list of step kinds. The JSON of a step carries the
/// snake-case name as `op` and the fields below.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Action {
    /// `pause: [tag, ...]`
    Pause { tags: Vec<String> },
    /// `resume: [tag, ...]`
    Resume { tags: Vec<String> },
    /// `call: name`: the application's callback of that name.
    Call { name: String },
    /// `assert: {free_gib_at_least: N, device: D}`: the device has at least `bytes` free.
    AssertFree { device: i32, bytes: u64 },
    /// `assert: {released: tag}`: the tag holds no resident memory in this process.
    AssertReleased { tag: String },
}

impl fmt::Display for Action {
    /// The one-line description reports and error messages use.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Pause { tags } => write!(f, "pause {}", tags.join(", ")),
            Action::Resume { tags } => write!(f, "resume {}", tags.join(", ")),
            Action::Call { name } => write!(f, "call {name}"),
            Action::AssertFree { device, bytes } => write!(
                f,
                "assert free >= {:.2} GiB on device {device}",
                *bytes as f64 / (1u64 << 30) as f64
            ),
            Action::AssertReleased { tag } => write!(f, "assert {tag} released"),
        }
    }
}

impl Stage {
    /// Names of the callbacks the stage calls, in order of first use.
    pub fn callbacks(&self) -> Vec<&str> {
        let mut names: Vec<&str> = Vec::new();
        for s in &self.steps {
            if let Action::Call { name } = &s.action
                && !names.contains(&name.as_str())
            {
                names.push(name);
            }
        }
        names
    }
}

impl Profile {
    /// Names of the callbacks any stage calls, in order of first use (stages in name order).
    pub fn callbacks(&self) -> Vec<&str> {
        let mut names: Vec<&str> = Vec::new();
        for n in self.stages.iter().flat_map(Stage::callbacks) {
            if !names.contains(&n) {
                names.push(n);
            }
        }
        names
    }

    /// The profile as the C ABI hands it out: everything a runner needs, typed, so it
    /// executes steps without a second list of step kinds or any validation:
    ///
    /// ```json
    /// {"version": 1, "file": "p.yaml", "callbacks": ["sync_weights"],
    ///  "tags": [{"name": "weights", "backup": "cpu"}],
    ///  "stages": [{"name": "wake", "callbacks": ["sync_weights"], "steps": [
    ///     {"op": "resume", "tags": ["weights"], "line": 11, "column": 7,
    ///      "description": "resume weights"}, ...]}]}
    /// ```
    pub fn to_json(&self) -> Value {
        let step = |s: &Step| {
            let mut v = serde_json::to_value(&s.action).unwrap_or(Value::Null);
            if let Value::Object(m) = &mut v {
                m.insert("line".into(), s.line.into());
                m.insert("column".into(), s.column.into());
                m.insert("description".into(), s.action.to_string().into());
            }
            v
        };
        json!({
            "version": self.version,
            "file": self.file,
            "callbacks": self.callbacks(),
            "tags": self.tags.iter().map(|t| json!({
                "name": t.name,
                "backup": t.backup.as_str(),
            })).collect::<Vec<_>>(),
            "stages": self.stages.iter().map(|s| json!({
                "name": s.name,
                "callbacks": s.callbacks(),
                "steps": s.steps.iter().map(step).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        })
    }
}

/// A profile that cannot be read, parsed or validated: where, and what was expected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProfileError {
    pub file: String,
    /// (line, column), both 1-based; `None` only when the file could not be read at all.
    pub position: Option<(u64, u64)>,
    pub message: String,
}

impl fmt::Display for ProfileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.position {
            Some((line, column)) => write!(f, "{}:{line}:{column}: {}", self.file, self.message),
            None => write!(f, "{}: {}", self.file, self.message),
        }
    }
}

impl std::error::Error for ProfileError {}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProfile {
    version: Spanned<u32>,
    #[serde(default)]
    tags: HashMap<Spanned<String>, RawTag>,
    stages: Spanned<HashMap<Spanned<String>, RawSteps>>,
}

/// The steps of one stage, with where the list and each step start.
type RawSteps = Spanned<Vec<Spanned<RawStep>>>;

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

/// Line and column (1-based) of `s`, never 0 (a location the parser did not fill in counts
/// as the start of the file).
fn pos<T>(s: &Spanned<T>) -> (u64, u64) {
    (s.referenced.line().max(1), s.referenced.column().max(1))
}

fn at<T>(file: &str, s: &Spanned<T>, message: impl Into<String>) -> ProfileError {
    ProfileError {
        file: file.to_owned(),
        position: Some(pos(s)),
        message: message.into(),
    }
}

/// Line and column (1-based) just after `text`.
fn end_of(text: &str) -> (u64, u64) {
    let line = text.matches('\n').count() as u64 + 1;
    let column = text.rsplit('\n').next().map_or(0, |l| l.chars().count()) as u64 + 1;
    (line, column)
}

/// Reads and validates the profile at `path` (read up to [`MAX_BYTES`]; messages name the
/// file as `path` is written).
pub fn load(path: &Path) -> Result<Profile, ProfileError> {
    let file = path.display().to_string();
    let unreadable = |e: std::io::Error| ProfileError {
        file: file.clone(),
        position: None,
        message: format!("cannot read the profile: {e}"),
    };
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_BYTES as u64 + 1).read_to_end(&mut bytes))
        .map_err(unreadable)?;
    parse_bytes(&bytes, &file)
}

/// Validates `bytes` as the text of a profile (at most [`MAX_BYTES`], UTF-8) and parses it.
pub fn parse_bytes(bytes: &[u8], file: &str) -> Result<Profile, ProfileError> {
    if bytes.len() > MAX_BYTES {
        let head = String::from_utf8_lossy(&bytes[..MAX_BYTES]);
        return Err(ProfileError {
            file: file.to_owned(),
            position: Some(end_of(&head)),
            message: format!(
                "the file is larger than {} KiB, the most a profile may have; is it the right file?",
                MAX_BYTES >> 10
            ),
        });
    }
    let text = std::str::from_utf8(bytes).map_err(|e| {
        let ok = e.valid_up_to();
        // `..ok` is valid UTF-8 by the definition of valid_up_to.
        let head = std::str::from_utf8(&bytes[..ok]).unwrap_or_default();
        ProfileError {
            file: file.to_owned(),
            position: Some(end_of(head)),
            message: format!(
                "not UTF-8 text (byte {:#04x} at offset {ok}): a profile is a YAML text file",
                bytes[ok]
            ),
        }
    })?;
    parse(text, file)
}

/// Parses and validates the profile text of `file` (the name is used in messages only).
pub fn parse(text: &str, file: &str) -> Result<Profile, ProfileError> {
    if text.trim().is_empty() {
        return Err(ProfileError {
            file: file.to_owned(),
            position: Some(end_of(text)),
            message: "the profile is empty: expected `version: 1`, `tags` and `stages`".into(),
        });
    }
    let raw: RawProfile = serde_saphyr::from_str(text).map_err(|e| {
        let position = e
            .location()
            .map_or((1, 1), |l| (l.line().max(1), l.column().max(1)));
        let full = e
            .to_string()
            .replace("<input>", file)
            .replace(", set DuplicateKeyPolicy in Options if acceptable", "");
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
            position: Some(position),
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
    let mut declared_tags: Vec<(&Spanned<String>, &RawTag)> = raw.tags.iter().collect();
    declared_tags.sort_by(|a, b| a.0.value.cmp(&b.0.value));
    let mut tags = Vec::new();
    for (name, t) in &declared_tags {
        validate_tag(&name.value).map_err(|e| at(file, name, format!("in `tags`: {e}")))?;
        let backup = match &t.backup {
            None => Policy::Discard,
            Some(b) => b.value.parse().map_err(|_: memsaver_allocator::Error| {
                let msg = format!(
                    "unknown backup policy '{}'; expected {}",
                    b.value,
                    Policy::accepted()
                );
                at(file, b, msg)
            })?,
        };
        tags.push(TagDecl {
            name: name.value.clone(),
            backup,
        });
    }
    let declared = |s: &Spanned<String>| -> Result<String, ProfileError> {
        if tags.iter().any(|t| t.name == s.value) {
            Ok(s.value.clone())
        } else {
            let known: Vec<&str> = tags.iter().map(|t| t.name.as_str()).collect();
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
    if raw.stages.value.is_empty() {
        return Err(at(
            file,
            &raw.stages,
            "`stages` is empty: declare at least one stage",
        ));
    }
    let mut raw_stages: Vec<_> = raw.stages.value.iter().collect();
    raw_stages.sort_by(|a, b| a.0.value.cmp(&b.0.value));
    let mut stages = Vec::new();
    for (name, steps) in raw_stages {
        if steps.value.is_empty() {
            return Err(at(
                file,
                steps,
                format!("stage '{}' has no steps", name.value),
            ));
        }
        let mut out = Vec::new();
        for step in &steps.value {
            let (line, column) = pos(step);
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
            out.push(Step {
                line,
                column,
                action,
            });
        }
        stages.push(Stage {
            name: name.value.clone(),
            steps: out,
        });
    }
    Ok(Profile {
        version: VERSION,
        file: file.to_owned(),
        tags,
        stages,
    })
}

#[cfg(test)]
mod tests;
