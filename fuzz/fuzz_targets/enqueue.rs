//! Enqueue validation: strict JSON, then every bound.
#![no_main]

use approvald::domain::operation::{Limits, parse};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(value) = approvald::domain::json::parse_strict(data) else { return };
    if let Ok(spec) = parse(&value, Limits { max_expires_in_secs: 86_400 }, 1_800_000_000_000) {
        // Whatever is accepted is within the protocol's bounds.
        assert!(spec.question.chars().count() <= 500);
        assert!(spec.external_id.encode_utf16().count() <= 256);
        assert!(spec.subject.parameters.as_ref().is_none_or(|p| p.len() <= 32));
        // The fingerprint is stable.
        assert_eq!(spec.fingerprint(), spec.clone().fingerprint());
    }
});
