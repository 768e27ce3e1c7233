//! The layers linked into libmemsaver.so add their start hooks and server routes to lists the
//! linker assembles (`memsaver_allocator::START_HOOKS`, `memsaver_ipc::server::ROUTES`): they
//! are in this test binary as in the library, and the allocator started through this crate
//! has the `nccl` tag (fake driver, via MEMSAVER_CUDA_LIB as set by `make test`).

use memsaver_ipc::server::{ROUTES, Service};

#[test]
fn every_layer_is_started_with_the_allocator() {
    let hooks: Vec<&str> = memsaver_allocator::START_HOOKS
        .iter()
        .map(|h| h.name)
        .collect();
    for hook in ["nccl", "control", "memsaver-ipc shared memory"] {
        assert!(hooks.contains(&hook), "{hook} missing from {hooks:?}");
    }
    let services: Vec<Service> = ROUTES.iter().map(|r| r.service).collect();
    for service in [Service::Buffers, Service::Control, Service::Shared] {
        assert!(
            services.contains(&service),
            "{service:?} missing from {services:?}"
        );
    }
    // nccl-hook's imports of peers' registered buffers, reached by owners' releases.
    assert_eq!(memsaver_ipc::shared::HOLDERS.len(), 1);
    let a = memsaver::allocator().expect("the allocator starts on the fake driver");
    assert!(
        a.stats().tags.iter().any(|t| t.tag == "nccl"),
        "the nccl tag is registered at start"
    );
}
