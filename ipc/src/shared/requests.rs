//! One topic: every request an importer makes of an owner. [`import`] trades a token
//! ([`crate::token`]) for the buffer's fd with its owner, [`request_fds`] asks an owner again
//! for buffers this process imported from it (a new generation, after the owner re-created
//! them, or word that the owner freed one), [`notify_released`] tells an owner that this
//! process let go of its imports and [`notify_pause_failed`] that its own pause failed. Each of
//! them takes `wait`, how long the owner itself may wait for a buffer still being restored (it
//! answers `NotReady` after that). The owners this process imports from are known by the
//! tokens they gave ([`owner_identity`]).

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::time::Duration;

use parking_lot::Mutex;

use crate::client::{Answered, exchange, exchange_read};
use crate::error::{Error, Result};
use crate::group;
use crate::identity::{self, Identity};
use crate::protocol::{Buffer, MAX_BUFFERS, Reply, Request};
use crate::token::Token;

/// The owners this process imports from: pid -> identity, learnt from their tokens.
static OWNERS: Mutex<Option<HashMap<u32, Identity>>> = Mutex::new(None);

pub(crate) fn owner_identity(pid: u32) -> Result<Identity> {
    OWNERS
        .lock()
        .as_ref()
        .and_then(|m| m.get(&pid).copied())
        .ok_or(Error::NoToken { pid })
}

/// Records `t`'s owner as the process behind its pid. Refused while this process still holds
/// imports of another process with that pid (`holds_imports_of(pid)`: a reused pid, or a
/// process of another pid namespace; either way not the owner those imports came from).
fn bind_owner(t: &Token, holds_imports_of: impl FnOnce(u32) -> bool) -> Result<()> {
    let id = t.owner();
    let known = OWNERS.lock().as_ref().and_then(|m| m.get(&t.pid).copied());
    if let Some(old) = known.filter(|old| *old != id)
        && holds_imports_of(t.pid)
    {
        return Err(Error::NotThatProcess(format!(
            "the token names process {} started at {} (nonce {:016x}), but this process \
             holds imports of another process {} (started at {}, nonce {:016x}): the pid \
             was reused or belongs to another pid namespace (container); memsaver shares \
             memory only between processes of one pid namespace",
            t.pid, t.start, t.nonce, old.pid, old.start, old.nonce
        )));
    }
    OWNERS
        .lock()
        .get_or_insert_with(HashMap::new)
        .insert(t.pid, id);
    identity::remember_start(t.pid, t.start);
    Ok(())
}

/// A buffer an owner served: the fd of its memory, the generation it is, and where the buffer
/// lies in that memory ([`Reply::Export`]).
#[derive(Debug)]
pub struct Served {
    pub fd: OwnedFd,
    pub generation: u64,
    pub offset: u64,
    /// The size of the memory the fd is.
    pub size: u64,
    /// The owner's epoch when it served it ([`crate::epoch`]).
    pub epoch: u64,
}

/// What an owner answered for one buffer asked of it.
#[derive(Debug)]
pub enum Answer {
    Served(Served),
    /// The owner freed the buffer ([`Reply::Gone`]): there is nothing to map any more; the
    /// importer drops its import.
    Gone,
}

/// A fetch that failed: why, and the notice that tells the owner this process holds none of
/// what it asked ([`notify_released`]).
#[derive(Debug)]
pub struct FetchFailed {
    pub error: Error,
    /// Every buffer asked, at the generation the owner served it where its answer was read
    /// (the owner recorded this process as mapping that generation, which may be later than
    /// the one asked: a notice naming another changes nothing there, and the owner's next
    /// pause would wait for this process until its timeout), else at the generation asked.
    pub release: Vec<Buffer>,
}

/// The buffers `wants` of `owner`: each one's fd with the generation it is, or word that the
/// owner freed it.
fn fetch(
    group: i64,
    owner: &Identity,
    wants: &[Buffer],
    wait: Duration,
) -> Result<Vec<Answer>, FetchFailed> {
    let mut replies = Vec::with_capacity(wants.len());
    let mut broke = None;
    for chunk in wants.chunks(MAX_BUFFERS) {
        let request = Request::Import {
            from: identity::me(),
            to: *owner,
            group,
            buffers: chunk.to_vec(),
        };
        let (read, failure) = exchange_read(group, owner, &request, chunk.len(), wait);
        replies.extend(read);
        if failure.is_some() {
            broke = failure;
            break;
        }
    }
    answers(owner.pid, wants, replies, broke, wait)
}

