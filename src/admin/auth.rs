//! Who may call the admin API, and what they may do. Two ways to authenticate:
//!
//! - **Bearer tokens** (`ADMIN_TOKENS_FILE`): one line per token, `NAME SCOPES TOKEN`, scopes
//!   `read`, `write` or `read,write` (a `#` at the start of a line or after a space starts a
//!   comment; one inside a token is part of it). The file is read again on every
//!   call (admin calls are rare; a Kubernetes Secret update or a rotated token applies at once);
//!   a file that no longer parses refuses every token until it is fixed, and says why in the
//!   log. Tokens are compared in constant time.
//! - **Client certificates** (`ADMIN_TLS_CLIENT_CACERT`): the TLS handshake requires one the CA
//!   signed (a wrong one never gets a connection); the certificate's subject common name names
//!   the caller, with the scopes `ADMIN_TLS_CLIENT_SCOPES` gives (`read` unless it says
//!   `read,write`: a CA reused for other clients must not make them writers; a bearer token, if
//!   sent, wins).
//!
//! With neither configured the listener must be loopback or a Unix socket (the server refuses
//! to start otherwise) and every local caller has both scopes, named `local`.

use std::path::{Path, PathBuf};
use tonic::Status;

/// Largest tokens file read.
const MAX_TOKENS_FILE_BYTES: u64 = 1 << 20;

/// What a caller may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Scopes {
    pub read: bool,
    pub write: bool,
}

impl Scopes {
    pub const ALL: Scopes = Scopes {
        read: true,
        write: true,
    };

    /// `read`, `write`, or both comma-separated.
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut scopes = Scopes::default();
        for part in s.split(',') {
            match part.trim() {
                "read" => scopes.read = true,
                // Who may change a limit may see it.
                "write" => scopes = Scopes::ALL,
                other => {
                    return Err(format!(
                        "unknown scope {other:?} (the scopes are read and write)"
                    ))
                }
            }
        }
        Ok(scopes)
    }
}

/// The scope a call needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    Read,
    Write,
}

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub name: String,
    pub scopes: Scopes,
}

/// One line of the tokens file.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Token {
    name: String,
    scopes: Scopes,
    secret: String,
}

/// How the admin API authenticates.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuthSettings {
    /// `ADMIN_TOKENS_FILE`.
    pub tokens_file: Option<PathBuf>,
    /// Set when the listener verifies client certificates (`ADMIN_TLS_CLIENT_CACERT`): the
    /// scopes a verified certificate's subject gets.
    pub client_cert_scopes: Option<Scopes>,
}

impl AuthSettings {
    /// Whether any authentication is configured (a non-loopback listener needs one).
    pub fn configured(&self) -> bool {
        self.tokens_file.is_some() || self.client_cert_scopes.is_some()
    }

    /// Checks the tokens file at start: a file that does not parse is a start-up error.
    pub fn check(&self) -> Result<(), String> {
        match &self.tokens_file {
            Some(path) => read_tokens(path).map(|_| ()),
            None => Ok(()),
        }
    }

    /// Who sent `request`, if they may do what `need` asks.
    pub fn authorize<T>(&self, request: &tonic::Request<T>, need: Need) -> Result<Caller, Status> {
        let caller = self.authenticate(request)?;
        let allowed = match need {
            Need::Read => caller.scopes.read,
            Need::Write => caller.scopes.write,
        };
        if !allowed {
            let scope = match need {
                Need::Read => "read",
                Need::Write => "write",
            };
            return Err(Status::permission_denied(format!(
                "{} has no {scope} scope: this call needs it",
                caller.name
            )));
        }
        Ok(caller)
    }

    fn authenticate<T>(&self, request: &tonic::Request<T>) -> Result<Caller, Status> {
        if !self.configured() {
            return Ok(Caller {
                name: "local".into(),
                scopes: Scopes::ALL,
            });
        }
        if let Some(header) = request.metadata().get("authorization") {
            let presented = header
                .to_str()
                .ok()
                .and_then(|h| h.strip_prefix("Bearer ").or(h.strip_prefix("bearer ")))
                .ok_or_else(|| Status::unauthenticated("authorization is not `Bearer <token>`"))?;
            return self.by_token(presented.trim());
        }
        if let Some(scopes) = self.client_cert_scopes {
            if let Some(name) = peer_name(request) {
                return Ok(Caller { name, scopes });
            }
        }
        Err(Status::unauthenticated(
            "the admin API needs a bearer token (authorization: Bearer <token>) or a client \
             certificate",
        ))
    }

