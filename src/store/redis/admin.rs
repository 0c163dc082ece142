//! The Redis store's admin side (see `store::admin`): resets by key pattern, overrides in one
//! hash every replica reads.
//!
//! - **Reset.** Every counter below a descriptor prefix lives in one Cluster slot (the hash tag
//!   is the domain and the first entry, or the domain alone under `hash_tag: domain`), and its
//!   keys start with one literal string. So a reset is a `SCAN ... MATCH <that string>*` on the
//!   one node owning the slot, `COUNT` [`SCAN_COUNT`] per call (no `KEYS`, no script walking the
//!   keyspace: each call is short whatever the keyspace holds), each page's keys `UNLINK`ed
//!   at once. The counters below a leased resource (hash tags of their own, any slot) are
//!   found by a second `SCAN` of every master for `PREFIX{domain|k=v|...`. A counter's keys (its windows, its lease sets) go; the RLQS demand boards
//!   (`#rlqs`) and the write-back guards (`#wb:`, which keep a retried write-back from counting
//!   twice) stay. A request decided between two pages counts on a key the reset has deleted or
//!   not yet reached: either way it is on one side of the reset, never half.
//! - **Overrides** live in the hash `PREFIX{sluice|admin}overrides` (no counter's hash tag is
//!   `sluice|admin`: a descriptor's has an `=`, a domain tag ends with `|`), one field per
//!   override, the value its expiry then its JSON; `PREFIX{sluice|admin}generation` counts the
//!   writes. Both in one slot, so `put.lua` caps the live overrides and drops expired ones
//!   atomically. Replicas poll the generation (one `GET`) and read the hash when it moved.

use super::board::Source;
use super::conn::Conn;
use super::{batch::single_connection, keys, Common};
use crate::config::Algorithm;
use crate::store::admin::{
    too_many, CounterAdmin, OverrideId, ResetCount, ResetRecord, StoredOverride, MAX_RESET_RECORDS,
};
use crate::store::{BoxFuture, StoreError};
use redis::Script;
use std::sync::{Arc, LazyLock};

/// Keys one `SCAN` call looks at: a short call (well under a millisecond) however large the
/// keyspace.
pub const SCAN_COUNT: usize = 1000;

static PUT_SCRIPT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
-- KEYS[1] the overrides hash, KEYS[2] the generation; ARGV: field, value, now (ms), max live.
local all = redis.call('HGETALL', KEYS[1])
local now, max, live, before = tonumber(ARGV[3]), tonumber(ARGV[4]), 0, ''
for i = 1, #all, 2 do
  local expires = tonumber(string.match(all[i + 1], '^(%d+)|'))
  if expires == nil or expires <= now then
    redis.call('HDEL', KEYS[1], all[i])
  elseif all[i] == ARGV[1] then
    before = all[i + 1]
  else
    live = live + 1
  end
end
if live >= max then return {0, ''} end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('INCR', KEYS[2])
return {1, before}
"#,
    )
});

static DELETE_SCRIPT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
-- KEYS[1] the overrides hash, KEYS[2] the generation; ARGV: field.
local before = redis.call('HGET', KEYS[1], ARGV[1]) or ''
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('INCR', KEYS[2])
return before
"#,
    )
});

/// A home store's reset of one page of keys, fencing each counting key (`fence.lua`).
static FENCE_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("fence.lua")));

/// The admin side of a [`super::RedisStore`], on its connections.
pub struct RedisAdmin {
    pub(super) common: Arc<Common>,
    pub(super) source: Source,
}

impl std::fmt::Debug for RedisAdmin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisAdmin")
            .field("prefix", &self.common.prefix)
            .finish_non_exhaustive()
    }
}

/// The hash tag of the admin keys.
const ADMIN_TAG: &str = "sluice|admin";

