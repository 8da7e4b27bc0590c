//! bmoe-core: placeholder
