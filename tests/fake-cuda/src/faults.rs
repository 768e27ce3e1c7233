//! Fault injection: make the Nth call of an operation fail once.
//!
//! Every call of the operation is counted, including calls that fail validation, so "the 3rd
//! `cuMemCreate`" means the 3rd time the function was entered. A trigger fires once and is then
//! disarmed.

use parking_lot::Mutex;

/// One injectable operation.
pub struct Fault {
    /// Guards the call counter and the armed call number together, so that a trigger set by
    /// `fakecuda_fail_*_at` from one thread and calls counted on others never disagree.
    inner: Mutex<FaultInner>,
}

struct FaultInner {
    /// Calls counted so far in this process.
    calls: u64,
    /// The call number (in `calls` terms) that will fail; `None` when disarmed.
    fail_at: Option<u64>,
    /// Whether the environment knob has been applied (it is applied on first use).
    env_applied: bool,
}

pub static CREATE: Fault = Fault::new();
pub static MAP: Fault = Fault::new();
/// Run-time control only (`fakecuda_fail_unmap_at`): makes a pause fail half-way.
pub static UNMAP: Fault = Fault::new();
/// Run-time control only (`fakecuda_fail_reserve_at`): a `cuMemAddressReserve` that fails with
/// `CUDA_ERROR_OUT_OF_MEMORY` although address space is free, as the real driver once did for
/// a 47.5 GiB reservation at a hint on a two-GPU H100 host.
pub static RESERVE: Fault = Fault::new();

/// Run-time control only (`fakecuda_fail_creates_over`): every `cuMemCreate` of more than this
/// many bytes fails with `CUDA_ERROR_OUT_OF_MEMORY` (0: none), as on a device with only that
/// much memory free, while smaller ones succeed.
pub static CREATE_LIMIT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Run-time control only (`fakecuda_fail_registers_over`): a `cuMemHostRegister` that would
/// take the bytes registered in this process over this many fails with
/// `CUDA_ERROR_OUT_OF_MEMORY` (0: none), as on a host that cannot lock more memory.
pub static REGISTER_LIMIT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Whether a `cuMemCreate` of `size` bytes is over [`CREATE_LIMIT`].
pub fn over_create_limit(size: u64) -> bool {
    let limit = CREATE_LIMIT.load(std::sync::atomic::Ordering::Relaxed);
    limit > 0 && size > limit
}

impl Fault {
    const fn new() -> Self {
        Self {
            inner: Mutex::new(FaultInner {
                calls: 0,
                fail_at: None,
                env_applied: false,
            }),
        }
    }

    /// Counts one call; true when this call must fail. `env_nth` is the knob's value, applied
    /// once (the Nth call of the process).
    pub fn hit(&self, env_nth: Option<u64>) -> bool {
        let mut f = self.inner.lock();
        f.apply_env(env_nth);
        f.calls += 1;
        if f.fail_at == Some(f.calls) {
            f.fail_at = None;
            true
        } else {
            false
        }
    }

    /// Arms the trigger: the `n`th call from now fails; 0 disarms.
    pub fn arm(&self, n: u32) {
        let mut f = self.inner.lock();
        // A trigger set at run time replaces the knob's.
        f.env_applied = true;
        f.fail_at = (n > 0).then(|| f.calls + u64::from(n));
    }

    /// Disarms the trigger (the knob too, if it has not fired yet).
    pub fn reset(&self) {
        let mut f = self.inner.lock();
        f.env_applied = true;
        f.fail_at = None;
    }
}

impl FaultInner {
    fn apply_env(&mut self, env_nth: Option<u64>) {
        if !self.env_applied {
            self.env_applied = true;
            self.fail_at = env_nth;
        }
    }
}
