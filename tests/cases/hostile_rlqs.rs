//! The caller is the adversary, on RLQS (issue 37, item 4): Envoys that report whenever they
//! like (1 to 12 s apart, across window edges), with junk buckets beside the real one (other
//! values, keys the config does not know, counts above 2^40), never get an assignment that
//! lets the limited key pass unpaced (ALLOW_ALL, or an abandon while in use), and what they can
//! admit while obeying their assignments stays within docs/rlqs.md's bound: per window,
//! L + B + B × R + R × (the longest gap between reports, up to the assignment's TTL, + 1 s),
//! with B the streams holding the key and R the largest rate assigned to all of them together
//! (past the TTL Envoy
//! follows its own `expired_assignment_behavior`, outside the bound). Each Envoy is modelled as obeying its last assignment
//! (a token bucket starting full), the most an honest Envoy can admit. On memory and Redis;
//! `SLUICE_HOSTILE_SEED` replays a seed.

use super::hostile::hostile_seeds;
use super::quota::{usage, Stream};
use crate::support::*;
use sluice::proto::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use sluice::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use sluice::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use std::time::Duration;

const YAML: &str = "
domain: rlqs
descriptors:
  - key: x-api-key
    rate_limit: { unit: minute, requests_per_unit: 600 }
";
const L: u64 = 600;
const S: u64 = 1_000_000;

/// What an obeying Envoy may admit under `action` over `elapsed` µs (`None`: no assignment
/// yet, one request: `no_assignment_behavior`).
fn permitted(action: Option<&BucketAction>, elapsed: u64) -> Result<u64, String> {
    let Some(a) = action else { return Ok(1) };
    let Some(Action::QuotaAssignmentAction(q)) = &a.bucket_action else {
        return Err(format!("the limited key was abandoned while in use: {a:?}"));
    };
    match q
        .rate_limit_strategy
        .as_ref()
        .and_then(|s| s.strategy.as_ref())
    {
        Some(Strategy::TokenBucket(tb)) => {
            let fill = tb
                .fill_interval
                .as_ref()
                .map_or(S, |d| d.seconds as u64 * S + d.nanos as u64 / 1000)
                .max(1);
            let per = u64::from(tb.tokens_per_fill.unwrap_or(0));
            // Past the assignment's TTL Envoy follows `expired_assignment_behavior` (its own
            // configuration, outside sluice's bound): an obeying Envoy admits nothing more.
            let ttl = q
                .assignment_time_to_live
                .as_ref()
                .map_or(0, |d| d.seconds.max(0) as u64 * S);
            Ok(u64::from(tb.max_tokens) + per * (elapsed.min(ttl) / fill))
        }
        Some(Strategy::BlanketRule(r)) if *r == BlanketRule::DenyAll as i32 => Ok(0),
        other => Err(format!(
            "the limited key was let through unpaced: {other:?}"
        )),
    }
}

/// How long an assignment holds (µs); before the first, no time at all.
fn ttl_of(action: Option<&BucketAction>) -> u64 {
    match action.and_then(|a| a.bucket_action.as_ref()) {
        Some(Action::QuotaAssignmentAction(q)) => q
            .assignment_time_to_live
            .as_ref()
            .map_or(0, |d| d.seconds.max(0) as u64 * S),
        _ => 0,
    }
}

/// The rate (per second) an action assigns, for the bound.
fn rate(action: &BucketAction) -> u64 {
    match &action.bucket_action {
        Some(Action::QuotaAssignmentAction(q)) => match q
            .rate_limit_strategy
            .as_ref()
            .and_then(|s| s.strategy.as_ref())
        {
            Some(Strategy::TokenBucket(tb)) => u64::from(tb.tokens_per_fill.unwrap_or(0)),
            _ => 0,
        },
        _ => 0,
    }
}

/// One Envoy: its stream, its junk buckets, its last assignment for the key and when.
struct Envoy {
    stream: Stream,
    junk: Vec<(String, String)>,
    last: Option<BucketAction>,
    since: u64,
}

