//! End-to-end tests across the real binaries live in `tests/`; this crate has
//! no library code of its own.
