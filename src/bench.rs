//! `sluice bench` (a module of the binary, not of the service library): a load generator for any Envoy RLS v3 endpoint (sluice, envoyproxy/ratelimit,
//! Limitador, ...). It exists so speed claims are measured the same way for every system: the
//! same descriptors, the same concurrency, the same latency accounting.
//!
//! Closed loop (`--concurrency` callers, each sending its next request when the previous one is
//! answered) or open loop (`--rate` requests per second on a fixed schedule; latency is taken
//! from the scheduled send time, so a stalled server is not hidden by coordinated omission).
//! Descriptors are templates: `resource=api,consumer={id}` replaces `{id}` with a random id below
//! `--consumers`. Latencies are kept in a fixed-size log-linear histogram (no per-request
//! allocation, bounded memory whatever the duration).

use clap::Args;
use sluice::proto::rate_limit_descriptor::Entry;
use sluice::proto::rate_limit_response::Code;
use sluice::proto::rate_limit_service_client::RateLimitServiceClient;
use sluice::proto::{RateLimitDescriptor, RateLimitRequest};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::task::JoinSet;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// Load generator for any RLS endpoint: decisions/s, OK / OVER_LIMIT / errors, latency.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// The RLS endpoint: `http://host:port` (h2c) or `https://host:port` (TLS).
    #[arg(long, default_value = "http://127.0.0.1:8081")]
    pub target: String,
    /// The rate-limit domain of every request.
    #[arg(long, default_value = "bench")]
    pub domain: String,
    /// A descriptor template, `key=value,key=value`; repeat the flag for several descriptors per
    /// request. `{id}` in a value is replaced by a random consumer id, `{req}` by a random
    /// request id (both drawn once per request, the same in each of its descriptors).
    #[arg(long = "descriptor", default_value = "resource=api,consumer={id}")]
    pub descriptors: Vec<String>,
    /// Distinct ids `{id}` takes (uniformly random).
    #[arg(long, default_value_t = 10_000)]
    pub consumers: u64,
    /// Requests in flight at once (closed loop), or the cap on them (open loop).
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// HTTP/2 connections the requests are spread over.
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    /// Open loop: requests per second on a fixed schedule. 0 = closed loop.
    #[arg(long, default_value_t = 0)]
    pub rate: u64,
    /// How long to send, e.g. `10s`, `1m`.
    #[arg(long, default_value = "10s", value_parser = sluice::parse_duration)]
    pub duration: Duration,
    /// Request-level `hits_addend` (0 = Envoy's default of 1).
    #[arg(long, default_value_t = 0)]
    pub hits_addend: u32,
    /// Per-call deadline sent as `grpc-timeout` (Envoy sends 20ms by default); 0 = none.
    #[arg(long, default_value = "0s", value_parser = sluice::parse_duration)]
    pub timeout: Duration,
    /// PEM CA certificate that signs the server's certificate (TLS).
    #[arg(long)]
    pub ca_cert: Option<PathBuf>,
    /// PEM client certificate and key for mutual TLS.
    #[arg(long, requires = "client_key")]
    pub client_cert: Option<PathBuf>,
    #[arg(long, requires = "client_cert")]
    pub client_key: Option<PathBuf>,
    /// Name to verify the server certificate against (default: the target's host).
    #[arg(long)]
    pub tls_server_name: Option<String>,
    /// Print the summary as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    /// Seed of the id generator, for repeatable runs.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// One descriptor template: entries whose value may hold `{id}`.
#[derive(Debug, Clone)]
struct Template(Vec<(String, String)>);

