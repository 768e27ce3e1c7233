//! An importer that fell behind its owners catches up before NCCL runs again.
//!
//! Every process of a group pauses and resumes `nccl` together, each following its owners in
//! a pause and a resume of its own. One that did not (it was stopped across its owners' pause
//! and resume, or did not pause with them) still maps memory its owner no longer uses: the
//! generation before, which the owner released, or the owner's paused memory. NCCL must not
//! run on it: a collective would hang or give wrong results, silently.
//!
//! So each guarded NCCL call ([`crate::interpose::guard`]) first compares, for each owner this
//! process imports from, the owner's published epoch (`memsaver_ipc::epoch`: raised by each of its
//! pauses and resumes) with the epoch its imports were served at. While they agree the call goes on
//! (one load of shared memory per owner). When the owner's is later:
//! - the owner is paused now: this process releases its imports of it (as its own pause
//!   would, telling the owner, whose pause then stops waiting for it) and the call is refused,
//!   as calls are while `nccl` is paused;
//! - the owner is resident: this process asks it for its current memory at the generation
//!   each import maps (the owner answers at once); if some came back newer, it unmaps its
//!   imports of that owner and maps what was served at the same addresses (as its own resume
//!   would), then the call goes on. If the owner cannot be reached or the mapping fails, the
//!   call is refused with the reason.
//!
//! One thread catches up at a time; the others' calls wait for it. An owner without an epoch
//! file (it could not make one) cannot be followed this way: its importers catch up in their
//! next pause and resume only. Which owners are ahead is [`crate::interpose::epochs`]'s, below the
//! interposition; this module is installed there at start.

use std::collections::BTreeMap;

use memsaver_allocator::Allocator;
use memsaver_ipc::deadline::Outcome;
use memsaver_ipc::epoch::Word;
use memsaver_ipc::group;
use memsaver_ipc::protocol::Buffer;
use parking_lot::Mutex;

use crate::interpose::epochs::{self, synced};
use crate::registry::{self, Kind};
use crate::tag::peer::{self, Fetch, Fetched, Wanted};
use crate::tag::release;

/// Held by the one thread catching up.
static CATCHING_UP: Mutex<()> = Mutex::new(());

/// Registers [`catch_up_with`] for the guarded NCCL calls.
pub(crate) fn install() {
    let _ = epochs::CATCH_UP.set(catch_up_with);
}

/// Catches up with every owner [`epochs::behind`] finds; `Err`: why the NCCL call must be
/// refused.
fn catch_up_with() -> Result<(), String> {
    let Some(a) = memsaver_allocator::global_if_started() else {
        return Ok(());
    };
    let _one = CATCHING_UP.lock();
    let group = group::id();
    // Read under the lock: another thread may have caught up meanwhile.
    for (owner, word) in epochs::behind() {
        catch_up(a, group, owner, word)?;
    }
    Ok(())
}

/// Follows `owner`, whose published state is `word`.
fn catch_up(a: &'static Allocator, group: i64, owner: u32, word: Word) -> Result<(), String> {
    let who = format!("process {owner} (group {group})");
    if word.paused {
        let released = release::release_imports_of(a, owner).map_err(|e| {
            format!(
                "{who} paused 'nccl'; releasing this process's imports of its memory failed: {e}"
            )
        })?;
        if let Some(items) = released.notices.get(&owner) {
            let _ = peer::notify_released(group, owner, items);
        }
        return Err(format!(
            "{who} paused 'nccl' without this process (this process's imports of its memory are \
             released now): NCCL cannot run until it resumes; pause and resume 'nccl' in every \
             process of the group together"
        ));
    }
    let wants = imports_of(owner);
    if wants.is_empty() {
        synced(owner, word.epoch);
        return Ok(());
    }
    let asks: Vec<Buffer> = wants.iter().map(|(w, _)| w.owner).collect();
    let answers = peer::request_fds(group, owner, &asks).map_err(|f| {
        format!(
            "{who} paused and resumed 'nccl' without this process, and its current memory \
             could not be fetched: {}",
            f.error
        )
    })?;
    let mut fetch = Fetch::default();
    let mut stale = false;
    let mut at = u64::MAX;
    for ((w, mapped), answer) in wants.into_iter().zip(answers) {
        match answer {
            memsaver_ipc::shared::requests::Answer::Served(s) => {
                stale |= mapped != Some(s.generation);
                at = at.min(s.epoch);
                fetch.served.push(Fetched::of(w, s));
            }
            memsaver_ipc::shared::requests::Answer::Gone => {
                stale = true;
                fetch.gone.push(w);
            }
        }
    }
    if !stale {
        // The owner's memory is the one mapped (its epoch moved for other buffers).
        synced(owner, at);
        return Ok(());
    }
    release::release_imports_of(a, owner).map_err(|e| {
        format!("{who} paused and resumed 'nccl' without this process; releasing this process's imports of its old memory failed: {e}")
    })?;
    let imported = peer::map_imports(
        a,
        group,
        BTreeMap::from([(owner, Outcome::Done(Ok(fetch)))]),
    );
    if let Some(e) = imported.map_error {
        return Err(format!(
            "{who} paused and resumed 'nccl' without this process, and its current memory \
             could not be mapped here: {e}"
        ));
    }
    tracing::info!(
        owner,
        mapped = imported.mapped,
        "memsaver: caught up with a peer that paused and resumed 'nccl' without this process"
    );
    Ok(())
}

/// `owner`'s buffers this process imported through tokens, to ask it for: each at the
/// generation it maps (the owner answers at once with that one or a later one), or after the
/// one it released; with the generation mapped.
fn imports_of(owner: u32) -> Vec<(Wanted, Option<u64>)> {
    let reg = registry::lock();
    reg.physicals
        .iter()
        .filter(|(_, p)| p.kind == Kind::Imported)
        .filter_map(|(vh, p)| {
            let s = p.source.filter(|s| s.owner == owner)?;
            let (ask, mapped) = match (p.mapped_generation(), p.released_generation()) {
                (Some(g), _) => (g, Some(g)),
                (None, Some(g)) => (g + 1, None),
                _ => return None,
            };
            Some((
                Wanted {
                    vh: *vh,
                    owner: s.item(ask),
                },
                mapped,
            ))
        })
        .collect()
}
