//! spmd