impl Template {
    fn parse(s: &str) -> Result<Self, String> {
        let entries = s
            .split(',')
            .map(|e| {
                let (k, v) = e
                    .split_once('=')
                    .ok_or_else(|| format!("descriptor entry {e:?} is not key=value"))?;
                if k.is_empty() {
                    return Err(format!("descriptor entry {e:?} has an empty key"));
                }
                Ok((k.to_string(), v.to_string()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self(entries))
    }

    fn render(&self, id: u64, req: u64) -> RateLimitDescriptor {
        RateLimitDescriptor {
            entries: self
                .0
                .iter()
                .map(|(k, v)| Entry {
                    key: k.clone(),
                    value: v
                        .replace("{id}", &id.to_string())
                        .replace("{req}", &format!("{req:016x}")),
                })
                .collect(),
            ..Default::default()
        }
    }
}

/// A log-linear latency histogram in microseconds: exact below 64 µs, then 32 sub-buckets per
/// power of two (a value is reported at most 1/32 low), 2 560 counters (20 KiB) whatever the
/// number of samples.
#[derive(Debug, Clone)]
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
    max: u64,
}

const SUB: u64 = 64;

impl Default for Histogram {
    fn default() -> Self {
        Self {
            counts: vec![0; (40 * SUB) as usize],
            total: 0,
            max: 0,
        }
    }
}

impl Histogram {
    fn index(v: u64) -> usize {
        if v < SUB {
            return v as usize;
        }
        let power = 63 - u64::from(v.leading_zeros()); // >= 6
        let shift = power - 5; // keep 6 significant bits
        let idx = (power - 5) * SUB / 2 + (v >> shift);
        (idx as usize).min((40 * SUB) as usize - 1)
    }

    fn lower_bound(i: usize) -> u64 {
        let i = i as u64;
        if i < SUB {
            return i;
        }
        let shift = i / (SUB / 2) - 1;
        (i - shift * SUB / 2) << shift
    }

    pub fn record(&mut self, us: u64) {
        self.counts[Self::index(us)] += 1;
        self.total += 1;
        self.max = self.max.max(us);
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
        self.max = self.max.max(other.max);
    }

    /// The value at quantile `q` (0..=1), as the lower bound of its bucket.
    pub fn quantile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((self.total as f64 * q).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Self::lower_bound(i).min(self.max);
            }
        }
        self.max
    }
}

#[derive(Debug, Default)]
struct Counters {
    ok: AtomicU64,
    over_limit: AtomicU64,
    errors: AtomicU64,
}

/// The result of a run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Summary {
    pub target: String,
    pub mode: &'static str,
    pub concurrency: usize,
    pub connections: usize,
    pub duration_s: f64,
    pub decisions: u64,
    pub decisions_per_s: f64,
    pub ok: u64,
    pub over_limit: u64,
    pub errors: u64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub max_us: u64,
    /// The first error seen, if any (the others are usually the same).
    pub first_error: Option<String>,
}

/// xorshift64*: a fast, seedable generator for consumer ids; statistical quality is irrelevant.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

async fn channels(args: &BenchArgs) -> Result<Vec<Channel>, String> {
    let mut endpoint = Endpoint::from_shared(args.target.clone())
        .map_err(|e| format!("invalid --target {:?}: {e}", args.target))?
        .tcp_nodelay(true);
    if args.target.starts_with("https://") {
        let mut tls = ClientTlsConfig::new();
        if let Some(ca) = &args.ca_cert {
            let pem = std::fs::read(ca).map_err(|e| format!("--ca-cert {}: {e}", ca.display()))?;
            tls = tls.ca_certificate(Certificate::from_pem(pem));
        }
        if let (Some(c), Some(k)) = (&args.client_cert, &args.client_key) {
            let cert =
                std::fs::read(c).map_err(|e| format!("--client-cert {}: {e}", c.display()))?;
            let key = std::fs::read(k).map_err(|e| format!("--client-key {}: {e}", k.display()))?;
            tls = tls.identity(Identity::from_pem(cert, key));
        }
        if let Some(name) = &args.tls_server_name {
            tls = tls.domain_name(name.clone());
        }
        endpoint = endpoint
            .tls_config(tls)
            .map_err(|e| format!("TLS settings: {e}"))?;
    }
    let mut out = Vec::with_capacity(args.connections.max(1));
    for _ in 0..args.connections.max(1) {
        out.push(
            endpoint
                .connect()
                .await
                .map_err(|e| format!("cannot connect to {}: {e:?}", args.target))?,
        );
    }
    Ok(out)
}

struct Shared {
    templates: Vec<Template>,
    args: BenchArgs,
    counters: Counters,
    first_error: Mutex<Option<String>>,
    /// Latencies of the current second, merged into the total once reported.
    recent: Mutex<Histogram>,
}

impl Shared {
    fn request(&self, rng: &mut Rng) -> tonic::Request<RateLimitRequest> {
        let consumers = self.args.consumers.max(1);
        // One consumer and one request id per request, shared by its descriptors (an
        // in_flight take and free of one request: `tenant={id},request_id={req}` and
        // `tenant={id},request_done={req}`).
        let (id, req) = (rng.next() % consumers, rng.next());
        let descriptors = self.templates.iter().map(|t| t.render(id, req)).collect();
        let mut req = tonic::Request::new(RateLimitRequest {
            domain: self.args.domain.clone(),
            descriptors,
            hits_addend: self.args.hits_addend,
        });
        if !self.args.timeout.is_zero() {
            req.set_timeout(self.args.timeout);
        }
        req
    }

