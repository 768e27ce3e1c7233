//! Puts the two shared libraries the wheel carries next to the Python package, so that every
//! standard build (`pip install ./python`, `pip wheel ./python`, `maturin build`) ships them:
//!
//! * `memsaver/libmemsaver.so`: the library the package loads (or the process preloads);
//! * `memsaver/_fake/libcuda.so.1`: the fake CUDA driver (host memory behind the driver API),
//!   an opt-in test asset: `memsaver demo --fake` and `MEMSAVER_CUDA_LIB` use it without a GPU.
//!
//! They are built by a nested `cargo build` of the workspace into `target/bundle` (its own target
//! directory: the outer build holds the lock of the usual one). The Makefile has built them
//! already and says where with `MEMSAVER_BUNDLE_FROM` (every cargo command it runs, so that a
//! workspace build or `cargo test` never starts the nested build): nothing is built twice.

use std::path::{Path, PathBuf};
use std::process::Command;

const LIBS: [(&str, &str); 2] = [
    ("libmemsaver.so", "memsaver/libmemsaver.so"),
    ("libcuda.so", "memsaver/_fake/libcuda.so.1"),
];

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let workspace = manifest
        .parent()
        .expect("python/ lies in the workspace")
        .to_path_buf();
    println!("cargo:rerun-if-env-changed=MEMSAVER_BUNDLE_FROM");
    for dir in [
        "allocator",
        "ipc",
        "nccl-hook",
        "torch-shim",
        "profile",
        "tests/fake-cuda",
    ] {
        println!(
            "cargo:rerun-if-changed={}",
            workspace.join(dir).join("src").display()
        );
    }
    // The packing kernels' PTX, which the allocator embeds.
    println!(
        "cargo:rerun-if-changed={}",
        workspace.join("allocator/kernels/pack.ptx").display()
    );
    let handed = std::env::var_os("MEMSAVER_BUNDLE_FROM").map(|dir| workspace.join(dir));
    let from = match &handed {
        Some(dir) => dir.clone(),
        None => build(&workspace),
    };
    for (built, packaged) in LIBS {
        let (src, dst) = (from.join(built), manifest.join(packaged));
        if handed.is_some() {
            // Rerun whenever the handed library changes (or, while it does not exist yet,
            // on every build: a workspace build may compile this crate before the library).
            println!("cargo:rerun-if-changed={}", src.display());
            if !src.exists() {
                println!(
                    "cargo:warning={} is not built yet: the package keeps the copy it has",
                    src.display()
                );
                continue;
            }
        }
        if let Some(parent) = dst.parent() {
            std::fs::create_dir_all(parent).expect("create the package directory");
        }
        // Copy to a temporary name, then rename: a loaded library is never overwritten in place.
        let tmp = dst.with_extension("tmp");
        std::fs::copy(&src, &tmp)
            .unwrap_or_else(|e| panic!("cannot copy {} into the package: {e}", src.display()));
        std::fs::rename(&tmp, &dst).expect("move the library into place");
    }
}

/// Builds libmemsaver.so and the fake driver; returns the directory that holds them.
fn build(workspace: &Path) -> PathBuf {
    let target = workspace.join("target").join("bundle");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .current_dir(workspace)
        .args([
            "build",
            "--release",
            "--lib",
            "-p",
            "memsaver-shim",
            "-p",
            "fake-cuda",
        ])
        .arg("--target-dir")
        .arg(&target)
        // The outer build's settings are for the extension, not for these libraries.
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_TARGET")
        .status()
        .expect("run cargo to build libmemsaver.so");
    assert!(
        status.success(),
        "building libmemsaver.so and the fake driver failed"
    );
    target.join("release")
}
