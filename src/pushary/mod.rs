//! Pushary: the wire client approvald uses, and the callback signature.

pub mod client;
pub mod signature;

pub use client::{PusharyClient, PusharyError};
