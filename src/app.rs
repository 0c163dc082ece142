//! The composition root: turns parsed [`ServeArgs`] into the [`ServerConfig`] `serve` starts
//! from, and builds every part the server serves ([`assemble`]: the store stack, the telemetry,
//! the decision engine, the trace export). This is where settings meet the world: names are
//! resolved, the config tree is read, and the store chain is built (which needs a Tokio runtime
//! for the Redis connections). Parsing itself (`settings`) stays free of I/O, and `server`
//! receives built parts and builds none.

use crate::clock::{Clock, SystemClock};
use crate::config::{load_path, LoadOptions, RuleSet};
use crate::server::reload::ReloadSettings;
use crate::server::{Parts, ServerConfig, ServerError};
use crate::service::{RateLimiter, RequestCaps, ServiceOptions};
use crate::settings::{resolve, ServeArgs, SettingsError};
use crate::store::redis::redact_url;
use crate::store::{StoreChain, StoreStack};
use crate::telemetry::trace::{TraceSettings, Tracing};
use crate::telemetry::Telemetry;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What the served parts are built from.
#[derive(Debug)]
pub struct Ingredients {
    /// The initial rules; `None` waits for the management server's first push (xDS).
    pub rules: Option<RuleSet>,
    pub store: StoreStack,
    pub options: ServiceOptions,
    /// The service's time source (the memory store and the deny cache read it too).
    pub clock: Arc<dyn Clock>,
    /// `TRACING_ENABLED`: export spans over OTLP with these settings.
    pub tracing: Option<TraceSettings>,
    /// Where `rules` came from, for the load log line.
    pub config_path: Option<PathBuf>,
    /// `DECISION_LOG`: started with the telemetry (its counters are metrics).
    pub decision_log: Option<crate::decision_log::Settings>,
}

impl Ingredients {
    /// Tests only (`test-util`): `rules` on a memory store on `clock`, default options, no
    /// tracing; override fields with struct update syntax.
    #[cfg(any(test, feature = "test-util"))]
    pub fn for_tests(rules: RuleSet, clock: Arc<dyn Clock>) -> Self {
        Self {
            rules: Some(rules),
            store: StoreStack::memory(
                Arc::clone(&clock),
                crate::store::memory::DEFAULT_MAX_COUNTERS,
            )
            .with_slices(
                Arc::clone(&clock),
                (crate::store::slices::DEFAULT_MAX_SLICES, false),
            ),
            options: ServiceOptions::default(),
            clock,
            tracing: None,
            config_path: None,
            decision_log: None,
        }
    }
}

/// Builds the parts a server serves: the trace export (when configured), the telemetry on the
/// store's signals, and the decision engine with the rules loaded or awaiting the first push.
pub fn assemble(mut i: Ingredients) -> Result<Parts, ServerError> {
    let tracing = start_tracing(i.tracing)?;
    let mut telemetry = Telemetry::new(i.clock)?;
    telemetry.tracer = tracing.as_ref().map(Tracing::tracer);
    if let Some(settings) = i.decision_log {
        let path = settings.path.display().to_string();
        let log = crate::decision_log::DecisionLog::start(
            settings,
            telemetry.metrics.decision_log_counters(),
        )
        .map_err(ServerError::DecisionLog)?;
        tracing::info!(path, "writing decided requests to the decision log");
        i.options.decision_log = Some(log);
    }
    let limiter = match i.rules {
        None => RateLimiter::awaiting_config(i.store, i.options, telemetry),
        Some(rules) => {
            crate::server::log_config_loaded(&rules, i.config_path.as_deref(), i.options.counting);
            RateLimiter::new(rules, i.store, i.options, telemetry)
        }
    };
    Ok(Parts {
        limiter: Arc::new(limiter),
        tracing,
    })
}

/// Starts the OTLP trace export when configured.
fn start_tracing(settings: Option<TraceSettings>) -> Result<Option<Tracing>, ServerError> {
    let Some(settings) = settings else {
        return Ok(None);
    };
    let t = Tracing::start(&settings)?;
    tracing::info!(
        endpoint = %settings.endpoint,
        service_name = %settings.service_name,
        sampling_rate = settings.sampling_rate,
        "exporting traces over OTLP"
    );
    Ok(Some(t))
}

