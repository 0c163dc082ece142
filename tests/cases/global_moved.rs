//! Demand that moves between regions mid-window (`store/global/moved.rs`), with real processes:
//! a home `redis-server`, regions A and C each with its own `redis-server` and one `sluice`,
//! each 75 ms from home each way (round trips of 150 ms, the worst the issue names). C serves a
//! few requests (connected, warm) and goes idle (its pool back home). A spends half of a global
//! 3 000 an hour at 1 500 a second, its pool filled past that, then goes on at a trickle of 2 a second (with slices of 2 units, the trickle takes from A's
//! pool every second or so: it is never idle for the 2 s of the ordinary give-back, and
//! without more would keep what it holds to the window's end); C then offers 3x: home is dry
//! and C is under its max-min share, so C marks the window short, and A's pool, idle for
//! 250 ms between two of the trickle's takes, goes home for C's next refill
//! (`sluice_global_moved_total` on A). C is admitted more than home had left when A stopped, A
//! and C together at least 98 % of the limit and never more than it, and once the pools are
//! back the home counter holds exactly what they admitted.
//!
//! Nothing here is timed: what is asserted are counts (C's load runs in short steps, and what
//! each step admitted is printed: how soon A's units reach C is a figure, not an assertion).

use super::global::{home_counters, load, metric_sum, region, write_config, Store};
use super::global_admin::{config, early_in_an_hour, inspect, LIMIT};
use crate::support::poll_until;
use crate::support::redis::start_redis;
use std::net::SocketAddr;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demand_that_moves_to_another_region_gets_the_units_the_first_one_left() {
    let (home, ra, rc) = tokio::join!(start_redis(&[]), start_redis(&[]), start_redis(&[]));
    // A's slices are of 2 units at most: its trickle takes from the pool every second or so,
    // so the pool is never idle for the 2 s of the ordinary give-back (only the short mark
    // can send it home). C's are the default.
    let (_dir, path) = write_config(&config());
    let (_dir_a, path_a) = write_config(&config().replace("global: {}", "global: {max_slice: 2}"));
    let home_addr = SocketAddr::from(([127, 0, 0, 1], home.port()));
    let delay = Duration::from_millis(75);
    let (a, c) = (Store::Single(ra), Store::Single(rc));
    let a = region("a", &a, home_addr, delay, &path_a, 1).await;
    let c = region("c", &c, home_addr, delay, &path, 1).await;
    early_in_an_hour().await;
    // C warm: connected to home, its scripts loaded, its pool refilled once (what a region
    // that serves traffic is; a cold one's first refill pays its connection's round trips).
    let (warm, _) = load(c.replicas[0].grpc_url(), 4, "1s").await;
    assert!(warm > 0);
    // Then idle: its slices and its pool go back home, and its report says so (a region
    // taking nothing, so A's refills are not held to a share beside it).
    poll_until("C's pool back home", || async {
        match inspect(&c).await {
            (usage, _) if usage == warm => Ok(()),
            other => Err(other),
        }
    })
    .await;

    // A alone at 1 500 a second for a second (half the limit), then nothing: its pool holds
    // units.
    let (from_a, _) = load(a.replicas[0].grpc_url(), 1_500, "1s").await;
    assert!(from_a > 0 && from_a < LIMIT, "{from_a}");
    // What home had left when A stopped; A's pool and slices hold the rest of what it granted.
    let home_then: u64 = home_counters(&home).iter().map(|(_, v)| *v).sum();
    let rest = LIMIT - home_then;

    // A goes on at a trickle, 2 a second, taking from its pool: without the short mark, what
    // the pool holds would stay there to the window's end. At once, C offers 3x, in steps.
    let trickle = tokio::spawn(load(a.replicas[0].grpc_url(), 2, "5s"));
    let mut from_c = warm;
    let mut steps = Vec::new();
    let refills = "sluice_global_refills_total{region=\"c\"}";
    for _ in 0..12 {
        let (ok, _) = load(c.replicas[0].grpc_url(), 2_500, "250ms").await;
        from_c += ok;
        // What the step admitted, and C's refills so far (a figure, not asserted).
        steps.push((ok, metric_sum(&c.replicas, refills).await));
    }
    let (trickled, _) = trickle.await.expect("the trickle");
    let from_a = from_a + trickled;
    eprintln!(
        "C admitted {from_c} ({warm} warming up), in 250 ms steps (admitted, C's refills so far) \
         {steps:?}; A {from_a} ({trickled} at the \
         trickle): A and C {} of {LIMIT}",
        from_a + from_c
    );
    let (usage, pools) = inspect(&a).await;
    eprintln!("then: home {usage}, the pools {pools:?}");
    let moved = metric_sum(&a.replicas, "sluice_global_moved_total{region=\"a\"}").await;
    eprintln!("A gave back {moved} units to a region short of them");
    assert!(moved > 0.0, "A's idle pool never went home for C");
    assert!(from_a + from_c <= LIMIT, "{from_a} + {from_c} past {LIMIT}");
    assert!(
        from_c > rest,
        "C admitted {from_c}, no more than the {rest} home had left when A stopped"
    );
    // C was admitted what A left: together nearly all the limit.
    assert!(
        (from_a + from_c) * 100 >= LIMIT * 98,
        "A {from_a} and C {from_c}: under 98 % of {LIMIT}"
    );
    // Once every pool and slice is back, home holds exactly what they admitted.
    poll_until("home holds what A and C admitted", || async {
        let counters = home_counters(&home);
        if counters.iter().map(|(_, v)| *v).sum::<u64>() == from_a + from_c {
            Ok(())
        } else {
            Err(counters)
        }
    })
    .await;
}
