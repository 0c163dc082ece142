//! Integration tests: one test binary (built once) driving real sluice servers over real
//! sockets. `support` starts servers (and, later, real redis-server processes); `cases` holds the
//! scenarios grouped by topic.

mod cases;
mod support;
