//! Descriptor matching. STUB
