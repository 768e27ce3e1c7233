//! Regions: a per-thread stack that decides the tag and policy of allocations made through the
//! hooks (`cudaMalloc` under LD_PRELOAD, the pluggable-allocator entry points).
//!
//! An entry is either a tag with its policy or "disabled" (allocations inside go to the real
//! allocator and are never paused). The innermost entry wins.
//!
//! **Whole-process mode** (`MEMSAVER_PROCESS_TAG`, or torch_memory_saver's `TMS_INIT_ENABLE=1`
//! meaning the tag `default`): on a thread with no open region, allocations get the process
//! tag and its policy (`MEMSAVER_PROCESS_BACKUP`) instead of going to the real allocator. A
//! disabled scope still means untagged. The process tag accepts new allocations while it is
//! paused (torch's caching allocator may grow during a pause): they are resident, and resume
//! skips them.

use std::cell::RefCell;
use std::sync::OnceLock;

use memsaver_allocator::{Error, Policy, options};
use serde::Serialize;

thread_local! {
    /// The calling thread's open regions, innermost last; `None` marks a disabled scope.
    static STACK: RefCell<Vec<Option<(String, Policy)>>> = const { RefCell::new(Vec::new()) };
}

/// The process tag, registered (once) as one that allocates while paused. Asked for with an
/// invalid option, every allocation it would take fails with the options' error.
fn process_tag() -> Result<Option<(String, Policy)>, Error> {
    static REGISTERED: OnceLock<Result<(), Error>> = OnceLock::new();
    let opts = options::get();
    let Some((tag, policy)) = opts.process.clone() else {
        return Ok(None);
    };
    crate::options::check()?;
    REGISTERED
        .get_or_init(|| crate::allocator()?.allow_malloc_while_paused(&tag))
        .clone()?;
    Ok(Some((tag, policy)))
}

/// Opens a region tagging allocations with `tag` and `policy`. A paused tag is refused: a
/// caching allocator inside the region could hand out cached blocks of its unmapped memory.
pub fn enter(tag: &str, policy: Policy) -> Result<(), Error> {
    let a = crate::allocator()?;
    a.register_tag(tag)?;
    if a.is_paused(tag) {
        return Err(Error::TagPaused {
            tag: tag.to_owned(),
        });
    }
    STACK.with(|s| s.borrow_mut().push(Some((tag.to_owned(), policy))));
    Ok(())
}

/// Opens a scope in which allocations are not tagged, even inside a region.
pub fn disable() {
    STACK.with(|s| s.borrow_mut().push(None));
}

/// Closes the innermost region or disabled scope.
pub fn exit() -> Result<(), Error> {
    STACK
        .with(|s| s.borrow_mut().pop())
        .map(drop)
        .ok_or_else(|| {
            Error::InvalidArgument(
                "memsaver_region_exit without a matching memsaver_region_enter".into(),
            )
        })
}

/// What applies to an allocation on this thread now.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Current {
    /// The tag, or `None` when allocations are not tagged (no region and no process tag, or a
    /// disabled scope).
    pub tag: Option<String>,
    pub policy: Option<Policy>,
    /// A disabled scope is the innermost entry.
    pub disabled: bool,
    /// The tag is the whole-process tag (no region is open on the thread).
    pub process: bool,
    /// Open regions and disabled scopes on this thread.
    pub depth: usize,
    /// The whole-process tag configured for the process (`MEMSAVER_PROCESS_TAG`), whether or
    /// not it applies on this thread now.
    pub process_tag: Option<String>,
}

/// The tag and policy that apply to an allocation on this thread now: the innermost region,
/// else the whole-process tag. An invalid whole-process option is an error here, so the
/// allocation that needs it fails with the variable named.
/// (Called by every hooked `cudaMalloc`: the process tag is looked at only when no region or
/// disabled scope is open.)
pub fn lookup() -> Result<Option<(String, Policy)>, Error> {
    match STACK.with(|s| s.borrow().last().cloned()) {
        Some(top) => Ok(top),
        None => process_tag(),
    }
}

/// The full picture of [`lookup`], for `memsaver_region_current_json`.
pub fn describe() -> Result<Current, Error> {
    let (top, depth) = STACK.with(|s| {
        let s = s.borrow();
        (s.last().cloned(), s.len())
    });
    let process = process_tag()?;
    let process_tag = process.as_ref().map(|(tag, _)| tag.clone());
    Ok(match top {
        Some(Some((tag, policy))) => Current {
            tag: Some(tag),
            policy: Some(policy),
            disabled: false,
            process: false,
            depth,
            process_tag,
        },
        Some(None) => Current {
            tag: None,
            policy: None,
            disabled: true,
            process: false,
            depth,
            process_tag,
        },
        None => Current {
            process: process.is_some(),
            policy: process.as_ref().map(|(_, policy)| *policy),
            tag: process_tag.clone(),
            disabled: false,
            depth,
            process_tag,
        },
    })
}

/// The tag and policy that apply now, if any; `None` also when the whole-process options are
/// invalid (use [`lookup`] to see why).
pub fn current() -> Option<(String, Policy)> {
    lookup().ok().flatten()
}
