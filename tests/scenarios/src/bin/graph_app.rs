//! An application that replays CUDA graphs while NCCL's memory is paused, the way rollout
//! engines do, for the graph-stack scenarios (`tests/graph_stack.rs`). Prints `key=value`
//! lines the test reads.
//!
//! `graph-app <libnccl.so.2> <libcuda.so.1> <case>` reaches the driver as the CUDA runtime
//! does (`dlsym(libcuda, "cuGetProcAddress_v2")`, then everything through it), sets up a fake
//! NCCL communicator, allocates NCCL memory and runs an all-reduce, then per case: sets the
//! stack limit itself, instantiates a graph (or has one instantiated where memsaver cannot
//! see it), destroys it, pauses `nccl`, grows the limit and instantiates a second graph while
//! paused, launches, resumes, and pauses and resumes once more.

use std::ffi::{CString, c_char, c_int, c_uint, c_void};

use memsaver_allocator::driver::sys::{CUgraph, CUgraphExec, fns};
use memsaver_scenarios::{Alloc, FakeNcclAlloc, TagCall, object_of, open_fake_libs, sym};

type StatsJson = unsafe extern "C" fn(*mut c_char, usize, *mut usize) -> c_int;
type CommInit = unsafe extern "C" fn(*const c_char, c_int) -> c_int;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    *mut c_void,
    *mut c_void,
) -> c_int;
type Unseen = unsafe extern "C" fn(*mut CUgraphExec, CUgraph) -> c_uint;
type Kernel = unsafe extern "C" fn(usize) -> c_uint;

/// What a case does (see the module documentation).
#[derive(Default)]
struct Case {
    nranks: c_int,
    app_sets: Option<usize>,
    graph: Option<Graph>,
    destroy_before_pause: bool,
    /// A kernel needing this much stack, and a graph instantiated, while paused.
    grow_while_paused: Option<usize>,
}

#[derive(Clone, Copy, PartialEq)]
enum Graph {
    /// Instantiated through the function the runtime-style lookup gave.
    Seen,
    /// Instantiated where no wrapper sees it (`fakecuda_instantiate_unseen`).
    Unseen,
}

fn case(name: &str) -> Case {
    match name {
        // (a) one rank (NCCL's kernels grow nothing); the application raises the limit itself.
        "app-set" => Case {
            nranks: 1,
            app_sets: Some(1744),
            graph: Some(Graph::Seen),
            ..Default::default()
        },
        // (b) two ranks: NCCL's kernel grew the limit; a graph is instantiated at it.
        "nccl-grown" => Case {
            nranks: 2,
            graph: Some(Graph::Seen),
            ..Default::default()
        },
        // (c) no graph, no limit set by the application.
        "no-graph" => Case {
            nranks: 2,
            ..Default::default()
        },
        // (d) the graph is gone before the pause.
        "destroyed" => Case {
            nranks: 2,
            graph: Some(Graph::Seen),
            destroy_before_pause: true,
            ..Default::default()
        },
        // (e) a graph instantiated while paused, at a higher limit.
        "during-pause" => Case {
            nranks: 2,
            grow_while_paused: Some(2048),
            ..Default::default()
        },
        // (f) a graph instantiated outside memsaver's view is launched.
        "unseen" => Case {
            nranks: 2,
            graph: Some(Graph::Unseen),
            ..Default::default()
        },
        other => panic!("unknown case {other}"),
    }
}

fn nccl_stats() -> String {
    let f: StatsJson = sym(libc::RTLD_DEFAULT, c"memsaver_nccl_stats_json");
    let mut buf = vec![0u8; 8192];
    let mut needed = 0;
    // SAFETY: `buf` has its length in writable bytes.
    let rc = unsafe { f(buf.as_mut_ptr().cast(), buf.len(), &mut needed) };
    assert_eq!(rc, 0);
    String::from_utf8_lossy(&buf[..needed - 1]).into_owned()
}

/// The driver as the CUDA runtime reaches it.
struct Runtime {
    gpa: fns::cuGetProcAddress_v2,
}

