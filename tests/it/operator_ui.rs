//! The operator page, metrics, logs and health.
