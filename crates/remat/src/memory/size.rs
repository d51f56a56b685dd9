//! Byte counts as people write them (`24GiB`, `512MiB`, `1.5GB`): read from a flag, written back
//! so that reading gives the same count; and in MiB or GiB as numbers, for whoever prints them.
//!
//! Not here: measuring anything.

/// Bytes from a size like `24GiB`, `512MiB`, `1.5GB` or `1000000` (binary and decimal units).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a size like 24GiB, 512MiB or 1000000"))?;
    let mult = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1u64,
        "kib" | "k" => 1 << 10,
        "mib" | "m" => 1 << 20,
        "gib" | "g" => 1 << 30,
        "kb" => 1000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        _ => {
            return Err(format!(
                "unknown unit `{unit}` in `{s}`; use B, KiB, MiB, GiB, KB, MB or GB"
            ))
        }
    };
    let bytes = n * mult as f64;
    if n.is_nan() || bytes < 1.0 || !n.is_finite() {
        return Err(format!("`{s}` is not a positive size"));
    }
    // A conversion to u64 saturates: a larger size would be taken as another, silently.
    if bytes >= u64::MAX as f64 {
        return Err(format!("`{s}` is more than a size can be ({} bytes)", u64::MAX));
    }
    Ok(bytes as u64)
}

/// A byte count as [`parse_size`] reads it back: whole GiB/MiB/KiB where exact, else bytes.
pub fn format_size(bytes: u64) -> String {
    match bytes {
        b if b > 0 && b % (1 << 30) == 0 => format!("{}GiB", b >> 30),
        b if b > 0 && b % (1 << 20) == 0 => format!("{}MiB", b >> 20),
        b if b > 0 && b % (1 << 10) == 0 => format!("{}KiB", b >> 10),
        b => b.to_string(),
    }
}

/// Bytes in MiB (2^20 bytes), for the caller to format.
pub fn mib(bytes: impl Into<u128>) -> f64 {
    bytes.into() as f64 / (1u64 << 20) as f64
}

/// Bytes in GiB (2^30 bytes), for the caller to format.
pub fn gib(bytes: impl Into<u128>) -> f64 {
    bytes.into() as f64 / (1u64 << 30) as f64
}
