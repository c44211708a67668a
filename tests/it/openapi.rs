//! The OpenAPI document (docs/openapi.json) against the running code.
