//! The backup reserve: pinned host memory made before any allocation needs it, that the pinned
//! backups of `cpu` allocations are carved from.
//!
//! Preparing backups in the background (`prepare.rs`) starts when an allocation is made, and
//! pinning runs at 0.35-0.65 s per GiB: a pause that comes right after the allocations (SGLang
//! and slime release memory right after loading weights) finds most of its backups not pinned
//! yet and fills fresh host memory on its critical path, at the host's page-fault rate. With a
//! reserve (`MEMSAVER_BACKUP_RESERVE_MB`, `memsaver_reserve_backups`), that memory is mapped,
//! faulted in and pinned while the process does something else (loads its model), by the
//! preparation thread, in the same bounded steps as a prepared backup (16 MiB
//! `cuMemHostRegister` calls, huge pages, relaxed capture mode), so the application's driver
//! calls and graph captures are not disturbed. A `cpu` backup is then carved from its pinned
//! part at once: no pinning and no pageable copy in any pause.
//!
//! The reserve is one or more *segments*, each one [`PinnedBuffer`] pinned step by step from
//! its start, divided into units of 2 MiB (the VMM granularity: allocation sizes are multiples
//! of it). A backup takes the first run of free units that lies wholly in the pinned part of a
//! segment, as a [`PinnedBuffer`] lent by the reserve ([`PinnedBuffer::lent`]), which gives the
//! units back when it is dropped (a backup released with retention off, or with its
//! allocation): the next backup reuses them. A backup that does not fit in what is pinned now
//! is not carved (a pause never waits for the reserve): it is prepared or allocated as without
//! a reserve.
//!
//! Pinning needs a context: the reserve pins in the primary context of the device the process
//! uses (its current device when the reserve is asked for, else the first device memsaver
//! opens); registrations are `PORTABLE`, usable from every context. A step that fails (the
//! host refuses to pin more, or has no memory to map) stops the reserve where it is: it keeps
//! what it pinned, says so once in the log, and tries again only when it is asked for again.
//!
//! The lock ([`Reserve::state`]) is taken under the preparer's; under it only a segment's own
//! buffer lock is taken (to read how far it is pinned), and no driver call is
//! made under it (a segment's address space is reserved under it, one `mmap` with no memory
//! behind it); segments released by a smaller target are dropped outside it.

use std::sync::Arc;

use parking_lot::Mutex;

use crate::driver::{Context, Driver, DriverError};
use crate::pinned::{Lender, PinJob, PinnedBuffer, Step};
use crate::units::human_bytes;

/// The unit backups are carved in: the VMM granularity, and a huge page.
const UNIT: usize = 2 << 20;

/// One range of the reserve.
struct Segment {
    id: u64,
    buf: PinnedBuffer,
    /// Bytes pinned from the start (the pinning thread's progress).
    pinned: usize,
    /// Pinning stopped at `pinned` (a step failed).
    stopped: bool,
    /// One flag per [`UNIT`]: carved out.
    used: Vec<bool>,
}

impl Segment {
    fn len(&self) -> usize {
        self.buf.len()
    }

    fn in_use(&self) -> bool {
        self.used.iter().any(|u| *u)
    }

    /// The first unit of the first run of `units` free units that lies in the pinned part.
    fn find(&self, units: usize) -> Option<usize> {
        let pinned_units = self.pinned / UNIT;
        let mut run = 0;
        for (i, used) in self.used[..pinned_units].iter().enumerate() {
            run = if *used { 0 } else { run + 1 };
            if run == units {
                return Some(i + 1 - units);
            }
        }
        None
    }
}

#[derive(Default)]
struct State {
    /// Bytes asked for (a multiple of [`UNIT`]).
    target: u64,
    segments: Vec<Segment>,
    next_id: u64,
    /// The context to pin in, once the process uses a device.
    ctx: Option<Context>,
    /// Pinning or mapping failed: no segment is added until the reserve is asked for again.
    stopped_short: bool,
}

