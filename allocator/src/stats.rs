//! Memory figures per tag and device, and for the whole process.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::backup::BackupKind;
use crate::table::Table;

/// Byte counts for a set of allocations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub allocations: u64,
    /// Virtual address space reserved (never released by a pause).
    pub reserved_bytes: u64,
    /// Physical device memory currently held.
    pub resident_bytes: u64,
    /// Host memory held by backups (`cpu` and `mmap`): `pinned_backup_bytes +
    /// mmap_backup_bytes`. With retention on (the default) a backup is kept after resume for the
    /// next pause, so this stays at the tag's size once it has been paused, until its
    /// allocations are freed; with retention off it drops to 0 at resume.
    pub backup_bytes: u64,
    /// Of `backup_bytes`, pinned memory (`cpu`).
    pub pinned_backup_bytes: u64,
    /// Of `backup_bytes`, pageable anonymous memory (`mmap`).
    pub mmap_backup_bytes: u64,
    /// Bytes of disk backup files (`disk`; not host memory, not in `backup_bytes`).
    pub disk_backup_bytes: u64,
    /// Pinned host memory allocated ahead of the first pause of `cpu` allocations (it becomes
    /// their backup at that pause; not in `backup_bytes`). Bounded by
    /// `MEMSAVER_BACKUP_PREPARE_MB`.
    pub prepared_backup_bytes: u64,
}

impl Usage {
    fn absorb(&mut self, other: &Usage) {
        self.allocations += other.allocations;
        self.reserved_bytes += other.reserved_bytes;
        self.resident_bytes += other.resident_bytes;
        self.backup_bytes += other.backup_bytes;
        self.pinned_backup_bytes += other.pinned_backup_bytes;
        self.mmap_backup_bytes += other.mmap_backup_bytes;
        self.disk_backup_bytes += other.disk_backup_bytes;
        self.prepared_backup_bytes += other.prepared_backup_bytes;
    }

    /// Counts one allocation (or one external tag's buffer): its reserved and resident bytes,
    /// its backup by kind, and the bytes prepared for it.
    pub fn add(
        &mut self,
        reserved: usize,
        resident: usize,
        backup: Option<(BackupKind, usize)>,
        prepared: usize,
    ) {
        self.allocations += 1;
        self.prepared_backup_bytes += prepared as u64;
        self.reserved_bytes += reserved as u64;
        self.resident_bytes += resident as u64;
        if let Some((kind, len)) = backup {
            let len = len as u64;
            match kind {
                BackupKind::Pinned => self.pinned_backup_bytes += len,
                BackupKind::Mmap => self.mmap_backup_bytes += len,
                BackupKind::Disk => self.disk_backup_bytes += len,
            }
            if kind != BackupKind::Disk {
                self.backup_bytes += len;
            }
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DeviceUsage {
    pub device: i32,
    #[serde(flatten)]
    pub usage: Usage,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TagStats {
    pub tag: String,
    pub paused: bool,
    /// The sum over devices.
    #[serde(flatten)]
    pub usage: Usage,
    pub devices: Vec<DeviceUsage>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Stats {
    /// Every tag ever used, in name order, with or without allocations.
    pub tags: Vec<TagStats>,
    pub total: Usage,
    /// `cpu` allocations whose backup the background thread has still to prepare, or to pin
    /// the rest of (a pause that came before it was prepared took it partly pinned).
    pub backups_preparing: u64,
    /// The pinned backup reserve (`MEMSAVER_BACKUP_RESERVE_MB`, `reserve_backups`): the bytes
    /// asked for, rounded up to 2 MiB.
    pub backup_reserve_bytes: u64,
    /// Of the reserve, the bytes pinned so far (below `backup_reserve_bytes` while it is being
    /// pinned, or when the host refused to pin more).
    pub backup_reserve_pinned_bytes: u64,
    /// Of the pinned reserve, the bytes carved out for backups (prepared ones, counted in
    /// `prepared_backup_bytes` too, and backups, in `pinned_backup_bytes`).
    pub backup_reserve_used_bytes: u64,
    /// Device memory of freed allocations that is still held: a resume backs adjacent
    /// allocations of a tag with one physical allocation, which is released only as a whole
    /// (at the tag's next pause, or once all of them are freed).
    pub freed_held_bytes: u64,
    /// Calls memsaver has made to the CUDA driver in this process, by kind
    /// ([`crate::driver::CALL_KINDS`]): its own and those it makes for NCCL's memory, not
    /// NCCL's own. The difference across a pause or resume is what it asked of the driver.
    pub driver_calls: BTreeMap<String, u64>,
}

impl Stats {
    pub fn tag(&self, tag: &str) -> Option<&TagStats> {
        self.tags.iter().find(|t| t.tag == tag)
    }

    /// Adds the row of an external tag and its figures to the totals.
    pub(crate) fn add_external(&mut self, tag: &str, paused: bool, devices: Vec<DeviceUsage>) {
        let mut usage = Usage::default();
        for d in &devices {
            usage.absorb(&d.usage);
        }
        self.total.absorb(&usage);
        self.tags.push(TagStats {
            tag: tag.to_owned(),
            paused,
            usage,
            devices,
        });
        self.tags.sort_by(|a, b| a.tag.cmp(&b.tag));
    }

    /// The figures of `table`; `prepared` gives the bytes prepared for an allocation id.
    pub(crate) fn collect(table: &Table, prepared: impl Fn(u64) -> Option<usize>) -> Self {
        let mut per: BTreeMap<&str, BTreeMap<i32, Usage>> =
            table.tags.keys().map(|k| (&**k, BTreeMap::new())).collect();
        let mut total = Usage::default();
        for a in table.allocations.values() {
            let (reserved, resident, backup) = (a.size, a.resident_bytes(), a.backup_usage());
            let prepared = prepared(a.id).unwrap_or(0);
            total.add(reserved, resident, backup, prepared);
            per.entry(&a.tag)
                .or_default()
                .entry(a.device.ordinal)
                .or_default()
                .add(reserved, resident, backup, prepared);
        }
        let tags = per
            .into_iter()
            .map(|(tag, devices)| {
                let mut usage = Usage::default();
                for d in devices.values() {
                    usage.absorb(d);
                }
                TagStats {
                    tag: tag.to_owned(),
                    paused: table.tags.get(tag).is_some_and(|t| t.paused),
                    usage,
                    devices: devices
                        .into_iter()
                        .map(|(device, usage)| DeviceUsage { device, usage })
                        .collect(),
                }
            })
            .collect();
        Stats {
            tags,
            total,
            ..Stats::default()
        }
    }
}
