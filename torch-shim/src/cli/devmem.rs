//! Filling and checking device memory with a reproducible pattern, through a pinned staging
//! buffer. Used by `demo` and `bench` to prove contents survive a pause/resume bit for bit.

use std::sync::Arc;

use memsaver_allocator::driver::{Context, Driver, Stream};

pub struct Staging {
    driver: Arc<Driver>,
    ctx: Context,
    stream: Stream,
    buf: *mut u8,
    len: usize,
}

fn word(seed: u64, index: u64) -> u64 {
    // splitmix64 of (seed, index): cheap, and every word of every allocation differs.
    let mut z =
        seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ index.wrapping_add(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(16)
}

impl Staging {
    pub fn new(driver: &Arc<Driver>, device: i32, len: usize) -> Result<Self, String> {
        let ctx = driver.primary_context(device).map_err(|e| e.to_string())?;
        let stream = driver
            .with_context(ctx, || driver.stream_create())
            .map_err(|e| e.to_string())?;
        let buf = driver
            .with_context(ctx, || driver.host_alloc(len))
            .map_err(|e| e.to_string())?;
        Ok(Self {
            driver: driver.clone(),
            ctx,
            stream,
            buf,
            len,
        })
    }

    fn host(&mut self, n: usize) -> &mut [u64] {
        // SAFETY: `buf` is `len` bytes of pinned memory owned by self, 4 KiB aligned, n <= len.
        unsafe { std::slice::from_raw_parts_mut(self.buf.cast::<u64>(), n / 8) }
    }

    fn chunks(&self, size: usize) -> impl Iterator<Item = (usize, usize)> + use<> {
        let len = self.len;
        (0..size)
            .step_by(len)
            .map(move |off| (off, len.min(size - off)))
    }

    /// Writes the pattern for `seed` over `size` bytes at `ptr`.
    pub fn fill(&mut self, ptr: u64, size: usize, seed: u64) -> Result<(), String> {
        for (off, n) in self.chunks(size) {
            let first = (off / 8) as u64;
            let words = self.host(n);
            par_chunks(words, |base, part| {
                for (i, w) in part.iter_mut().enumerate() {
                    *w = word(seed, first + base + i as u64);
                }
                true
            });
            let (d, s, buf) = (&self.driver, self.stream, self.buf);
            d.with_context(self.ctx, || {
                // SAFETY: `ptr+off..+n` is mapped device memory of the caller's allocation and
                // `buf` holds `n` bytes; we wait for the copy before touching `buf` again.
                unsafe { d.copy_htod_async(ptr + off as u64, buf, n, s) }?;
                d.stream_synchronize(s)
            })
            .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Checks that `size` bytes at `ptr` hold the pattern for `seed`.
    pub fn verify(&mut self, ptr: u64, size: usize, seed: u64) -> Result<(), String> {
        for (off, n) in self.chunks(size) {
            let (d, s, buf) = (&self.driver, self.stream, self.buf);
            d.with_context(self.ctx, || {
                // SAFETY: as in `fill`, in the other direction.
                unsafe { d.copy_dtoh_async(buf, ptr + off as u64, n, s) }?;
                d.stream_synchronize(s)
            })
            .map_err(|e| e.to_string())?;
            let first = (off / 8) as u64;
            let words = self.host(n);
            let ok = par_chunks(words, |base, part| {
                part.iter()
                    .enumerate()
                    .all(|(i, w)| *w == word(seed, first + base + i as u64))
            });
            if !ok {
                return Err(format!(
                    "contents of the allocation at {ptr:#x} differ from what was written \
                     (bytes {off}..{})",
                    off + n
                ));
            }
        }
        Ok(())
    }
}

/// Runs `f(first_index, part)` over `words` split across threads; true if every call was.
fn par_chunks(words: &mut [u64], f: impl Fn(u64, &mut [u64]) -> bool + Sync) -> bool {
    let per = words.len().div_ceil(threads()).max(1);
    std::thread::scope(|s| {
        let handles: Vec<_> = words
            .chunks_mut(per)
            .enumerate()
            .map(|(k, part)| {
                let f = &f;
                s.spawn(move || f((k * per) as u64, part))
            })
            .collect();
        handles.into_iter().all(|h| h.join().unwrap_or(false))
    })
}

impl Drop for Staging {
    fn drop(&mut self) {
        // SAFETY: every copy touching `buf` was synchronised before returning.
        let _ = unsafe { self.driver.host_free(self.buf) };
        let _ = self
            .driver
            .with_context(self.ctx, || self.driver.stream_destroy(self.stream));
    }
}