    fn record(
        &self,
        result: Result<tonic::Response<sluice::proto::RateLimitResponse>, tonic::Status>,
        latency: Duration,
        local: &mut Histogram,
    ) {
        match result {
            Ok(r) if r.get_ref().overall_code == Code::OverLimit as i32 => {
                self.counters.over_limit.fetch_add(1, Ordering::Relaxed);
            }
            Ok(_) => {
                self.counters.ok.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                if let Ok(mut f) = self.first_error.lock() {
                    f.get_or_insert_with(|| format!("{}: {}", e.code(), e.message()));
                }
            }
        }
        local.record(u64::try_from(latency.as_micros()).unwrap_or(u64::MAX));
    }

    fn flush(&self, local: &mut Histogram) {
        if let Ok(mut r) = self.recent.lock() {
            r.merge(local);
        }
        *local = Histogram::default();
    }
}

/// Runs the load and returns its summary; progress lines go to stderr once a second.
pub async fn run(args: BenchArgs) -> Result<Summary, String> {
    let templates = args
        .descriptors
        .iter()
        .map(|d| Template::parse(d))
        .collect::<Result<Vec<_>, _>>()?;
    if args.concurrency == 0 {
        return Err("--concurrency must be at least 1".into());
    }
    let chans = channels(&args).await?;
    let shared = Arc::new(Shared {
        templates,
        args: args.clone(),
        counters: Counters::default(),
        first_error: Mutex::new(None),
        recent: Mutex::new(Histogram::default()),
    });
    let started = Instant::now();
    let workers = if args.rate == 0 {
        closed_loop(&shared, &chans, started + args.duration)
    } else {
        open_loop(&shared, &chans, started)
    };
    let total = progress(&shared, started, workers).await?;
    let elapsed = started.elapsed().as_secs_f64();
    let c = &shared.counters;
    let done = decisions(c);
    Ok(Summary {
        target: args.target.clone(),
        mode: if args.rate == 0 { "closed" } else { "open" },
        concurrency: args.concurrency,
        connections: chans.len(),
        duration_s: elapsed,
        decisions: done,
        decisions_per_s: done as f64 / elapsed,
        ok: c.ok.load(Ordering::Relaxed),
        over_limit: c.over_limit.load(Ordering::Relaxed),
        errors: c.errors.load(Ordering::Relaxed),
        p50_us: total.quantile(0.5),
        p99_us: total.quantile(0.99),
        p999_us: total.quantile(0.999),
        max_us: total.max,
        first_error: shared.first_error.lock().ok().and_then(|f| f.clone()),
    })
}

/// Closed loop: `concurrency` workers, each sending its next request when the last answered.
fn closed_loop(shared: &Arc<Shared>, chans: &[Channel], deadline: Instant) -> JoinSet<()> {
    let mut workers = JoinSet::new();
    for w in 0..shared.args.concurrency {
        let shared = shared.clone();
        let mut client = RateLimitServiceClient::new(chans[w % chans.len()].clone());
        let mut rng = Rng(shared.args.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (w as u64 + 1));
        workers.spawn(async move {
            let mut local = Histogram::default();
            let mut last_flush = Instant::now();
            while Instant::now() < deadline {
                let req = shared.request(&mut rng);
                let sent = Instant::now();
                let r = client.should_rate_limit(req).await;
                shared.record(r, sent.elapsed(), &mut local);
                if last_flush.elapsed() >= Duration::from_millis(100) {
                    shared.flush(&mut local);
                    last_flush = Instant::now();
                }
            }
            shared.flush(&mut local);
        });
    }
    workers
}

