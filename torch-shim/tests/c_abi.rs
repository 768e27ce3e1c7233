//! The C ABI of libmemsaver.so over the process-wide allocator (fake driver, via
//! MEMSAVER_CUDA_LIB as set by `make test`).

use std::ffi::c_void;

use memsaver::*;

mod common;
use common::{c, last_error, stats, tag};

#[test]
fn pause_resume_and_stats_through_the_c_abi() {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointer and C strings.
    let rc = unsafe {
        memsaver_malloc(
            &mut p,
            3 << 20,
            0,
            c("abi_weights").as_ptr(),
            c("cpu").as_ptr(),
        )
    };
    assert_eq!(rc, 0, "{}", last_error());
    // SAFETY: on the fake driver device memory is host memory mapped read-write.
    unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0xAB, 3 << 20) };

    // SAFETY: C string argument.
    let rc = unsafe { memsaver_pause(c("abi_weights").as_ptr()) };
    assert_eq!(rc, 0, "{}", last_error());
    let s = stats();
    assert_eq!(tag(&s, "abi_weights")["paused"], true);
    assert_eq!(tag(&s, "abi_weights")["resident_bytes"], 0);
    assert_eq!(tag(&s, "abi_weights")["backup_bytes"], 4 << 20);

    // SAFETY: C string argument.
    let rc = unsafe { memsaver_resume(c(" abi_weights ").as_ptr()) };
    assert_eq!(rc, 0, "{}", last_error());
    // SAFETY: resident again, at the same address.
    let bytes = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), 3 << 20) };
    assert!(bytes.iter().all(|b| *b == 0xAB));
    assert_eq!(memsaver_free(p), 0);
}

#[test]
fn errors_return_codes_and_messages() {
    // SAFETY: C string argument.
    let rc = unsafe { memsaver_pause(c("no_such_tag").as_ptr()) };
    assert_eq!(rc, Status::UnknownTag as i32);
    assert!(
        last_error().contains("unknown tag 'no_such_tag'"),
        "{}",
        last_error()
    );

    assert_eq!(
        memsaver_free(0x1234 as *mut c_void),
        Status::UnknownPointer as i32
    );
    assert!(last_error().contains("not allocated by memsaver"));

    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointer and C strings.
    let rc = unsafe { memsaver_malloc(&mut p, 1 << 20, 0, c("x").as_ptr(), c("tape").as_ptr()) };
    assert_eq!(rc, Status::InvalidArgument as i32);
    assert!(
        last_error()
            .contains("unknown backup policy 'tape'; expected 'discard', 'cpu', 'mmap' or 'disk'"),
        "{}",
        last_error()
    );
    // SAFETY: NULL tag is rejected, not dereferenced.
    let rc = unsafe { memsaver_malloc(&mut p, 1 << 20, 0, std::ptr::null(), std::ptr::null()) };
    assert_eq!(rc, Status::InvalidArgument as i32);
    assert!(last_error().contains("tag is NULL"));

    assert_eq!(memsaver_region_exit(), Status::InvalidArgument as i32);
    assert!(last_error().contains("without a matching"));
}

#[test]
fn regions_nest_per_thread() {
    // SAFETY: C string arguments.
    unsafe {
        assert_eq!(
            memsaver_region_enter(c("outer").as_ptr(), c("cpu").as_ptr()),
            0
        );
        assert_eq!(
            memsaver_region_enter(c("inner").as_ptr(), std::ptr::null()),
            0
        );
    }
    assert_eq!(
        region::current(),
        Some(("inner".into(), memsaver_allocator::Policy::Discard))
    );
    std::thread::spawn(|| assert_eq!(region::current(), None))
        .join()
        .unwrap();
    assert_eq!(memsaver_region_exit(), 0);
    assert_eq!(
        region::current(),
        Some(("outer".into(), memsaver_allocator::Policy::Cpu))
    );
    assert_eq!(memsaver_region_exit(), 0);
    assert_eq!(region::current(), None);
    // Entering a region registers its tag.
    assert!(tag(&stats(), "outer")["allocations"] == 0);
}

