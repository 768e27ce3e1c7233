//! The `nccl` tag: pause releases NCCL's device memory behind its virtual handles, in this
//! process and, together with the peers, the references between processes; resume rebuilds it
//! at the same addresses.
//!
//! Pause, in every process of the group:
//! 1. (registry locked, local work only) synchronise the devices; back up the device memory
//!    NCCL created here, exported or not; unmap and release it, and unmap and release every
//!    import of a peer's buffer;
//! 2. tell each owner which of its buffers this process let go of;
//! 3. wait until every importer of this process's exported buffers has let go, or fail after
//!    the timeout naming the processes that did not (a dead process counts as let go).
//!
//! Resume: (1) re-create, map and restore this process's memory, a new generation for exported
//! buffers; (2) ask each owner for the new generation of the buffers imported here; (3) import
//! and map them at their old addresses. Step 1 never waits for a peer and the registry lock is
//! never held while waiting, so processes resuming (or pausing) together cannot deadlock.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use memsaver_allocator::backup::HostBuffer;
use memsaver_allocator::driver::Handle;
use memsaver_allocator::{Allocator, DeviceUsage, Error, ExternalTag, Report, Result, Usage};

use crate::peer;
use crate::registry::{self, Kind, Registry};

const TAG: &str = "nccl";

pub struct NcclTag {
    allocator: &'static Allocator,
}

impl NcclTag {
    pub fn new(allocator: &'static Allocator) -> Self {
        Self { allocator }
    }
}

/// The mappings of `vh`: (address, size, access).
fn mappings_of(
    reg: &Registry,
    vh: u64,
) -> Vec<(
    u64,
    u64,
    Vec<memsaver_allocator::driver::sys::CUmemAccessDesc>,
)> {
    reg.mappings
        .iter()
        .filter(|(_, m)| m.vh == vh)
        .map(|(p, m)| (*p, m.size, m.access.clone()))
        .collect()
}

/// The device whose context handles `vh` here: for an import, the device NCCL granted access
/// to (the owner's device may not even be visible in this process); else its location.
fn device_of(reg: &Registry, vh: u64) -> i32 {
    let p = &reg.physicals[&vh];
    if p.kind == Kind::Imported
        && let Some(d) = reg
            .mappings
            .values()
            .filter(|m| m.vh == vh)
            .flat_map(|m| m.access.iter())
            .find(|a| {
                a.location.type_ == memsaver_allocator::driver::sys::CU_MEM_LOCATION_TYPE_DEVICE
            })
    {
        return d.location.id;
    }
    p.device()
}

/// Resident handles pause may release: (own device memory, imports), in handle order.
fn releasable(reg: &Registry) -> (Vec<u64>, Vec<u64>) {
    let (mut own, mut imports) = (Vec::new(), Vec::new());
    for (vh, p) in &reg.physicals {
        if p.real.is_none() || p.pausable().is_err() || !reg.mappings.values().any(|m| m.vh == *vh)
        {
            continue;
        }
        if p.kind == Kind::Imported {
            imports.push(*vh)
        } else {
            own.push(*vh)
        }
    }
    own.sort_unstable();
    imports.sort_unstable();
    (own, imports)
}

fn report(allocations: usize, bytes: u64, copied_bytes: u64, start: Instant) -> Report {
    Report {
        tags: vec![TAG.into()],
        allocations,
        bytes,
        copied_bytes,
        elapsed: start.elapsed(),
    }
}

fn peer_error(message: String) -> Error {
    Error::Peer {
        tag: TAG.into(),
        message,
    }
}