static RECORD_SCRIPT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
-- KEYS[1] the reset records (a list), KEYS[2] the generation; ARGV: the record (JSON), most kept.
local g = redis.call('INCR', KEYS[2])
redis.call('RPUSH', KEYS[1], g .. '|' .. ARGV[1])
redis.call('LTRIM', KEYS[1], -tonumber(ARGV[2]), -1)
return g
",
    )
});

impl RedisAdmin {
    fn resets_key(&self) -> String {
        format!("{}{{{ADMIN_TAG}}}resets", self.common.prefix)
    }

    fn hash_key(&self) -> String {
        format!("{}{{{ADMIN_TAG}}}overrides", self.common.prefix)
    }

    fn generation_key(&self) -> String {
        format!("{}{{{ADMIN_TAG}}}generation", self.common.prefix)
    }

    async fn connection(&self) -> Result<Conn, StoreError> {
        match &self.source {
            Source::Pool(p) => single_connection(p).await,
            Source::Cluster(c) => c.connection().await,
        }
    }

    /// One call within `REDIS_TIMEOUT`.
    async fn call<T: Send>(
        &self,
        run: impl AsyncFnOnce(&mut Conn) -> redis::RedisResult<T>,
    ) -> Result<T, StoreError> {
        let call = async { self.connection().await?.query(run).await };
        match tokio::time::timeout(self.common.quick, call).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Transient(format!(
                "Redis did not answer within {:?}",
                self.common.quick
            ))),
        }
    }

    /// `INCR` of the generation every replica polls.
    async fn bump(&self) -> Result<(), StoreError> {
        let generation = self.generation_key();
        self.call(async |c| {
            redis::cmd("INCR")
                .arg(&generation)
                .query_async::<u64>(c)
                .await
        })
        .await
        .map(|_| ())
    }

    /// Resets the counters below `prefix`; with a `fence`, a home store's reset, leaving a fence
    /// beside each counting key it removes ([`CounterAdmin::reset_fenced`]).
    async fn reset_now(
        &self,
        domain: &str,
        prefix: &[(String, String)],
        domain_tag: bool,
        fence: Option<u64>,
    ) -> Result<ResetCount, StoreError> {
        let (literal, tag) = reset_literal(&self.common.prefix, domain, prefix, domain_tag)?;
        let pattern = reset_pattern(&literal, prefix.len(), domain_tag);
        // Bumped before the scans as well as after: a reset cut midway (a Redis error) has
        // still made every replica drop its deny cache for what it did delete.
        self.bump().await?;
        // Counted, not collected: a prefix with a million consumers must not hold a million
        // names here. A counter has one key that counts (its current window, or its state);
        // a lease limit's entry sets beside it are not counted again.
        let mut counters = self
            .reset_pages(keys::tag_slot(&tag), (&pattern, literal.len()), true, fence)
            .await?;
        if !domain_tag {
            // The counters below a leased resource have hash tags of their own
            // (`{d|k=v|...}`), in any slot: every master is scanned for them.
            // At the prefix's own depth a one-entry tag is the ordinary one (reset above).
            let own = own_literal(&self.common.prefix, domain, prefix);
            let end = if prefix.len() > 1 { "[|}]*" } else { "|*" };
            let pattern = format!("{}{end}", glob_escape(&own));
            for slot in self.master_slots().await? {
                counters += self
                    .reset_pages(slot, (&pattern, own.len()), false, fence)
                    .await?;
            }
        }
        // Again after the scans: a denial cached while they ran is dropped too.
        self.bump().await?;
        Ok(ResetCount {
            counters,
            counted: true,
        })
    }
}

