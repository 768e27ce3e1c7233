//! `wire-client`: a process of another pid namespace (run under `unshare --pid` without
//! `--mount-proc`, so that `/proc` still shows the parent's namespace) that asks an owner's
//! memsaver server for what it must not get.
//!
//! `wire-client <socket> <group> <buffers>` sends, on one connection each, a control `Stats`
//! request and an `Import` request for the owner's first `<buffers>` virtual handles (guessed:
//! `VH_BASE | 1..`, key 0), first naming itself as its own pid namespace shows it, then with
//! the pid and start time the owner's namespace shows for it (read from the parent's `/proc`,
//! as any process there can). It prints one JSON object per request: `as` (`self` or
//! `outer`), `request`, the `pid` and `start` it claimed, and the `replies` (kind, text) and
//! `fds` that came back.

use std::path::Path;
use std::time::Duration;

use memsaver_scenarios::wire::{self, FDS, Identity, STATS, VH_BASE};

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let (sock, group, buffers): (&Path, i64, u64) = (
        Path::new(&a[1]),
        a[2].parse().expect("a group"),
        a[3].parse().expect("a count"),
    );
    let to = Identity::of_socket(sock);
    let outer = Identity::this_process(7);
    let inner = Identity {
        pid: std::process::id(),
        ..outer
    };
    let items: Vec<(u64, u64, u64)> = (1..=buffers).map(|n| (VH_BASE | n, 0, 0)).collect();
    for (who, from) in [("self", inner), ("outer", outer)] {
        for (what, body) in [
            ("stats", wire::head(STATS, from, to, group)),
            ("fds", wire::items_request(FDS, from, to, group, &items)),
        ] {
            let r = wire::ask(sock, &body, Duration::from_secs(60)).unwrap_or_else(|e| {
                eprintln!("wire-client: {what} as {who}: {e}");
                std::process::exit(2)
            });
            let replies: Vec<serde_json::Value> = r
                .frames
                .iter()
                .map(|f| serde_json::json!({"kind": f.kind, "text": f.text}))
                .collect();
            println!(
                "{}",
                serde_json::json!({
                    "as": who, "request": what, "pid": from.pid, "start": from.start,
                    "replies": replies, "fds": r.fds,
                })
            );
        }
    }
}
