//! Byte counts as the reports and lines print them.

pub use remat::memory::gib;

/// Bytes in MiB, formatted: `12.3 MiB`.
pub fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", remat::memory::mib(bytes))
}

/// Bytes in GiB, formatted: `12.3 GiB`.
pub fn gib_text(bytes: u64) -> String {
    format!("{:.1} GiB", gib(bytes))
}

/// Bytes as the tables print them: GiB with two decimals from 1 GiB up, else MiB.
pub fn size(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", gib(bytes))
    } else {
        mib(bytes)
    }
}
