//! The log of the threads that serve other processes (the server's reading thread and
//! workers, the control thread): nothing there writes to stderr. Lines go to a bounded queue
//! ([`note`]) read by one logging thread, which writes at most one line per [`LOG_INTERVAL`]
//! and counts the rest (and those dropped because the queue was full). A full stderr (a pipe
//! nobody reads) stops only that thread.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender};
use std::time::{Duration, Instant};

/// At most one line of the log per interval.
const LOG_INTERVAL: Duration = Duration::from_secs(1);
/// Lines waiting for the logging thread; more are counted, not kept.
const LOG_QUEUE: usize = 64;

/// Lines dropped because the logging thread's queue was full (counted in its next line).
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// Hands `line` to the logging thread without ever waiting: when its queue is full (stderr
/// does not take lines), the line is counted and dropped. Used by the server's threads, the
/// handlers they run and the control thread, which must never block on stderr.
pub fn note(line: String) {
    static QUEUE: OnceLock<Option<SyncSender<String>>> = OnceLock::new();
    let tx = QUEUE.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<String>(LOG_QUEUE);
        std::thread::Builder::new()
            .name("memsaver-log".into())
            .spawn(move || write_log(&rx))
            .ok()
            .map(|_| tx)
    });
    let sent = tx.as_ref().is_some_and(|tx| tx.try_send(line).is_ok());
    if !sent {
        DROPPED.fetch_add(1, Ordering::Relaxed);
    }
}

/// The logging thread: at most one line per [`LOG_INTERVAL`].
fn write_log(rx: &Receiver<String>) {
    let mut quiet = Quiet::new(LOG_INTERVAL);
    loop {
        let got = match quiet.due() {
            Some(at) => rx.recv_timeout(at.saturating_duration_since(Instant::now())),
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        let now = Instant::now();
        let dropped = DROPPED.swap(0, Ordering::Relaxed);
        let line = match got {
            Ok(what) => quiet.line(now, what, dropped),
            Err(RecvTimeoutError::Timeout) => quiet.flush(now, dropped),
            Err(RecvTimeoutError::Disconnected) => return,
        };
        if let Some(line) = line {
            tracing::warn!("memsaver: {line}");
        }
    }
}

/// Rate limiting of the server's log: the first line at once, then at most one line per
/// interval, which says how many were held back meanwhile.
struct Quiet {
    interval: Duration,
    /// When the next line may be written.
    next: Option<Instant>,
    /// Lines held back since the last one written, and the last of them.
    held: u64,
    last: Option<String>,
}

impl Quiet {
    fn new(interval: Duration) -> Self {
        Self {
            interval,
            next: None,
            held: 0,
            last: None,
        }
    }

    /// When lines held back are due to be counted in a line of their own.
    fn due(&self) -> Option<Instant> {
        self.next.filter(|_| self.held > 0)
    }

    /// `what` happened at `now` (and `dropped` lines were lost before it): the line to write
    /// now, if one is due.
    fn line(&mut self, now: Instant, what: String, dropped: u64) -> Option<String> {
        self.held += dropped;
        if self.next.is_some_and(|n| now < n) {
            self.held += 1;
            self.last = Some(what);
            return None;
        }
        self.next = Some(now + self.interval);
        let held = std::mem::take(&mut self.held);
        self.last = None;
        Some(if held == 0 {
            what
        } else {
            format!("{what} (and {held} more line(s) of the peer server not shown one by one)")
        })
    }

    /// At `now`, with `dropped` more lines lost: the line counting what was held back, if its
    /// time came.
    fn flush(&mut self, now: Instant, dropped: u64) -> Option<String> {
        self.held += dropped;
        if self.held == 0 || self.next.is_some_and(|n| now < n) {
            return None;
        }
        self.next = Some(now + self.interval);
        let held = std::mem::take(&mut self.held);
        let last = self.last.take().unwrap_or_default();
        Some(format!(
            "{held} more line(s) of the peer server in the last {} s, not shown one by one; \
             the last: {last}",
            self.interval.as_secs_f64()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_says_one_line_per_interval_and_counts_the_rest() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut q = Quiet::new(s);
        assert_eq!(q.line(t0, "a".into(), 0).as_deref(), Some("a"));
        assert_eq!(q.due(), None);
        for i in 0..10 {
            assert_eq!(q.line(t0 + s / 20 * i, format!("b{i}"), 0), None);
        }
        assert_eq!(q.due(), Some(t0 + s));
        assert_eq!(q.flush(t0 + s / 2, 5), None, "not before the interval");
        let line = q.flush(t0 + s, 0).unwrap();
        assert!(
            line.starts_with("15 more line(s)") && line.ends_with("the last: b9"),
            "{line}"
        );
        assert_eq!(q.due(), None);
        // Within the next interval a line is held back, then told with the next one.
        assert_eq!(q.line(t0 + s + s / 2, "c".into(), 0), None);
        let line = q.line(t0 + 3 * s, "d".into(), 2).unwrap();
        assert!(line.starts_with("d (and 3 more"), "{line}");
    }
}