#[test]
fn cuda_malloc_hook_tags_allocations_inside_regions_only() {
    let mut p: *mut c_void = std::ptr::null_mut();
    // Outside a region the call is forwarded to libcudart, which this test process lacks.
    // SAFETY: valid out-pointer.
    let rc = unsafe { hooks::cudaMalloc(&mut p, 2 << 20) };
    assert_eq!(
        rc, 3,
        "forwarded (cudaErrorInitializationError without libcudart)"
    );

    // SAFETY: C string arguments; valid out-pointer.
    unsafe {
        assert_eq!(
            memsaver_region_enter(c("hook_tag").as_ptr(), c("cpu").as_ptr()),
            0
        );
        assert_eq!(hooks::cudaMalloc(&mut p, 5 << 20), 0, "{}", last_error());
    }
    assert!(!p.is_null());
    let s = stats();
    assert_eq!(tag(&s, "hook_tag")["allocations"], 1);
    assert_eq!(tag(&s, "hook_tag")["reserved_bytes"], 6 << 20);

    // A disabled scope inside the region forwards again.
    assert_eq!(memsaver_region_disable(), 0);
    let mut q: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    assert_eq!(unsafe { hooks::cudaMalloc(&mut q, 2 << 20) }, 3);
    assert_eq!(memsaver_region_exit(), 0);
    assert_eq!(memsaver_region_exit(), 0);

    // cudaFree of memsaver memory is handled by memsaver, also while paused.
    // SAFETY: C string argument.
    assert_eq!(unsafe { memsaver_pause(c("hook_tag").as_ptr()) }, 0);
    // SAFETY: a pointer returned by the hook.
    assert_eq!(unsafe { hooks::cudaFree(p) }, 0);
    assert_eq!(tag(&stats(), "hook_tag")["allocations"], 0);
    assert_eq!(tag(&stats(), "hook_tag")["backup_bytes"], 0);
}

#[test]
fn pluggable_allocator_entry_points() {
    let p = hooks::memsaver_torch_malloc(1 << 20, 0, std::ptr::null_mut());
    assert!(
        p.is_null(),
        "outside a region the pluggable allocator refuses"
    );
    assert!(
        last_error().contains("outside a memsaver region"),
        "{}",
        last_error()
    );

    // SAFETY: C string arguments.
    unsafe {
        assert_eq!(
            memsaver_region_enter(c("pool_tag").as_ptr(), std::ptr::null()),
            0
        )
    };
    let p = hooks::memsaver_torch_malloc(3 << 20, 1, std::ptr::null_mut());
    assert_eq!(memsaver_region_exit(), 0);
    assert!(!p.is_null(), "{}", last_error());
    let s = stats();
    let t = tag(&s, "pool_tag");
    assert_eq!(
        t["devices"][0]["device"], 1,
        "allocated on the device torch asked for"
    );
    hooks::memsaver_torch_free(p, 3 << 20, 1, std::ptr::null_mut());
    assert_eq!(tag(&stats(), "pool_tag")["allocations"], 0);
}

#[test]
fn backup_pointer_through_the_c_abi() {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointer and C strings.
    let rc =
        unsafe { memsaver_malloc(&mut p, 2 << 20, 0, c("abi_bp").as_ptr(), c("mmap").as_ptr()) };
    assert_eq!(rc, 0, "{}", last_error());
    // SAFETY: resident fake-driver memory.
    unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0x5A, 2 << 20) };
    let mut out: *mut c_void = std::ptr::dangling_mut::<c_void>();
    // SAFETY: valid out-pointer.
    let rc = unsafe { memsaver_backup_pointer(p as u64, 16, &mut out) };
    assert_eq!(rc, 0);
    assert!(out.is_null(), "never paused: no backup, not an error");
    // SAFETY: C string argument.
    let rc = unsafe { memsaver_pause(c("abi_bp").as_ptr()) };
    assert_eq!(rc, 0, "{}", last_error());
    // SAFETY: valid out-pointers.
    unsafe {
        assert_eq!(memsaver_backup_pointer(p as u64, 2 << 20, &mut out), 0);
        assert!(!out.is_null());
        let base = out.cast::<u8>();
        assert_eq!(
            *base.add(12345),
            0x5A,
            "the backup holds the paused contents"
        );
        assert_eq!(memsaver_backup_pointer(p as u64 + 4096, 8, &mut out), 0);
        assert_eq!(
            out.cast::<u8>(),
            base.add(4096),
            "interior pointers are offset"
        );
        assert_eq!(
            memsaver_backup_pointer(p as u64 + 4096, 2 << 20, &mut out),
            0
        );
        assert!(out.is_null(), "range past the end");
        assert_eq!(
            memsaver_backup_pointer(p as u64, 1, std::ptr::null_mut()),
            Status::InvalidArgument as i32
        );
    }
    assert_eq!(memsaver_free(p), 0);
}

