//! Talking to several peers under one deadline.
//!
//! Every exchange with a peer can block: a peer that is stopped (SIGSTOP, a debugger) or hung
//! accepts the connection and never answers, and the client's exchanges
//! ([`crate::client`]) wait for up to the owner's wait plus [`crate::client::IO_TIMEOUT`] each.
//! So a caller that must hear from several peers (a pause or resume of memory shared with
//! them) talks to each peer on a thread of its own ([`PerPeer::start`]) and waits for them all
//! until one deadline ([`PerPeer::finish`]); a thread still waiting then is left to finish on
//! its own, and undoes what it did if that matters (the `late` callback: an import served too
//! late is reported released). Exchanges of this process with one peer go one at a time
//! ([`Lanes`]), so a late undo always reaches the peer before the next request.
//!
//! While it waits, the caller says once a second whom it waits for ([`Progress`]).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Peers this process is exchanging messages with right now, each on one thread.
struct Lanes {
    /// Guards the set of busy peers.
    busy: parking_lot::Mutex<std::collections::HashSet<u32>>,
    freed: parking_lot::Condvar,
}

/// This process's lanes.
static LANES: std::sync::LazyLock<Lanes> = std::sync::LazyLock::new(|| Lanes {
    busy: parking_lot::Mutex::new(Default::default()),
    freed: parking_lot::Condvar::new(),
});

impl Lanes {
    /// Runs `f` once no other exchange with `peer` is under way, or returns `None` if one
    /// still is at `deadline`.
    fn with<T>(&self, peer: u32, deadline: Instant, f: impl FnOnce() -> T) -> Option<T> {
        {
            let mut busy = self.busy.lock();
            while busy.contains(&peer) {
                if self.freed.wait_until(&mut busy, deadline).timed_out() && busy.contains(&peer) {
                    return None;
                }
            }
            busy.insert(peer);
        }
        // Freed however `f` ends.
        let _free = LaneTaken(self, peer);
        Some(f())
    }
}

struct LaneTaken<'a>(&'a Lanes, u32);

impl Drop for LaneTaken<'_> {
    fn drop(&mut self) {
        self.0.busy.lock().remove(&self.1);
        self.0.freed.notify_all();
    }
}

/// Results of per-peer threads, collected until a deadline.
struct Collected<T> {
    /// Set at the deadline: a thread finishing later undoes its work instead of storing it.
    abandoned: bool,
    done: BTreeMap<u32, T>,
}

/// Work running on one thread per peer (see the module documentation).
pub struct PerPeer<T> {
    /// The results (the mutex guards them) and a condvar notified as each comes in.
    shared: std::sync::Arc<(parking_lot::Mutex<Collected<T>>, parking_lot::Condvar)>,
    peers: Vec<u32>,
    /// Peers whose thread could not be started.
    unstarted: BTreeMap<u32, String>,
    /// The option that sets the deadline, named in progress lines.
    setting: &'static str,
}

/// What became of the exchange with one peer.
pub enum Outcome<T> {
    Done(T),
    /// No answer by the deadline (the exchange goes on; see the module documentation).
    NoAnswer,
    /// The thread could not be started.
    NotStarted(String),
}

impl<T: Send + 'static> PerPeer<T> {
    /// Runs `work(peer, input)` for every peer of `inputs` at once, each on a thread named
    /// `memsaver-<name>`; `late(peer, result)` instead of storing a result that comes after the
    /// deadline, which the option `setting` sets.
    pub fn start<I, W, L>(
        name: &str,
        setting: &'static str,
        inputs: BTreeMap<u32, I>,
        deadline: Instant,
        work: W,
        late: L,
    ) -> Self
    where
        I: Send + 'static,
        W: FnOnce(u32, I) -> T + Clone + Send + 'static,
        L: FnOnce(u32, T) + Clone + Send + 'static,
    {
        let shared = std::sync::Arc::new((
            parking_lot::Mutex::new(Collected {
                abandoned: false,
                done: BTreeMap::new(),
            }),
            parking_lot::Condvar::new(),
        ));
        let mut out = PerPeer {
            shared,
            peers: inputs.keys().copied().collect(),
            unstarted: BTreeMap::new(),
            setting,
        };
        for (peer, input) in inputs {
            let (shared, work, late) = (out.shared.clone(), work.clone(), late.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("memsaver-{name}"))
                .spawn(move || {
                    LANES.with(peer, deadline, || {
                        let r = work(peer, input);
                        let mut c = shared.0.lock();
                        if c.abandoned {
                            drop(c);
                            late(peer, r);
                        } else {
                            c.done.insert(peer, r);
                            shared.1.notify_all();
                        }
                    })
                });
            if let Err(e) = spawned {
                out.unstarted
                    .insert(peer, format!("cannot start a thread: {e}"));
            }
        }
        out
    }

    /// Waits until every peer's thread has its result or `deadline` has passed, logging who
    /// it still waits for (`waiting`: what for, `group`) once a second after the first.
    pub fn finish(self, deadline: Instant, waiting: &str, group: i64) -> BTreeMap<u32, Outcome<T>> {
        let (lock, cv) = &*self.shared;
        let mut c = lock.lock();
        let started = self.peers.len() - self.unstarted.len();
        let mut progress = Progress::new(deadline, self.setting);
        while c.done.len() < started && Instant::now() < deadline {
            cv.wait_until(&mut c, progress.next());
            if c.done.len() < started {
                let pending: Vec<String> = self
                    .peers
                    .iter()
                    .filter(|p| !c.done.contains_key(p) && !self.unstarted.contains_key(p))
                    .map(|p| format!("process {p} (group {group})"))
                    .collect();
                progress.say(|| format!("{waiting}: {}", listed(&pending)));
            }
        }
        c.abandoned = true;
        let mut done = std::mem::take(&mut c.done);
        drop(c);
        let mut unstarted = self.unstarted;
        self.peers
            .into_iter()
            .map(|p| {
                let o = match (done.remove(&p), unstarted.remove(&p)) {
                    (Some(r), _) => Outcome::Done(r),
                    (None, Some(e)) => Outcome::NotStarted(e),
                    (None, None) => Outcome::NoAnswer,
                };
                (p, o)
            })
            .collect()
    }
}

/// Progress lines of a wait for peers: visible by default (warn), the first after a second of
/// waiting, then at most one a second, each saying how long the wait may still last and which
/// option sets the deadline.
pub struct Progress {
    deadline: Instant,
    next: Instant,
    setting: &'static str,
}

impl Progress {
    /// Progress of a wait until `deadline`, which the option `setting` sets.
    pub fn new(deadline: Instant, setting: &'static str) -> Self {
        Self {
            deadline,
            next: Instant::now() + Duration::from_secs(1),
            setting,
        }
    }

    /// Logs `what()` if a line is due.
    pub fn say(&mut self, what: impl FnOnce() -> String) {
        let now = Instant::now();
        if now < self.next {
            return;
        }
        self.next = now + Duration::from_secs(1);
        let left = self.deadline.saturating_duration_since(now).as_secs_f64();
        tracing::warn!(
            left_s = left,
            "memsaver: {}; giving up in {left:.1} s ({})",
            what(),
            self.setting
        );
    }

    /// When the next line is due (a waiter wakes up then).
    pub fn next(&self) -> Instant {
        self.next.min(self.deadline)
    }
}

/// The first items of a list, and how many more.
pub fn listed(items: &[String]) -> String {
    const SHOWN: usize = 8;
    let mut s = items[..items.len().min(SHOWN)].join("; ");
    if items.len() > SHOWN {
        s.push_str(&format!("; and {} more", items.len() - SHOWN));
    }
    s
}
