//! Pinned backups prepared ahead of the first pause.
//!
//! Allocating pinned host memory is slow (0.35-0.65 s per GiB in 16 MiB steps on an H100: the
//! pages are faulted in and the driver registers every one; 5.2 s for 8 GiB in
//! `docs/logs/2026-11-25-h100-issue21/background_prepare_after.log`), so a `cpu` allocation's first pause would spend far longer allocating
//! its backup than copying into it. When a `cpu` allocation is made, the allocator asks the
//! [`Preparer`] for its backup buffer: a background thread allocates it, and the first pause
//! takes it ready-made. Later pauses reuse the retained backup, so only the first one needed it.
//!
//! The preparer keeps no contents: a prepared buffer becomes the allocation's backup only when
//! a pause copies into it. What it holds is bounded by a byte limit (`MEMSAVER_BACKUP_PREPARE_MB`)
//! and reported in the stats (`prepared_backup_bytes`, `backups_preparing`).
//!
//! Keys are the allocator's allocation ids, never addresses, so a freed and reused address
//! never receives the buffer of its previous owner. The preparer's lock is a leaf: no other
//! lock is taken under it, and no driver call is made under it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

use crate::backup::HostBuffer;
use crate::driver::{Context, Driver};

/// One buffer to prepare.
struct Request {
    key: u64,
    ctx: Context,
    len: usize,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Request>,
    /// The request the thread is allocating now, and whether it was cancelled meanwhile.
    in_flight: Option<(u64, bool)>,
    ready: HashMap<u64, HostBuffer>,
    /// Bytes queued, in flight and ready: what the limit bounds.
    committed: u64,
    limit: u64,
    /// Set once the thread has been started.
    started: bool,
    /// Set when the owner goes away: the thread exits.
    stopping: bool,
}

pub(crate) struct Preparer {
    driver: Arc<Driver>,
    state: Mutex<State>,
    /// Signalled when a request is queued, when one completes, and on stop.
    changed: Condvar,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Preparer {
    pub(crate) fn new(driver: Arc<Driver>, limit: u64) -> Arc<Self> {
        Arc::new(Self {
            driver,
            state: Mutex::new(State {
                limit,
                ..State::default()
            }),
            changed: Condvar::new(),
            thread: Mutex::new(None),
        })
    }

    pub(crate) fn limit(&self) -> u64 {
        self.state.lock().limit
    }

    /// Sets the byte limit; buffers already prepared stay.
    pub(crate) fn set_limit(&self, bytes: u64) {
        self.state.lock().limit = bytes;
    }

    /// Queues a buffer of `len` bytes for `key`, unless that would take the prepared bytes over
    /// the limit (the first pause then allocates it, as without a preparer). Starts the thread on
    /// first use.
    pub(crate) fn request(self: &Arc<Self>, key: u64, ctx: Context, len: usize) {
        {
            let mut s = self.state.lock();
            if s.stopping || s.committed + len as u64 > s.limit {
                return;
            }
            s.committed += len as u64;
            s.queue.push_back(Request { key, ctx, len });
            if s.started {
                self.changed.notify_all();
                return;
            }
            s.started = true;
        }
        let me = self.clone();
        let spawned = std::thread::Builder::new()
            .name("memsaver-prepare".into())
            .spawn(move || me.run());
        match spawned {
            Ok(h) => *self.thread.lock() = Some(h),
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the backup preparation thread; first pauses allocate their backups");
                let mut s = self.state.lock();
                s.queue.clear();
                s.committed = 0;
                s.stopping = true;
            }
        }
    }

    /// The prepared buffer of `key`, waiting for it if the thread is allocating it now. `None`
    /// when there is none (never requested, over the limit, failed, or still queued: a queued
    /// request is dropped, since the caller is about to allocate it anyway).
    pub(crate) fn take(&self, key: u64) -> Option<HostBuffer> {
        let mut s = self.state.lock();
        while s.in_flight.is_some_and(|(k, _)| k == key) {
            self.changed.wait(&mut s);
        }
        if let Some(buf) = s.ready.remove(&key) {
            s.committed -= buf.len() as u64;
            return Some(buf);
        }
        Self::unqueue(&mut s, key);
        None
    }

    /// Forgets `key` (its allocation was freed): the buffer, if ready, is returned for the caller
    /// to drop outside its locks; a request still queued or in flight is cancelled.
    pub(crate) fn forget(&self, key: u64) -> Option<HostBuffer> {
        let mut s = self.state.lock();
        if let Some((k, cancelled)) = s.in_flight.as_mut()
            && *k == key
        {
            *cancelled = true;
        }
        Self::unqueue(&mut s, key);
        let buf = s.ready.remove(&key)?;
        s.committed -= buf.len() as u64;
        Some(buf)
    }

    fn unqueue(s: &mut State, key: u64) {
        if let Some(i) = s.queue.iter().position(|r| r.key == key) {
            let r = s.queue.remove(i).expect("found above");
            s.committed -= r.len as u64;
        }
    }

    /// The bytes prepared for `key`, ready to be taken.
    pub(crate) fn ready_bytes(&self, key: u64) -> Option<usize> {
        self.state.lock().ready.get(&key).map(HostBuffer::len)
    }

    /// Requests queued or in flight.
    pub(crate) fn pending(&self) -> u64 {
        let s = self.state.lock();
        s.queue.len() as u64 + u64::from(s.in_flight.is_some())
    }

    /// Waits until nothing is queued or in flight.
    pub(crate) fn wait_idle(&self) {
        let mut s = self.state.lock();
        while !s.stopping && (!s.queue.is_empty() || s.in_flight.is_some()) {
            self.changed.wait(&mut s);
        }
    }

    /// Stops the thread and frees every prepared buffer; for the owner's drop.
    pub(crate) fn stop(&self) {
        let ready = {
            let mut s = self.state.lock();
            s.stopping = true;
            s.queue.clear();
            self.changed.notify_all();
            std::mem::take(&mut s.ready)
        };
        if let Some(h) = self.thread.lock().take() {
            let _ = h.join();
        }
        drop(ready);
    }

    fn run(self: Arc<Self>) {
        loop {
            let r = {
                let mut s = self.state.lock();
                loop {
                    if s.stopping {
                        return;
                    }
                    if let Some(r) = s.queue.pop_front() {
                        s.in_flight = Some((r.key, false));
                        break r;
                    }
                    self.changed.wait(&mut s);
                }
            };
            let buf = HostBuffer::new(&self.driver, r.ctx, r.len);
            let mut s = self.state.lock();
            let cancelled = s.in_flight.take().is_some_and(|(_, c)| c);
            let unused = match buf {
                Ok(b) if !cancelled && !s.stopping => {
                    s.ready.insert(r.key, b);
                    None
                }
                Ok(b) => {
                    s.committed -= r.len as u64;
                    Some(b)
                }
                Err(e) => {
                    s.committed -= r.len as u64;
                    tracing::info!(bytes = r.len, error = %e, "could not prepare a pinned backup; the first pause will allocate it");
                    None
                }
            };
            self.changed.notify_all();
            drop(s);
            drop(unused);
        }
    }
}
