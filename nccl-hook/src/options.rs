//! The NCCL hook's options: one list ([`memsaver_allocator::declare_options!`]; the rules every
//! list follows are in `memsaver_allocator::options`): the `nccl` tag's backup, then its
//! peers' tokens and deadline (the group, the runtime directory and control requests are
//! `memsaver_ipc::options`).
//!
//! An invalid value of any of them fails the first operation done for the application together
//! with every other layer's (`memsaver_allocator::global`, through [`LAYER`] in
//! `memsaver_allocator::OPTION_LAYERS`); the hooks that answer NCCL's driver calls use the
//! default meanwhile.

use std::time::Duration;

memsaver_allocator::declare_options! {
    layer "libmemsaver.so: the NCCL hook", "";

    /// The NCCL hook's options in force (the core's are `memsaver_allocator::options`). A
    /// field whose variable is invalid holds its default, and the variable's message is in
    /// `errors`.
    pub struct Options {}

    options {
        /// the nccl tag's backup policy. headers (the default): pinned host memory, prepared
        /// in the background when NCCL allocates, holding every byte of NCCL's private buffers
        /// and of the buffers it shares with peers only their first 64 KiB (the control block
        /// before the LL/LL128/Simple staging area, whose contents live only within one
        /// collective; see docs/nccl.md). Or, as a region's: cpu (every byte, pinned), mmap,
        /// disk or discard. all is the older name of cpu
        NCCL_BACKUP = "MEMSAVER_NCCL_BACKUP", one_of(NcclBackup {
                /// Every byte, in pinned host memory.
                Cpu = "cpu",
                /// Every byte, in pageable host memory.
                Mmap = "mmap",
                /// Every byte, in a file of the disk backup directory.
                Disk = "disk",
                /// Nothing: resumed memory holds arbitrary bytes.
                Discard = "discard",
                /// Pinned, the first 64 KiB of buffers shared with peers; all of the others
                /// (the default).
                Headers = "headers",
                /// The older name of `cpu`.
                All = "all",
            }), default "headers", Library
            => pub nccl_backup: NcclBackup;

        /// a resume backs adjacent NCCL buffers with one physical allocation of up to this size,
        /// which each peer importing any of them then maps whole: a process's buffers come back
        /// in as few driver calls as their properties allow (65536, one 64 GiB block, is no cap
        /// in practice); a buffer NCCL frees inside one is held until the next pause (stats:
        /// freed_held_bytes). 0: every buffer its own physical allocation, imported alone
        NCCL_MERGE_MB = "MEMSAVER_NCCL_MERGE_MB", int(0, 65_536, "MiB"), default "65536",
            Library
            => /// Bytes: the largest physical allocation a resume makes for adjacent NCCL
               /// buffers (the variable is in MiB; 0 turns runs off).
               pub nccl_merge_limit: u64 = |mb| mb as u64 * (1 << 20);

        /// NCCL's small buffers (device memory of at most a sixteenth of this size) are carved
        /// when NCCL creates them from physical allocations of this size made ahead (chunks),
        /// so that even the first pause of nccl releases one allocation per chunk, not one per
        /// buffer, and each peer maps a chunk whole. A multiple of the device's allocation
        /// granularity (2 MiB on H100 and H200), at least 32 MiB for NCCL's 2 MiB buffers to be
        /// carved; capped by MEMSAVER_NCCL_MERGE_MB; not with NVLS (a carved buffer cannot be
        /// bound to a multicast object). A chunk the driver cannot make (out of memory, a size
        /// it refuses) turns chunks off for the process, with a warning. 0 (the default): each
        /// buffer has its own allocation until the first resume
        NCCL_CHUNK_MB = "MEMSAVER_NCCL_CHUNK_MB", int(0, 1024, "MiB"), default "0", Library
            => /// Bytes: the size of the chunks NCCL's small buffers are carved from at
               /// their creation (the variable is in MiB; 0 turns chunks off).
               pub nccl_chunk: u64 = |mb| mb as u64 * (1 << 20);

        /// 1: keep only the first 64 KiB of NCCL's shared buffers (headers) also on an NCCL
        /// newer than the last version whose buffer layouts were checked (docs/nccl.md); by
        /// default such an NCCL's buffers are backed up whole, and the log says why once
        NCCL_HEADERS_UNCHECKED = "MEMSAVER_NCCL_HEADERS_UNCHECKED", bool, default "0", Library
            => pub nccl_headers_unchecked: bool;

        // ---- the nccl tag's peers ----
        /// how long pause('nccl') waits for peers to release their imports, and resume for
        /// owners to come back
        NCCL_TIMEOUT_MS = "MEMSAVER_NCCL_TIMEOUT_MS", int(1, 86_400_000, "ms"), default "30000",
            Library
            => pub nccl_timeout: Duration = |ms| Duration::from_millis(ms as u64);

        /// 0: NCCL exports plain driver fds (for jobs with processes not preloaded); exported
        /// buffers and imports then stay resident on pause, and NCCL's registration of tensors
        /// in memsaver memory fails (turn it off: NCCL_LOCAL_REGISTER=0, NCCL_GRAPH_REGISTER=0)
        NCCL_TOKENS = "MEMSAVER_NCCL_TOKENS", bool, default "1", Library
            => pub nccl_tokens: bool;
    }
}