#[test]
fn disk_dir_through_the_c_abi() {
    let base = std::env::temp_dir().join(format!("memsaver-abi-disk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let dir = base.join("d");
    let cdir = c(dir.to_str().unwrap());
    // SAFETY: C string argument.
    let rc = unsafe { memsaver_set_disk_dir(cdir.as_ptr()) };
    assert_eq!(rc, 0, "{}", last_error());
    assert!(dir.is_dir(), "created");
    let file = base.join("f");
    std::fs::write(&file, b"x").unwrap();
    let cfile = c(file.to_str().unwrap());
    // SAFETY: C string argument.
    let rc = unsafe { memsaver_set_disk_dir(cfile.as_ptr()) };
    assert_eq!(rc, Status::InvalidArgument as i32);
    assert!(last_error().contains("not a directory"), "{}", last_error());

    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointer and C strings.
    let rc = unsafe {
        memsaver_malloc(
            &mut p,
            2 << 20,
            0,
            c("abi_disk").as_ptr(),
            c("disk").as_ptr(),
        )
    };
    assert_eq!(rc, 0, "{}", last_error());
    // SAFETY: resident fake-driver memory.
    unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0x3C, 2 << 20) };
    // SAFETY: C string arguments.
    unsafe {
        assert_eq!(
            memsaver_pause(c("abi_disk").as_ptr()),
            0,
            "{}",
            last_error()
        );
        assert_eq!(tag(&stats(), "abi_disk")["disk_backup_bytes"], 2 << 20);
        assert_eq!(
            memsaver_resume(c("abi_disk").as_ptr()),
            0,
            "{}",
            last_error()
        );
    }
    // SAFETY: resident again.
    let bytes = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), 2 << 20) };
    assert!(bytes.iter().all(|b| *b == 0x3C));
    assert_eq!(memsaver_free(p), 0);
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "free removes the file"
    );
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn region_current_json_reports_the_thread_region() {
    fn current() -> serde_json::Value {
        let mut buf = vec![0u8; 256];
        let mut needed = 0usize;
        // SAFETY: `buf` has 256 bytes.
        let rc = unsafe {
            memsaver_region_current_json(buf.as_mut_ptr().cast(), buf.len(), &mut needed)
        };
        assert_eq!(rc, 0, "{}", last_error());
        serde_json::from_slice(&buf[..needed - 1]).unwrap()
    }
    let none = current();
    assert_eq!(
        (none["tag"].is_null(), none["depth"].as_u64()),
        (true, Some(0))
    );
    assert_eq!(
        none["process"], false,
        "no MEMSAVER_PROCESS_TAG in this test process"
    );
    // SAFETY: C string arguments.
    unsafe {
        assert_eq!(
            memsaver_region_enter(c("abi_cur").as_ptr(), c("mmap").as_ptr()),
            0
        )
    };
    let r = current();
    assert_eq!(
        (r["tag"].as_str(), r["policy"].as_str()),
        (Some("abi_cur"), Some("mmap"))
    );
    assert_eq!(memsaver_region_disable(), 0);
    let d = current();
    assert_eq!(
        (d["disabled"].as_bool(), d["depth"].as_u64()),
        (Some(true), Some(2))
    );
    assert!(d["tag"].is_null());
    assert_eq!(memsaver_region_exit(), 0);
    assert_eq!(memsaver_region_exit(), 0);
}

#[test]
fn empty_blank_and_separator_only_tag_lists_are_refused_not_read_as_every_tag() {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointer and C strings.
    let rc = unsafe {
        memsaver_malloc(
            &mut p,
            2 << 20,
            0,
            c("abi_blank").as_ptr(),
            c("discard").as_ptr(),
        )
    };
    assert_eq!(rc, 0, "{}", last_error());
    for list in ["", " ", ",", " , ", "abi_blank,,abi_blank", "abi_blank,"] {
        for f in [memsaver_pause, memsaver_resume] {
            // SAFETY: C string argument.
            let rc = unsafe { f(c(list).as_ptr()) };
            assert_eq!(rc, Status::InvalidArgument as i32, "{list:?}");
            assert!(
                last_error().contains("empty tag"),
                "{list:?}: {}",
                last_error()
            );
        }
        assert_eq!(
            tag(&stats(), "abi_blank")["paused"],
            false,
            "{list:?} paused something"
        );
    }
    // A malformed name is named as such, not as an unknown tag.
    // SAFETY: C string argument.
    let rc = unsafe { memsaver_pause(c("abi blank").as_ptr()) };
    assert_eq!(rc, Status::InvalidArgument as i32);
    assert!(last_error().contains("invalid tag"), "{}", last_error());
    assert_eq!(memsaver_free(p), 0);
}