impl State {
    fn size(&self) -> u64 {
        self.segments.iter().map(|s| s.len() as u64).sum()
    }
}

/// Figures for the stats.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ReserveFigures {
    /// Bytes asked for.
    pub target: u64,
    /// Bytes pinned so far.
    pub pinned: u64,
    /// Bytes carved out for backups (prepared or in use).
    pub used: u64,
}

pub(crate) struct Reserve {
    driver: Arc<Driver>,
    /// Guards the segments and the target (see the module documentation for what is taken
    /// under it).
    state: Mutex<State>,
}

impl Reserve {
    pub(crate) fn new(driver: Arc<Driver>, target: u64) -> Arc<Self> {
        Arc::new(Self {
            driver,
            state: Mutex::new(State {
                target: round_up(target),
                ..State::default()
            }),
        })
    }

    pub(crate) fn target(&self) -> u64 {
        self.state.lock().target
    }

    /// Sets the bytes the reserve should hold, and tries again what failed to pin. More: a
    /// segment for the difference is pinned in the background (once there is a context).
    /// Less: free segments are released, newest first, while the reserve is larger than
    /// `bytes`, and what that leaves short of `bytes` is pinned again as a new segment in the
    /// background; a segment still lent out in part stays until a later call finds it free.
    /// Returns whether there is pinning to do.
    pub(crate) fn set_target(&self, bytes: u64) -> bool {
        let released = {
            let mut s = self.state.lock();
            s.target = round_up(bytes);
            // Asked again: what failed is tried again.
            s.stopped_short = false;
            for g in &mut s.segments {
                g.stopped = false;
            }
            let mut released = Vec::new();
            let mut size = s.size();
            let mut i = s.segments.len();
            while i > 0 && size > s.target {
                i -= 1;
                let len = s.segments[i].len() as u64;
                if !s.segments[i].in_use() {
                    size -= len;
                    released.push(s.segments.remove(i));
                }
            }
            released
        };
        for seg in &released {
            tracing::info!(bytes = seg.len(), "backup reserve: segment released");
        }
        drop(released);
        self.has_work()
    }

    /// Offers the context to pin in; the first one offered is kept. Returns whether there is
    /// pinning to do.
    pub(crate) fn offer_context(&self, ctx: Context) -> bool {
        let mut s = self.state.lock();
        if s.ctx.is_none() {
            s.ctx = Some(ctx);
        }
        drop(s);
        self.has_work()
    }

    /// Whether a step of pinning is to be done now.
    pub(crate) fn has_work(&self) -> bool {
        let s = self.state.lock();
        s.ctx.is_some()
            && (s.segments.iter().any(|g| !g.stopped && g.pinned < g.len())
                || (!s.stopped_short && s.size() < s.target))
    }

    /// The next step to pin: (segment id, its pin job). Adds a segment for what the target
    /// asks beyond the reserve's size first. `None` when there is nothing to pin, or no
    /// context yet.
    pub(crate) fn next_step(&self) -> Option<(u64, PinJob)> {
        let mut s = self.state.lock();
        let ctx = s.ctx?;
        if !s.stopped_short && s.size() < s.target {
            let len = (s.target - s.size()) as usize;
            // Reserving is one mmap with no memory behind it, no driver call.
            match PinnedBuffer::reserve(&self.driver, ctx, len) {
                Ok(buf) => {
                    let id = s.next_id;
                    s.next_id += 1;
                    s.segments.push(Segment {
                        id,
                        buf,
                        pinned: 0,
                        stopped: false,
                        used: vec![false; len / UNIT],
                    });
                    tracing::info!(bytes = len, "backup reserve: pinning a segment");
                }
                Err(e) => {
                    s.stopped_short = true;
                    let size = s.size();
                    tracing::warn!(
                        asked = s.target,
                        kept = size,
                        error = %e,
                        "backup reserve: cannot reserve {} of address space; the reserve keeps {}",
                        human_bytes(len as u64),
                        human_bytes(size)
                    );
                }
            }
        }
        s.segments
            .iter()
            .find(|g| !g.stopped && g.pinned < g.len())
            .and_then(|g| Some((g.id, g.buf.job()?)))
    }

