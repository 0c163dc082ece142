//! YAML parsing with positions. STUB: being written.