impl NcclTag {
    /// Pause step 1. Returns (allocations, bytes, notices per owner).
    #[allow(clippy::type_complexity)]
    fn release_local(&self) -> Result<(usize, u64, BTreeMap<u32, Vec<(u64, u64)>>)> {
        let a = self.allocator;
        let d = a.driver();
        let mut reg = registry::lock();
        reg.paused = true;
        crate::guard::set_paused(true);
        let (own, imports) = releasable(&reg);
        let mut devices: Vec<i32> = own
            .iter()
            .chain(&imports)
            .map(|vh| device_of(&reg, *vh))
            .collect();
        devices.sort_unstable();
        devices.dedup();
        // NCCL's kernels (here) may still use the memory.
        for &dev in &devices {
            let (ctx, _) = a.copy_stream(dev)?;
            d.with_context(ctx, || d.synchronize())?;
        }
        // Back up what this process owns (imports are backed up by their owners).
        for vh in &own {
            let maps = mappings_of(&reg, *vh);
            let p = reg.physicals.get_mut(vh).expect("listed above");
            let (ctx, stream) = a.copy_stream(p.device())?;
            if p.backup.is_none() {
                p.backup = Some(HostBuffer::new(d, ctx, p.size as usize)?);
            }
            let (ptr, size, _) = maps[0];
            let dst = p.backup.as_mut().expect("set above").as_mut_ptr();
            d.with_context(ctx, || {
                // SAFETY: NCCL's mapped memory (the device is idle); the backup holds
                // `p.size >= size` bytes; the stream is synchronised below.
                unsafe { d.copy_dtoh_async(dst, ptr, size.min(p.size) as usize, stream) }
            })?;
        }
        for &dev in &devices {
            let (ctx, stream) = a.copy_stream(dev)?;
            d.with_context(ctx, || d.stream_synchronize(stream))?;
        }
        let (mut bytes, mut notices) = (0, BTreeMap::<u32, Vec<(u64, u64)>>::new());
        for vh in own.iter().chain(&imports) {
            for (ptr, size, _) in mappings_of(&reg, *vh) {
                // SAFETY: NCCL's mapping; the device is idle and the backup complete.
                unsafe { d.unmap(ptr, size as usize) }?;
            }
            let p = reg.physicals.get_mut(vh).expect("listed above");
            d.release(Handle(
                p.real.take().expect("releasable handles are resident"),
            ))?;
            match (p.kind, p.source) {
                (Kind::Imported, Some(s)) => notices
                    .entry(s.owner)
                    .or_default()
                    .push((s.vh, s.generation)),
                _ => bytes += p.size,
            }
        }
        Ok((own.len() + imports.len(), bytes, notices))
    }

    /// Resume step 1: this process's own memory. Returns (allocations, bytes, imports to fetch
    /// per owner as (local handle, owner's handle, wanted generation)).
    #[allow(clippy::type_complexity)]
    fn restore_local(&self) -> Result<(usize, u64, BTreeMap<u32, Vec<(u64, u64, u64)>>)> {
        let a = self.allocator;
        let d = a.driver();
        let mut reg = registry::lock();
        let mut vhs: Vec<u64> = reg
            .physicals
            .iter()
            .filter(|(_, p)| p.real.is_none())
            .map(|(vh, _)| *vh)
            .collect();
        vhs.sort_unstable();
        let (mut done, mut bytes, mut fetch) = (0, 0, BTreeMap::<u32, Vec<(u64, u64, u64)>>::new());
        let mut devices = Vec::new();
        for (i, vh) in vhs.iter().enumerate() {
            let maps = mappings_of(&reg, *vh);
            let p = reg.physicals.get_mut(vh).expect("listed above");
            if let Some(s) = p.source {
                fetch
                    .entry(s.owner)
                    .or_default()
                    .push((*vh, s.vh, s.generation + 1));
                continue;
            }
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
                    if p.exported {
                        p.generation += 1;
                        p.importers.clear();
                    }
                    done += 1;
                    bytes += p.size;
                    if !devices.contains(&p.device()) {
                        devices.push(p.device());
                    }
                }
                Err(e) if e.is_out_of_memory() => {
                    let remaining: Vec<&u64> = vhs[i..]
                        .iter()
                        .filter(|v| reg.physicals[v].source.is_none())
                        .collect();
                    return Err(Error::ResumeOutOfMemory {
                        device: reg.physicals[vh].device(),
                        tags: vec![TAG.into()],
                        resumed: done,
                        still_paused: remaining.len(),
                        bytes_still_paused: remaining.iter().map(|v| reg.physicals[*v].size).sum(),
                    });
                }
                Err(e) => return Err(e.into()),
            }
        }
        for dev in devices {
            let (ctx, stream) = a.copy_stream(dev)?;
            d.with_context(ctx, || d.stream_synchronize(stream))?;
        }
        Ok((done, bytes, fetch))
    }

    /// Resume step 3: import the owners' new generations and map them where they were.
    fn map_imports(&self, fetched: Vec<(u64, OwnedFd, u64)>) -> Result<usize> {
        let d = self.allocator.driver();
        let mut reg = registry::lock();
        let mut n = 0;
        for (vh, fd, generation) in fetched {
            if !reg.physicals.contains_key(&vh) {
                continue;
            }
            let maps = mappings_of(&reg, vh);
            let (ctx, _) = self.allocator.copy_stream(device_of(&reg, vh))?;
            let p = reg.physicals.get_mut(&vh).expect("checked above");
            let h = d.with_context(ctx, || {
                let h = d.import_fd(std::os::fd::AsRawFd::as_raw_fd(&fd))?;
                for (ptr, size, access) in &maps {
                    // SAFETY: NCCL's reserved range for this import, unmapped since the pause.
                    if let Err(e) = unsafe { d.map_with_access(*ptr, *size as usize, h, access) } {
                        let _ = d.release(h);
                        return Err(e);
                    }
                }
                Ok(h)
            })?;
            p.real = Some(h.0);
            if let Some(s) = p.source.as_mut() {
                s.generation = generation;
            }
            n += 1;
        }
        Ok(n)
    }
}

