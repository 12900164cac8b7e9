//! End-to-end tests across the real binaries live in `tests/`; the library
//! holds what they share: the OpenAPI document's generator and validator, and the process tests'
//! workspace helpers.

pub mod openapi;
pub mod workspace;
