//! Every option of memsaver: the registry of each layer's list ([`LAYERS`]), and the lists of
//! the options no layer of libmemsaver.so reads, the Python package's ([`python`]) and the test
//! suite's ([`testing`]). They are here, at the top of the library that links every layer and
//! that the Python package loads, rather than in the core, which has no business with Python.
//!
//! Each layer declares its own options with `memsaver_allocator::declare_options!` (the rules
//! every list follows, aliases, unset and invalid values, are in `memsaver_allocator::options`):
//! the core (`memsaver_allocator::options`), the NCCL hook (`memsaver_nccl_hook::options`), and
//! the two lists here. From the registry come the `memsaver options` command ([`markdown`]),
//! [`validate_all`], docs/options.md (`make options-doc`; a test fails when it drifts) and the
//! test that every `MEMSAVER_*` name in the Python package and the Rust sources is in a list.

use memsaver_allocator::Result;
use memsaver_allocator::options::{Layer, OptionDoc, check_messages};

/// The options the Python package reads itself (`Reader::Python`), listed here for the
/// documentation and [`validate_all`].
pub mod python {
    memsaver_allocator::declare_options! {
        layer "The Python package", "";

        /// Empty: nothing in Rust reads these options.
        pub struct Options {}

        options {
            /// auto (preload if libmemsaver.so is preloaded, else inprocess), preload (fail with
            /// instructions unless preloaded) or inprocess
            HOOK_MODE = "MEMSAVER_HOOK_MODE", one_of("auto", "preload", "inprocess"),
                default "auto", Python;

            /// 1 makes `import torch_memory_saver` give memsaver.compat in every Python process
            /// that sees it (read at interpreter start by the wheel's .pth file; says so on
            /// stderr when it shadows an installed torch_memory_saver)
            TORCH_MEMORY_SAVER = "MEMSAVER_TORCH_MEMORY_SAVER", bool, default "0", Python;

            /// record pause/resume events (memsaver.timeline) and write them to this JSON file,
            /// {pid} replaced by the process id, at exit and on timeline.save(); `python -m
            /// memsaver timeline` charts them
            TIMELINE = "MEMSAVER_TIMELINE", path, unset "(none)", Python;

            /// 1 makes the vLLM plugin (memsaver.vllm, a vllm.general_plugins entry point of
            /// the wheel) put vLLM's sleep-mode allocator on memsaver in every vLLM process that
            /// sees it; `--sleep-mode-backend memsaver` sets it for the engine's processes
            /// (docs/integrations.md)
            VLLM = "MEMSAVER_VLLM", bool, default "0", Python;
        }
    }
}

/// The options of the test suite and of the `memsaver` command's fake-driver fallback (and of
/// `bench nccl --fake`'s fake NCCL)
/// (`Reader::Testing`).
pub mod testing {
    memsaver_allocator::declare_options! {
        layer "Testing", "Read by the test suite and the `memsaver` command only.";

        /// Empty: `crate::cli` reads its one option itself (an unset variable there means the
        /// fake driver beside the library).
        pub struct Options {}

        options {
            /// the fake driver the `memsaver` command (demo, bench) falls back to when there is
            /// no GPU (`make test` sets it)
            FAKE_CUDA_LIB = "MEMSAVER_FAKE_CUDA_LIB", path,
                unset "_fake/libcuda.so.1 beside libmemsaver.so (the wheel's), else target/fake-cuda/libcuda.so.1", Testing;
            /// the fake NCCL (tests/fake-nccl, not in the wheel) that `memsaver bench nccl
            /// --fake` and the tests load (`make test` sets it)
            FAKE_NCCL_LIB = "MEMSAVER_FAKE_NCCL_LIB", path,
                unset "target/fake-nccl/libnccl.so.2 beside the fake driver", Testing;
        }
    }
}

/// Every layer's list, in the order of docs/options.md.
pub const LAYERS: &[Layer] = &[
    memsaver_allocator::options::LAYER,
    memsaver_nccl_hook::options::LAYER,
    memsaver_ipc::options::LAYER,
    python::LAYER,
    testing::LAYER,
];

/// Every option, layer by layer.
pub fn all() -> impl Iterator<Item = &'static OptionDoc> {
    LAYERS.iter().flat_map(|l| l.options)
}

