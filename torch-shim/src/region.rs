//! Regions: a per-thread stack of (tag, policy) that tags allocations made through the hooks.

use std::cell::RefCell;

use memsaver_allocator::{Error, Policy};

thread_local! {
    /// The calling thread's open regions, innermost last.
    static STACK: RefCell<Vec<(String, Policy)>> = const { RefCell::new(Vec::new()) };
}

pub fn enter(tag: &str, policy: Policy) -> Result<(), Error> {
    memsaver_allocator::global()?.register_tag(tag)?;
    STACK.with(|s| s.borrow_mut().push((tag.to_owned(), policy)));
    Ok(())
}

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

/// The innermost region of the calling thread, if any.
pub fn current() -> Option<(String, Policy)> {
    STACK.with(|s| s.borrow().last().cloned())
}
