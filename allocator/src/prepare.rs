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
//! (`pinned.rs`), and once the transition's copies are done it hands the buffer back as a
//! finish job ([`Preparer::finish`]): the thread pins the rest in place, step by step, after
//! any queued request, so later pauses and resumes copy at pinned speed. Freeing the allocation
//! or releasing the backup cancels it.
//!
//! The preparer keeps no contents: a prepared buffer becomes the allocation's backup only when
//! a pause copies into it. What it holds is bounded by a byte limit (`MEMSAVER_BACKUP_PREPARE_MB`;
//! finish jobs are backups already and do not count) and reported in the stats
//! (`prepared_backup_bytes`; `backups_preparing` counts requests and finish jobs).
//!
//! With a backup reserve (`reserve.rs`), a request is carved from the reserve's pinned memory
//! first, at once, and only what does not fit is prepared as above. The same thread pins the
//! reserve, before any request it cannot carve yet (requests wait for the reserve rather than
//! pin memory of their own beside it), and carves queued requests from it as it grows; but
//! after the backups that pauses took partly pinned, which are in use: a first pause that came
//! before the reserve was pinned then costs later cycles nothing.
//! Buffers carved from the reserve are not bounded by the limit (the reserve is its own bound)
//! and go back to the reserve when they are dropped.
//!
//! Keys are the allocator's allocation ids, never addresses, so a freed and reused address
//! never receives the buffer of its previous owner. Under the preparer's lock only the
//! reserve's is taken (to carve queued requests), and no driver call is made under it (the
//! thread reserves a request's address space under it, one `mmap` with no memory behind it).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

use crate::backup::HostBuffer;
use crate::driver::{Context, Driver, DriverError};
use crate::pinned::{PinJob, PinnedBuffer, Staging, Step};
use crate::reserve::{Reserve, ReserveFigures};

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
    /// Buffers carved from the reserve for requests, ready to be taken (not in `committed`).
    carved: HashMap<u64, HostBuffer>,
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
/// twice the driver's pageable speed through them (`pinned.rs`, [`Staging`]).
const STAGING_FROM: u64 = 1 << 30;