impl Runtime {
    fn get<T: Copy>(&self, name: &std::ffi::CStr) -> T {
        let mut p = std::ptr::null_mut();
        let mut status = 0;
        // SAFETY: valid out-pointers, NUL-terminated name.
        let r = unsafe { (self.gpa)(name.as_ptr(), &mut p, 12000, 0, &mut status) };
        assert!(
            r == 0 && !p.is_null(),
            "cuGetProcAddress({name:?}) failed: {r}"
        );
        // SAFETY: the caller names the function's CUDA 12 type.
        unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let c = case(&args[3]);
    let (hn, hc) = open_fake_libs(&args[1], &args[2]);
    let cuda = CString::new(args[2].as_str()).unwrap();
    // Like cudart: look up cuGetProcAddress_v2, ask it for cuGetProcAddress, use that.
    let first = Runtime {
        gpa: sym(hc, c"cuGetProcAddress_v2"),
    };
    let rt = Runtime {
        gpa: first.get(c"cuGetProcAddress"),
    };
    let init: fns::cuInit = rt.get(c"cuInit");
    let retain: fns::cuDevicePrimaryCtxRetain = rt.get(c"cuDevicePrimaryCtxRetain");
    let push: fns::cuCtxPushCurrent_v2 = rt.get(c"cuCtxPushCurrent");
    let get_limit: fns::cuCtxGetLimit = rt.get(c"cuCtxGetLimit");
    let set_limit: fns::cuCtxSetLimit = rt.get(c"cuCtxSetLimit");
    let synchronize: fns::cuCtxSynchronize = rt.get(c"cuCtxSynchronize");
    let graph_create: fns::cuGraphCreate = rt.get(c"cuGraphCreate");
    // CUDA >= 12.0: the name resolves to the flags form.
    let instantiate: fns::cuGraphInstantiateWithFlags = rt.get(c"cuGraphInstantiate");
    let launch: fns::cuGraphLaunch = rt.get(c"cuGraphLaunch");
    let exec_destroy: fns::cuGraphExecDestroy = rt.get(c"cuGraphExecDestroy");
    // Which library answered: memsaver's wrappers, through cuGetProcAddress and through a
    // direct dlsym alike.
    println!("instantiate_from={}", object_of(instantiate as usize));
    println!("set_limit_from={}", object_of(set_limit as usize));
    let direct: *mut c_void = sym(hc, c"cuGraphInstantiateWithFlags");
    println!("instantiate_direct_from={}", object_of(direct as usize));
    let direct: *mut c_void = sym(hc, c"cuGraphLaunch");
    println!("launch_direct_from={}", object_of(direct as usize));
    let direct: *mut c_void = sym(hc, c"cuMemCreate");
    println!("create_direct_from={}", object_of(direct as usize));
    let unseen: Unseen = sym(hc, c"fakecuda_instantiate_unseen");
    let kernel: Kernel = sym(hc, c"fakecuda_launch_kernel_needing_stack");
    let (pause, resume): (TagCall, TagCall) = (
        sym(libc::RTLD_DEFAULT, c"memsaver_pause"),
        sym(libc::RTLD_DEFAULT, c"memsaver_resume"),
    );
    let comm_init: CommInit = sym(hn, c"fake_nccl_comm_init");
    let alloc: Alloc = sym(hn, c"fake_nccl_alloc");
    // As a program linked to NCCL finds it: memsaver's guarded collective.
    let all_reduce: AllReduce = sym(libc::RTLD_DEFAULT, c"ncclAllReduce");
    let null = std::ptr::null_mut();

    let mut ctx = null;
    let stack = || {
        let mut v = 0;
        // SAFETY: valid out-pointer; the context is current.
        unsafe { get_limit(&mut v, 0) };
        v
    };
    // SAFETY: the driver's signatures; every pointer is a live local; the context stays current.
    unsafe {
        assert_eq!(init(0), 0);
        assert_eq!(retain(&mut ctx, 0), 0);
        assert_eq!(push(ctx), 0);
        assert_eq!(comm_init(cuda.as_ptr(), c.nranks), 0);
        let mut buf = FakeNcclAlloc::default();
        assert_eq!(alloc(cuda.as_ptr(), 4 << 20, 0, &mut buf), 0);
        if let Some(bytes) = c.app_sets {
            println!("app_set_rc={}", set_limit(0, bytes));
        }
        println!(
            "allreduce_rc={}",
            all_reduce(null, null, 0, 0, 0, null, null)
        );
        println!("stack_before={}", stack());

        let mut graph = null;
        assert_eq!(graph_create(&mut graph, 0), 0);
        let mut exec = null;
        if let Some(g) = c.graph {
            let rc = match g {
                Graph::Seen => instantiate(&mut exec, graph, 0),
                Graph::Unseen => unseen(&mut exec, graph),
            };
            println!("instantiate_rc={rc}");
            println!("launch_before_rc={}", launch(exec, null));
            if c.destroy_before_pause {
                println!("destroy_rc={}", exec_destroy(exec));
                exec = null;
            }
        }

        println!("pause_rc={}", pause(c"nccl".as_ptr()));
        println!("stack_paused={}", stack());
        // The rollout engine replays its graphs while the trainer's NCCL is paused.
        if !exec.is_null() {
            println!("launch_paused_rc={}", launch(exec, null));
        }
        let mut exec2 = null;
        if let Some(bytes) = c.grow_while_paused {
            println!("kernel_paused_rc={}", kernel(bytes));
            println!("stack_grown={}", stack());
            println!(
                "instantiate_paused_rc={}",
                instantiate(&mut exec2, graph, 0)
            );
            println!("launch2_paused_rc={}", launch(exec2, null));
        }
        println!("sync_paused_rc={}", synchronize());
        println!("stats_paused={}", nccl_stats());

        println!("resume_rc={}", resume(c"nccl".as_ptr()));
        println!("stack_resumed={}", stack());
        println!(
            "allreduce_resumed_rc={}",
            all_reduce(null, null, 0, 0, 0, null, null)
        );
        for (key, e) in [("launch_resumed_rc", exec), ("launch2_resumed_rc", exec2)] {
            if !e.is_null() {
                println!("{key}={}", launch(e, null));
            }
        }
        println!("stats_resumed={}", nccl_stats());

        // Once more: what was kept is kept again (and an unseen launch is never forgotten).
        println!("pause2_rc={}", pause(c"nccl".as_ptr()));
        println!("stack_paused2={}", stack());
        if !exec.is_null() {
            println!("launch_paused2_rc={}", launch(exec, null));
        }
        println!("stats_paused2={}", nccl_stats());
        println!("resume2_rc={}", resume(c"nccl".as_ptr()));
        println!("sync_end_rc={}", synchronize());
    }
}
