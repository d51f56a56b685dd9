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
    let too_large =
        || format!("`{s}` is more than the largest size, {MAX_SIZE} bytes (2^64 - 2048)");
    // A whole number is read exactly: through an f64, one above 2^53 would be taken as another.
    if let Ok(whole) = num.trim().parse::<u64>() {
        return match whole.checked_mul(mult) {
            Some(0) => Err(format!("`{s}` is not a positive size")),
            Some(bytes) if bytes <= MAX_SIZE => Ok(bytes),
            _ => Err(too_large()),
        };
    }
    let bytes = n * mult as f64;
    if n.is_nan() || bytes < 1.0 || !n.is_finite() {
        return Err(format!("`{s}` is not a positive size"));
    }
    // A conversion to u64 saturates: a larger size would be taken as another, silently.
    if bytes > MAX_SIZE as f64 {
        return Err(too_large());
    }
    Ok(bytes as u64)
}

/// The largest size [`parse_size`] reads: the largest f64 below 2^64 (a fraction of a unit is
/// computed in f64), exact as an f64.
const MAX_SIZE: u64 = u64::MAX - 2047;

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

#[cfg(test)]
mod tests {
    use super::parse_size;

    /// A size beyond the largest is refused naming the largest, not the size refused: 2^64 - 1
    /// said it was "more than a size can be (18446744073709551615 bytes)". Byte counts are read
    /// exactly: one above the largest is refused, not rounded down to it.
    #[test]
    fn a_size_beyond_the_largest_names_the_largest() {
        let largest = (u64::MAX - 2047).to_string();
        assert_eq!(parse_size(&largest), Ok(u64::MAX - 2047));
        assert_eq!(parse_size("9007199254740993"), Ok(9007199254740993), "2^53 + 1, exactly");
        for s in [
            "18446744073709551615",
            "18446744073709549569",
            "18446744073709551616",
            "20000000000GB",
            "17179869184GiB",
        ] {
            let e = parse_size(s).unwrap_err();
            assert!(
                e.contains("more than the largest size, 18446744073709549568 bytes")
                    && !e.contains("(18446744073709551615"),
                "{s}: {e}"
            );
        }
        assert_eq!(parse_size("24GiB"), Ok(24 << 30));
        assert_eq!(parse_size("1.5GB"), Ok(1_500_000_000));
        assert_eq!(parse_size("1000000"), Ok(1_000_000));
        assert!(parse_size("0").unwrap_err().contains("not a positive size"));
        assert!(parse_size("-1GiB").unwrap_err().contains("not a positive size"));
        assert!(parse_size("12 parsecs").unwrap_err().contains("unknown unit"));
        assert!(parse_size("x").unwrap_err().contains("is not a size"));
    }
}
