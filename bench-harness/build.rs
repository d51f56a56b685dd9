//! Records the candle version from Cargo.lock, so results name the candle that produced them.
fn main() {
    let lock = std::fs::read_to_string("../Cargo.lock").unwrap_or_default();
    let version = lock
        .split("[[package]]")
        .find(|p| p.contains("name = \"candle-core\""))
        .and_then(|p| p.lines().find_map(|l| l.strip_prefix("version = ")))
        .map(|v| v.trim_matches('"').to_string())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=CANDLE_VERSION={version}");
    println!("cargo:rerun-if-changed=../Cargo.lock");
}