/// The option of variable `name`, or of which `name` is an alias.
pub fn find(name: &str) -> Option<&'static OptionDoc> {
    all().find(|o| o.env == name || o.aliases.contains(&name))
}

/// The options libmemsaver.so reads, of every layer, must all be valid for an operation to
/// run: the error names every invalid variable and what it accepts.
pub fn check() -> Result<()> {
    let errors: Vec<String> = LAYERS.iter().flat_map(|l| (l.errors)()).collect();
    check_messages(&errors)
}

/// Every invalid variable of every list in `get`, one message each: those libmemsaver.so reads
/// (as the layers' `errors`), the log filter, and the Python package's and the tests'.
pub fn validate(get: impl Fn(&str) -> Option<String>) -> Vec<String> {
    LAYERS.iter().flat_map(|l| (l.validate)(&get)).collect()
}

/// [`validate`] of this process's environment.
pub fn validate_all() -> Vec<String> {
    validate(|name| std::env::var(name).ok())
}

const DOC_HEAD: &str = "\
# Options

<!-- Generated from the option list of each layer (allocator/src/options.rs, ipc/src/options.rs, nccl-hook/src/options.rs, torch-shim/src/options.rs) by `make options-doc` (`memsaver options` prints the same); edit the lists there, not this file. -->

Every option is an environment variable. libmemsaver.so (the allocator, the NCCL hook and the C
ABI) reads its options once, on first use; the Python package reads its own when it needs them.
An alias (torch_memory_saver's `TMS_*`, AMem's `AMEM_GROUPID`) is read when the `MEMSAVER_*`
variable is not set: the `MEMSAVER_*` variable wins. Unset and empty are the same.

An invalid value is an error, never a silent default. For libmemsaver.so's options the first
memsaver operation (malloc, pause, resume, a region, stats, ...) fails with a message that names
every invalid variable and what it accepts, for example
`MEMSAVER_NCCL_TOKENS='maybe': expected 0 or 1`; NCCL's own calls, which cannot fail on our
account, go on with the default meanwhile. The exception is `MEMSAVER_LOG`: the logger starts
where no error can be returned, so an invalid filter is one warning line on stderr and the
default. The Python package's options raise `memsaver.MemsaverError` in the call that needs them
(`MEMSAVER_TORCH_MEMORY_SAVER`, read at interpreter start, warns on stderr and stays off
instead).

";

const DOC_TAIL: &str = "
Not options: the fake driver's own variables (`FAKE_CUDA_DIR`, `FAKE_CUDA_MEM_BYTES`,
`FAKE_CUDA_DEVICES`, ..., read by `tests/fake-cuda`, a stand-in for libcuda that knows nothing of
memsaver) and the variables of other programs that memsaver looks at (`NCCL_CUMEM_ENABLE`,
`XDG_RUNTIME_DIR`).
";

