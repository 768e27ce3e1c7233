//! What control requests from other processes do in this one (`memsaver_ipc::control`
//! carries them), and the client side of the C ABI's `memsaver_control_json`.
//!
//! Pause, resume and stats run here, on the allocator, whatever language the process is
//! written in. A profile stage runs in the Python package, which installs a stage runner
//! (`memsaver_control_set_runner`) when it loads this library: its `call` steps call only the
//! callbacks that process registered (`memsaver.register_callback`). A process without one
//! refuses to run stages, saying why.

use std::ffi::{CString, c_char};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::time::Duration;

use memsaver_ipc::control::{self, Control, Outcome};
use serde_json::{Value, json};

use crate::Status;
use crate::ffi::take_malloc_c_string;

/// The stage runner: given a request (JSON: `{"source", "stage", "profile", "from"}`) it runs
/// the stage and returns a `malloc`ed NUL-terminated JSON text, `{"ok": true, "report": ...}`
/// or `{"ok": false, "status": code, "error": message}`, which this library frees.
pub type StageRunner = unsafe extern "C" fn(request: *const c_char) -> *mut c_char;

/// The installed runner (a function pointer), or NULL.
static RUNNER: AtomicPtr<()> = AtomicPtr::new(std::ptr::null_mut());

pub(crate) fn set_runner(r: Option<StageRunner>) {
    RUNNER.store(
        r.map_or(std::ptr::null_mut(), |f| f as *mut ()),
        Ordering::SeqCst,
    );
}

fn runner() -> Option<StageRunner> {
    let p = RUNNER.load(Ordering::SeqCst);
    // SAFETY: a non-null value was stored from a `StageRunner` by `set_runner`.
    (!p.is_null()).then(|| unsafe { std::mem::transmute::<*mut (), StageRunner>(p) })
}

fn error(status: Status, message: impl Into<String>) -> Outcome {
    Outcome::Error {
        status: status as u16,
        message: message.into(),
    }
}

fn core<T>(r: Result<T, memsaver_allocator::Error>) -> Result<T, Outcome> {
    r.map_err(|e| error(Status::of(&e), e.to_string()))
}

/// Runs a control request's operation in this process (the executor of
/// `memsaver_ipc::control`, on its control thread).
pub(crate) fn execute(op: &Control, from: u32) -> Outcome {
    let done = match op {
        Control::Pause { tags } | Control::Resume { tags } => (|| {
            let tags: Vec<&str> = tags.iter().map(String::as_str).collect();
            let a = core(crate::allocator())?;
            if matches!(op, Control::Pause { .. }) {
                core(a.pause(&tags))?;
            } else {
                core(a.resume(&tags))?;
            }
            Ok(Outcome::Done)
        })(),
        Control::Stats => (|| {
            let a = core(crate::allocator())?;
            let v = json!({
                "pid": std::process::id(),
                "group": memsaver_ipc::group::id(),
                "stats": a.stats(),
            });
            Ok(Outcome::Json(v.to_string()))
        })(),
        Control::Run {
            source,
            stage,
            profile,
        } => run_stage(source, stage, profile, from),
    };
    done.unwrap_or_else(|e| e)
}

fn run_stage(source: &str, stage: &str, profile: &str, from: u32) -> Result<Outcome, Outcome> {
    let me = std::process::id();
    let Some(run) = runner() else {
        return Err(error(
            Status::Control,
            format!(
                "process {me} cannot run profile stages: the memsaver Python package is not \
                 loaded in it (import memsaver there and register the stage's callbacks with \
                 memsaver.register_callback); pause, resume and stats work without it"
            ),
        ));
    };
    let request = json!({"source": source, "stage": stage, "profile": profile, "from": from});
    let request = CString::new(request.to_string())
        .map_err(|_| error(Status::InvalidArgument, "a profile with a NUL character"))?;
    // SAFETY: a NUL-terminated request that outlives the call, per the runner's contract.
    let answer = unsafe { run(request.as_ptr()) };
    // SAFETY: the runner returns NULL or a malloc'ed NUL-terminated text, ours to free.
    let Some(text) = (unsafe { take_malloc_c_string(answer) }) else {
        return Err(error(
            Status::Internal,
            format!("process {me}: the stage runner gave no answer"),
        ));
    };
    let v: Value = serde_json::from_str(&text).map_err(|e| {
        error(
            Status::Internal,
            format!("process {me}: the stage runner answered {e}"),
        )
    })?;
    if v["ok"] == Value::Bool(true) {
        return Ok(Outcome::Json(v["report"].to_string()));
    }
    let status = v["status"].as_u64().unwrap_or(Status::Internal as u64) as u16;
    let message = v["error"].as_str().unwrap_or("the stage failed").to_owned();
    Err(Outcome::Error { status, message })
}