/// The answers of owner `pid` to `wants` from its `replies` (in order; fewer than `wants`
/// when the exchange broke with `broke`). Any reply that is not an export or a `Gone` of the
/// buffer asked, or an exchange that broke, fails the whole fetch; the failure's notice names
/// what the owner served at the generation it served ([`FetchFailed::release`]).
pub(crate) fn answers(
    pid: u32,
    wants: &[Buffer],
    replies: Vec<Answered>,
    broke: Option<Error>,
    wait: Duration,
) -> Result<Vec<Answer>, FetchFailed> {
    let mut error = broke;
    let mut release = wants.to_vec();
    let mut out = Vec::with_capacity(wants.len());
    for (((reply, fd), want), notice) in replies.into_iter().zip(wants).zip(&mut release) {
        let id = want.id;
        let failure = match (reply, fd) {
            (
                Reply::Export {
                    id: got,
                    generation,
                    offset,
                    size,
                    epoch,
                },
                Some(fd),
            ) if got == id => {
                notice.generation = generation;
                out.push(Answer::Served(Served {
                    fd,
                    generation,
                    offset,
                    size,
                    epoch,
                }));
                continue;
            }
            (Reply::Gone { id: got }, None) if got == id => {
                out.push(Answer::Gone);
                continue;
            }
            (Reply::NotReady { .. }, _) => Error::NotRestored {
                pid,
                id,
                generation: want.generation,
                waited_ms: wait.as_millis(),
            },
            (Reply::Error { message, .. }, None) => Error::OwnerFailed { pid, message },
            (Reply::Failed { .. }, _) => Error::ExportFailed {
                pid,
                what: format!("buffer {id:#x}"),
            },
            (r, _) => Error::Wire {
                pid,
                what: format!("answered {r:?} for buffer {id:#x}"),
            },
        };
        // The first failure is the one reported; the answers after it are still read for
        // the generations served.
        error.get_or_insert(failure);
    }
    if error.is_none() && out.len() < wants.len() {
        error = Some(Error::Wire {
            pid,
            what: format!("answered {} of {} buffers", out.len(), wants.len()),
        });
    }
    match error {
        None => Ok(out),
        Some(error) => Err(FetchFailed { error, release }),
    }
}

/// The import of token `t`: checks its group (and fixes this process's, [`group::fix`]) and
/// its owner (`holds_imports_of`: see [`bind_owner`]), then the buffer's fd and its generation.
pub fn import(
    t: &Token,
    wait: Duration,
    holds_imports_of: impl FnOnce(u32) -> bool,
) -> Result<Served> {
    let mine = group::try_fix()?;
    if t.group != mine {
        return Err(Error::OtherGroup {
            pid: t.pid,
            theirs: t.group,
            mine,
        });
    }
    bind_owner(t, holds_imports_of)?;
    let want = Buffer {
        id: t.buffer,
        key: t.key,
        generation: t.generation,
    };
    let answer = fetch(t.group, &t.owner(), &[want], wait).map_err(|f| f.error)?;
    match answer.into_iter().next() {
        Some(Answer::Served(s)) => Ok(s),
        Some(Answer::Gone) => Err(Error::Freed {
            pid: t.pid,
            id: t.buffer,
        }),
        None => Err(Error::Wire {
            pid: t.pid,
            what: "no answer".into(),
        }),
    }
}

/// Buffers `wants` of `owner` (each at least the generation given): each one's fd with the
/// generation it is, or word that the owner freed it. On a failure, what to tell the owner
/// ([`FetchFailed::release`]).
pub fn request_fds(
    group: i64,
    owner: u32,
    wants: &[Buffer],
    wait: Duration,
) -> Result<Vec<Answer>, FetchFailed> {
    let owner = owner_identity(owner).map_err(|error| FetchFailed {
        error,
        release: Vec::new(),
    })?;
    fetch(group, &owner, wants, wait)
}

