//! `DECISION_LOG_REDACT`: the descriptor keys whose values the decision log holds as digests,
//! not as sent (an API key, a user id). A digest is `h:` and the first 16 bytes, hex, of the
//! value's HMAC-SHA256 under `DECISION_LOG_REDACT_SALT`: the same value is the same digest
//! across lines and restarts with the same salt (a replay still counts per consumer), and a
//! log read without the salt does not give a value back, not even a guessable one.
//!
//! A rule that names a redacted value (`key: api_key, value: abc`) does not match its digest
//! in a replay: redact the keys limited per value (`api_key` as a consumer), not those whose
//! values rules name.

use ring::hmac;

/// Which keys' values are redacted, and the key of their digests.
#[derive(Clone)]
pub struct Redact {
    keys: Keys,
    mac: hmac::Key,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Keys {
    None,
    All,
    These(Vec<String>),
}

impl std::fmt::Debug for Redact {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the salt.
        f.debug_struct("Redact").field("keys", &self.keys).finish()
    }
}

impl Redact {
    /// `spec`: empty (nothing), `*` (every value), or descriptor keys separated by commas.
    pub fn new(spec: &str, salt: &[u8]) -> Self {
        let keys: Vec<String> = spec
            .split(',')
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .map(str::to_string)
            .collect();
        let keys = if keys.is_empty() {
            Keys::None
        } else if keys.iter().any(|k| k == "*") {
            Keys::All
        } else {
            Keys::These(keys)
        };
        Self {
            keys,
            mac: hmac::Key::new(hmac::HMAC_SHA256, salt),
        }
    }

    /// Whether any value is redacted.
    pub fn is_on(&self) -> bool {
        self.keys != Keys::None
    }

    /// `value` as the log holds it under `key`.
    pub fn value(&self, key: &str, value: String) -> String {
        let hidden = match &self.keys {
            Keys::None => false,
            Keys::All => true,
            Keys::These(keys) => keys.iter().any(|k| k == key),
        };
        if !hidden {
            return value;
        }
        let tag = hmac::sign(&self.mac, value.as_bytes());
        let mut out = String::with_capacity(34);
        out.push_str("h:");
        for b in &tag.as_ref()[..16] {
            out.push_str(&format!("{b:02x}"));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_keys_are_digested_the_same_each_time_and_others_kept() {
        let r = Redact::new(" api_key , user", b"salt");
        assert!(r.is_on());
        let a = r.value("api_key", "secret-1".into());
        assert!(a.starts_with("h:") && a.len() == 34, "{a}");
        assert!(!a.contains("secret"));
        assert_eq!(
            a,
            r.value("user", "secret-1".into()),
            "one digest per value"
        );
        assert_ne!(a, r.value("api_key", "secret-2".into()));
        assert_eq!(r.value("path", "/x".into()), "/x");
        // Another salt, another digest.
        assert_ne!(
            a,
            Redact::new("api_key", b"other").value("api_key", "secret-1".into())
        );
        assert_eq!(Redact::new("*", b"").value("any", "v".into()).len(), 34);
        let off = Redact::new(" , ", b"");
        assert!(!off.is_on());
        assert_eq!(off.value("api_key", "v".into()), "v");
        assert!(!format!("{r:?}").contains("salt"));
    }
}
