//! The knobs: every environment variable the fake reads, in one table, read once at first use.
//!
//! | env var                    | default                                   | meaning                                     |
//! | -------------------------- | ----------------------------------------- | ------------------------------------------- |
//! | `FAKE_CUDA_DEVICES`        | 2                                         | number of devices (1..=64; 0 = no device)   |
//! | `FAKE_CUDA_MEM_BYTES`      | 8GiB                                      | memory per device; bytes or `512MiB`, `8GiB` |
//! | `FAKE_CUDA_DIR`            | `/dev/shm/fake-cuda-<uid>` (else tmp dir) | state shared by all processes of one "machine" |
//! | `FAKE_CUDA_FAIL_CREATE_AT` | unset                                     | the Nth `cuMemCreate` of the process fails  |
//! | `FAKE_CUDA_FAIL_MAP_AT`    | unset                                     | the Nth `cuMemMap` of the process fails     |
//! | `FAKE_CUDA_PIN_MS_PER_GIB` | 100                                       | how long pinning holds the driver lock, per GiB |
//! | `FAKE_CUDA_FRESH`          | `zeros`                                   | what new device memory holds: `zeros`, or `junk` (0xA5 bytes: the driver promises nothing) |
//! | `FAKE_CUDA_HOST_POINTER`   | 1                                         | 0: the device does not reach registered host memory at its host address (no packed backups) |

use std::path::PathBuf;
use std::sync::OnceLock;

/// Most devices the fake pretends to have (the primary-context tokens are a static array).
pub const MAX_DEVICES: usize = 64;

/// The configuration of this process, fixed at first use.
#[derive(Debug, Clone)]
pub struct Config {
    pub devices: i32,
    pub mem_bytes: u64,
    pub dir: PathBuf,
    pub fail_create_at: Option<u64>,
    pub fail_map_at: Option<u64>,
    /// Milliseconds a pinning call holds the driver lock per GiB it pins (`pinning`).
    pub pin_ms_per_gib: u64,
    /// New device memory is filled with [`JUNK`] instead of zeros: the driver does not say what
    /// `cuMemCreate` returns, so code that needs zeros must write them.
    pub fresh_junk: bool,
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`.
    pub host_pointer: bool,
}

/// The byte new device memory holds under `FAKE_CUDA_FRESH=junk`.
pub const JUNK: u8 = 0xA5;

/// The configuration, or the message saying which knob is malformed.
pub fn get() -> Result<&'static Config, &'static str> {
    static CONFIG: OnceLock<Result<Config, String>> = OnceLock::new();
    CONFIG
        .get_or_init(|| Config::from_env(|name| std::env::var(name).ok()))
        .as_ref()
        .map_err(String::as_str)
}

impl Config {
    fn from_env(var: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        let devices = match var("FAKE_CUDA_DEVICES") {
            None => 2,
            Some(s) => match s.trim().parse::<i32>() {
                Ok(n) if (0..=MAX_DEVICES as i32).contains(&n) => n,
                _ => return Err(format!("FAKE_CUDA_DEVICES={s:?}: want 0..={MAX_DEVICES}")),
            },
        };
        let mem_bytes = match var("FAKE_CUDA_MEM_BYTES") {
            None => 8 << 30,
            Some(s) => parse_bytes(&s).ok_or_else(|| {
                format!("FAKE_CUDA_MEM_BYTES={s:?}: want e.g. 8589934592, 512MiB, 8GiB")
            })?,
        };
        let dir = match var("FAKE_CUDA_DIR") {
            Some(d) if !d.is_empty() => PathBuf::from(d),
            _ => default_dir(),
        };
        Ok(Self {
            devices,
            mem_bytes,
            dir,
            fail_create_at: parse_nth(var("FAKE_CUDA_FAIL_CREATE_AT"), "FAKE_CUDA_FAIL_CREATE_AT")?,
            fail_map_at: parse_nth(var("FAKE_CUDA_FAIL_MAP_AT"), "FAKE_CUDA_FAIL_MAP_AT")?,
            pin_ms_per_gib: match var("FAKE_CUDA_PIN_MS_PER_GIB") {
                None => 100,
                Some(s) => s.trim().parse().map_err(|_| {
                    format!("FAKE_CUDA_PIN_MS_PER_GIB={s:?}: want a whole number of ms")
                })?,
            },
            fresh_junk: match var("FAKE_CUDA_FRESH").as_deref().map(str::trim) {
                None | Some("zeros") => false,
                Some("junk") => true,
                Some(s) => return Err(format!("FAKE_CUDA_FRESH={s:?}: want zeros or junk")),
            },
            host_pointer: match var("FAKE_CUDA_HOST_POINTER").as_deref().map(str::trim) {
                None | Some("1") => true,
                Some("0") => false,
                Some(s) => return Err(format!("FAKE_CUDA_HOST_POINTER={s:?}: want 0 or 1")),
            },
        })
    }

    /// Directory holding device `dev`'s physical allocations.
    pub fn device_dir(&self, dev: i32) -> PathBuf {
        self.dir.join(format!("dev{dev}"))
    }

    /// Directory holding host (`HOST`/`HOST_NUMA`) physical allocations.
    pub fn host_dir(&self) -> PathBuf {
        self.dir.join("host")
    }
}

fn default_dir() -> PathBuf {
    // SAFETY: getuid has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    let shm = std::path::Path::new("/dev/shm");
    let base = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    base.join(format!("fake-cuda-{uid}"))
}

/// `N` in 1.. (the Nth call fails); unset, empty or 0 mean "never".
fn parse_nth(value: Option<String>, name: &str) -> Result<Option<u64>, String> {
    match value.as_deref().map(str::trim) {
        None | Some("") => Ok(None),
        Some(s) => match s.parse::<u64>() {
            Ok(0) => Ok(None),
            Ok(n) => Ok(Some(n)),
            Err(_) => Err(format!(
                "{name}={s:?}: want a call number (1 = the first call)"
            )),
        },
    }
}

/// Plain bytes, or a number with a unit: `K`/`KiB`, `M`/`MiB`, `G`/`GiB`, `T`/`TiB` (powers of
/// 1024) or `KB`, `MB`, `GB`, `TB` (powers of 1000). Case-insensitive, spaces allowed.
pub fn parse_bytes(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    let n: u64 = digits.parse().ok()?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return None,
    };
    n.checked_mul(mult)
}
