//! The scenario harness itself (`common`): a rank that stops answering fails the test within
//! the job's answer wait, naming the command and the process, and is killed with the job; it
//! never blocks the test.

mod common;

use std::time::{Duration, Instant};

use common::{Dirs, Job};

#[test]
fn a_rank_that_does_not_answer_fails_the_test_in_time_naming_the_command_and_the_rank() {
    let dirs = Dirs::new();
    let mut job = Job::start(2, 71, &dirs.fake, &dirs.rt, 60_000);
    assert!(job.one(1, "used").starts_with("ok "));
    let pid = job.pid(1);
    job.signal(1, libc::SIGSTOP);
    job.answer_wait = Duration::from_millis(500);
    let t = Instant::now();
    let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job.on(&[0, 1], "used")))
        .expect_err("a stopped rank cannot answer");
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    let message = failed.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        message.contains(&format!(
            "rank 1 (pid {pid}) did not answer \"used\" within 500ms"
        )),
        "{message}"
    );
    drop(job);
    // The stopped rank was killed and reaped with the job.
    // SAFETY: signal 0 only checks whether the pid exists.
    let gone = unsafe { libc::kill(pid as libc::pid_t, 0) } != 0;
    assert!(gone, "rank 1 (pid {pid}) outlived its job");
}