/// The JSON text of `memsaver_allocations_json(tags)`, or the status code.
fn allocations_json(tags: Option<&str>) -> Result<serde_json::Value, i32> {
    let t = tags.map(c);
    let p = t.as_ref().map_or(std::ptr::null(), |t| t.as_ptr());
    let mut needed = 0usize;
    // SAFETY: NULL buffer of length 0 asks for the size; valid out-pointer.
    let rc = unsafe { memsaver_allocations_json(p, std::ptr::null_mut(), 0, &mut needed) };
    if rc != Status::BufferTooSmall as i32 {
        return Err(rc);
    }
    let mut buf = vec![0u8; needed];
    // SAFETY: a buffer of `needed` bytes.
    let rc = unsafe { memsaver_allocations_json(p, buf.as_mut_ptr().cast(), needed, &mut needed) };
    assert_eq!(rc, 0, "{}", last_error());
    Ok(serde_json::from_slice(&buf[..needed - 1]).unwrap())
}

#[test]
fn backups_chosen_at_pause_and_resume_time_through_the_c_abi() {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointer and C strings.
    let rc = unsafe {
        memsaver_malloc(
            &mut p,
            2 << 20,
            0,
            c("abi_chosen").as_ptr(),
            c("discard").as_ptr(),
        )
    };
    assert_eq!(rc, 0, "{}", last_error());
    // SAFETY: on the fake driver device memory is host memory mapped read-write.
    unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0x5A, 2 << 20) };

    // SAFETY: C strings.
    let rc = unsafe { memsaver_pause_with_backup(c("abi_chosen").as_ptr(), c("tape").as_ptr()) };
    assert_eq!(rc, Status::InvalidArgument as i32);
    assert!(
        last_error().contains("unknown backup policy 'tape'"),
        "{}",
        last_error()
    );
    // SAFETY: C strings.
    let rc = unsafe { memsaver_pause_with_backup(c("abi_nope").as_ptr(), c("cpu").as_ptr()) };
    assert_eq!(rc, Status::UnknownTag as i32);
    assert_eq!(
        tag(&stats(), "abi_chosen")["paused"],
        false,
        "nothing changed"
    );

    // SAFETY: C strings.
    let rc = unsafe { memsaver_pause_with_backup(c("abi_chosen").as_ptr(), c("cpu").as_ptr()) };
    assert_eq!(rc, 0, "{}", last_error());
    let listed = allocations_json(Some("abi_chosen")).unwrap();
    assert_eq!(listed[0]["ptr"], p as u64);
    assert_eq!(listed[0]["policy"], "discard");
    assert_eq!(listed[0]["state"], "paused");
    assert_eq!(listed[0]["backup"], "pinned");
    assert_eq!(
        allocations_json(Some("abi_nope")),
        Err(Status::UnknownTag as i32)
    );
    assert_eq!(
        allocations_json(Some("nccl")),
        Err(Status::InvalidArgument as i32)
    );

    // SAFETY: C string.
    let rc = unsafe { memsaver_resume_keep_backups(c("abi_chosen").as_ptr(), 0) };
    assert_eq!(rc, 0, "{}", last_error());
    // SAFETY: resident again.
    let bytes = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), 2 << 20) };
    assert!(
        bytes.iter().all(|b| *b == 0x5A),
        "restored from the chosen backup"
    );
    assert_eq!(
        tag(&stats(), "abi_chosen")["backup_bytes"],
        0,
        "released at resume"
    );

    // SAFETY: C strings.
    let rc = unsafe { memsaver_discard(c("nccl").as_ptr()) };
    assert_eq!(rc, Status::InvalidArgument as i32);
    // SAFETY: C string.
    let rc = unsafe { memsaver_discard(c("abi_chosen").as_ptr()) };
    assert_eq!(rc, 0, "{}", last_error());
    assert_eq!(tag(&stats(), "abi_chosen")["paused"], true);
    // SAFETY: C string.
    let rc = unsafe { memsaver_resume_keep_backups(c("abi_chosen").as_ptr(), -1) };
    assert_eq!(rc, 0, "{}", last_error());
    assert_eq!(memsaver_free(p), 0);
}
