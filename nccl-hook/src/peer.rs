//! The `nccl` tag's exchanges with its peers through the cross-process layer
//! (`memsaver_ipc`), under the `nccl` timeout: the pause tells owners which imports it released,
//! the resume asks owners for the new generation of its imports ([`crate::provider`]).
//!
//! NCCL shares a P2P buffer by exporting its handle as a POSIX fd, sending the fd over its own
//! Unix socket and importing it in the peer. The export wrapper ([`crate::vmm`]) hands NCCL a
//! token instead (`memsaver_ipc::token`, naming the buffer by its virtual handle); the
//! importer's wrapper trades it for the real fd with the owner; the owner serves it from its
//! registry ([`crate::exports`]). So the owner knows every importer of each buffer, and every
//! importer knows the owner and buffer behind each import. Who may talk to whom, and what
//! enforces it, is docs/security.md.

use std::os::fd::OwnedFd;
use std::time::Duration;

use crate::options;
use memsaver_ipc::client;
use memsaver_ipc::protocol::Buffer;

pub(crate) use memsaver_ipc::identity::alive;

/// How long pause waits for importers to let go and resume for owners to come back
/// (`MEMSAVER_NCCL_TIMEOUT_MS`); also how long an owner waits for a buffer still resuming
/// before it answers a peer's import.
pub(crate) fn timeout() -> Duration {
    options::get().nccl_timeout
}

/// The option that sets [`timeout`], named in progress lines.
pub(crate) const TIMEOUT_SETTING: &str = "MEMSAVER_NCCL_TIMEOUT_MS";

/// The real fds of buffers `wants` of `owner` (each at least the generation given), with the
/// generation each one is.
pub(crate) fn request_fds(
    group: i64,
    owner: u32,
    wants: &[Buffer],
) -> Result<Vec<(OwnedFd, u64)>, String> {
    client::request_fds(group, owner, wants, timeout())
}

/// Tells `owner` that this process released its imports `items`.
pub(crate) fn notify_released(group: i64, owner: u32, items: &[Buffer]) -> Result<(), String> {
    client::notify_released(group, owner, items, timeout())
}