/// Tells `owner` that this process released its imports of `buffers`.
pub fn notify_released(group: i64, owner: u32, buffers: &[Buffer], wait: Duration) -> Result<()> {
    let owner = owner_identity(owner)?;
    for chunk in buffers.chunks(MAX_BUFFERS) {
        let request = Request::Released {
            from: identity::me(),
            to: owner,
            group,
            buffers: chunk.to_vec(),
        };
        exchange(group, &owner, request, 1, wait)?;
    }
    Ok(())
}

/// Tells `owner` that this process's own pause failed (`message`) and left some of its
/// imports of `owner`'s buffers mapped.
pub fn notify_pause_failed(group: i64, owner: u32, message: &str, wait: Duration) -> Result<()> {
    let owner = owner_identity(owner)?;
    let request = Request::PauseFailed {
        from: identity::me(),
        to: owner,
        group,
        message: message.to_owned(),
    };
    exchange(group, &owner, request, 1, wait)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Buffers 1 to 3 asked at generation 4.
    fn wants() -> Vec<Buffer> {
        (1..=3)
            .map(|id| Buffer {
                id,
                key: 7,
                generation: 4,
            })
            .collect()
    }

    /// The owner's export of buffer `id` at `generation`, an fd of `/dev/null` with it.
    fn export(id: u64, generation: u64) -> Answered {
        let fd = std::fs::File::open("/dev/null").unwrap().into();
        let reply = Reply::Export {
            id,
            generation,
            offset: 0,
            size: 1 << 20,
            epoch: 2,
        };
        (reply, Some(fd))
    }

    #[test]
    fn every_buffer_served_or_gone_makes_a_fetch() {
        let replies = vec![export(1, 6), (Reply::Gone { id: 2 }, None), export(3, 4)];
        let a = answers(9, &wants(), replies, None, Duration::ZERO).unwrap();
        assert!(
            matches!(
                a.as_slice(),
                [
                    Answer::Served(Served { generation: 6, .. }),
                    Answer::Gone,
                    Answer::Served(Served { generation: 4, .. }),
                ]
            ),
            "{a:?}"
        );
    }

    /// The owner wrote buffer 1's answer before the connection broke: it counts this process
    /// as mapping generation 6, which the notice names; the others as asked.
    #[test]
    fn a_broken_exchange_releases_what_was_read_at_the_generation_served() {
        let broke = Error::Wire {
            pid: 9,
            what: "closed the connection (did it exit?)".into(),
        };
        let w = wants();
        let failed = answers(9, &w, vec![export(1, 6)], Some(broke), Duration::ZERO).unwrap_err();
        assert_eq!(
            failed.error.to_string(),
            "process 9: closed the connection (did it exit?)"
        );
        assert_eq!(
            failed.release,
            vec![
                Buffer {
                    generation: 6,
                    ..w[0]
                },
                w[1],
                w[2]
            ]
        );
    }

    /// A `Gone` or an export of another buffer than the one asked, an export without its fd, or
    /// a failure fails the fetch, naming the first; the answers after it still count for the
    /// notice.
    #[test]
    fn an_answer_that_is_not_the_buffers_fails_the_fetch() {
        let w = wants();
        let cases: [(Answered, &str); 4] = [
            (
                (Reply::Gone { id: 3 }, None),
                "answered Gone { id: 3 } for buffer 0x1",
            ),
            (
                (
                    Reply::Export {
                        id: 1,
                        generation: 5,
                        offset: 0,
                        size: 1,
                        epoch: 0,
                    },
                    None,
                ),
                "answered Export",
            ),
            (
                (Reply::Failed { id: 1 }, None),
                "could not export buffer 0x1",
            ),
            ((Reply::Done, None), "answered Done for buffer 0x1"),
        ];
        for (first, says) in cases {
            let replies = vec![first, export(2, 8), (Reply::Gone { id: 3 }, None)];
            let failed = answers(9, &w, replies, None, Duration::ZERO).unwrap_err();
            assert!(failed.error.to_string().contains(says), "{}", failed.error);
            assert_eq!(
                failed.release,
                vec![
                    w[0],
                    Buffer {
                        generation: 8,
                        ..w[1]
                    },
                    w[2]
                ]
            );
        }
    }
}
