//! gates
