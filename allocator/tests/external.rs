//! External tags pause, resume and report with the table's tags.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use common::*;
use memsaver_allocator::{DeviceUsage, Error, ExternalTag, Policy, Report, Result, Usage};

#[derive(Default)]
struct Mock {
    paused: AtomicBool,
    pauses: AtomicU32,
    resumes: AtomicU32,
}

impl ExternalTag for Mock {
    fn pause(&self) -> Result<Report> {
        self.pauses.fetch_add(1, Ordering::SeqCst);
        self.paused.store(true, Ordering::SeqCst);
        Ok(Report {
            tags: vec!["mock".into()],
            allocations: 2,
            bytes: 4 << 20,
            ..Default::default()
        })
    }
    fn resume(&self) -> Result<Report> {
        self.resumes.fetch_add(1, Ordering::SeqCst);
        self.paused.store(false, Ordering::SeqCst);
        Ok(Report {
            tags: vec!["mock".into()],
            allocations: 2,
            bytes: 4 << 20,
            ..Default::default()
        })
    }
    fn paused(&self) -> bool {
        self.paused.load(Ordering::SeqCst)
    }
    fn usage(&self) -> Vec<DeviceUsage> {
        let resident = if self.paused() { 0 } else { 4 << 20 };
        let usage = Usage {
            allocations: 2,
            reserved_bytes: 4 << 20,
            resident_bytes: resident,
            backup_bytes: 0,
            ..Default::default()
        };
        vec![DeviceUsage { device: 0, usage }]
    }
}

#[test]
fn external_tags_join_pause_resume_and_stats() {
    let a = allocator();
    let mock = Arc::new(Mock::default());
    a.register_external("mock", mock.clone()).unwrap();
    let p = a.malloc(2 * MIB, 0, "weights", Policy::Cpu).unwrap();

    let r = a.pause(&["weights", "mock"]).unwrap();
    assert_eq!(
        (r.allocations, r.bytes),
        (3, 6 << 20),
        "one report for both kinds"
    );
    assert_eq!(mock.pauses.load(Ordering::SeqCst), 1);
    let s = a.stats();
    let m = s.tag("mock").unwrap();
    assert!(m.paused && m.usage.resident_bytes == 0 && m.usage.reserved_bytes == 4 << 20);
    assert_eq!(s.total.reserved_bytes, (4 << 20) + (2 << 20));
    assert!(a.is_paused("mock"));

    a.resume(&[]).unwrap();
    assert_eq!(
        mock.resumes.load(Ordering::SeqCst),
        1,
        "resume of all tags includes external ones"
    );
    assert!(!a.stats().tag("mock").unwrap().paused);

    let e = a.malloc(MIB, 0, "mock", Policy::Discard).unwrap_err();
    assert!(e.to_string().contains("reserved"), "{e}");
    let e = a.pause(&["nope"]).unwrap_err();
    assert!(
        matches!(&e, Error::UnknownTag { known, .. } if known.contains(&"mock".to_string())),
        "{e}"
    );
    assert_eq!(
        mock.pauses.load(Ordering::SeqCst),
        1,
        "an invalid call pauses nothing"
    );
    a.free(p).unwrap();
}