pub(crate) struct Preparer {
    driver: Arc<Driver>,
    /// The backup reserve, pinned by this thread. Its lock is a leaf, taken under `state`.
    reserve: Arc<Reserve>,
    /// Pinned staging buffers for the copies of backups not pinned yet, made by the thread
    /// before its first buffer once `STAGING_FROM` bytes are to be prepared.
    staging: Staging,
    state: Mutex<State>,
    /// Signalled when a request is queued, when one completes, and on stop.
    changed: Condvar,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// What the thread does next.
enum Work {
    /// Make the staging buffers, in this context.
    Staging(Context),
    /// Pin one step of the reserve's segment.
    Reserve(u64, PinJob),
    /// Prepare a buffer (`finish`: pin the rest of a backup) for `key`.
    Buffer { key: u64, finish: bool, job: PinJob },
}

/// How a job ended.
enum Outcome {
    Done,
    Stopped,
    Failed(DriverError),
}

impl Preparer {
    pub(crate) fn new(driver: Arc<Driver>, limit: u64, reserve: u64) -> Arc<Self> {
        Arc::new(Self {
            reserve: Reserve::new(driver.clone(), reserve),
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

    /// The bytes the backup reserve should hold.
    pub(crate) fn reserve_target(&self) -> u64 {
        self.reserve.target()
    }

    /// Sets the bytes the backup reserve should hold (`reserve.rs`), with the context to pin
    /// in if the caller knows one; the thread pins what is missing.
    pub(crate) fn set_reserve(self: &Arc<Self>, bytes: u64, ctx: Option<Context>) {
        if let Some(ctx) = ctx {
            self.reserve.offer_context(ctx);
        }
        if self.reserve.set_target(bytes) {
            self.wake(self.state.lock());
        }
    }

    /// Offers a context for the reserve to pin in (the first device the process uses); starts
    /// its pinning if it waited for one.
    pub(crate) fn offer_context(self: &Arc<Self>, ctx: Context) {
        if self.reserve.offer_context(ctx) {
            let s = self.state.lock();
            if !s.stopping {
                self.wake(s);
            }
        }
    }

    /// The reserve's figures, for the stats.
    pub(crate) fn reserve_figures(&self) -> ReserveFigures {
        self.reserve.figures()
    }

    /// A buffer of `len` bytes carved from the reserve's pinned memory, if it has that much
    /// free now (for a backup with no prepared buffer).
    pub(crate) fn carve(&self, len: usize) -> Option<HostBuffer> {
        self.reserve.carve(len).map(HostBuffer::Pinned)
    }

    /// Takes a buffer of `len` bytes for `key` from the reserve if it can, at once; else
    /// queues one, unless that would take the prepared bytes over the limit (the first pause
    /// then allocates it, as without a preparer). Starts the thread on first use.
    pub(crate) fn request(self: &Arc<Self>, key: u64, ctx: Context, len: usize) {
        self.offer_context(ctx);
        let mut s = self.state.lock();
        if s.stopping {
            return;
        }
        if let Some(buf) = self.reserve.carve(len) {
            if let Some(old) = s.carved.insert(key, HostBuffer::Pinned(buf)) {
                // Never: keys are not reused. Dropped outside the lock (it takes the
                // reserve's).
                drop(s);
                drop(old);
            }
            return;
        }
        if s.committed + len as u64 > s.limit {
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
        if let Some(buf) = s.carved.remove(&key) {
            return Some(buf);
        }
        let r = Self::unqueue(&mut s, key)?;
        drop(s);
        if let Some(buf) = self.reserve.carve(r.len) {
            return Some(HostBuffer::Pinned(buf));
        }
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
        if let Some(buf) = s.carved.remove(&key) {
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

    /// The bytes prepared for `key` (or carved from the reserve for it), ready to be taken.
    pub(crate) fn ready_bytes(&self, key: u64) -> Option<usize> {
        let s = self.state.lock();
        s.ready
            .get(&key)
            .or_else(|| s.carved.get(&key))
            .map(HostBuffer::len)
    }

    /// Whether the backup reserve still has pinning to do.
    pub(crate) fn reserve_has_work(&self) -> bool {
        self.reserve.has_work()
    }

    /// Buffers queued or in flight, and backups whose rest is still to pin.
    pub(crate) fn pending(&self) -> u64 {
        let s = self.state.lock();
        let finishing = s.finishing.iter().filter(|f| !f.job.released()).count();
        (s.queue.len() + finishing) as u64 + u64::from(s.in_flight.is_some())
    }

    /// Waits until nothing is queued or in flight, and the reserve is pinned (as far as it
    /// goes; not while it waits for a context), or until `deadline`. Returns whether it got
    /// there.
    pub(crate) fn wait_idle(&self, deadline: std::time::Instant) -> bool {
        let mut s = self.state.lock();
        while !s.stopping
            && (!s.queue.is_empty()
                || !s.finishing.is_empty()
                || s.in_flight.is_some()
                || self.reserve.has_work())
        {
            if self.changed.wait_until(&mut s, deadline).timed_out() {
                return false;
            }
        }
        true
    }

    /// Stops the thread and frees every prepared buffer; for the owner's drop.
    pub(crate) fn stop(&self) {
        let (ready, carved, finishing) = {
            let mut s = self.state.lock();
            s.stopping = true;
            s.queue.clear();
            self.changed.notify_all();
            (
                std::mem::take(&mut s.ready),
                std::mem::take(&mut s.carved),
                std::mem::take(&mut s.finishing),
            )
        };
        if let Some(h) = self.thread.lock().take() {
            let _ = h.join();
        }
        drop(ready);
        drop(carved);
        drop(finishing);
    }

    /// What the thread does next, waiting until there is something (`None`: stop): the
    /// staging buffers once the backlog is large enough, requests the reserve can take now
    /// (carved at once), a backup to finish, a step of the reserve, a request to prepare.
    fn next_work(&self) -> Option<Work> {
        let mut s = self.state.lock();
        loop {
            if s.stopping {
                return None;
            }
            // Before the first buffer of a large enough backlog.
            if !s.staging_made
                && s.committed >= STAGING_FROM
                && let Some(ctx) = s.queue.front().map(|r| r.ctx)
            {
                s.staging_made = true;
                return Some(Work::Staging(ctx));
            }
            self.carve_queued(&mut s);
            // Backups a pause took partly pinned before the reserve: in use, so pinned before
            // the reserve grows (else every cycle copies them as pageable memory until the
            // whole reserve is pinned, seconds for gigabytes).
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
                return Some(Work::Buffer {
                    key: f.key,
                    finish: true,
                    job: f.job,
                });
            }
            if let Some((id, job)) = self.reserve.next_step() {
                return Some(Work::Reserve(id, job));
            }
            if let Some(r) = s.queue.pop_front() {
                if let Some(buf) = self.reserve.carve(r.len) {
                    s.committed -= r.len as u64;
                    s.carved.insert(r.key, HostBuffer::Pinned(buf));
                    self.changed.notify_all();
                    continue;
                }
                // Reserving is one mmap, no driver call: under the lock, so the request is
                // never out of sight of `take` (which would then pin it).
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
                        return Some(Work::Buffer {
                            key: r.key,
                            finish: false,
                            job,
                        });
                    }
                    Err(e) => {
                        s.committed -= r.len as u64;
                        tracing::info!(bytes = r.len, error = %e, "could not prepare a pinned backup; the first pause will allocate it");
                        continue;
                    }
                }
            }
            self.changed.wait(&mut s);
        }
    }

    /// Carves the queued requests that the reserve's pinned memory can take now, in order,
    /// stopping at the first that does not fit (requests are served first come, first served,
    /// and one scan of the reserve per request is all the lock is held for).
    fn carve_queued(&self, s: &mut State) {
        while let Some(len) = s.queue.front().map(|r| r.len) {
            let Some(buf) = self.reserve.carve(len) else {
                return;
            };
            let r = s.queue.pop_front().expect("just seen");
            s.committed -= len as u64;
            s.carved.insert(r.key, HostBuffer::Pinned(buf));
            self.changed.notify_all();
        }
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
            let (key, finish, job) = match self.next_work() {
                None => return,
                Some(Work::Staging(ctx)) => {
                    self.staging.prepare(&self.driver, ctx);
                    continue;
                }
                Some(Work::Reserve(id, job)) => {
                    self.reserve.pin_step(id, job);
                    // Under the lock a waiter checks the reserve under (`wait_idle`), so
                    // that the step's end is not missed between its check and its wait.
                    let _s = self.state.lock();
                    self.changed.notify_all();
                    continue;
                }
                Some(Work::Buffer { key, finish, job }) => (key, finish, job),
            };
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