/// Open loop: requests sent on a fixed schedule (`rate` per second), at most `concurrency`
/// outstanding; a request's latency counts from its scheduled time.
fn open_loop(shared: &Arc<Shared>, chans: &[Channel], started: Instant) -> JoinSet<()> {
    let (shared, chans) = (shared.clone(), chans.to_vec());
    let mut workers = JoinSet::new();
    workers.spawn(async move {
        let deadline = started + shared.args.duration;
        let permits = Arc::new(tokio::sync::Semaphore::new(shared.args.concurrency));
        let mut rng = Rng(shared.args.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let interval = Duration::from_secs_f64(1.0 / shared.args.rate as f64);
        let mut inflight = JoinSet::new();
        for n in 0u64.. {
            let scheduled = started + interval.mul_f64(n as f64);
            if scheduled >= deadline {
                break;
            }
            tokio::time::sleep_until(scheduled.into()).await;
            // Over the cap, the request still waits for a slot, and its latency counts the
            // wait (measured from the schedule).
            let Ok(permit) = permits.clone().acquire_owned().await else {
                break;
            };
            let req = shared.request(&mut rng);
            let mut client = RateLimitServiceClient::new(chans[(n as usize) % chans.len()].clone());
            let shared = shared.clone();
            inflight.spawn(async move {
                let r = client.should_rate_limit(req).await;
                let mut local = Histogram::default();
                shared.record(r, scheduled.elapsed(), &mut local);
                shared.flush(&mut local);
                drop(permit);
            });
            while inflight.try_join_next().is_some() {}
        }
        while inflight.join_next().await.is_some() {}
    });
    workers
}

/// Prints a progress line every second until the workers finish; returns every latency.
async fn progress(
    shared: &Shared,
    started: Instant,
    mut workers: JoinSet<()>,
) -> Result<Histogram, String> {
    let mut total = Histogram::default();
    let mut last = (0u64, Instant::now());
    let mut tick = tokio::time::interval_at(
        (started + Duration::from_secs(1)).into(),
        Duration::from_secs(1),
    );
    let join_all = async { while workers.join_next().await.is_some() {} };
    tokio::pin!(join_all);
    loop {
        tokio::select! {
            _ = &mut join_all => break,
            _ = tick.tick() => {
                let second = std::mem::take(&mut *shared.recent.lock().map_err(|_| "poisoned")?);
                let done = decisions(&shared.counters);
                let now = Instant::now();
                let rate = (done - last.0) as f64 / now.duration_since(last.1).as_secs_f64();
                eprintln!(
                    "[{:>4.0}s] {:>9.0} decisions/s  p50 {:>6}us  p99 {:>6}us  errors {}",
                    started.elapsed().as_secs_f64(),
                    rate,
                    second.quantile(0.5),
                    second.quantile(0.99),
                    shared.counters.errors.load(Ordering::Relaxed),
                );
                total.merge(&second);
                last = (done, now);
            }
        }
    }
    if let Ok(rest) = shared.recent.lock() {
        total.merge(&rest);
    }
    Ok(total)
}

fn decisions(c: &Counters) -> u64 {
    c.ok.load(Ordering::Relaxed) + c.over_limit.load(Ordering::Relaxed)
}

/// The human-readable summary.
pub fn render(s: &Summary) -> String {
    let mut out = format!(
        "{} ({} loop, {} in flight, {} connections, {:.1}s)\n\
         decisions/s {:.0}   decisions {}   OK {}   OVER_LIMIT {}   errors {}\n\
         latency p50 {}us   p99 {}us   p99.9 {}us   max {}us\n",
        s.target,
        s.mode,
        s.concurrency,
        s.connections,
        s.duration_s,
        s.decisions_per_s,
        s.decisions,
        s.ok,
        s.over_limit,
        s.errors,
        s.p50_us,
        s.p99_us,
        s.p999_us,
        s.max_us
    );
    if let Some(e) = &s.first_error {
        out.push_str(&format!("first error: {e}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_quantiles_are_within_one_bucket() {
        let mut h = Histogram::default();
        for v in 1..=100_000u64 {
            h.record(v);
        }
        for (q, want) in [(0.5, 50_000.0), (0.99, 99_000.0), (0.999, 99_900.0)] {
            let got = h.quantile(q) as f64;
            assert!(
                (got - want).abs() / want <= 1.0 / 32.0,
                "q{q}: {got} vs {want}"
            );
        }
        assert_eq!(h.max, 100_000);
        assert_eq!(h.quantile(0.0), 1);
        for v in [0u64, 1, 63, 64, 65, 127, 128, 1000, 123_456_789] {
            let lb = Histogram::lower_bound(Histogram::index(v));
            assert!(lb <= v && v - lb <= v / 32, "{v} -> bucket starting {lb}");
        }
    }

    #[test]
    fn templates_replace_the_id() {
        let t = Template::parse("resource=api,consumer=c{id}").expect("parses");
        let d = t.render(42, 7);
        assert_eq!(d.entries[1].value, "c42");
        assert_eq!(d.entries[0].key, "resource");
        assert!(Template::parse("noequals").is_err());
        assert!(Template::parse("=v").is_err());
    }
}