/// Resolves addresses, builds the store and loads the config: everything `serve` needs
/// before it binds. Fails before any port is opened.
pub fn server_config(args: &ServeArgs) -> Result<ServerConfig, SettingsError> {
    let chain = args.store_chain()?;
    let grpc_tls = args.tls.grpc_tls()?;
    let grpc_addr = resolve("gRPC", &args.grpc_host, args.grpc_port)?;
    let http_addr = resolve("HTTP", &args.host, args.port)?;
    let load = &args.load;
    let xds = args
        .source
        .xds((load.merge_domain_config, load.use_calendar_month_rate_limit))?;
    let path = args.config_path();
    // Taken before the read: a change made after it is seen by the first reload check.
    let loaded_fingerprint = match xds {
        None => crate::config::fingerprint(&path, &args.load_options()),
        Some(_) => 0,
    };
    let rules = match xds {
        None => Some(load_rules(&path, &args.load_options())?),
        // The management server brings the rules.
        Some(_) => None,
    };
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let store = build_store(args, chain.as_ref(), &clock)?;
    let parts = assemble(Ingredients {
        rules,
        store,
        options: service_options(args),
        clock,
        tracing: args.observe.tracing(),
        config_path: xds.is_none().then(|| path.clone()),
        decision_log: args.decision_log.settings(),
    })
    .map_err(SettingsError::Start)?;
    let candidate_reload = load_candidates(args, &parts.limiter)?;
    let mut config = ServerConfig::new(parts);
    config.candidate_reload = candidate_reload;
    config.grpc_addr = grpc_addr;
    config.http_addr = http_addr;
    config.grpc_tls = grpc_tls;
    config.loaded_fingerprint = loaded_fingerprint;
    let interval = args.runtime.config_reload_interval;
    config.reload = (xds.is_none() && !interval.is_zero()).then(|| ReloadSettings {
        path: path.clone(),
        options: args.load_options(),
        interval,
        candidate: false,
    });
    config.shutdown_grace = args.shutdown_grace;
    config.drain_delay = args.shutdown_drain_delay;
    config.connection_age =
        (!args.grpc_max_connection_age.is_zero()).then_some(crate::server::ConnectionAge {
            max: args.grpc_max_connection_age,
        });
    if let Some(n) = args.worker_threads {
        config.grpc_threads = usize::from(n);
    }
    config.xds = xds;
    config.envoy_stats = args.stats.settings()?;
    config.quota = args.rlqs.settings();
    config.http2 = args.http2.limits();
    config.json_endpoint = args.json.json_endpoint;
    config.json_negative_hits = args.json.json_allow_negative_hits;
    if args.grpc_uds.is_some() && config.grpc_tls.is_some() {
        return Err(SettingsError::Tls(
            "GRPC_UDS and GRPC_SERVER_USE_TLS are both set: sluice serves a Unix socket in \
             plaintext only"
                .into(),
        ));
    }
    config.grpc_uds = args.grpc_uds.clone();
    config.debug_addr = Some(resolve("debug", &args.debug_host, args.debug_port)?);
    config.admin = args.admin.listen()?;
    Ok(config)
}

/// `CANDIDATE_CONFIG`: the candidate rules, loaded into `limiter` (an error names file, line
/// and rule, and stops the start as the config's do), and how to reload them.
fn load_candidates(
    args: &ServeArgs,
    limiter: &RateLimiter,
) -> Result<Option<(ReloadSettings, u64)>, SettingsError> {
    let Some(path) = &args.candidate_config else {
        return Ok(None);
    };
    // A candidate's `leased:` or `global:` is tried as a plain counter on the region's store.
    let options = LoadOptions {
        global_store: true,
        ..args.load_options()
    };
    let digest = crate::config::fingerprint(path, &options);
    let rules = load_rules(path, &options)?;
    tracing::info!(
        source = %path.display(),
        domains = rules.domains.len(),
        "candidate limits loaded: decided beside the config, never changing an answer"
    );
    limiter.replace_candidates(rules);
    let interval = args.runtime.config_reload_interval;
    Ok((!interval.is_zero()).then(|| {
        let settings = ReloadSettings {
            path: path.clone(),
            options,
            interval,
            candidate: true,
        };
        (settings, digest)
    }))
}

fn load_rules(path: &Path, opts: &LoadOptions) -> Result<RuleSet, SettingsError> {
    load_path(path, opts).map_err(|errors| SettingsError::Config {
        path: path.to_path_buf(),
        errors,
    })
}

/// The Redis store chain when Redis is configured, else the embedded store.
fn build_store(
    args: &ServeArgs,
    chain: Option<&StoreChain>,
    clock: &Arc<dyn Clock>,
) -> Result<StoreStack, SettingsError> {
    let Some(chain) = chain else {
        tracing::info!(
            max_counters = args.memory_max_counters,
            "using the in-memory store (counters are per process)"
        );
        let stack = StoreStack::memory(Arc::clone(clock), args.memory_max_counters);
        return Ok(with_home(stack, None, args, clock)?
            .with_slices(Arc::clone(clock), (args.leased_max_counters, false)));
    };
    tracing::info!(
        kind = ?chain.redis.kind,
        urls = ?chain.redis.urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>(),
        timeout = ?chain.redis.timeout,
        tls = ?chain.redis.tls,
        local_cache_bytes = chain.local_cache_bytes,
        "using the Redis store"
    );
    Ok(
        with_home(chain.build(Arc::clone(clock))?, Some(chain), args, clock)?.with_slices(
            Arc::clone(clock),
            (args.leased_max_counters, chain.local.is_some()),
        ),
    )
}