/// A failure of `memsaver_control_json` itself (no target, a bad request).
pub(crate) struct ClientError(pub String);

/// `memsaver_control_json`: sends the request described by `request` (JSON) to its targets
/// and returns every answer as JSON.
pub(crate) fn client(request: &str) -> Result<String, ClientError> {
    let bad = |what: &str| ClientError(format!("invalid control request: {what}"));
    let r: Value = serde_json::from_str(request).map_err(|e| bad(&e.to_string()))?;
    let text = |k: &str| -> Result<String, ClientError> {
        r[k].as_str()
            .map(str::to_owned)
            .ok_or_else(|| bad(&format!("'{k}' must be a string")))
    };
    let tags = || -> Result<Vec<String>, ClientError> {
        match &r["tags"] {
            Value::Null => Ok(Vec::new()),
            Value::Array(a) => a
                .iter()
                .map(|t| {
                    t.as_str()
                        .map(str::to_owned)
                        .ok_or_else(|| bad("tags are strings"))
                })
                .collect(),
            _ => Err(bad("'tags' must be a list")),
        }
    };
    let op = match r["op"].as_str() {
        Some("pause") => Control::Pause { tags: tags()? },
        Some("resume") => Control::Resume { tags: tags()? },
        Some("stats") => Control::Stats,
        Some("run") => Control::Run {
            source: text("source")?,
            stage: text("stage")?,
            profile: text("profile")?,
        },
        _ => return Err(bad("'op' must be pause, resume, stats or run")),
    };
    let pid = match &r["pid"] {
        Value::Null => None,
        v => Some(
            v.as_u64()
                .and_then(|p| u32::try_from(p).ok())
                .ok_or_else(|| bad("'pid' must be a process id"))?,
        ),
    };
    let group = match &r["group"] {
        Value::Null => None,
        v => Some(
            v.as_i64()
                .ok_or_else(|| bad("'group' must be an integer"))?,
        ),
    };
    let timeout = match &r["timeout_s"] {
        Value::Null => Duration::from_secs(600),
        v => v
            .as_f64()
            .filter(|t| *t > 0.0 && *t <= 86_400.0)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| bad("'timeout_s' must be a number of seconds (0 to 86400)"))?,
    };
    let targets = control::targets(pid, group).map_err(|e| ClientError(e.to_string()))?;
    let answers =
        control::send_all(&targets, &op, timeout).map_err(|e| ClientError(e.to_string()))?;
    let out: Vec<Value> = targets
        .iter()
        .zip(answers)
        .map(|(t, a)| {
            let (ok, status, error, result) = match a {
                Ok(Outcome::Done) => (true, 0, None, Value::Null),
                Ok(Outcome::Json(text)) => (
                    true,
                    0,
                    None,
                    serde_json::from_str(&text).unwrap_or(Value::String(text)),
                ),
                Ok(Outcome::Error { status, message }) => {
                    (false, status, Some(message), Value::Null)
                }
                Err(e) => (
                    false,
                    Status::Control as u16,
                    Some(e.to_string()),
                    Value::Null,
                ),
            };
            json!({"pid": t.pid, "group": t.group, "ok": ok, "status": status,
                   "error": error, "result": result})
        })
        .collect();
    Ok(json!({"op": control::describe(&op), "targets": out}).to_string())
}

/// Installs [`execute`] as the control executor when the library is loaded (a pointer store,
/// nothing else: no thread, no allocation of memory on the device).
#[used]
#[unsafe(link_section = ".init_array")]
static INSTALL: extern "C" fn() = {
    extern "C" fn install() {
        control::set_executor(execute);
    }
    install
};