impl ExternalTag for NcclTag {
    fn pause(&self) -> Result<Report> {
        let start = Instant::now();
        let (n, bytes, notices) = self.release_local()?;
        let released = start.elapsed();
        let group = crate::amem::group_id();
        for (owner, items) in notices {
            if let Err(e) = peer::notify_released(group, owner, &items)
                && peer::alive(owner)
            {
                tracing::warn!(
                    "memsaver: could not tell process {owner} that its NCCL buffers were released: {e}"
                );
            }
        }
        // Every exported buffer of ours that is paused (also by an earlier, failed call) is
        // free only once its importers have let go.
        let deadline = Instant::now() + peer::timeout();
        loop {
            let mut holders: Vec<u32> = {
                let mut reg = registry::lock();
                let mut h = Vec::new();
                for p in reg
                    .physicals
                    .values_mut()
                    .filter(|p| p.exported && p.real.is_none())
                {
                    p.importers.retain(|pid| peer::alive(*pid));
                    h.extend(p.importers.iter().copied());
                }
                h
            };
            if holders.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                holders.sort_unstable();
                holders.dedup();
                return Err(Error::PeersHoldMemory {
                    tag: TAG.into(),
                    peers: holders,
                    waited_ms: peer::timeout().as_millis() as u64,
                });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        tracing::info!(
            release_local_ms = released.as_secs_f64() * 1e3,
            total_ms = start.elapsed().as_secs_f64() * 1e3,
            allocations = n,
            bytes,
            "nccl pause"
        );
        Ok(report(n, bytes, bytes, start))
    }

    fn resume(&self) -> Result<Report> {
        let start = Instant::now();
        let (mut n, bytes, fetch) = self.restore_local()?;
        let restored = start.elapsed();
        let group = crate::amem::group_id();
        let mut fetched = Vec::new();
        for (owner, items) in fetch {
            let wants: Vec<(u64, u64)> = items.iter().map(|(_, ovh, g)| (*ovh, *g)).collect();
            let fds = peer::request_fds(group, owner, &wants).map_err(peer_error)?;
            for ((vh, _, _), (fd, generation)) in items.into_iter().zip(fds) {
                fetched.push((vh, fd, generation));
            }
        }
        let fetched_at = start.elapsed();
        n += self.map_imports(fetched)?;
        registry::lock().paused = false;
        crate::guard::set_paused(false);
        tracing::info!(
            restore_local_ms = restored.as_secs_f64() * 1e3,
            fetch_ms = (fetched_at - restored).as_secs_f64() * 1e3,
            map_imports_ms = (start.elapsed() - fetched_at).as_secs_f64() * 1e3,
            allocations = n,
            bytes,
            "nccl resume"
        );
        Ok(report(n, bytes, bytes, start))
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