/// `stack` with global limits' home store (`GLOBAL_REDIS_URL`), when one is set. On Redis the
/// region's pools get connections of their own that wait up to
/// [`POOL_PATIENCE`](crate::store::global::POOL_PATIENCE): their calls run off the request
/// path, and one given up on at `REDIS_TIMEOUT` on a busy machine while Redis still ran it
/// would lose the units it took (home counted them, nobody could spend them).
fn with_home(
    stack: StoreStack,
    chain: Option<&StoreChain>,
    args: &ServeArgs,
    clock: &Arc<dyn Clock>,
) -> Result<StoreStack, SettingsError> {
    let share = args.global.share()?;
    let Some(home) = args.global.settings(&args.redis)? else {
        return Ok(stack);
    };
    let stack = match chain {
        Some(c) => {
            let patience = crate::store::global::POOL_PATIENCE.max(c.redis.timeout);
            // Signals of their own: the main store's health (readiness, the breaker) is what
            // its own calls say, not a pool call's five-second verdict.
            let pools = crate::store::redis::RedisStore::patient(&c.redis, patience)?.pool();
            stack.with_pool(Arc::new(pools))
        }
        None => stack,
    };
    tracing::info!(
        region = %args.global.region,
        kind = ?home.kind,
        urls = ?home.urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>(),
        timeout = ?home.timeout,
        cut_off_share = ?share,
        "global limits: home store"
    );
    // The bare store, no layer around it: its refunds are fenced (`refund_fenced`), which a
    // layer forwarding only `decide` would quietly undo.
    let home = crate::store::redis::RedisStore::new(&home)?;
    let regions = Arc::new(home.regions());
    // Overrides live at home and resets reach it: every region applies the same
    // (`store/global/admin.rs`).
    let home_admin: Arc<dyn crate::store::admin::CounterAdmin> = Arc::new(home.admin());
    let admin = crate::store::global::GlobalAdmin {
        region: Arc::clone(&stack.admin),
        home: home_admin,
    };
    let stack = stack
        .with_admin(Arc::new(admin))
        .with_home(Arc::new(home), Arc::clone(clock));
    if let Some(g) = &stack.global {
        let _ = g.tallies.region.set(args.global.region.clone());
        g.report_to(regions, args.global.region.clone());
        if let Some(share) = share {
            g.share_when_cut_off(share);
        }
    }
    Ok(stack)
}

fn service_options(args: &ServeArgs) -> ServiceOptions {
    ServiceOptions {
        global_shadow_mode: args.decide.shadow_mode,
        global_quota_mode: args.decide.quota_mode,
        counting: args.load.counting,
        stop_increment_when_over: args.decide.stop_cache_key_increment_when_overlimit,
        failure_mode: args.failure_mode,
        near_limit_ratio: args.observe.near_limit_ratio,
        headers: args.observe.headers(),
        caps: RequestCaps {
            descriptors: args.max_descriptors_per_request,
            entries: args.max_entries_per_descriptor,
            key_bytes: args.max_descriptor_key_bytes,
            value_bytes: args.max_descriptor_value_bytes,
        },
        ready_needs_config: args.source.ready_needs_config(),
        response_dynamic_metadata: args.response_dynamic_metadata,
        allow_limit_override: args.decide.allow_limit_override,
        decision_log: None,
    }
}

#[cfg(any(test, feature = "test-util"))]
impl ServerConfig {
    /// Tests only (`test-util`): [`ServerConfig::new`] serving `rules` on a memory store on
    /// `clock` (a `ManualClock`) with default options ([`Ingredients::for_tests`]). Here, in
    /// the composition root, so `server` never reaches up for it.
    pub fn for_tests(rules: RuleSet, clock: Arc<dyn Clock>) -> Self {
        Self::from_ingredients(Ingredients::for_tests(rules, clock))
    }

    /// Tests only (`test-util`): [`ServerConfig::new`] on the parts [`assemble`] builds from
    /// `ingredients`.
    pub fn from_ingredients(ingredients: Ingredients) -> Self {
        Self::new(assemble(ingredients).unwrap_or_else(|e| panic!("parts: {e}")))
    }
}
