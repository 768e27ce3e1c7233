//! The fake CUDA driver (`tests/fake-cuda`), tested the way memsaver uses the real one: loaded
//! with `dlopen`, driven from several real processes (`fake-peer` children) that pass exported
//! fds over a Unix socket with `SCM_RIGHTS`.
//!
//! Build the fake first (the Makefile does):
//!
//! ```text
//! cargo build -p fake-cuda && mkdir -p target/fake-cuda \
//!   && cp target/debug/libcuda.so target/fake-cuda/libcuda.so.1
//! MEMSAVER_CUDA_LIB=$PWD/target/fake-cuda/libcuda.so.1 \
//!   cargo test -p memsaver-scenarios --test fake_driver
//! ```
//!
//! Every scenario gets its own `FAKE_CUDA_DIR` (its own "machine"), passed to its children; the
//! test process itself never initialises the fake, since the fake reads its knobs once.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Duration;

use memsaver_allocator::driver::sys::*;

const MIB: u64 = 1 << 20;
/// Device memory of each scenario's machine.
const MEM: u64 = 256 * MIB;
/// How long one command of a peer may take before the test gives up on it.
const REPLY_TIMEOUT: Duration = Duration::from_secs(60);

/// One fake machine: a fresh `FAKE_CUDA_DIR`, removed at the end.
struct Machine {
    dir: PathBuf,
}