    /// Pins the next step of segment `id` with `job` (outside the lock), and records the
    /// outcome: a failed step stops the reserve where it is.
    pub(crate) fn pin_step(&self, id: u64, job: PinJob) {
        let r = job.step();
        drop(job);
        let mut s = self.state.lock();
        let target = s.target;
        let size = s.size();
        let Some(g) = s.segments.iter_mut().find(|g| g.id == id) else {
            return;
        };
        g.pinned = g.buf.pinned_bytes();
        match r {
            Ok(Step::More) => {}
            Ok(Step::Done) => tracing::info!(bytes = g.len(), "backup reserve: segment pinned"),
            Ok(Step::Released) => g.stopped = true,
            Err(e) => Self::stop(&mut s, id, target, size, e),
        }
    }

    /// Stops segment `id` at what it pinned, after a failed step.
    fn stop(s: &mut State, id: u64, target: u64, size: u64, e: DriverError) {
        s.stopped_short = true;
        let Some(g) = s.segments.iter_mut().find(|g| g.id == id) else {
            return;
        };
        g.stopped = true;
        let pinned: u64 = s.segments.iter().map(|g| g.pinned as u64).sum();
        tracing::warn!(
            asked = target,
            pinned,
            error = %e,
            "backup reserve: pinning stopped at {} of {} ({}); the reserve keeps what is pinned, and backups beyond it are prepared as without a reserve",
            human_bytes(pinned),
            human_bytes(target.max(size)),
            e
        );
    }

    /// A pinned buffer of `len` bytes carved from the pinned part of the reserve, if a run of
    /// free units that large is pinned now (never waits).
    pub(crate) fn carve(self: &Arc<Self>, len: usize) -> Option<PinnedBuffer> {
        if len == 0 {
            return None;
        }
        let units = len.div_ceil(UNIT);
        let mut s = self.state.lock();
        let ctx = s.ctx?;
        let (g, first) = s
            .segments
            .iter_mut()
            .find_map(|g| g.find(units).map(|first| (g, first)))?;
        g.used[first..first + units].fill(true);
        let off = first * UNIT;
        // SAFETY: the units lie in the segment's pinned part (`find`), registered in steps of
        // PIN_CHUNK from the segment's start; they are marked used, so nothing else gets them
        // until the buffer gives them back, and the segment is never released while in use.
        let ptr = unsafe { g.buf.as_ptr().add(off) };
        let lender: Arc<dyn Lender> = self.clone();
        // SAFETY: as above.
        Some(unsafe { PinnedBuffer::lent(&self.driver, ctx, ptr, len, off, lender) })
    }

    pub(crate) fn figures(&self) -> ReserveFigures {
        let s = self.state.lock();
        ReserveFigures {
            target: s.target,
            pinned: s.segments.iter().map(|g| g.pinned as u64).sum(),
            used: s
                .segments
                .iter()
                .map(|g| (g.used.iter().filter(|u| **u).count() * UNIT) as u64)
                .sum(),
        }
    }
}

impl Lender for Reserve {
    fn give_back(&self, ptr: *mut u8, len: usize) {
        let mut s = self.state.lock();
        let at = ptr as usize;
        let Some(g) = s.segments.iter_mut().find(|g| {
            let base = g.buf.as_ptr() as usize;
            (base..base + g.len()).contains(&at)
        }) else {
            tracing::error!(
                ptr = format_args!("{at:#x}"),
                bytes = len,
                "backup reserve: a buffer given back is not the reserve's"
            );
            return;
        };
        let first = (at - g.buf.as_ptr() as usize) / UNIT;
        g.used[first..first + len.div_ceil(UNIT)].fill(false);
    }
}

/// `bytes` rounded up to the unit.
fn round_up(bytes: u64) -> u64 {
    bytes.div_ceil(UNIT as u64).saturating_mul(UNIT as u64)
}
