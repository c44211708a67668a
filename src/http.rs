//! Outgoing HTTP clients. reqwest is built without a bundled TLS provider
//! (ring is chosen here: no C toolchain needed), so every client must come
//! from this builder, which installs the provider first.

pub fn client_builder() -> reqwest::ClientBuilder {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder().user_agent(concat!("approvald/", env!("CARGO_PKG_VERSION")))
}
