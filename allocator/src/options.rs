//! Every option of memsaver, in one table. Options are read from `MEMSAVER_*` environment
//! variables once, when the process-wide allocator (or, for the hook mode, the Python package)
//! starts. `docs/options.md` is generated from
//! [`OPTIONS`] by `memsaver options --markdown`.

/// One option: its environment variable, default and a one-line description.
pub struct OptionDoc {
    pub env: &'static str,
    pub default: &'static str,
    pub doc: &'static str,
}

pub const OPTIONS: &[OptionDoc] = &[
    OptionDoc {
        env: "MEMSAVER_CUDA_LIB",
        default: "libcuda.so.1",
        doc: "CUDA driver library to load; point it at target/fake-cuda/libcuda.so.1 to run on the fake driver",
    },
    OptionDoc {
        env: "MEMSAVER_HOOK_MODE",
        default: "auto",
        doc: "Python package: auto (preload if libmemsaver.so is preloaded, else inprocess), preload (fail with instructions unless preloaded) or inprocess",
    },
    OptionDoc {
        env: "MEMSAVER_GROUP",
        default: "0",
        doc: "group id of the process for the nccl tag: processes pause and resume NCCL memory with peers of the same group only (AMEM_GROUPID, ncclSetGroupID and memsaver.set_group work too; fixed once NCCL shared memory)",
    },
    OptionDoc {
        env: "MEMSAVER_NCCL_TIMEOUT_MS",
        default: "30000",
        doc: "how long pause('nccl') waits for peers to release their imports, and resume for owners to come back",
    },
    OptionDoc {
        env: "MEMSAVER_NCCL_BACKUP",
        default: "all",
        doc: "what pause('nccl') copies to host memory: all (every byte NCCL allocated) or headers (of the buffers NCCL shares with peers, only their first 64 KiB: the control block before the LL/LL128/Simple staging area, whose contents live only within one collective; see docs/nccl.md)",
    },
    OptionDoc {
        env: "MEMSAVER_NCCL_TOKENS",
        default: "1",
        doc: "0: NCCL exports plain driver fds (for jobs with processes not preloaded); exported buffers and imports then stay resident on pause",
    },
    OptionDoc {
        env: "MEMSAVER_RUNTIME_DIR",
        default: "$XDG_RUNTIME_DIR/memsaver or /tmp/memsaver-<uid>",
        doc: "private directory (mode 0700) for the sockets processes use to coordinate the nccl tag",
    },
    OptionDoc {
        env: "MEMSAVER_LOG",
        default: "warn",
        doc: "log filter for tracing (error, warn, info, debug, trace, or a directive like memsaver_allocator=debug); logs go to stderr",
    },
];

/// The options in force, as read from the environment.
#[derive(Clone, Debug)]
pub struct Options {
    pub cuda_lib: String,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            cuda_lib: OPTIONS[0].default.into(),
        }
    }
}

impl Options {
    pub fn from_env() -> Self {
        let mut o = Self::default();
        if let Ok(v) = std::env::var("MEMSAVER_CUDA_LIB")
            && !v.is_empty()
        {
            o.cuda_lib = v;
        }
        o
    }

    /// The option table as a Markdown table.
    pub fn markdown() -> String {
        let mut s = String::from("| variable | default | meaning |\n| --- | --- | --- |\n");
        for o in OPTIONS {
            s.push_str(&format!("| `{}` | `{}` | {} |\n", o.env, o.default, o.doc));
        }
        s
    }
}
