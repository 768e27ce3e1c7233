//! The 64 bytes of a CUDA IPC handle (`cudaIpcMemHandle_t`) of memsaver memory: magic `MSIP`,
//! version, the owner's identity (pid, start time, nonce) and group, the allocation's id there,
//! its **key** (64 random bits the owner drew when it first gave a handle of the allocation;
//! only the handle carries it) and its size as the giver saw it. The handle is an address, not
//! a proof: the owner refuses a request that does not name one of its allocations with that
//! key, and the receiver takes the size from the owner's answer, never from the handle.

use crate::identity::Identity;

/// Bytes of a `cudaIpcMemHandle_t`.
pub const HANDLE_BYTES: usize = 64;
const MAGIC: [u8; 4] = *b"MSIP";
const VERSION: u16 = 1;

/// A CUDA IPC handle of memory memsaver owns (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcHandle {
    pub owner: Identity,
    pub group: i64,
    pub id: u64,
    pub key: u64,
    pub size: u64,
}

impl IpcHandle {
    pub fn encode(&self) -> [u8; HANDLE_BYTES] {
        let mut b = [0u8; HANDLE_BYTES];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[8..12].copy_from_slice(&self.owner.pid.to_le_bytes());
        b[12..20].copy_from_slice(&self.owner.start.to_le_bytes());
        b[20..28].copy_from_slice(&self.owner.nonce.to_le_bytes());
        b[28..36].copy_from_slice(&self.group.to_le_bytes());
        b[36..44].copy_from_slice(&self.id.to_le_bytes());
        b[44..52].copy_from_slice(&self.key.to_le_bytes());
        b[52..60].copy_from_slice(&self.size.to_le_bytes());
        b
    }

    /// The handle `b` spells, or `None` when it is not one of memsaver's (a handle of the real
    /// CUDA runtime, or one with a version or reserved bytes this build does not know).
    pub fn decode(b: &[u8; HANDLE_BYTES]) -> Option<Self> {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if b[0..4] != MAGIC
            || u16::from_le_bytes([b[4], b[5]]) != VERSION
            || b[6..8] != [0, 0]
            || b[60..64] != [0; 4]
        {
            return None;
        }
        Some(Self {
            owner: Identity {
                pid: u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
                start: u64_at(12),
                nonce: u64_at(20),
            },
            group: u64_at(28) as i64,
            id: u64_at(36),
            key: u64_at(44),
            size: u64_at(52),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn handle() -> impl Strategy<Value = IpcHandle> {
        (
            any::<(u32, u64, u64)>(),
            any::<i64>(),
            any::<(u64, u64, u64)>(),
        )
            .prop_map(|((pid, start, nonce), group, (id, key, size))| IpcHandle {
                owner: Identity { pid, start, nonce },
                group,
                id,
                key,
                size,
            })
    }

    /// The bytes outside the fields: magic, version, reserved.
    const CHECKED: [usize; 12] = [0, 1, 2, 3, 4, 5, 6, 7, 60, 61, 62, 63];

    proptest! {
        #[test]
        fn handles_round_trip(h in handle()) {
            prop_assert_eq!(IpcHandle::decode(&h.encode()), Some(h));
        }

        /// A real handle with any change to its magic, version or reserved bytes (another
        /// runtime's handle, another version) is not taken for one: the caller forwards it to
        /// libcudart.
        #[test]
        fn a_changed_header_or_reserved_byte_is_not_a_handle(
            h in handle(),
            at in proptest::sample::select(CHECKED.to_vec()),
            flip in 1u8..,
        ) {
            let mut b = h.encode();
            b[at] ^= flip;
            prop_assert_eq!(IpcHandle::decode(&b), None);
        }

        /// Random bytes decode exactly when their header and reserved bytes are memsaver's.
        #[test]
        fn random_bytes_decode_only_with_memsavers_header(
            b in proptest::collection::vec(any::<u8>(), HANDLE_BYTES),
        ) {
            let b: [u8; HANDLE_BYTES] = b.try_into().expect("64 bytes");
            let ours = b[0..4] == MAGIC && b[4..6] == VERSION.to_le_bytes() && b[6..8] == [0, 0]
                && b[60..64] == [0; 4];
            prop_assert_eq!(IpcHandle::decode(&b).is_some(), ours);
        }
    }

    #[test]
    fn the_real_runtimes_zero_handle_is_not_one() {
        assert_eq!(IpcHandle::decode(&[0; HANDLE_BYTES]), None);
    }
}
