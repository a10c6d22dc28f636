//! Counts and byte counts as people read and write them: one formatter and one parser for
//! every crate.

/// `1234567` -> `1,234,567`.
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `bytes` for people: plain bytes below 1 KiB (`1000 B`), else two decimals in the largest
/// binary unit that keeps the number at least 1 (`1.50 GiB`).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = bytes as f64;
    let mut unit = 0;
    while x >= 1024.0 && unit + 1 < UNITS.len() {
        x /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{x:.2} {}", UNITS[unit])
    }
}

/// `123456`, `20GiB`, `1.5 GB`: bytes, rounded down. Units: `B`, `KB`/`MB`/`GB`/`TB` (powers
/// of 1000), `KiB`/`MiB`/`GiB`/`TiB` (powers of 1024).
pub fn parse_bytes(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let num: f64 = num.parse().ok()?;
    let mult: f64 = match unit.trim() {
        "" | "B" => 1.0,
        "KB" | "kB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        "KiB" => 1024.0,
        "MiB" => 1024f64.powi(2),
        "GiB" => 1024f64.powi(3),
        "TiB" => 1024f64.powi(4),
        _ => return None,
    };
    let bytes = num * mult;
    (0.0..1.8e19).contains(&bytes).then_some(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_in_binary_units() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1000), "1000 B");
        assert_eq!(human_bytes(4096), "4.00 KiB");
        assert_eq!(human_bytes(64 << 20), "64.00 MiB");
        assert_eq!(human_bytes(1536 << 20), "1.50 GiB");
        assert_eq!(human_bytes(3 << 40), "3.00 TiB");
        assert_eq!(human_bytes(5000 << 40), "5000.00 TiB");
    }

    #[test]
    fn parses_decimal_and_binary_units() {
        assert_eq!(parse_bytes("123456"), Some(123456));
        assert_eq!(parse_bytes("2KiB"), Some(2048));
        assert_eq!(parse_bytes("1.5 GB"), Some(1_500_000_000));
        assert_eq!(parse_bytes("20GiB"), Some(20 << 30));
        assert_eq!(parse_bytes("lots"), None);
        assert_eq!(parse_bytes("1e30"), None);
    }
}