/// The newest NCCL (`ncclGetVersion`'s code) whose buffers were checked to hold nothing but
/// zeros-tolerant staging past their first bytes (docs/nccl.md, "What headers keeps").
pub(crate) const LAST_CHECKED_NCCL: i32 = 23007;

/// Bytes at the start of a shared buffer that `MEMSAVER_NCCL_BACKUP=headers` keeps: NCCL's
/// control block is 4 KiB (`MEM_ALIGN`); the rest is margin.
pub(crate) const HEADER_BYTES: u64 = 64 << 10;

#[linkme::distributed_slice(memsaver_allocator::OPTION_LAYERS)]
static CHECKED: &memsaver_allocator::options::Layer = &LAYER;

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(vars: &[(&str, &str)]) -> Options {
        Options::from_vars(vars)
    }

    /// The one error of `vars`.
    fn error(vars: &[(&str, &str)]) -> String {
        Options::only_error(vars)
    }

    #[test]
    fn defaults() {
        let o = opts(&[]);
        assert_eq!(o.nccl_timeout, Duration::from_secs(30));
        assert_eq!(o.nccl_backup, NcclBackup::Headers);
        assert!(o.nccl_tokens);
        assert_eq!(o.nccl_merge_limit, 64 << 30);
        assert_eq!(o.nccl_chunk, 0);
        assert!(o.errors.is_empty());
        assert!(o.check().is_ok());
    }

    #[test]
    fn each_type_parses() {
        let o = opts(&[
            ("MEMSAVER_NCCL_TIMEOUT_MS", "250"),
            ("MEMSAVER_NCCL_BACKUP", "cpu"),
            ("MEMSAVER_NCCL_TOKENS", "0"),
            ("MEMSAVER_NCCL_MERGE_MB", "0"),
            ("MEMSAVER_NCCL_CHUNK_MB", "64"),
        ]);
        assert!(o.errors.is_empty(), "{:?}", o.errors);
        assert_eq!(o.nccl_timeout, Duration::from_millis(250));
        assert_eq!(o.nccl_backup, NcclBackup::Cpu);
        assert!(!o.nccl_tokens);
        assert_eq!(o.nccl_merge_limit, 0);
        assert_eq!(o.nccl_chunk, 64 << 20);
        // Blank is unset.
        assert!(opts(&[("MEMSAVER_NCCL_TOKENS", " ")]).nccl_tokens);
        assert_eq!(
            NcclBackup::NAMES,
            ["cpu", "mmap", "disk", "discard", "headers", "all"]
        );
        assert_eq!(
            opts(&[("MEMSAVER_NCCL_BACKUP", "all")]).nccl_backup,
            NcclBackup::All
        );
    }

    #[test]
    fn invalid_values_name_the_variable_and_the_accepted_values() {
        let cases: &[(&str, &str, &str)] = &[
            (
                "MEMSAVER_NCCL_TOKENS",
                "maybe",
                "MEMSAVER_NCCL_TOKENS='maybe': expected 0 or 1",
            ),
            (
                "MEMSAVER_NCCL_TIMEOUT_MS",
                "soon",
                "MEMSAVER_NCCL_TIMEOUT_MS='soon': expected a whole number from 1 to 86400000 (ms)",
            ),
            (
                "MEMSAVER_NCCL_TIMEOUT_MS",
                "0",
                "MEMSAVER_NCCL_TIMEOUT_MS='0': expected a whole number from 1 to 86400000 (ms)",
            ),
            (
                "MEMSAVER_NCCL_MERGE_MB",
                "65537",
                "MEMSAVER_NCCL_MERGE_MB='65537': expected a whole number from 0 to 65536 (MiB)",
            ),
            (
                "MEMSAVER_NCCL_BACKUP",
                "some",
                "MEMSAVER_NCCL_BACKUP='some': expected cpu, mmap, disk, discard, headers or all",
            ),
        ];
        for (var, v, want) in cases {
            assert_eq!(&error(&[(var, v)]), want);
        }
        // The default is kept meanwhile, and check() names it.
        let o = opts(&[("MEMSAVER_NCCL_TOKENS", "maybe")]);
        assert!(o.nccl_tokens);
        let e = o.check().unwrap_err().to_string();
        assert!(
            e.contains("MEMSAVER_NCCL_TOKENS='maybe': expected 0 or 1"),
            "{e}"
        );
        // Several at once: all of them.
        let o = opts(&[("MEMSAVER_NCCL_TOKENS", "x"), ("MEMSAVER_NCCL_BACKUP", "y")]);
        let e = o.check().unwrap_err().to_string();
        assert!(
            e.contains("MEMSAVER_NCCL_TOKENS='x'") && e.contains("MEMSAVER_NCCL_BACKUP='y'"),
            "{e}"
        );
    }

    /// This list is among those `memsaver_allocator::global` checks, with the cross-process
    /// layer's below it.
    #[test]
    fn global_checks_this_list_and_the_layers_below() {
        let headings: Vec<&str> = memsaver_allocator::OPTION_LAYERS
            .iter()
            .map(|l| l.heading)
            .collect();
        assert!(headings.contains(&LAYER.heading), "{headings:?}");
        assert!(
            headings.contains(&memsaver_ipc::options::LAYER.heading),
            "{headings:?}"
        );
    }
}
