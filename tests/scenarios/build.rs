//! Tells the scenario tests whether this machine lets this user make pid namespaces with
//! `unshare` (as the tests do). Where it does not, `cfg(no_pid_namespaces)` marks the tests
//! that need them ignored, with the reason, and the build says why: they never pass without
//! running. CI runs as root, where they run.

use std::process::Command;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(no_pid_namespaces)");
    println!("cargo::rerun-if-changed=build.rs");
    let probes: [&[&str]; 2] = [
        &["--user", "--map-root-user", "--pid", "--fork", "true"],
        &[
            "--user",
            "--map-root-user",
            "--pid",
            "--fork",
            "--mount-proc",
            "true",
        ],
    ];
    for args in probes {
        let why = match Command::new("unshare").args(args).output() {
            Ok(o) if o.status.success() => continue,
            Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_owned(),
            Err(e) => e.to_string(),
        };
        println!("cargo::rustc-cfg=no_pid_namespaces");
        println!(
            "cargo::warning=`unshare {}` fails here ({why}): the scenario tests that need pid \
             namespaces are ignored",
            args.join(" ")
        );
        return;
    }
}
