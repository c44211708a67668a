//! Micro-benchmarks of the pure hot paths: the callback signature check,
//! answer validation and the enqueue fingerprint. `cargo bench --bench micro`.

use std::hint::black_box;

use approvald::domain::answer::{DecisionType, validate};
use approvald::domain::operation::{Limits, parse};
use approvald::pushary::signature;
use criterion::{Criterion, criterion_group, criterion_main};

fn signature_check(c: &mut Criterion) {
    let body = br#"{"correlationId":"dec_0123456789abcdef01234567","answer":"yes","value":"yes","answeredAt":"2026-11-29T12:00:00.000Z","pad":"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}"#;
    let good = signature::sign("whsec_bench", body);
    let bad = signature::sign("whsec_other", body);
    c.bench_function("signature: verify a 300-byte callback (valid)", |b| {
        b.iter(|| signature::verify(["whsec_bench"], black_box(body), black_box(&good)))
    });
    c.bench_function("signature: verify with two secrets (forged)", |b| {
        b.iter(|| signature::verify(["whsec_bench", "whsec_next"], black_box(body), black_box(&bad)))
    });
}

fn answer_validation(c: &mut Criterion) {
    let options: Vec<String> = (0..20).map(|i| format!("option number {i}")).collect();
    c.bench_function("answer: confirm", |b| {
        b.iter(|| validate(DecisionType::Confirm, &[], black_box("yes")))
    });
    c.bench_function("answer: select among 20 (last)", |b| {
        b.iter(|| validate(DecisionType::Select, black_box(&options), black_box("option number 19")))
    });
    let text = "a free-text answer of a realistic length, with some words in it".repeat(4);
    c.bench_function("answer: input, 256 chars", |b| {
        b.iter(|| validate(DecisionType::Input, &[], black_box(&text)))
    });
}

fn fingerprint(c: &mut Criterion) {
    let body = serde_json::json!({
        "operationKey": "refund-4242", "threadId": "thread-1", "interruptId": "int-1", "effect": "orders",
        "question": "Refund order #4242 for $120?", "type": "confirm", "externalId": "user_42",
        "toolName": "refund", "toolTarget": "order 4242",
        "parameters": {"amount": 120, "currency": "USD", "reason": "damaged"},
    });
    let spec = parse(&body, Limits { max_expires_in_secs: 86_400 }, 1_800_000_000_000).expect("valid");
    c.bench_function("fingerprint: a typical enqueue", |b| b.iter(|| black_box(&spec).fingerprint()));
    c.bench_function("enqueue: strict JSON + every bound + fingerprint", |b| {
        let bytes = serde_json::to_vec(&body).expect("json");
        b.iter(|| {
            let v = approvald::domain::json::parse_strict(black_box(&bytes)).expect("json");
            parse(&v, Limits { max_expires_in_secs: 86_400 }, 1_800_000_000_000).expect("valid").fingerprint()
        })
    });
}

criterion_group!(benches, signature_check, answer_validation, fingerprint);
criterion_main!(benches);
