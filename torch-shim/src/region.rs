//! Regions: a per-thread stack that decides the tag and policy of allocations made through the
//! hooks (`cudaMalloc` under LD_PRELOAD, the pluggable-allocator entry points).
//!
//! An entry is either a tag with its policy or "disabled" (allocations inside go to the real
//! allocator and are never paused). The innermost entry wins.

use std::cell::RefCell;

use memsaver_allocator::{Error, Policy};

thread_local! {
    /// The calling thread's open regions, innermost last; `None` marks a disabled scope.
    static STACK: RefCell<Vec<Option<(String, Policy)>>> = const { RefCell::new(Vec::new()) };
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

/// The tag and policy that apply to an allocation on this thread now, if any.
pub fn current() -> Option<(String, Policy)> {
    STACK.with(|s| s.borrow().last().cloned().flatten())
}
