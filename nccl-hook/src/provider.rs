//! The `nccl` tag: pause releases the device memory behind NCCL's virtual handles, resume
//! creates new memory behind the same handles at the same addresses and restores it.
//!
//! This stage pauses what one process can release on its own: device memory NCCL created and
//! never exported. Exported buffers (mapped by peer processes) and imports of peers' buffers
//! stay resident until the cross-process protocol exists; [`crate::stats`] reports them.

use std::time::Instant;

use memsaver_allocator::backup::HostBuffer;
use memsaver_allocator::driver::Handle;
use memsaver_allocator::{Allocator, DeviceUsage, Error, ExternalTag, Report, Result, Usage};

use crate::registry::{self, Kind, Registry};

pub struct NcclTag {
    allocator: &'static Allocator,
}

impl NcclTag {
    pub fn new(allocator: &'static Allocator) -> Self {
        Self { allocator }
    }
}

/// The virtual handles pause may release now, with their devices, in address order.
fn pausable(reg: &Registry) -> Vec<u64> {
    let mut v: Vec<u64> = reg
        .physicals
        .iter()
        .filter(|(vh, p)| {
            p.real.is_some() && p.pausable().is_ok() && reg.mappings.values().any(|m| m.vh == **vh)
        })
        .map(|(vh, _)| *vh)
        .collect();
    v.sort_unstable();
    v
}

/// The mappings of `vh`: (address, size).
fn mappings_of(reg: &Registry, vh: u64) -> Vec<(u64, u64)> {
    reg.mappings
        .iter()
        .filter(|(_, m)| m.vh == vh)
        .map(|(p, m)| (*p, m.size))
        .collect()
}

fn report(allocations: usize, bytes: u64, start: Instant) -> Report {
    Report {
        tags: vec!["nccl".into()],
        allocations,
        bytes,
        copied_bytes: bytes,
        elapsed: start.elapsed(),
    }
}

impl ExternalTag for NcclTag {
    fn pause(&self) -> Result<Report> {
        let start = Instant::now();
        let a = self.allocator;
        let d = a.driver();
        let mut reg = registry::lock();
        reg.paused = true;
        let vhs = pausable(&reg);
        let mut devices: Vec<i32> = vhs.iter().map(|vh| reg.physicals[vh].device()).collect();
        devices.sort_unstable();
        devices.dedup();
        // NCCL's kernels may still use the memory.
        for &dev in &devices {
            let (ctx, _) = a.copy_stream(dev)?;
            d.with_context(ctx, || d.synchronize())?;
        }
        // Back everything up (contents of NCCL's buffers and metadata are kept by default).
        for vh in &vhs {
            let maps = mappings_of(&reg, *vh);
            let p = reg.physicals.get_mut(vh).expect("listed above");
            let (ctx, stream) = a.copy_stream(p.device())?;
            if p.backup.is_none() {
                p.backup = Some(HostBuffer::new(d, ctx, p.size as usize)?);
            }
            let (ptr, size) = maps[0];
            let dst = p.backup.as_mut().expect("set above").as_mut_ptr();
            d.with_context(ctx, || {
                // SAFETY: `ptr..ptr+size` is NCCL's mapped memory (the device is idle) and the
                // backup holds `p.size >= size` bytes; the stream is synchronised below.
                unsafe { d.copy_dtoh_async(dst, ptr, size.min(p.size) as usize, stream) }
            })?;
        }
        for &dev in &devices {
            let (ctx, stream) = a.copy_stream(dev)?;
            d.with_context(ctx, || d.stream_synchronize(stream))?;
        }
        let mut bytes = 0;
        for vh in &vhs {
            for (ptr, size) in mappings_of(&reg, *vh) {
                // SAFETY: NCCL's mapping; the device is idle and the backup complete.
                unsafe { d.unmap(ptr, size as usize) }?;
            }
            let p = reg.physicals.get_mut(vh).expect("listed above");
            d.release(Handle(
                p.real.take().expect("pausable handles are resident"),
            ))?;
            bytes += p.size;
        }
        Ok(report(vhs.len(), bytes, start))
    }

    fn resume(&self) -> Result<Report> {
        let start = Instant::now();
        let a = self.allocator;
        let d = a.driver();
        let mut reg = registry::lock();
        let mut vhs: Vec<u64> = reg
            .physicals
            .iter()
            .filter(|(_, p)| p.real.is_none() && p.kind == Kind::Device)
            .map(|(vh, _)| *vh)
            .collect();
        vhs.sort_unstable();
        let (mut done, mut bytes) = (0, 0);
        let mut devices = Vec::new();
        for (i, vh) in vhs.iter().enumerate() {
            let maps: Vec<(u64, u64, Vec<_>)> = reg
                .mappings
                .iter()
                .filter(|(_, m)| m.vh == *vh)
                .map(|(p, m)| (*p, m.size, m.access.clone()))
                .collect();
            let p = reg.physicals.get_mut(vh).expect("listed above");
            let (ctx, stream) = a.copy_stream(p.device())?;
            let r = d.with_context(ctx, || {
                let h = d.create_with(&p.prop, p.size as usize)?;
                for (ptr, size, access) in &maps {
                    // SAFETY: NCCL's reserved range, unmapped since the pause.
                    if let Err(e) = unsafe { d.map_with_access(*ptr, *size as usize, h, access) } {
                        let _ = d.release(h);
                        return Err(e);
                    }
                }
                if let (Some(b), Some((ptr, size, _))) = (&p.backup, maps.first()) {
                    // SAFETY: just mapped; the backup outlives the copy (synchronised below).
                    unsafe {
                        d.copy_htod_async(*ptr, b.as_ptr(), (*size).min(p.size) as usize, stream)
                    }?;
                }
                Ok(h)
            });
            match r {
                Ok(h) => {
                    p.real = Some(h.0);
                    done += 1;
                    bytes += p.size;
                    if !devices.contains(&p.device()) {
                        devices.push(p.device());
                    }
                }
                Err(e) => {
                    let remaining = &vhs[i..];
                    let device = p.device();
                    let bytes_still_paused = remaining.iter().map(|v| reg.physicals[v].size).sum();
                    return Err(if e.is_out_of_memory() {
                        Error::ResumeOutOfMemory {
                            device,
                            tags: vec!["nccl".into()],
                            resumed: done,
                            still_paused: remaining.len(),
                            bytes_still_paused,
                        }
                    } else {
                        e.into()
                    });
                }
            }
        }
        for dev in devices {
            let (ctx, stream) = a.copy_stream(dev)?;
            d.with_context(ctx, || d.stream_synchronize(stream))?;
        }
        reg.paused = false;
        Ok(report(done, bytes, start))
    }

    fn paused(&self) -> bool {
        registry::lock().paused
    }

    fn usage(&self) -> Vec<DeviceUsage> {
        let reg = registry::lock();
        let mut out: Vec<DeviceUsage> = Vec::new();
        for p in reg.physicals.values().filter(|p| p.kind == Kind::Device) {
            let dev = p.device();
            let i = match out.iter().position(|u| u.device == dev) {
                Some(i) => i,
                None => {
                    out.push(DeviceUsage {
                        device: dev,
                        usage: Usage::default(),
                    });
                    out.len() - 1
                }
            };
            let u = &mut out[i].usage;
            u.allocations += 1;
            u.reserved_bytes += p.size;
            u.resident_bytes += if p.real.is_some() { p.size } else { 0 };
            u.backup_bytes += p.backup.as_ref().map_or(0, |b| b.len() as u64);
        }
        out.sort_by_key(|u| u.device);
        out
    }
}
