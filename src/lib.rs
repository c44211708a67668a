//! approvald: durable human approvals for AI agents.
//!
//! The library runs everything from a [`config::Config`]; `main.rs` is only
//! the command line. See DESIGN.md for the moving parts.

#![forbid(unsafe_code)]

pub mod api;
pub mod app;
pub mod bench;
pub mod clock;
pub mod config;
pub mod dev;
pub mod doctor;
pub mod domain;
pub mod error;
pub mod fault;
pub mod html;
pub mod http;
pub mod metrics;
pub mod operator_ui;
pub mod pushary;
pub mod resource;
pub mod rotation;
pub mod sandbox;
pub mod secret;
pub mod store;
pub mod webhooks;
pub mod worker;

pub use app::Application;
pub use config::Config;
