//! The caller is the adversary, on reservations over a `sliding_log` (issue 37, review B9): a
//! randomized caller reserves estimates, makes plain charges, settles its requests in any order
//! at any actual up to the estimate, and moves the clock across the period; the log never holds
//! more than the limit in any span of one period, each request counted at its reservation's
//! time as what it settled at (its estimate until then). A settle's give-back shrinks the
//! reservation's own entry: shrinking the newest entries instead (as before) let hits charged
//! after the reservation leave the log early, and this fails at step 493 of seed 1.
//!
//! A failing seed is printed; `SLUICE_HOSTILE_SEED=<seed>` replays it.

use super::hostile::hostile_seeds;
use crate::support::*;
use sluice::proto::rate_limit_response::Code;
use std::time::Duration;

const LIMIT: u64 = 50;
const PERIOD_MS: u64 = 10_000;

const CONFIG: &str = r#"
domain: ai
descriptors:
  - key: user
    rate_limit: {requests_per_unit: 50, period: 10s, algorithm: sliding_log}
    reservations: {lease: 1h, id_key: request_id, done_key: request_done, max: 1000}
"#;

/// One admitted charge as the model counts it: when (ms on the test clock), and how many hits.
struct Charge {
    at: u64,
    hits: u64,
    /// A reservation not yet settled: its id.
    open: Option<String>,
}

/// The hits the model counts in the period ending at `now`.
fn in_period(charges: &[Charge], now: u64) -> u64 {
    charges
        .iter()
        .filter(|c| c.at + PERIOD_MS > now)
        .map(|c| c.hits)
        .sum()
}

async fn a_hostile_caller_never_gets_past_a_reserved_sliding_log(kind: &str) {
    for seed in hostile_seeds() {
        println!("{kind}: hostile seed {seed} (SLUICE_HOSTILE_SEED={seed} replays it)");
        let (store, clock, _backend) = super::store::make_store(kind).await;
        let s = TestServer::start_on(
            CONFIG,
            sluice::service::ServiceOptions::default(),
            Some(store),
            clock.clone(),
        )
        .await;
        let mut rng = Rng::new(seed);
        let (mut now, mut next_id) = (0u64, 0u64);
        let mut charges: Vec<Charge> = Vec::new();
        for step in 0..600 {
            let context = format!("{kind}, seed {seed}, step {step}, t {now} ms");
            let open: Vec<usize> = (0..charges.len())
                .filter(|&i| charges[i].open.is_some())
                .collect();
            let mut roll = rng.below(10);
            if open.is_empty() {
                roll %= 7;
            }
            if roll < 4 {
                next_id += 1;
                let id = format!("r{next_id}");
                let estimate = 1 + rng.below(20);
                let mut req = one("ai", &[("user", "u"), ("request_id", &id)]);
                req.descriptors[0].hits_addend = Some(estimate);
                if code(&s.call(req).await) == Code::Ok {
                    charges.push(Charge {
                        at: now,
                        hits: estimate,
                        open: Some(id),
                    });
                }
            } else if roll < 7 {
                let hits = rng.below(6);
                let mut req = one("ai", &[("user", "u")]);
                req.descriptors[0].hits_addend = Some(hits);
                if code(&s.call(req).await) == Code::Ok && hits > 0 {
                    charges.push(Charge {
                        at: now,
                        hits,
                        open: None,
                    });
                }
            } else {
                // One open request ends, any of them, at an actual up to its estimate: given
                // back only while the period that took it lasts.
                let c = &mut charges[open[rng.below(open.len() as u64) as usize]];
                let actual = if rng.below(2) == 0 {
                    0
                } else {
                    rng.below(c.hits + 1)
                };
                let id = c.open.take().unwrap_or_default();
                let mut req = one("ai", &[("user", "u"), ("request_done", &id)]);
                req.descriptors[0].hits_addend = Some(actual);
                assert_eq!(code(&s.call(req).await), Code::Ok, "{context}");
                if now < c.at + PERIOD_MS {
                    c.hits = actual;
                }
            }
            let counted = in_period(&charges, now);
            assert!(
                counted <= LIMIT,
                "{context}: {counted} hits in the period ending now, limit {LIMIT}"
            );
            let step_ms = match rng.below(20) {
                0..=9 => 0,
                10..=15 => rng.below(1_000),
                16..=18 => rng.below(4_000),
                _ => PERIOD_MS - 1 + rng.below(3),
            };
            clock.advance(Duration::from_millis(step_ms));
            now += step_ms;
            charges.retain(|c| c.open.is_some() || c.at + PERIOD_MS > now);
        }
        s.stop().await;
    }
}

test_with_all_stores!(hostile_reserved_logs_on, kind => a_hostile_caller_never_gets_past_a_reserved_sliding_log);