impl Machine {
    fn new() -> Self {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let shm = Path::new("/dev/shm");
        let base = if shm.is_dir() {
            shm.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!(
            "fake-cuda-test-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create test dir");
        Self { dir }
    }

    fn peer(&self, name: &str) -> Peer {
        self.peer_with(name, &[])
    }

    /// A `fake-peer` process on this machine, with `init` done (device 0 current).
    fn peer_with(&self, name: &str, env: &[(&str, &str)]) -> Peer {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_fake-peer"));
        cmd.env("MEMSAVER_CUDA_LIB", memsaver_scenarios::cuda_lib())
            .env("FAKE_CUDA_DIR", &self.dir)
            .env("FAKE_CUDA_MEM_BYTES", MEM.to_string())
            .env("FAKE_CUDA_DEVICES", "2")
            .env_remove("FAKE_CUDA_FAIL_CREATE_AT")
            .env_remove("FAKE_CUDA_FAIL_MAP_AT")
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().expect("spawn fake-peer");
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut peer = Peer {
            name: name.to_owned(),
            child,
            stdin,
            lines,
        };
        if !env.iter().any(|(k, _)| *k == "NO_INIT") {
            peer.ok("init");
        }
        peer
    }

    fn socket(&self) -> String {
        self.dir.join("sock").display().to_string()
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A running `fake-peer`.
struct Peer {
    name: String,
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

impl Peer {
    /// Sends `cmd` without waiting for the reply (see [`Peer::finish`]).
    fn start(&mut self, cmd: &str) {
        writeln!(self.stdin, "{cmd}")
            .and_then(|()| self.stdin.flush())
            .unwrap_or_else(|e| panic!("{}: cannot send {cmd:?}: {e}", self.name));
    }

    /// The reply to the command sent last.
    fn finish(&mut self) -> String {
        match self.lines.recv_timeout(REPLY_TIMEOUT) {
            Ok(line) => line,
            Err(RecvTimeoutError::Timeout) => panic!("{}: no reply", self.name),
            Err(RecvTimeoutError::Disconnected) => panic!("{}: exited", self.name),
        }
    }

    fn send(&mut self, cmd: &str) -> String {
        self.start(cmd);
        let reply = self.finish();
        assert!(
            !reply.starts_with("fail"),
            "{}: {cmd:?} -> {reply}",
            self.name
        );
        reply
    }

    /// Runs `cmd`, which must succeed; returns what follows `ok`.
    fn ok(&mut self, cmd: &str) -> String {
        let reply = self.send(cmd);
        match reply.strip_prefix("ok") {
            Some(rest) => rest.trim().to_owned(),
            None => panic!("{}: {cmd:?} -> {reply:?}", self.name),
        }
    }

    /// Runs `cmd`, which must fail with a CUDA error; returns the code.
    fn err(&mut self, cmd: &str) -> CUresult {
        let reply = self.send(cmd);
        reply
            .strip_prefix("err ")
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("{}: {cmd:?} should fail, got {reply:?}", self.name))
    }

    fn num(&mut self, cmd: &str) -> u64 {
        let v = self.ok(cmd);
        v.parse()
            .unwrap_or_else(|_| panic!("{}: {cmd:?} -> {v:?} is not a number", self.name))
    }

    /// Device memory in use (all processes), as `cuMemGetInfo` reports it to this peer.
    fn used(&mut self) -> u64 {
        let info = self.ok("info");
        let (free, total) = info.split_once(' ').expect("free total");
        let (free, total): (u64, u64) = (free.parse().unwrap(), total.parse().unwrap());
        assert_eq!(total, MEM);
        total - free
    }

    /// Asks the process to exit, and waits for it to be gone.
    fn exit(mut self) {
        self.start("exit");
        let status = self.child.wait().expect("wait");
        assert!(status.success(), "{}: {status}", self.name);
    }

    /// `SIGKILL`, and wait for the process to be gone.
    fn kill(mut self) {
        self.child.kill().expect("kill");
        self.child.wait().expect("wait");
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Owner creates 64 MiB (POSIX fd), maps it, writes a pattern and sends an exported fd to
/// the importer, which imports it, closes the fd, maps it and checks the pattern; each sees the
/// other's writes. Returns (owner, importer, observer).
fn share_64mib(m: &Machine) -> (Peer, Peer, Peer) {
    let mut observer = m.peer("observer");
    let mut owner = m.peer("owner");
    let mut importer = m.peer("importer");
    assert_eq!(observer.used(), 0);

    owner.ok("create H 64 type=posix");
    owner.ok("reserve V 64");
    owner.ok("map V 0 H 64");
    owner.ok("access V 0 64 rw");
    owner.ok("write V 0 64 1");
    owner.ok("export F H");
    owner.ok(&format!("listen {}", m.socket()));
    importer.ok(&format!("connect {}", m.socket()));
    owner.ok("accept");
    owner.ok("sendfd F");
    importer.ok("recvfd F");
    importer.ok("import H F");
    importer.ok("closefd F");
    importer.ok("reserve V 64");
    importer.ok("map V 0 H 64");
    importer.ok("access V 0 64 rw");
    importer.ok("verify V 0 64 1");
    importer.ok("write V 32 1 2");
    owner.ok("verify V 32 1 2");
    owner.ok("verify V 0 32 1");
    assert_eq!(
        owner.ok("props H"),
        importer.ok("props H"),
        "import keeps the properties"
    );

    assert_eq!(observer.used(), 64 * MIB);
    assert_eq!(owner.used(), 64 * MIB);
    assert_eq!(importer.used(), 64 * MIB);
    (owner, importer, observer)
}

#[test]
fn shared_memory_is_freed_when_owner_then_importer_let_go() {
    let m = Machine::new();
    let (mut owner, mut importer, mut observer) = share_64mib(&m);

    owner.ok("closefd F");
    owner.ok("unmap V 0 64");
    owner.ok("release H");
    owner.ok("addrfree V");
    assert_eq!(owner.num("live"), 0);
    assert_eq!(
        observer.used(),
        64 * MIB,
        "the importer still maps and holds it"
    );
    importer.ok("verify V 0 32 1");

    importer.ok("unmap V 0 64");
    assert_eq!(
        observer.used(),
        64 * MIB,
        "the importer still holds its handle"
    );
    importer.ok("release H");
    assert_eq!(importer.num("live"), 0);
    assert_eq!(observer.used(), 0);
}

#[test]
fn shared_memory_is_freed_when_importer_then_owner_let_go() {
    let m = Machine::new();
    let (mut owner, mut importer, mut observer) = share_64mib(&m);

    importer.ok("unmap V 0 64");
    importer.ok("release H");
    importer.ok("addrfree V");
    assert_eq!(observer.used(), 64 * MIB);

    owner.ok("release H");
    assert_eq!(observer.used(), 64 * MIB, "the owner still maps it");
    owner.ok("verify V 0 32 1");
    owner.ok("unmap V 0 64");
    assert_eq!(
        observer.used(),
        64 * MIB,
        "the owner's exported fd is still open"
    );
    owner.ok("closefd F");
    assert_eq!(observer.used(), 0);
}

#[test]
fn an_exported_fd_alone_keeps_memory_alive_across_processes() {
    let m = Machine::new();
    let mut observer = m.peer("observer");
    let mut owner = m.peer("owner");
    let mut receiver = m.peer("receiver");

    owner.ok("create H 16");
    owner.ok("export F H");
    owner.ok("release H");
    assert_eq!(owner.num("live"), 0);
    assert_eq!(observer.used(), 16 * MIB, "the exported fd holds it");

    owner.ok(&format!("listen {}", m.socket()));
    receiver.ok(&format!("connect {}", m.socket()));
    owner.ok("accept");
    owner.ok("sendfd F");
    receiver.ok("recvfd F");
    owner.ok("closefd F");
    owner.exit();
    assert_eq!(
        observer.used(),
        16 * MIB,
        "the fd in flight to another process holds it"
    );

    // It is still importable from there.
    receiver.ok("import H F");
    receiver.ok("closefd F");
    assert_eq!(observer.used(), 16 * MIB);
    receiver.ok("release H");
    assert_eq!(observer.used(), 0);
}

#[test]
fn a_killed_process_lets_go_of_its_share() {
    let m = Machine::new();
    let (mut owner, importer, mut observer) = share_64mib(&m);

    owner.ok("closefd F");
    owner.ok("unmap V 0 64");
    owner.ok("release H");
    assert_eq!(observer.used(), 64 * MIB);
    importer.kill();
    assert_eq!(
        observer.used(),
        0,
        "SIGKILL released the importer's handle and mapping"
    );

    // Same for a lone owner killed while it maps memory.
    owner.ok("create H2 8");
    owner.ok("reserve V2 8");
    owner.ok("map V2 0 H2 8");
    owner.ok("release H2");
    assert_eq!(observer.used(), 8 * MIB);
    owner.kill();
    assert_eq!(observer.used(), 0);
}

#[test]
fn out_of_memory_at_the_device_capacity() {
    let m = Machine::new();
    let mut a = m.peer("a");
    let mut b = m.peer("b");

    a.ok("create A1 128");
    a.ok("create A2 120");
    assert_eq!(
        b.err("create B 16"),
        CUDA_ERROR_OUT_OF_MEMORY,
        "248 + 16 MiB > 256 MiB"
    );
    b.ok("create B 8");
    assert_eq!(a.used(), MEM);
    assert_eq!(a.err("create A3 2"), CUDA_ERROR_OUT_OF_MEMORY);

    // Another device and host memory are not this device's.
    b.ok("create B1 16 dev=1");
    b.ok("create BH 512 loc=host");
    assert_eq!(
        b.ok("props BH"),
        format!("1 1 {CU_MEM_LOCATION_TYPE_HOST_NUMA} 0")
    );
    assert_eq!(b.used(), MEM);
    let mut on_dev1 = m.peer_with("dev1", &[("NO_INIT", "1")]);
    on_dev1.ok("init 1");
    assert_eq!(on_dev1.ok("device"), "1");
    assert_eq!(
        on_dev1.used(),
        16 * MIB,
        "cuMemGetInfo reports the current context's device"
    );

    a.ok("release A2");
    a.ok("create A3 64");
    assert_eq!(b.err("create B2 64"), CUDA_ERROR_OUT_OF_MEMORY);
}

#[test]
fn create_fault_from_the_knob_and_at_run_time() {
    let m = Machine::new();
    let mut p = m.peer_with("p", &[("FAKE_CUDA_FAIL_CREATE_AT", "3")]);
    p.ok("create A 2");
    p.ok("create B 2");
    assert_eq!(p.err("create C 2"), CUDA_ERROR_OUT_OF_MEMORY);
    p.ok("create C 2");
    p.ok("create D 2");

    p.ok("failcreate 2");
    p.ok("create E 2");
    assert_eq!(p.err("create F 2"), CUDA_ERROR_OUT_OF_MEMORY);
    p.ok("create F 2");

    p.ok("failcreate 1");
    p.ok("resetfaults");
    p.ok("create G 2");
    assert_eq!(p.num("live"), 7);
    assert_eq!(p.used(), 14 * MIB, "failed creates allocate nothing");
}

#[test]
fn map_fault_from_the_knob_and_at_run_time() {
    let m = Machine::new();
    let mut p = m.peer_with("p", &[("FAKE_CUDA_FAIL_MAP_AT", "1")]);
    p.ok("create H 4");
    p.ok("reserve V 8");
    assert_eq!(p.err("map V 0 H 4"), CUDA_ERROR_UNKNOWN);
    assert_eq!(
        p.err("range V 0"),
        CUDA_ERROR_NOT_FOUND,
        "a failed map maps nothing"
    );
    p.ok("map V 0 H 4");

    p.ok("failmap 2");
    p.ok("map V 4 H 4");
    p.ok("unmap V 4 4");
    assert_eq!(p.err("map V 4 H 4"), CUDA_ERROR_UNKNOWN);
    p.ok("map V 4 H 4");
    p.ok("unmap V 0 8");
}

#[test]
fn unmap_keeps_the_range_reserved_and_remapping_works() {
    let m = Machine::new();
    let mut p = m.peer("p");
    p.ok("create H 4");
    let base = p.num("reserve V 8");
    assert_eq!(base % (2 * MIB), 0);
    p.ok("map V 0 H 4");
    p.ok("access V 0 4 rw");
    p.ok("write V 0 4 5");
    p.ok("unmap V 0 4");

    // The range is still reserved: a reservation asking for its address lands elsewhere.
    let other = p.num(&format!("reserve W 8 at={base}"));
    assert_ne!(other, base);
    // Nothing is mapped there any more.
    assert_eq!(p.err("range V 0"), CUDA_ERROR_NOT_FOUND);
    assert_eq!(p.err("retain R V 0"), CUDA_ERROR_INVALID_VALUE);
    assert_eq!(
        p.err("verify V 0 4 5"),
        CUDA_ERROR_INVALID_VALUE,
        "no copy from unmapped memory"
    );

    // Same handle again at the same address: same contents.
    p.ok("map V 0 H 4");
    assert_eq!(
        p.err("verify V 0 4 5"),
        CUDA_ERROR_INVALID_VALUE,
        "no access before cuMemSetAccess"
    );
    p.ok("access V 0 4 r");
    p.ok("verify V 0 4 5");
    assert_eq!(
        p.err("memset V 0 4 9"),
        CUDA_ERROR_INVALID_VALUE,
        "read-only"
    );
    p.ok("access V 0 4 rw");
    p.ok("memset V 0 2 9");
    p.ok("expect V 0 2 9");
    p.ok("unmap V 0 4");

    // A new allocation at the same address: fresh contents.
    p.ok("release H");
    p.ok("create H2 4");
    p.ok("map V 0 H2 4");
    p.ok("access V 0 4 rw");
    p.ok("expect V 0 4 0");
    p.ok("write V 0 4 6");
    p.ok("sync");
    p.ok("pinned V 0 4 6");
    p.ok("unmap V 0 4");
    p.ok("release H2");
    p.ok("addrfree V");
    p.ok("addrfree W");
    assert_eq!(p.used(), 0);
}

#[test]
fn vmm_argument_rules() {
    let m = Machine::new();
    let mut p = m.peer("p");
    assert_eq!(p.err("create X 0"), CUDA_ERROR_INVALID_VALUE);
    assert_eq!(p.err("create X 2 dev=7"), CUDA_ERROR_INVALID_DEVICE);
    p.ok("create H 4");
    p.ok("create H2 2");
    assert_eq!(p.num("reserve V 8 align=8") % (8 * MIB), 0);
    let base = p.num("reserve A 6");
    assert_eq!(base % (2 * MIB), 0);

    assert_eq!(
        p.err("map V 6 H 4"),
        CUDA_ERROR_INVALID_VALUE,
        "past the reservation's end"
    );
    assert_eq!(
        p.err("map V 0 H 6"),
        CUDA_ERROR_INVALID_VALUE,
        "larger than the allocation"
    );
    p.ok("map V 0 H 4");
    assert_eq!(p.err("map V 2 H2 2"), CUDA_ERROR_ALREADY_MAPPED);
    p.ok("map V 4 H2 2");
    assert_eq!(
        p.err("unmap V 0 2"),
        CUDA_ERROR_INVALID_VALUE,
        "part of a mapping"
    );
    assert_eq!(
        p.err("unmap V 0 8"),
        CUDA_ERROR_INVALID_VALUE,
        "a gap at 6 MiB"
    );
    assert_eq!(p.err("unmap V 6 2"), CUDA_ERROR_INVALID_VALUE, "not mapped");
    assert_eq!(
        p.err("access V 0 8 rw"),
        CUDA_ERROR_INVALID_VALUE,
        "not fully mapped"
    );
    p.ok("access V 0 6 rw");
    p.ok("write V 3 2 4");
    p.ok("verify V 3 2 4");
    p.ok("unmap V 0 6");
    p.ok("addrfree A");
    assert_eq!(p.err("addrfree A"), CUDA_ERROR_INVALID_VALUE, "freed twice");
    p.ok("release H");
    p.ok("release H2");
    assert_eq!(p.err("release H"), CUDA_ERROR_INVALID_VALUE);
}

#[test]
fn retain_and_address_range_follow_the_mapping() {
    let m = Machine::new();
    let mut p = m.peer("p");
    let h = p.ok("create H 8");
    p.ok("reserve V 8");
    p.ok("map V 0 H 8");
    p.ok("reserve X 2");
    let v = p.ok("range V 0");
    let (vbase, vsize) = v.split_once(' ').unwrap();
    assert_eq!(vsize.parse::<u64>().unwrap(), 8 * MIB);
    assert_eq!(
        p.ok("range V 5"),
        format!("{vbase} {vsize}"),
        "any address inside the mapping"
    );
    assert_eq!(
        p.err("range X 0"),
        CUDA_ERROR_NOT_FOUND,
        "reserved, never mapped"
    );

    // NCCL's free path: retain the handle from the address, release it, look up the range,
    // unmap, release again (the original reference), free the range.
    assert_eq!(p.ok("retain R V 3"), h, "the mapping's own handle value");
    assert_eq!(p.num("live"), 1);
    p.ok("release R");
    p.ok("range V 0");
    p.ok("unmap V 0 8");
    p.ok("release R");
    p.ok("addrfree V");
    assert_eq!(p.num("live"), 0);
    assert_eq!(p.used(), 0);

    // A mapping outlives its handle, and retain brings the handle back.
    p.ok("create H2 4");
    p.ok("reserve V2 4");
    p.ok("map V2 0 H2 4");
    let h2 = p.ok("handle H2");
    p.ok("release H2");
    assert_eq!(p.num("live"), 0);
    assert_eq!(p.used(), 4 * MIB, "the mapping keeps it");
    assert_eq!(p.ok("retain R2 V2 0"), h2);
    p.ok("props R2");
    p.ok("unmap V2 0 4");
    assert_eq!(p.used(), 4 * MIB, "the retained handle keeps it");
    p.ok("release R2");
    assert_eq!(p.used(), 0);
}

#[test]
fn export_gives_a_new_fd_each_time_and_import_checks_it() {
    let m = Machine::new();
    let mut p = m.peer("p");
    p.ok("create H 2");
    let a = p.num("export F1 H");
    let b = p.num("export F2 H");
    assert_ne!(a, b);
    p.ok("create N 2 type=none");
    assert_eq!(
        p.err("export F3 N"),
        CUDA_ERROR_INVALID_VALUE,
        "not created exportable"
    );
    p.ok("devnull D");
    assert_eq!(
        p.err("import X D"),
        CUDA_ERROR_INVALID_VALUE,
        "not a fake-cuda allocation"
    );

    // Importing in the same process gives another handle on the same memory.
    p.ok("import I F1");
    assert_ne!(p.ok("handle I"), p.ok("handle H"));
    assert_eq!(
        p.ok("props I"),
        format!(
            "{} {} {} 0",
            CU_MEM_ALLOCATION_TYPE_PINNED,
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            CU_MEM_LOCATION_TYPE_DEVICE
        )
    );
    assert_eq!(p.used(), 4 * MIB);
    p.ok("release H");
    p.ok("release N");
    p.ok("closefd F1");
    p.ok("closefd F2");
    assert_eq!(p.used(), 2 * MIB, "the import still holds H's memory");
    p.ok("release I");
    assert_eq!(p.used(), 0);
}

#[test]
fn many_threads_allocate_at_once() {
    let m = Machine::new();
    let mut a = m.peer("a");
    let mut b = m.peer("b");
    // Two processes, four threads each, through the whole cycle at the same time.
    a.start("stress 4 25 2");
    b.start("stress 4 25 4");
    assert_eq!(a.finish(), "ok");
    assert_eq!(b.finish(), "ok");
    assert_eq!(a.num("live"), 0);
    assert_eq!(b.num("live"), 0);
    assert_eq!(a.used(), 0);
}

/// The library itself, loaded into this process: every entry point is exported under its
/// CUDA name, `cuGetProcAddress` resolves like the real driver, errors have names. Nothing
/// here calls `cuInit`, so no knob is read in the test process.
#[test]
fn entry_points_and_proc_address() {
    let path = CString::new(memsaver_scenarios::cuda_lib().display().to_string()).unwrap();
    // SAFETY: a NUL-terminated path to the fake driver, whose loading has no side effects.
    let lib = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!lib.is_null());
    let sym = |name: &str| {
        let c = CString::new(name).unwrap();
        // SAFETY: a live handle and a NUL-terminated name.
        unsafe { libc::dlsym(lib, c.as_ptr()) }
    };
    let names = [
        "cuInit",
        "cuDriverGetVersion",
        "cuGetErrorName",
        "cuGetErrorString",
        "cuDeviceGetCount",
        "cuDeviceGet",
        "cuDevicePrimaryCtxRetain",
        "cuDevicePrimaryCtxRelease_v2",
        "cuCtxPushCurrent_v2",
        "cuCtxPopCurrent_v2",
        "cuCtxPushCurrent",
        "cuCtxPopCurrent",
        "cuCtxSetCurrent",
        "cuCtxSynchronize",
        "cuCtxGetCurrent",
        "cuCtxGetDevice",
        "cuMemGetInfo_v2",
        "cuMemGetInfo",
        "cuMemGetAllocationGranularity",
        "cuMemCreate",
        "cuMemRelease",
        "cuMemAddressReserve",
        "cuMemAddressFree",
        "cuMemMap",
        "cuMemUnmap",
        "cuMemSetAccess",
        "cuMemExportToShareableHandle",
        "cuMemImportFromShareableHandle",
        "cuMemRetainAllocationHandle",
        "cuMemGetAllocationPropertiesFromHandle",
        "cuMemGetAddressRange_v2",
        "cuMemGetAddressRange",
        "cuStreamCreate",
        "cuStreamSynchronize",
        "cuStreamDestroy_v2",
        "cuStreamDestroy",
        "cuEventCreate",
        "cuEventRecord",
        "cuEventSynchronize",
        "cuEventDestroy_v2",
        "cuEventDestroy",
        "cuMemcpyDtoHAsync_v2",
        "cuMemcpyHtoDAsync_v2",
        "cuMemcpyDtoHAsync",
        "cuMemcpyHtoDAsync",
        "cuMemcpyDtoH_v2",
        "cuMemcpyHtoD_v2",
        "cuMemsetD8_v2",
        "cuMemsetD8",
        "cuMemHostAlloc",
        "cuMemFreeHost",
        "cuMemHostRegister_v2",
        "cuMemHostUnregister",
        "cuGetProcAddress_v2",
        "cuGetProcAddress",
        "fakecuda_fail_create_at",
        "fakecuda_fail_map_at",
        "fakecuda_reset_faults",
        "fakecuda_live_handles",
    ];
    for name in names {
        assert!(!sym(name).is_null(), "{name} is not exported");
    }
    // Every entry point `sys::fns` declares, so the fake cannot fall behind the allocator.
    let sys = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../allocator/src/driver/sys.rs"
    ));
    let declared: Vec<&str> = sys
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub type cu"))
        .filter_map(|rest| rest.split([' ', '=']).next())
        .collect();
    assert!(
        declared.len() > 30,
        "sys.rs parsing found only {declared:?}"
    );
    for rest in declared {
        let name = format!("cu{rest}");
        assert!(!sym(&name).is_null(), "{name} (sys::fns) is not exported");
    }

    // SAFETY: the symbols have these types (sys::fns; CUDA 11.3's cuGetProcAddress).
    let (get_proc, get_proc_v1, error_name, error_string, version, get_info) = unsafe {
        (
            std::mem::transmute::<*mut c_void, fns::cuGetProcAddress_v2>(sym(
                "cuGetProcAddress_v2",
            )),
            std::mem::transmute::<
                *mut c_void,
                unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CUresult,
            >(sym("cuGetProcAddress")),
            std::mem::transmute::<*mut c_void, fns::cuGetErrorName>(sym("cuGetErrorName")),
            std::mem::transmute::<*mut c_void, fns::cuGetErrorString>(sym("cuGetErrorString")),
            std::mem::transmute::<*mut c_void, fns::cuDriverGetVersion>(sym("cuDriverGetVersion")),
            std::mem::transmute::<*mut c_void, fns::cuMemGetInfo_v2>(sym("cuMemGetInfo_v2")),
        )
    };
    let resolve = |name: &CStr, ver: c_int| {
        let (mut p, mut status) = (std::ptr::null_mut(), -1);
        // SAFETY: a NUL-terminated name and valid out-pointers.
        let rc = unsafe { get_proc(name.as_ptr(), &mut p, ver, 0, &mut status) };
        (rc, p, status)
    };
    // cudart's path: the base name, with a version, gets the _v2 variant.
    assert_eq!(
        resolve(c"cuMemGetInfo", 12080),
        (CUDA_SUCCESS, sym("cuMemGetInfo_v2"), 0)
    );
    assert_eq!(
        resolve(c"cuGetProcAddress", 12080),
        (CUDA_SUCCESS, sym("cuGetProcAddress_v2"), 0)
    );
    assert_eq!(
        resolve(c"cuGetProcAddress", 11080),
        (CUDA_SUCCESS, sym("cuGetProcAddress"), 0)
    );
    assert_eq!(
        resolve(c"cuMemCreate", 12080),
        (CUDA_SUCCESS, sym("cuMemCreate"), 0)
    );
    assert_eq!(resolve(c"cuMemUnmap_v2", 12080).0, CUDA_ERROR_NOT_FOUND);
    assert_eq!(resolve(c"cuMemMap_v2", 12080).2, 1);
    assert_eq!(
        resolve(c"cuMulticastCreate", 12080),
        (CUDA_ERROR_NOT_FOUND, std::ptr::null_mut(), 1)
    );
    let mut p = std::ptr::null_mut();
    // SAFETY: as above.
    let rc = unsafe { get_proc_v1(c"cuMemRelease".as_ptr(), &mut p, 12080, 0) };
    assert_eq!(rc, CUDA_SUCCESS);
    assert_eq!(p, sym("cuMemRelease"));

    let text = |f: fns::cuGetErrorName, code| {
        let mut s = std::ptr::null();
        // SAFETY: a valid out-pointer; the result is null or a static C string.
        let rc = unsafe { f(code, &mut s) };
        let text = (!s.is_null()).then(|| {
            // SAFETY: non-null results are static NUL-terminated strings.
            unsafe { CStr::from_ptr(s) }.to_str().unwrap().to_owned()
        });
        (rc, text)
    };
    assert_eq!(
        text(error_name, CUDA_ERROR_OUT_OF_MEMORY),
        (CUDA_SUCCESS, Some("CUDA_ERROR_OUT_OF_MEMORY".into()))
    );
    assert_eq!(
        text(error_string, CUDA_ERROR_OUT_OF_MEMORY),
        (CUDA_SUCCESS, Some("out of memory".into()))
    );
    assert_eq!(text(error_name, 12345), (CUDA_ERROR_INVALID_VALUE, None));

    let mut v = 0;
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { version(&mut v) }, CUDA_SUCCESS);
    assert_eq!(v, 12080);
    let (mut free, mut total) = (0, 0);
    // SAFETY: valid out-pointers.
    let rc = unsafe { get_info(&mut free, &mut total) };
    assert_eq!(rc, CUDA_ERROR_NOT_INITIALIZED, "before cuInit");
}