    fn by_token(&self, presented: &str) -> Result<Caller, Status> {
        let Some(path) = &self.tokens_file else {
            return Err(Status::unauthenticated(
                "no tokens are configured (ADMIN_TOKENS_FILE)",
            ));
        };
        let tokens = read_tokens(path).map_err(|e| {
            tracing::error!("admin tokens file: {e}");
            Status::unauthenticated("the admin tokens file cannot be read: see the server log")
        })?;
        // Every token is compared (in constant time), so timing tells nothing of which matched.
        let mut found = None;
        for t in &tokens {
            if constant_time_eq(t.secret.as_bytes(), presented.as_bytes()) && found.is_none() {
                found = Some(Caller {
                    name: t.name.clone(),
                    scopes: t.scopes,
                });
            }
        }
        found.ok_or_else(|| Status::unauthenticated("unknown token"))
    }
}

/// The verified client certificate's subject common name (its whole subject if it has none).
fn peer_name<T>(request: &tonic::Request<T>) -> Option<String> {
    let certs = request.peer_certs()?;
    let leaf = certs.first()?;
    let (_, cert) = x509_parser::parse_x509_certificate(leaf.as_ref()).ok()?;
    let subject = cert.subject();
    let cn = subject
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .map(str::to_string);
    Some(cn.unwrap_or_else(|| subject.to_string()))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for (i, &x) in a.iter().enumerate() {
        diff |= x ^ b.get(i).copied().unwrap_or(!x);
    }
    diff == 0
}

fn read_tokens(path: &Path) -> Result<Vec<Token>, String> {
    let at = |e: std::io::Error| format!("{}: {e}", path.display());
    let len = std::fs::metadata(path).map_err(at)?.len();
    if len > MAX_TOKENS_FILE_BYTES {
        return Err(format!(
            "{}: {len} bytes, more than the {MAX_TOKENS_FILE_BYTES} a tokens file may have",
            path.display()
        ));
    }
    let text = std::fs::read_to_string(path).map_err(at)?;
    parse_tokens(&text).map_err(|(line, e)| format!("{}:{line}: {e}", path.display()))
}

/// `line` up to its comment: a `#` at the start of the line or after whitespace. A `#` inside a
/// field is part of it (a generated token may hold one: cut there, it would be a weaker token).
fn without_comment(line: &str) -> &str {
    let mut after_space = true;
    for (i, c) in line.char_indices() {
        if c == '#' && after_space {
            return &line[..i];
        }
        after_space = c.is_whitespace();
    }
    line
}

/// `NAME SCOPES TOKEN` per line; errors carry their line number.
fn parse_tokens(text: &str) -> Result<Vec<Token>, (usize, String)> {
    let mut tokens: Vec<Token> = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = without_comment(line).trim();
        if line.is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [name, scopes, secret] = fields[..] else {
            return Err((
                n + 1,
                "expected `NAME SCOPES TOKEN` (scopes: read, write or read,write)".into(),
            ));
        };
        let scopes = Scopes::parse(scopes).map_err(|e| (n + 1, e))?;
        if secret.len() < 16 {
            return Err((
                n + 1,
                format!("the token of {name} is shorter than 16 characters"),
            ));
        }
        if tokens.iter().any(|t| t.secret == secret) {
            return Err((n + 1, format!("the token of {name} is also another name's")));
        }
        tokens.push(Token {
            name: name.to_string(),
            scopes,
            secret: secret.to_string(),
        });
    }
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_files_parse_and_name_the_bad_line() {
        let t = parse_tokens(
            "# ops\nalice read,write 0123456789abcdef\n\nbob read fedcba9876543210 # ro\n",
        )
        .unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!((t[0].name.as_str(), t[0].scopes), ("alice", Scopes::ALL));
        assert_eq!(
            (t[1].name.as_str(), t[1].scopes),
            (
                "bob",
                Scopes {
                    read: true,
                    write: false
                }
            )
        );
        assert_eq!(parse_tokens("a read\n").unwrap_err().0, 1);
        assert!(parse_tokens("\na admin 0123456789abcdef")
            .unwrap_err()
            .1
            .contains("unknown scope"));
        assert!(parse_tokens("a read short")
            .unwrap_err()
            .1
            .contains("shorter"));
        let dup = "a read 0123456789abcdef\nb write 0123456789abcdef";
        assert_eq!(parse_tokens(dup).unwrap_err().0, 2);
    }

    #[test]
    fn a_hash_inside_a_token_is_part_of_it() {
        let t =
            parse_tokens("ci write 0123456789#abcdef # the CI's\n#off\n  # indented\n").unwrap();
        assert_eq!(t.len(), 1);
        // Cut at the `#` (as before), this token was 10 characters: a confusing refusal.
        assert_eq!(t[0].secret, "0123456789#abcdef");
        // And this one 18: its weaker prefix authenticated.
        let t = parse_tokens("ci write 0123456789abcdefgh#xy\n").unwrap();
        assert_eq!(t[0].secret, "0123456789abcdefgh#xy");
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(!constant_time_eq(b"ab", b"abc"));
        assert!(!constant_time_eq(b"", b"a"));
    }
}
