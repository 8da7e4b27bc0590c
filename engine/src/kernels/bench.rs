//! Placeholder; replaced below.
