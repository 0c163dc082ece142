//! Which keys each kind of mapping accepts, and the message for one it does not (with a
//! suggestion when the key is a near miss or belongs elsewhere).

/// Where a mapping sits, which decides the keys it accepts.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Scope {
    Root,
    Descriptor,
    /// The `rate_limit` block of a descriptor.
    RateLimit,
    /// One entry of a descriptor's `rate_limits` list (sluice extension).
    RateLimitsEntry,
    Replaces,
    /// A descriptor's `in_flight` block.
    InFlight,
    /// A descriptor's `reservations` block.
    Reservations,
    /// A limit's `calendar` block.
    Calendar,
    /// A descriptor's `leased` block.
    Leased,
    /// A descriptor's `global` block.
    Global,
}

const ROOT_KEYS: &[&str] = &[
    "domain",
    "descriptors",
    "hash_tag",
    "counting",
    "allow_limit_override",
];
const DESCRIPTOR_KEYS: &[&str] = &[
    "key",
    "value",
    "rate_limit",
    "rate_limits",
    "descriptors",
    "shadow_mode",
    "detailed_metric",
    "value_to_metric",
    "share_threshold",
    "quota_mode",
    "metadata",
    "in_flight",
    "reservations",
    "leased",
    "global",
    "own_hash_tags",
];
/// The keys of one limit: envoyproxy/ratelimit's, then the sluice extensions (docs/semantics.md, "sluice extensions").
const LIMIT_KEYS: &[&str] = &[
    "unit",
    "requests_per_unit",
    "unlimited",
    "name",
    "replaces",
    "period",
    "algorithm",
    "burst",
    "applies_to_descendants",
    "record_usage",
    "calendar",
];
const REPLACES_KEYS: &[&str] = &["name"];
const IN_FLIGHT_KEYS: &[&str] = &["max", "lease", "id_key", "done_key"];
const CALENDAR_KEYS: &[&str] = &["time_zone", "week_start", "anchor_day"];
const LEASED_KEYS: &[&str] = &["max_slice", "ahead"];
const RESERVATIONS_KEYS: &[&str] = &["lease", "id_key", "done_key", "max", "min_estimate"];

impl Scope {
    pub(super) fn keys(self) -> &'static [&'static str] {
        match self {
            Scope::Root => ROOT_KEYS,
            Scope::Descriptor => DESCRIPTOR_KEYS,
            Scope::RateLimit | Scope::RateLimitsEntry => LIMIT_KEYS,
            Scope::Replaces => REPLACES_KEYS,
            Scope::InFlight => IN_FLIGHT_KEYS,
            Scope::Reservations => RESERVATIONS_KEYS,
            Scope::Calendar => CALENDAR_KEYS,
            Scope::Leased | Scope::Global => LEASED_KEYS,
        }
    }

    pub(super) fn is_limit(self) -> bool {
        matches!(self, Scope::RateLimit | Scope::RateLimitsEntry)
    }

    pub(super) fn describe(self) -> &'static str {
        match self {
            Scope::Root => "at the top level",
            Scope::Descriptor => "in a descriptor",
            Scope::RateLimit => "in `rate_limit`",
            Scope::RateLimitsEntry => "in a `rate_limits` entry",
            Scope::Replaces => "in a `replaces` entry",
            Scope::InFlight => "in `in_flight`",
            Scope::Reservations => "in `reservations`",
            Scope::Calendar => "in `calendar`",
            Scope::Leased => "in `leased`",
            Scope::Global => "in `global`",
        }
    }
}

/// Why `key` is not accepted in `scope`, naming where it belongs when it belongs elsewhere.
pub(super) fn unknown_key_message(key: &str, scope: Scope) -> String {
    let hint = if scope.is_limit() && matches!(key, "rate_limit" | "rate_limits") {
        format!(
            "`{key}` belongs to the descriptor; a limit cannot contain another (list several \
             limits in the descriptor's `rate_limits`)"
        )
    } else if scope != Scope::Descriptor && DESCRIPTOR_KEYS.contains(&key) {
        match scope {
            Scope::RateLimit => {
                format!("`{key}` belongs to the descriptor, next to `rate_limit`, not inside it")
            }
            Scope::RateLimitsEntry => format!(
                "`{key}` belongs to the descriptor, next to `rate_limits`, not inside one of its \
                 entries"
            ),
            _ => format!("`{key}` belongs in an entry of `descriptors`"),
        }
    } else if !scope.is_limit() && LIMIT_KEYS.contains(&key) {
        format!("`{key}` belongs inside `rate_limit` (or an entry of `rate_limits`)")
    } else if scope != Scope::Root && ROOT_KEYS.contains(&key) {
        format!("`{key}` is only valid at the top level of the file")
    } else {
        format!("accepted {}: {}", scope.describe(), scope.keys().join(", "))
    };
    format!(
        "config error, unknown key '{key}' {}; {hint}",
        scope.describe()
    )
}
