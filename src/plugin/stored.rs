//! How a plugin's component is kept in the database: deflated (gzip). A JavaScript or Python
//! component carries its language's engine and shrinks by two thirds (12.1 MB -> 3.9 MB, 18.3 MB
//! -> 6.1 MB), which also keeps it within MySQL's default `max_allowed_packet` (16 MiB). Versions
//! stored before are raw components, told apart by their first bytes (`\0asm` vs gzip's
//! `1f 8b`), and read as they are.

use std::io::{Read, Write};

use flate2::read::GzDecoder;
use flate2::write::GzEncoder;
use flate2::Compression;

/// gzip's magic number; a component starts with `\0asm` instead.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// The bytes to store for a component.
pub fn encode(wasm: &[u8]) -> Vec<u8> {
    let mut encoder = GzEncoder::new(Vec::with_capacity(wasm.len() / 3), Compression::default());
    // Writing to a Vec cannot fail.
    match encoder.write_all(wasm).and_then(|()| encoder.finish()) {
        Ok(deflated) => deflated,
        Err(_) => wasm.to_vec(),
    }
}

/// The component from stored bytes, at most `max_bytes` long (a larger one is refused, never
/// inflated whole); `None` when the stored bytes are damaged or too large.
pub fn decode(stored: &[u8], max_bytes: usize) -> Option<Vec<u8>> {
    if !stored.starts_with(&GZIP_MAGIC) {
        return (stored.len() <= max_bytes).then(|| stored.to_vec());
    }
    let mut wasm = Vec::new();
    let limit = u64::try_from(max_bytes).ok()?.saturating_add(1);
    GzDecoder::new(stored).take(limit).read_to_end(&mut wasm).ok()?;
    (wasm.len() <= max_bytes).then_some(wasm)
}

#[cfg(test)]
mod tests {
    use super::{decode, encode};

    /// A component round-trips deflated; a raw one (stored before) reads as it is; too large or
    /// damaged stored bytes give nothing.
    #[test]
    fn components_round_trip_and_raw_ones_still_read() {
        let wasm: Vec<u8> =
            b"\0asm\x0d\0\x01\0".iter().copied().chain((0..100_000u32).map(|i| (i % 7) as u8)).collect();
        let stored = encode(&wasm);
        assert!(stored.len() < wasm.len() / 10, "deflated: {} bytes", stored.len());
        assert_eq!(decode(&stored, wasm.len()), Some(wasm.clone()));
        assert_eq!(decode(&stored, wasm.len() - 1), None, "one byte over the limit");
        assert_eq!(decode(&wasm, wasm.len()), Some(wasm.clone()), "a raw component");
        assert_eq!(decode(&stored[..stored.len() / 2], wasm.len()), None, "cut short");
    }
}