impl RedisAdmin {
    /// Every page of `SCAN MATCH pattern` on the node owning `slot`, each page's counter keys
    /// `UNLINK`ed; returns the counters among them. `one_slot`: every match shares one slot
    /// (one `UNLINK` per page), else each key is unlinked on its own (a Cluster refuses keys
    /// of several slots in one command).
    async fn reset_pages(
        &self,
        slot: u16,
        (pattern, literal): (&str, usize),
        one_slot: bool,
        fence: Option<u64>,
    ) -> Result<u64, StoreError> {
        let (mut cursor, mut counters) = (0u64, 0u64);
        loop {
            let (next, found): (u64, Vec<String>) = self
                .call(async |c| scan(c, slot, cursor, pattern).await)
                .await?;
            let doomed: Vec<(&String, bool)> = found
                .iter()
                .filter_map(|k| {
                    let counts = counter_of(k, literal)?;
                    counters += u64::from(counts);
                    Some((k, counts))
                })
                .collect();
            let batches: Vec<Vec<(&String, bool)>> = match (doomed.is_empty(), one_slot) {
                (true, _) => Vec::new(),
                (false, true) => vec![doomed],
                (false, false) => doomed.into_iter().map(|k| vec![k]).collect(),
            };
            for batch in batches {
                self.unlink(&batch, fence).await?;
            }
            if next == 0 {
                return Ok(counters);
            }
            cursor = next;
        }
    }

    /// `UNLINK`s one slot's `keys`; with a `fence`, after raising the fence beside each that
    /// counts, in the same call (`FENCE_SCRIPT`).
    async fn unlink(&self, keys: &[(&String, bool)], fence: Option<u64>) -> Result<(), StoreError> {
        let names: Vec<&String> = keys.iter().map(|(k, _)| *k).collect();
        let Some(fence) = fence else {
            return self
                .call(async |c| redis::cmd("UNLINK").arg(&names).query_async::<u64>(c).await)
                .await
                .map(|_| ());
        };
        self.call(async |c| {
            let mut inv = FENCE_SCRIPT.prepare_invoke();
            inv.arg(fence);
            for (k, counts) in keys {
                inv.key(k.as_str()).arg(u8::from(*counts));
            }
            inv.invoke_async::<u64>(c).await
        })
        .await
        .map(|_| ())
    }

    /// One slot of each master (`CLUSTER SLOTS`), where a scan of the whole keyspace goes; on
    /// standalone Redis or Sentinel, the one node.
    async fn master_slots(&self) -> Result<Vec<u16>, StoreError> {
        if matches!(self.source, Source::Pool(_)) {
            return Ok(vec![0]);
        }
        let ranges: redis::Value = self
            .call(async |c| redis::cmd("CLUSTER").arg("SLOTS").query_async(c).await)
            .await?;
        let mut seen: Vec<(String, i64)> = Vec::new();
        let mut slots = Vec::new();
        let redis::Value::Array(ranges) = ranges else {
            return Err(StoreError::Permanent("CLUSTER SLOTS: not an array".into()));
        };
        for range in ranges {
            let redis::Value::Array(fields) = range else {
                continue;
            };
            let (Some(redis::Value::Int(start)), Some(redis::Value::Array(master))) =
                (fields.first(), fields.get(2))
            else {
                continue;
            };
            let host = match master.first() {
                Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
                _ => String::new(),
            };
            let port = match master.get(1) {
                Some(redis::Value::Int(p)) => *p,
                _ => 0,
            };
            if !seen.contains(&(host.clone(), port)) {
                seen.push((host, port));
                slots.push(u16::try_from(*start).unwrap_or(0));
            }
        }
        Ok(slots)
    }
}

/// The literal start of the own-tagged keys below `prefix`: `PREFIX{domain|k=v|...` (the tag
/// left open: deeper entries or its `}` follow).
fn own_literal(key_prefix: &str, domain: &str, prefix: &[(String, String)]) -> String {
    let mut literal = format!("{key_prefix}{{");
    keys::escape_into(&mut literal, domain);
    for (k, v) in prefix {
        literal.push('|');
        keys::escape_into(&mut literal, k);
        literal.push('=');
        keys::escape_into(&mut literal, v);
    }
    literal
}

/// `literal` with the glob characters escaped.
fn glob_escape(literal: &str) -> String {
    let mut p = String::with_capacity(literal.len() + 8);
    for c in literal.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            p.push('\\');
        }
        p.push(c);
    }
    p
}

