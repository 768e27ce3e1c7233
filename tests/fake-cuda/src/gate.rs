//! Calls held at their entry (`fakecuda_hold_map`): a test that must order another thread's
//! work against one driver call (a `malloc` mapping its memory while a pause of its tag runs)
//! holds that call at its entry, waits until a call is held there (`fakecuda_wait_map_held`),
//! does its work, then lets it go. Nothing is held while waiting; a hold ends by itself after
//! its deadline, so a regression fails instead of hanging.

use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// One kind of call that can be held.
pub struct Gate {
    /// Until when calls are held (`None`: not held), and how many wait now.
    state: Mutex<(Option<Instant>, u64)>,
    changed: Condvar,
}

impl Gate {
    pub const fn new() -> Self {
        Self {
            state: Mutex::new((None, 0)),
            changed: Condvar::new(),
        }
    }

    /// Holds calls for at most `ms` from now; 0 lets every held call go.
    pub fn hold(&self, ms: u64) {
        self.state.lock().0 = (ms > 0).then(|| Instant::now() + Duration::from_millis(ms));
        self.changed.notify_all();
    }

    /// A call's entry: waits while calls are held.
    pub fn enter(&self) {
        let mut s = self.state.lock();
        if s.0.is_none() {
            return;
        }
        s.1 += 1;
        self.changed.notify_all();
        while let Some(until) = s.0 {
            if Instant::now() >= until {
                break;
            }
            self.changed.wait_until(&mut s, until);
        }
        s.1 -= 1;
    }

    /// Waits until at least `n` calls are held, or `ms` pass; returns how many are.
    pub fn wait_held(&self, n: u64, ms: u64) -> u64 {
        let until = Instant::now() + Duration::from_millis(ms);
        let mut s = self.state.lock();
        while s.1 < n && !self.changed.wait_until(&mut s, until).timed_out() {}
        s.1
    }
}

/// `cuMemMap` calls.
pub static MAP: Gate = Gate::new();
