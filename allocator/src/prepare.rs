//! Pinned backups prepared ahead of the first pause.
//!
//! Allocating pinned host memory is slow (0.35-0.65 s per GiB in 16 MiB steps on an H100: the
//! pages are faulted in and the driver registers every one; 5.2 s for 8 GiB in
//! `docs/logs/2026-11-25-h100-issue21/background_prepare_after.log`), so a `cpu` allocation's first pause would spend far longer allocating
//! its backup than copying into it. When a `cpu` allocation is made, the allocator asks the
//! [`Preparer`] for its backup buffer: a background thread allocates it, and the first pause
//! takes it ready-made. Later pauses reuse the retained backup, so only the first one needed it.
//!
//! A pause never waits for that pinning: it takes a buffer being pinned as it stands (the
//! thread looks between steps whether its buffer was taken, and stops), and a request still
//! queued as an empty reservation. The steps not pinned yet are copied as pageable memory
//! (`backup.rs`), and once the transition's copies are done it hands the buffer back as a
//! finish job ([`Preparer::finish`]): the thread pins the rest in place, step by step, after
//! any queued request, so later pauses and resumes copy at pinned speed. Freeing the allocation
//! or releasing the backup cancels it.
//!
//! The preparer keeps no contents: a prepared buffer becomes the allocation's backup only when
//! a pause copies into it. What it holds is bounded by a byte limit (`MEMSAVER_BACKUP_PREPARE_MB`;
//! finish jobs are backups already and do not count) and reported in the stats
//! (`prepared_backup_bytes`; `backups_preparing` counts requests and finish jobs).
//!
//! Keys are the allocator's allocation ids, never addresses, so a freed and reused address
//! never receives the buffer of its previous owner. The preparer's lock is a leaf: no other
//! lock is taken under it, and no driver call is made under it (the thread reserves a
//! request's address space under it, one `mmap` with no memory behind it).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

use crate::backup::{HostBuffer, PinJob, PinnedBuffer, Staging, Step};
use crate::driver::{Context, Driver, DriverError};

/// One buffer to prepare.
struct Request {
    key: u64,
    ctx: Context,
    len: usize,
}

/// The rest of a backup to pin: a partly pinned buffer that a pause took (see
/// [`Preparer::finish`]).
struct Finish {
    key: u64,
    job: PinJob,
}

/// What the thread works on now.
struct InFlight {
    key: u64,
    len: usize,
    /// A buffer being prepared (`None` once taken or forgotten: the thread stops after the
    /// step it is in); `None` from the start for the rest of a backup.
    buf: Option<HostBuffer>,
    /// Pinning the rest of a backup, not preparing a buffer.
    finish: bool,
    /// A finish job whose allocation was freed.
    cancelled: bool,
}

#[derive(Default)]
struct State {
    /// Set once the thread decided about the staging buffers (made them, or tried).
    staging_made: bool,
    queue: VecDeque<Request>,
    /// Backups to pin the rest of, after the requests.
    finishing: VecDeque<Finish>,
    in_flight: Option<InFlight>,
    ready: HashMap<u64, HostBuffer>,
    /// Bytes queued, in flight and ready: what the limit bounds (not finish jobs: their
    /// buffers are backups already).
    committed: u64,
    limit: u64,
    /// Set once the thread has been started.
    started: bool,
    /// Set when the owner goes away: the thread exits.
    stopping: bool,
}

/// Bytes of backups to prepare from which the staging buffers pay for the pinned memory they
/// keep (32 MiB): a first pause that comes before 1 GiB of backups is pinned copies it at about
/// twice the driver's pageable speed through them (`backup.rs`, [`Staging`]).
const STAGING_FROM: u64 = 1 << 30;

pub(crate) struct Preparer {
    driver: Arc<Driver>,
    /// Pinned staging buffers for the copies of backups not pinned yet, made by the thread
    /// before its first buffer once `STAGING_FROM` bytes are to be prepared.
    staging: Staging,
    state: Mutex<State>,
    /// Signalled when a request is queued, when one completes, and on stop.
    changed: Condvar,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// How a job ended.
enum Outcome {
    Done,
    Stopped,
    Failed(DriverError),
}

impl Preparer {
    pub(crate) fn new(driver: Arc<Driver>, limit: u64) -> Arc<Self> {
        Arc::new(Self {
            driver,
            state: Mutex::new(State {
                limit,
                ..State::default()
            }),
            staging: Staging::default(),
            changed: Condvar::new(),
            thread: Mutex::new(None),
        })
    }

