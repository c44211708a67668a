//! Deterministic keys, byte-compatible with the Pushary SDK: SHA-256 over the
//! parts joined by a NUL byte, lowercase hex, first 40 characters.

use serde_json::Value;
use sha2::{Digest, Sha256};

pub fn deterministic_key(parts: &[&str]) -> String {
    let mut hasher = Sha256::new();
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            hasher.update([0u8]);
        }
        hasher.update(part.as_bytes());
    }
    let mut hex = hex::encode(hasher.finalize());
    hex.truncate(40);
    hex
}

/// Lowercase hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Canonical JSON: object keys sorted, no whitespace. `serde_json::Value`
/// cannot hold NaN or infinities, so the SDK's "no NaN" rule holds by type.
pub fn canonical_json(value: &Value) -> String {
    // serde_json's map is a BTreeMap unless `preserve_order` is enabled,
    // which this crate never enables, so serialization is already sorted.
    serde_json::to_string(value).expect("a Value always serializes")
}

/// The SDK's request fingerprint: the deterministic key of the canonical JSON.
pub fn fingerprint(value: &Value) -> String {
    deterministic_key(&[&canonical_json(value)])
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keys_are_order_and_boundary_sensitive() {
        assert_ne!(deterministic_key(&["a", "bc"]), deterministic_key(&["ab", "c"]));
        assert_eq!(deterministic_key(&["x"]).len(), 40);
    }

    #[test]
    fn fingerprint_ignores_key_order() {
        let a = json!({"b": 1, "a": {"d": true, "c": "x"}});
        let b = json!({"a": {"c": "x", "d": true}, "b": 1});
        assert_eq!(canonical_json(&a), r#"{"a":{"c":"x","d":true},"b":1}"#);
        assert_eq!(fingerprint(&a), fingerprint(&b));
        assert_ne!(fingerprint(&a), fingerprint(&json!({"b": 2, "a": {"d": true, "c": "x"}})));
    }
}
