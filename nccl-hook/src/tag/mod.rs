//! The `nccl` tag: pause and resume of NCCL's memory, over the records the interposition keeps
//! ([`crate::registry`]) and the wrappers' state ([`crate::interpose`]), never the other way
//! round (`tests/layers.rs` checks).
//!
//! * [`provider`]: the tag the allocator pauses and resumes ([`provider::NcclTag`]), the order
//!   of its steps and what each reports;
//! * `release` (pause step 1) and `restore` (resume step 1): this process's own memory and its
//!   mappings of peers' memory on the engine's steps (`memsaver_allocator::steps`, shared with
//!   every tag), with what both share in `local`;
//! * `peer`: the requests to the owners of this process's imports and the waits for its
//!   importers, over `memsaver_ipc`;
//! * `exports`: the memory behind the owner's answers to peers, routed to it by
//!   `memsaver_ipc`'s server;
//! * `registered`: peers' memsaver memory that NCCL registered and mapped here, released and
//!   rebuilt when its owner pauses and resumes its tag (`memsaver_ipc::shared::HOLDERS`);
//! * `catchup`: an importer whose owners paused or resumed without it catches up.

pub(crate) mod catchup;
pub(crate) mod exports;
pub(crate) mod local;
pub(crate) mod peer;
pub(crate) mod provider;
pub(crate) mod registered;
pub(crate) mod release;
pub(crate) mod restore;
