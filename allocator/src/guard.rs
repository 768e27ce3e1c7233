//! The pause guard: the core's downward interface to whatever hands out this process's memory
//! again without asking the core. PyTorch's caching allocator keeps freed blocks and gives them
//! to the next tensor of a fitting size with no `cudaMalloc`, so a block inside a paused
//! allocation would be handed out and the kernel using it would fault. The core cannot see
//! those caches; the layer that can (the Python package, for torch's pools) registers a guard
//! ([`Allocator::set_pause_guard`](crate::Allocator::set_pause_guard)) and the engine calls it
//! under the transition lock, for pauses made in this process and for those other processes
//! ask for (control requests), alike.

use crate::error::LayerError;

/// What a pause guard does around each transition.
pub trait PauseGuard: Send + Sync {
    /// A pause is about to pause the allocations of `tags` (the tags of the allocation table it
    /// names, every one of them when it names none): make sure nothing hands out their memory
    /// until they are resumed. `Err` refuses the pause before anything changed
    /// ([`crate::Error::PauseRefused`]), with a message that says why and what to do.
    fn before_pause(&self, tags: &[String]) -> Result<(), LayerError>;
    /// A pause or resume has ended, whatever its outcome: tags that are no longer paused may
    /// hand out their memory again.
    fn after_transition(&self);
}