    /// The staging buffers for copies of backups not pinned yet (none before the thread made
    /// them).
    pub(crate) fn staging(&self) -> &Staging {
        &self.staging
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
        let mut s = self.state.lock();
        if s.stopping || s.committed + len as u64 > s.limit {
            return;
        }
        s.committed += len as u64;
        s.queue.push_back(Request { key, ctx, len });
        self.wake(s);
    }

    /// Queues the pinning of the rest of `key`'s backup, which a pause took partly pinned
    /// (the transition's steps call this once their copies are done). Nothing if it is queued
    /// or pinned already.
    pub(crate) fn finish(self: &Arc<Self>, key: u64, job: PinJob) {
        let mut s = self.state.lock();
        let known = s.finishing.iter().any(|f| f.key == key)
            || s.in_flight
                .as_ref()
                .is_some_and(|f| f.key == key && f.finish && !f.cancelled);
        if s.stopping || known || job.released() {
            return;
        }
        s.finishing.push_back(Finish { key, job });
        self.wake(s);
    }

    /// Wakes the thread for new work, starting it on first use.
    fn wake(self: &Arc<Self>, mut s: parking_lot::MutexGuard<'_, State>) {
        if s.started {
            self.changed.notify_all();
            return;
        }
        s.started = true;
        drop(s);
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
                s.finishing.clear();
                s.committed = 0;
                s.stopping = true;
            }
        }
    }

    /// The buffer prepared for `key`, never waiting for pinning: ready, or as it stands if the
    /// thread is pinning it now (the thread stops after the step it is in), or an empty
    /// reservation if its request is still queued. Steps not pinned yet are copied as pageable
    /// memory, and the caller has [`Preparer::finish`] pin them afterwards. `None` when there
    /// is none (never requested, over the limit, or failed).
    pub(crate) fn take(&self, key: u64) -> Option<HostBuffer> {
        let mut s = self.state.lock();
        if let Some(f) = s.in_flight.as_mut()
            && f.key == key
            && let Some(buf) = f.buf.take()
        {
            let len = f.len as u64;
            s.committed -= len;
            return Some(buf);
        }
        if let Some(buf) = s.ready.remove(&key) {
            s.committed -= buf.len() as u64;
            return Some(buf);
        }
        let r = Self::unqueue(&mut s, key)?;
        drop(s);
        match PinnedBuffer::reserve(&self.driver, r.ctx, r.len) {
            Ok(b) => Some(HostBuffer::Pinned(b)),
            Err(e) => {
                tracing::info!(bytes = r.len, error = %e, "cannot reserve a backup buffer; the pause allocates it");
                None
            }
        }
    }

    /// Forgets `key` (its allocation was freed): the buffer, if ready or being prepared, is
    /// returned for the caller to drop outside its locks (dropping never waits for pinning); a
    /// request or finish job still queued is dropped, one in flight cancelled.
    pub(crate) fn forget(&self, key: u64) -> Option<HostBuffer> {
        let mut s = self.state.lock();
        let mut gone = None;
        if let Some(f) = s.in_flight.as_mut()
            && f.key == key
        {
            f.cancelled = true;
            gone = f.buf.take();
            if gone.is_some() {
                let len = f.len as u64;
                s.committed -= len;
            }
        }
        Self::unqueue(&mut s, key);
        s.finishing.retain(|f| f.key != key);
        if let Some(buf) = s.ready.remove(&key) {
            s.committed -= buf.len() as u64;
            gone = Some(buf);
        }
        gone
    }

    fn unqueue(s: &mut State, key: u64) -> Option<Request> {
        let i = s.queue.iter().position(|r| r.key == key)?;
        let r = s.queue.remove(i).expect("found above");
        s.committed -= r.len as u64;
        Some(r)
    }

    /// The bytes prepared for `key`, ready to be taken.
    pub(crate) fn ready_bytes(&self, key: u64) -> Option<usize> {
        self.state.lock().ready.get(&key).map(HostBuffer::len)
    }

    /// Buffers queued or in flight, and backups whose rest is still to pin.
    pub(crate) fn pending(&self) -> u64 {
        let s = self.state.lock();
        let finishing = s.finishing.iter().filter(|f| !f.job.released()).count();
        (s.queue.len() + finishing) as u64 + u64::from(s.in_flight.is_some())
    }

    /// Waits until nothing is queued or in flight.
    pub(crate) fn wait_idle(&self) {
        let mut s = self.state.lock();
        while !s.stopping
            && (!s.queue.is_empty() || !s.finishing.is_empty() || s.in_flight.is_some())
        {
            self.changed.wait(&mut s);
        }
    }

    /// Stops the thread and frees every prepared buffer; for the owner's drop.
    pub(crate) fn stop(&self) {
        let (ready, finishing) = {
            let mut s = self.state.lock();
            s.stopping = true;
            s.queue.clear();
            self.changed.notify_all();
            (
                std::mem::take(&mut s.ready),
                std::mem::take(&mut s.finishing),
            )
        };
        if let Some(h) = self.thread.lock().take() {
            let _ = h.join();
        }
        drop(ready);
        drop(finishing);
    }

    /// The thread: prepares the requests in order, then pins the rest of the backups pauses
    /// took partly pinned, one step per call, looking between steps whether its work was
    /// taken, forgotten or stopped. Its lock is never held across a driver call.
    fn run(self: Arc<Self>) {
        // Pinning is a call a thread may not make while another captures a stream in global
        // mode (torch's default): it would invalidate the capture (a `torch.cuda.graph`
        // capture failed so on an H100 while this thread pinned). This thread never captures.
        if let Err(e) = self.driver.relax_capture_mode() {
            tracing::info!(error = %e, "cannot relax the preparation thread's capture mode; a CUDA graph captured while backups are prepared may fail");
        }
        loop {
            let (key, finish, job, stage) = {
                let mut s = self.state.lock();
                loop {
                    if s.stopping {
                        return;
                    }
                    if let Some(r) = s.queue.pop_front() {
                        // Reserving is one mmap, no driver call: under the lock, so the
                        // request is never out of sight of `take` (which would then pin it).
                        match PinnedBuffer::reserve(&self.driver, r.ctx, r.len) {
                            Ok(b) => {
                                let buf = HostBuffer::Pinned(b);
                                let job = buf.pin_job().expect("nothing pinned yet");
                                s.in_flight = Some(InFlight {
                                    key: r.key,
                                    len: r.len,
                                    buf: Some(buf),
                                    finish: false,
                                    cancelled: false,
                                });
                                // Before the first buffer of a large enough backlog.
                                let stage = (!s.staging_made && s.committed >= STAGING_FROM)
                                    .then_some(r.ctx);
                                s.staging_made |= stage.is_some();
                                break (r.key, false, job, stage);
                            }
                            Err(e) => {
                                s.committed -= r.len as u64;
                                tracing::info!(bytes = r.len, error = %e, "could not prepare a pinned backup; the first pause will allocate it");
                                continue;
                            }
                        }
                    }
                    if let Some(f) = s.finishing.pop_front() {
                        if f.job.released() {
                            continue;
                        }
                        s.in_flight = Some(InFlight {
                            key: f.key,
                            len: f.job.len(),
                            buf: None,
                            finish: true,
                            cancelled: false,
                        });
                        break (f.key, true, f.job, None);
                    }
                    self.changed.wait(&mut s);
                }
            };
            if let Some(ctx) = stage {
                self.staging.prepare(&self.driver, ctx);
            }
            let outcome = loop {
                {
                    let s = self.state.lock();
                    let f = s.in_flight.as_ref().expect("ours");
                    if s.stopping || f.cancelled || (!finish && f.buf.is_none()) {
                        break Outcome::Stopped;
                    }
                }
                match job.step() {
                    Ok(Step::More) => {}
                    Ok(Step::Done) => break Outcome::Done,
                    Ok(Step::Released) => break Outcome::Stopped,
                    Err(e) => break Outcome::Failed(e),
                }
            };
            drop(job);
            let mut s = self.state.lock();
            let f = s.in_flight.take().expect("ours");
            let unused = match (outcome, f.buf) {
                (Outcome::Done, Some(buf)) if !s.stopping => {
                    s.ready.insert(key, buf);
                    None
                }
                (Outcome::Failed(e), buf) => {
                    if finish {
                        tracing::info!(bytes = f.len, error = %e, "could not pin the rest of a backup; its other steps stay pageable");
                    } else {
                        tracing::info!(bytes = f.len, error = %e, "could not prepare a pinned backup; the first pause will allocate it");
                    }
                    buf
                }
                (_, buf) => buf,
            };
            if unused.is_some() {
                s.committed -= f.len as u64;
            }
            self.changed.notify_all();
            drop(s);
            drop(unused);
        }
    }
}
