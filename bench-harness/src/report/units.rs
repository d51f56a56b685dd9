//! Byte counts as the reports and lines print them.

/// Bytes in GiB, for the caller to format.
pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Bytes in MiB, formatted: `12.3 MiB`.
pub fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
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
