//! Servers. STUB
