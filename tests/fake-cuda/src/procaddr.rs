//! Name resolution for `cuGetProcAddress(_v2)`.
//!
//! Callers (cudart, NCCL) ask for *base* names ("cuMemGetInfo") together with the CUDA version
//! they were built for; the driver hands back the newest ABI variant that version knows
//! ("cuMemGetInfo_v2"). Exact names of this library's exports are accepted too.

use std::ffi::{c_int, c_void};

/// CUDA version from which a base name resolves to its `_v2` variant, where it is not the
/// default of "any version this fake can meet".
fn v2_since(base: &str) -> c_int {
    match base {
        // CUDA 12.0 changed cuGetProcAddress's signature (added the status out-parameter).
        "cuGetProcAddress" => 12000,
        "cuDevicePrimaryCtxRelease" => 11000,
        _ => 0,
    }
}

/// The export that `symbol` names for a caller built against `cuda_version`.
pub fn resolve(
    symbol: &str,
    cuda_version: c_int,
    exported: impl Fn(&str) -> Option<*mut c_void>,
) -> Option<*mut c_void> {
    // Renamed, not versioned: CUDA 12.0 made `cuGraphInstantiate` mean the flags form.
    if symbol == "cuGraphInstantiate" {
        return exported(if cuda_version >= 12000 {
            "cuGraphInstantiateWithFlags"
        } else {
            "cuGraphInstantiate_v2"
        });
    }
    let versioned = symbol
        .rsplit_once("_v")
        .is_some_and(|(_, n)| n.parse::<u32>().is_ok());
    if !versioned
        && cuda_version >= v2_since(symbol)
        && let Some(p) = exported(&format!("{symbol}_v2"))
    {
        return Some(p);
    }
    exported(symbol)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(name: &str) -> Option<*mut c_void> {
        let known = [
            "cuMemGetInfo",
            "cuMemGetInfo_v2",
            "cuGetProcAddress",
            "cuGetProcAddress_v2",
            "cuInit",
        ];
        known
            .iter()
            .position(|k| *k == name)
            .map(|i| std::ptr::without_provenance_mut(i + 1))
    }

    #[test]
    fn base_names_get_v2() {
        assert_eq!(
            resolve("cuMemGetInfo", 12080, table),
            table("cuMemGetInfo_v2")
        );
        assert_eq!(
            resolve("cuMemGetInfo_v2", 12080, table),
            table("cuMemGetInfo_v2")
        );
        assert_eq!(resolve("cuInit", 12080, table), table("cuInit"));
        assert_eq!(
            resolve("cuGetProcAddress", 12080, table),
            table("cuGetProcAddress_v2")
        );
        assert_eq!(
            resolve("cuGetProcAddress", 11080, table),
            table("cuGetProcAddress")
        );
        assert_eq!(resolve("cuNothing", 12080, table), None);
    }
}