/// One `SCAN` page on the node owning `slot` (any connection on standalone Redis).
async fn scan(
    c: &mut Conn,
    slot: u16,
    cursor: u64,
    pattern: &str,
) -> redis::RedisResult<(u64, Vec<String>)> {
    let mut cmd = redis::cmd("SCAN");
    cmd.arg(cursor)
        .arg("MATCH")
        .arg(pattern)
        .arg("COUNT")
        .arg(SCAN_COUNT);
    match c {
        Conn::Single(..) => cmd.query_async(c).await,
        Conn::Cluster(cluster) => {
            use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
            let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::new(
                slot,
                SlotAddr::Master,
            )));
            let v = cluster.route_command(cmd, route).await?;
            Ok(redis::from_redis_value(v)?)
        }
    }
}

/// The literal start every key below the prefix shares (`PREFIX{tag}|k=v...`), and the tag.
fn reset_literal(
    key_prefix: &str,
    domain: &str,
    prefix: &[(String, String)],
    domain_tag: bool,
) -> Result<(String, String), StoreError> {
    let Some(((k0, v0), rest)) = prefix.split_first() else {
        return Err(StoreError::Permanent(
            "a reset names at least one descriptor entry".into(),
        ));
    };
    let mut tag = String::new();
    keys::escape_into(&mut tag, domain);
    tag.push('|');
    let below: &[(String, String)] = if domain_tag { prefix } else { rest };
    if !domain_tag {
        keys::escape_into(&mut tag, k0);
        tag.push('=');
        keys::escape_into(&mut tag, v0);
    }
    let mut literal = format!("{key_prefix}{{{tag}}}");
    for (k, v) in below {
        literal.push('|');
        keys::escape_into(&mut literal, k);
        literal.push('=');
        keys::escape_into(&mut literal, v);
    }
    Ok((literal, tag))
}

/// The `SCAN` pattern: the literal, glob characters escaped, then anything; where the literal
/// ends in a value (not in the tag's `}`), the next character must end that value.
fn reset_pattern(literal: &str, entries: usize, domain_tag: bool) -> String {
    let mut p = glob_escape(literal);
    if domain_tag || entries > 1 {
        p.push_str("[|:]");
    }
    p.push('*');
    p
}

/// Whether a key below the prefix is a counter's: `Some(true)` for the key that counts it (its
/// state, or its current window: `:<index>`, `:c<start>`), `Some(false)` for a lease set beside
/// it or a global counter's regions' reports, `None` for a key that is no counter's (a
/// demand board, a write-back guard, a region's pool), which a reset keeps. `literal` bytes of the key are the prefix; past them come the remaining entries
/// (no raw `:` in them: it is escaped), then `:alg:limit:period[:bN][:o]`, then any suffix.
fn counter_of(key: &str, literal: usize) -> Option<bool> {
    let rest = key.get(literal..)?;
    let colon = rest.find(':')?;
    let limit = &rest[colon + 1..];
    if let Some(hash) = limit.find('#') {
        // The regions' reports of a global counter at home (`regions.rs`): they say what each
        // region was granted of the count a reset forgets, and refills are sized on them
        // (`store/global/fair.rs`), so they go with it (each region reports afresh once it
        // clears its pools). Not counted.
        return limit[hash + 1..].starts_with("regions:").then_some(false);
    }
    let fields: Vec<&str> = limit.split(':').collect();
    let mut n = 3.min(fields.len());
    if fields.first() == Some(&Algorithm::TokenBucket.key_tag())
        && fields.get(n).is_some_and(|f| f.starts_with('b'))
    {
        n += 1;
    }
    if fields.get(n) == Some(&"o") {
        n += 1;
    }
    let window = |f: &str| {
        let digits = f.strip_prefix('c').unwrap_or(f);
        !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
    };
    Some(match &fields[n..] {
        [] => true,
        [f] => window(f),
        _ => false,
    })
}

