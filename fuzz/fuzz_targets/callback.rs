//! The callback path: signature check on the raw bytes, then parsing.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // First bytes as the signature header, the rest as the body.
    let split = data.first().map_or(0, |n| usize::from(*n).min(data.len().saturating_sub(1)));
    let (sig, body) = data.split_at(split.min(data.len()));
    let sig = String::from_utf8_lossy(sig);
    let verified = approvald::pushary::signature::verify(["whsec_fuzz"], body, &sig);
    // A random signature must never verify.
    assert!(!verified || sig == approvald::pushary::signature::sign("whsec_fuzz", body));
    let signed = approvald::pushary::signature::sign("whsec_fuzz", body);
    assert!(approvald::pushary::signature::verify(["whsec_fuzz"], body, &signed));
    if let Ok(cb) = approvald::domain::callback::parse(body) {
        assert!(!cb.correlation_id.is_empty() && cb.correlation_id.len() <= 256);
        assert!(!cb.answer.contains('\0'));
    }
});
