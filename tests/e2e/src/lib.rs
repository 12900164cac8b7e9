//! End-to-end tests across the real binaries live in `tests/`; the library
//! holds what they share: the OpenAPI document's generator and validator, the
//! HTTP-wide tests' stack, and the process tests' workspace helpers.

pub mod http_stack;
pub mod openapi;
pub mod workspace;
