//! The library's test harness (`tests/support/` at the workspace root: a
//! database of its own per test, on the server the testkit finds or starts),
//! shared rather than copied, plus [`cli`]: running the binary.
#![allow(dead_code, unused_imports)]

#[path = "../../../tests/support/mod.rs"]
mod library;

pub use library::*;

pub mod cdp;
pub mod cli;
