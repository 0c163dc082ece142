//! Settings. STUB
