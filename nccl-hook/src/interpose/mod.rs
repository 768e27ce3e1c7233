//! Interposition: what NCCL does with the driver, seen and recorded, never acted on. This
//! layer answers NCCL's calls (and, for graphs and stack limits, every caller's); it never
//! reaches up into what a pause does (`crate::tag`) or the crate root, and writes its records
//! into `crate::registry` (`tests/layers.rs` checks both).
//!
//! * [`dlsym`]: our `dlsym` answers lookups of `cuGetProcAddress(_v2)` made from libnccl with
//!   [`procaddr`]'s wrapper, and forwards everything else untouched (`dl`: the loader's real
//!   lookups).
//! * [`procaddr`]: that wrapper asks the driver and swaps in our wrappers for NCCL's VMM calls.
//! * `vmm`: the wrappers give NCCL virtual handles and record every handle and mapping in the
//!   registry; `sharing`'s wrappers export and import between processes with tokens instead of
//!   fds (`tokens`), and pin what NCCL gives to a NIC or a multicast object. Both call the
//!   driver's own functions that `real` stores.
//! * `graphs`: CUDA graph executables and explicit stack limits, seen through wrappers handed
//!   to every caller, and the kernel stack limit a pause lowers and a resume gives back, as far
//!   as is safe for the graphs and kernels that run while it is paused.
//! * `guard`: NCCL's collectives and send/recv return `ncclInvalidUsage` while the tag is
//!   paused; before each, `epochs` compares the owners' published epochs with this process's
//!   imports (an importer behind them catches up first).
//! * `appmem`: `ncclMemAlloc`/`ncclMemFree`: the application's memory takes the thread's tag or,
//!   untagged, is made by libnccl unrecorded: it is never NCCL's scratch.
//! * [`amem`]: the AMem plugin's C API (`ncclPause`, `ncclResume`, ...), also answered to
//!   lookups in libnccl's handle.

pub mod amem;
pub(crate) mod appmem;
pub(crate) mod dl;
pub mod dlsym;
pub(crate) mod epochs;
pub(crate) mod graphs;
pub(crate) mod guard;
pub mod procaddr;
pub(crate) mod real;
pub(crate) mod sharing;
pub(crate) mod tokens;
pub(crate) mod vmm;