/// docs/options.md, all of it: one section per layer.
pub fn markdown() -> String {
    let sections: Vec<String> = LAYERS.iter().map(Layer::markdown).collect();
    format!("{DOC_HEAD}{}{DOC_TAIL}", sections.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use memsaver_allocator::options::{Kind, Reader};
    use std::path::{Path, PathBuf};

    use memsaver_allocator::options::lookup_in as lookup;

    #[test]
    fn every_typed_default_is_a_value_its_kind_accepts() {
        use memsaver_allocator::options::{BACKUP_PREPARE_MB, RETAIN_BACKUP};
        for o in all() {
            if matches!(o.kind, Kind::Bool | Kind::Int { .. } | Kind::Enum(_))
                && o.env != RETAIN_BACKUP.env
                && o.env != BACKUP_PREPARE_MB.env
            {
                assert_eq!(o.check(o.env, o.default), Ok(()), "{}", o.env);
            }
        }
    }

    #[test]
    fn names_are_unique_and_all_memsaver() {
        let mut names: Vec<&str> = all()
            .flat_map(|o| std::iter::once(&o.env).chain(o.aliases))
            .copied()
            .collect();
        assert!(all().all(|o| o.env.starts_with("MEMSAVER_")));
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n, "a name is listed twice");
    }

    /// Options are declared by the layer that reads them.
    #[test]
    fn each_layer_lists_its_own_readers_options() {
        let layer = |name| {
            LAYERS
                .iter()
                .position(|l| l.options.iter().any(|o| o.env == name))
                .unwrap()
        };
        assert_eq!(layer("MEMSAVER_CUDA_LIB"), 0);
        assert_eq!(layer("MEMSAVER_NCCL_BACKUP"), 1);
        assert_eq!(layer("MEMSAVER_NCCL_TOKENS"), 1);
        assert_eq!(layer("MEMSAVER_RUNTIME_DIR"), 2);
        assert_eq!(layer("MEMSAVER_GROUP"), 2);
        assert!(python::OPTIONS.iter().all(|o| o.reader == Reader::Python));
        assert!(testing::OPTIONS.iter().all(|o| o.reader == Reader::Testing));
        for l in &LAYERS[..3] {
            assert!(l.options.iter().all(|o| o.reader == Reader::Library));
        }
    }

    #[test]
    fn validate_checks_every_option_of_the_table() {
        let errors = validate(lookup(&[
            ("MEMSAVER_HOOK_MODE", "sometimes"),
            ("MEMSAVER_TORCH_MEMORY_SAVER", "yes"),
            ("MEMSAVER_NCCL_TOKENS", "maybe"),
            ("MEMSAVER_LOG", "a=b=c"),
            ("MEMSAVER_TIMELINE", "/tmp/t.json"),
        ]));
        assert_eq!(errors.len(), 4, "{errors:?}");
        assert!(errors.contains(
            &"MEMSAVER_HOOK_MODE='sometimes': expected auto, preload or inprocess".to_owned()
        ));
        assert!(errors.contains(&"MEMSAVER_TORCH_MEMORY_SAVER='yes': expected 0 or 1".to_owned()));
        assert!(errors.iter().any(|e| e.starts_with("MEMSAVER_LOG='a=b=c'")));
        assert!(validate(lookup(&[])).is_empty());
    }

    fn repo() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
    }

    /// Drift between the lists and docs/options.md.
    #[test]
    fn docs_options_md_is_generated_from_the_table() {
        let path = repo().join("docs/options.md");
        if std::env::var_os("WRITE_OPTIONS_DOC").is_some() {
            std::fs::write(&path, markdown()).expect("write docs/options.md");
        }
        let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            on_disk == markdown(),
            "docs/options.md differs from the option lists (allocator/src/options.rs, \
             nccl-hook/src/options.rs, torch-shim/src/options.rs): run `make options-doc` and \
             commit the result"
        );
    }

    /// Every `MEMSAVER_*` name in `dir`'s files ending in `ext`.
    fn names_in(dir: &Path, ext: &str, out: &mut Vec<(String, PathBuf)>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                names_in(&p, ext, out);
            } else if p.extension().is_some_and(|x| x == ext) {
                let text = std::fs::read_to_string(&p).unwrap_or_default();
                for (i, _) in text.match_indices("MEMSAVER_") {
                    let name: String = text[i..]
                        .chars()
                        .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                        .collect();
                    // Not variables: the C ABI's status codes (MEMSAVER_OK, MEMSAVER_ERR_*)
                    // and the pause guard's event codes (MEMSAVER_GUARD_*).
                    let status = name == "MEMSAVER_OK"
                        || name.starts_with("MEMSAVER_ERR_")
                        || name.starts_with("MEMSAVER_GUARD_");
                    if !name.ends_with('_') && !status {
                        out.push((name, p.clone()));
                    }
                }
            }
        }
    }

    /// The Python package and the Rust code name no variable the lists lack.
    #[test]
    fn every_memsaver_variable_in_the_sources_is_in_the_table() {
        let mut found = Vec::new();
        names_in(&repo().join("python/memsaver"), "py", &mut found);
        names_in(&repo().join("python"), "pth", &mut found);
        for dir in [
            "allocator/src",
            "ipc/src",
            "nccl-hook/src",
            "torch-shim/src",
            "python/src",
        ] {
            names_in(&repo().join(dir), "rs", &mut found);
        }
        assert!(found.iter().any(|(n, _)| n == "MEMSAVER_HOOK_MODE"));
        let missing: Vec<String> = found
            .iter()
            .filter(|(n, _)| find(n).is_none())
            .map(|(n, p)| format!("{n} ({})", p.display()))
            .collect();
        assert!(
            missing.is_empty(),
            "in no option list (allocator/src/options.rs, nccl-hook/src/options.rs, \
             torch-shim/src/options.rs): {missing:?}"
        );
    }
}