impl CounterAdmin for RedisAdmin {
    fn record_reset<'a>(
        &'a self,
        domain: &'a str,
        prefix: &'a [(String, String)],
        opens: bool,
    ) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(async move {
            let record = ResetRecord {
                seq: 0,
                domain: domain.to_string(),
                prefix: prefix.to_vec(),
                opens,
            };
            let json = serde_json::to_string(&record)
                .map_err(|e| StoreError::Permanent(format!("a reset record: {e}")))?;
            let (list, generation) = (self.resets_key(), self.generation_key());
            self.call(async |c| {
                RECORD_SCRIPT
                    .key(&list)
                    .key(&generation)
                    .arg(&json)
                    .arg(MAX_RESET_RECORDS)
                    .invoke_async::<u64>(c)
                    .await
            })
            .await
        })
    }

    fn resets(&self) -> BoxFuture<'_, Result<Vec<ResetRecord>, StoreError>> {
        Box::pin(async move {
            let list = self.resets_key();
            let all: Vec<String> = self
                .call(async |c| {
                    redis::cmd("LRANGE")
                        .arg(&list)
                        .arg(0)
                        .arg(-1)
                        .query_async(c)
                        .await
                })
                .await?;
            Ok(all
                .iter()
                .filter_map(|line| {
                    let (seq, json) = line.split_once('|')?;
                    let mut r: ResetRecord = serde_json::from_str(json).ok()?;
                    r.seq = seq.parse().ok()?;
                    Some(r)
                })
                .collect())
        })
    }

    fn reset<'a>(
        &'a self,
        domain: &'a str,
        prefix: &'a [(String, String)],
        domain_tag: bool,
    ) -> BoxFuture<'a, Result<ResetCount, StoreError>> {
        Box::pin(self.reset_now(domain, prefix, domain_tag, None))
    }

    fn reset_fenced<'a>(
        &'a self,
        domain: &'a str,
        prefix: &'a [(String, String)],
        domain_tag: bool,
        fence: u64,
    ) -> BoxFuture<'a, Result<ResetCount, StoreError>> {
        Box::pin(self.reset_now(domain, prefix, domain_tag, Some(fence)))
    }

    fn overrides(&self) -> BoxFuture<'_, Result<(u64, Vec<StoredOverride>), StoreError>> {
        Box::pin(async move {
            let (hash, generation) = (self.hash_key(), self.generation_key());
            let (g, all): (Option<u64>, Vec<(String, String)>) = self
                .call(async |c| {
                    redis::pipe()
                        .cmd("GET")
                        .arg(&generation)
                        .cmd("HGETALL")
                        .arg(&hash)
                        .query_async(c)
                        .await
                })
                .await?;
            let overrides = all
                .iter()
                .filter_map(|(_, v)| StoredOverride::decode(v))
                .collect();
            Ok((g.unwrap_or(0), overrides))
        })
    }

    fn generation(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(async move {
            let generation = self.generation_key();
            let g: Option<u64> = self
                .call(async |c| redis::cmd("GET").arg(&generation).query_async(c).await)
                .await?;
            Ok(g.unwrap_or(0))
        })
    }

    fn put_override<'a>(
        &'a self,
        o: &'a StoredOverride,
        now_ms: u64,
        max: usize,
    ) -> BoxFuture<'a, Result<Option<StoredOverride>, StoreError>> {
        Box::pin(async move {
            let (hash, generation) = (self.hash_key(), self.generation_key());
            let (field, value) = (o.id.field(), o.encode());
            let (stored, before): (u8, String) = self
                .call(async |c| {
                    PUT_SCRIPT
                        .key(&hash)
                        .key(&generation)
                        .arg(&field)
                        .arg(&value)
                        .arg(now_ms)
                        .arg(max)
                        .invoke_async(c)
                        .await
                })
                .await?;
            if stored == 0 {
                return Err(too_many(max));
            }
            Ok(StoredOverride::decode(&before))
        })
    }

    fn delete_override<'a>(
        &'a self,
        id: &'a OverrideId,
        now_ms: u64,
    ) -> BoxFuture<'a, Result<Option<StoredOverride>, StoreError>> {
        Box::pin(async move {
            let (hash, generation) = (self.hash_key(), self.generation_key());
            let field = id.field();
            let before: String = self
                .call(async |c| {
                    DELETE_SCRIPT
                        .key(&hash)
                        .key(&generation)
                        .arg(&field)
                        .invoke_async(c)
                        .await
                })
                .await?;
            Ok(StoredOverride::decode(&before).filter(|o| o.live(now_ms)))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(e: &[(&str, &str)]) -> Vec<(String, String)> {
        e.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_prefix_pattern_matches_its_counters_and_no_other() {
        let (lit, tag) = reset_literal("rl_", "d", &entries(&[("tenant", "acme")]), false).unwrap();
        assert_eq!(
            (lit.as_str(), tag.as_str()),
            ("rl_{d|tenant=acme}", "d|tenant=acme")
        );
        assert_eq!(reset_pattern(&lit, 1, false), "rl_{d|tenant=acme}*");
        let two = entries(&[("tenant", "acme"), ("user", "b*b")]);
        let (lit, _) = reset_literal("", "d", &two, false).unwrap();
        assert_eq!(
            reset_pattern(&lit, 2, false),
            "{d|tenant=acme}|user=b\\*b[|:]*"
        );
        let (lit, tag) = reset_literal("", "d", &two[..1], true).unwrap();
        assert_eq!((lit.as_str(), tag.as_str()), ("{d|}|tenant=acme", "d|"));
        assert_eq!(reset_pattern(&lit, 1, true), "{d|}|tenant=acme[|:]*");
        // Layout characters are escaped as in counter keys: a value cannot end the tag early.
        let (lit, _) = reset_literal("", "d", &entries(&[("t", "a}|x=y")]), false).unwrap();
        assert_eq!(lit, "{d|t=a%7D%7Cx%3Dy}");
        assert!(reset_literal("", "d", &[], false).is_err());
    }

    #[test]
    fn a_counter_counts_once_and_boards_and_guards_are_kept() {
        fn c(k: &str) -> Option<bool> {
            counter_of(k, "{d|tenant=acme}".len())
        }
        assert_eq!(c("{d|tenant=acme}:sw:10:minute"), Some(true));
        assert_eq!(c("{d|tenant=acme}|user=x:fw:10:minute:2900000"), Some(true));
        assert_eq!(
            c("{d|tenant=acme}|user=x:fw:10:month@utc:c1764547200"),
            Some(true)
        );
        assert_eq!(c("{d|tenant=acme}|user=x:tb:10:minute:b9:o"), Some(true));
        assert_eq!(c("{d|tenant=acme}:fw:10:hour:o:482000"), Some(true));
        assert_eq!(c("{d|tenant=acme}:if:3:30s"), Some(true));
        assert_eq!(c("{d|tenant=acme}:if:3:30s:e"), Some(false));
        assert_eq!(c("{d|tenant=acme}:fw:1000:hour:r"), Some(false));
        assert_eq!(c("{d|tenant=acme}:fw:10:minute#rlqs"), None);
        assert_eq!(c("{d|tenant=acme}:fw:10:minute#wb:abc"), None);
        // A global counter's regions' reports at home go with the count; a region's pool
        // (cleared by the reset record, its refill's lease kept) and the short mark stay.
        assert_eq!(
            c("{d|tenant=acme}:fw:10:minute#regions:1764547200000"),
            Some(false)
        );
        assert_eq!(c("{d|tenant=acme}:fw:10:minute#pool:1764547200000"), None);
        assert_eq!(c("{d|tenant=acme}:fw:10:minute#short:1764547200000"), None);
        // A home reset's fences stay through the next reset (which only raises them).
        assert_eq!(c("{d|tenant=acme}:fw:10:minute:29409120#reset"), None);
        assert_eq!(c("{d|tenant=acme}:tb:10:minute:b9#reset"), None);
    }
}