async fn a_hostile_rlqs_caller_stays_within_the_stated_bound(kind: &str) {
    for seed in hostile_seeds() {
        println!("{kind}: hostile seed {seed} (SLUICE_HOSTILE_SEED={seed} replays it)");
        let (store, clock, _backend) = super::store::make_store(kind).await;
        let s = TestServer::start_on(
            YAML,
            sluice::service::ServiceOptions::default(),
            Some(store),
            clock.clone(),
        )
        .await;
        let mut rng = Rng::new(seed);
        let mut now = T0.as_micros() as u64;
        let mut envoys = Vec::new();
        for e in 0..1 + rng.below(3) {
            let junk = (0..rng.below(4))
                .map(|j| match rng.below(3) {
                    0 => ("x-api-key".to_string(), format!("junk{e}-{j}")),
                    1 => ("unknown-key".to_string(), format!("v{j}")),
                    _ => ("x-api-key".to_string(), "{k}|:".to_string()),
                })
                .collect();
            envoys.push(Envoy {
                stream: Stream::open(&s).await,
                junk,
                last: None,
                since: now,
            });
        }
        // Per window (minute): admitted on the key, the largest rate and gap seen.
        let mut windows: std::collections::BTreeMap<u64, (u64, u64, u64)> = Default::default();
        for step in 0..80 {
            let context = format!("{kind}, seed {seed}, step {step}");
            let dt = match rng.below(6) {
                0 => 60 * S - now % (60 * S) + rng.below(2 * S),
                _ => S + rng.below(11 * S),
            };
            clock.advance(Duration::from_micros(dt));
            now += dt;
            let e = rng.below(envoys.len() as u64) as usize;
            let envoy = &mut envoys[e];
            let gap = now - envoy.since;
            let most = permitted(envoy.last.as_ref(), gap).unwrap_or_else(|why| {
                panic!("{context}: {why}");
            });
            // What the Envoy admitted (any part of what it may) and denied.
            let allowed = if most == 0 { 0 } else { rng.below(most + 1) };
            let mut usages = vec![usage(&[("x-api-key", "k")], allowed, rng.below(50))];
            for (k, v) in &envoy.junk {
                let count = if rng.below(4) == 0 {
                    1 << 41
                } else {
                    rng.below(30)
                };
                usages.push(usage(&[(k.as_str(), v.as_str())], count, 0));
            }
            let is_key = |a: &&BucketAction| {
                a.bucket_id.as_ref().is_some_and(|b| {
                    b.bucket.get("x-api-key").map(String::as_str) == Some("k")
                        && b.bucket.len() == 1
                })
            };
            // Responses answer no report in particular: one sluice sent on its own (the
            // abandon of a junk bucket whose assignment expired) may come first (seed
            // 1795905356081519705, step 25). The report's answer follows it.
            let mut actions = envoy.stream.report("rlqs", usages).await;
            for _ in 0..4 {
                if actions.iter().any(|a| is_key(&a)) {
                    break;
                }
                // Bounded only against a hang (sluice never answering the key fails below).
                match tokio::time::timeout(Duration::from_secs(30), envoy.stream.response()).await {
                    Ok(next) => actions.extend(next),
                    Err(_) => break,
                }
            }
            let mine = actions
                .iter()
                .find(is_key)
                .unwrap_or_else(|| panic!("{context}: no answer for the key: {actions:?}"))
                .clone();
            permitted(Some(&mine), 0).unwrap_or_else(|why| panic!("{context}: {why}"));
            // What was admitted over (since, now], spread evenly over its windows (as sluice
            // splits a report straddling a window's end).
            let span = gap.min(ttl_of(envoy.last.as_ref()));
            let from = now - gap;
            let assigned: u64 = envoys.iter().map(|e| e.last.as_ref().map_or(0, rate)).sum();
            let envoy = &mut envoys[e];
            let mut left = allowed;
            for start in (from / (60 * S)..=now / (60 * S)).rev() {
                let lo = from.max(start * 60 * S);
                let hi = now.min((start + 1) * 60 * S);
                let part = if lo == from {
                    left
                } else {
                    (allowed * (hi - lo)).div_ceil(gap.max(1)).min(left)
                };
                left -= part;
                let w = windows.entry(start).or_default();
                w.0 += part;
                w.1 = w.1.max(assigned);
                w.2 = w.2.max(span);
            }
            envoy.last = Some(mine);
            envoy.since = now;
            // R: the rate assigned on the key, all streams together.
            let total: u64 = envoys.iter().map(|e| e.last.as_ref().map_or(0, rate)).sum();
            let w = windows.entry(now / (60 * S)).or_default();
            w.1 = w.1.max(total);
            // The key's window: what was admitted in it stays within the bound.
            let b = envoys.len() as u64;
            for (start, &(admitted, r, longest)) in &windows {
                let bound = L + b + b * r + r * (longest.div_ceil(S) + 1);
                assert!(
                    admitted <= bound,
                    "{context}: window {start}: {admitted} admitted, at most {bound} \
                     (B {b}, R {r}, gap {longest} µs)"
                );
            }
        }
        s.stop().await;
    }
}

test_with_stores!(hostile_rlqs_callers_on, [memory, redis, cluster], kind => a_hostile_rlqs_caller_stays_within_the_stated_bound);
