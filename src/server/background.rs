//! The tasks that run beside the servers until shutdown aborts them: envoyproxy's stats
//! (statsd push, Prometheus listener), the debug listener, and the config sources (xDS
//! subscription or file watch).

use super::{http, reload, xds, EnvoyStatsSettings};
use crate::service::RateLimiter;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// What the background tasks need, taken out of the [`super::ServerConfig`] and the bound
/// listeners.
pub(super) struct Background {
    pub(super) envoy_stats: Option<EnvoyStatsSettings>,
    pub(super) envoy_metrics: Option<(TcpListener, SocketAddr, String)>,
    pub(super) debug: Option<(TcpListener, SocketAddr)>,
    pub(super) xds: Option<xds::XdsSettings>,
    pub(super) reload: Option<reload::ReloadSettings>,
    pub(super) loaded_fingerprint: u64,
    pub(super) candidate_reload: Option<(reload::ReloadSettings, u64)>,
}

impl Background {
    pub(super) fn spawn(self, limiter: &Arc<RateLimiter>) -> Vec<JoinHandle<()>> {
        let mut tasks = Vec::new();
        if let Some(stats) = self.envoy_stats {
            tasks.extend(envoy_stats(limiter, stats, self.envoy_metrics));
        }
        if let Some((listener, addr)) = self.debug {
            tracing::info!(addr = %addr, "debug listener: / /rlconfig /stats");
            let app = http::debug_router(Arc::clone(limiter));
            tasks.push(serve_axum(listener, app, "the debug listener failed"));
        }
        if let Some(x) = self.xds {
            tracing::info!(
                server = %x.server_url,
                node = %x.node_id,
                tls = x.tls.is_some(),
                "config over xDS: requests get UNAVAILABLE until the first config is in"
            );
            tasks.push(tokio::spawn(xds::watch(Arc::clone(limiter), x)));
        }
        if let Some(r) = self.reload {
            tracing::info!(
                source = %r.path.display(),
                interval = ?r.interval,
                "watching the config for changes"
            );
            let watch = reload::watch(Arc::clone(limiter), r, self.loaded_fingerprint);
            tasks.push(tokio::spawn(watch));
        }
        if let Some((r, loaded)) = self.candidate_reload {
            tracing::info!(
                source = %r.path.display(),
                interval = ?r.interval,
                "watching the candidate config for changes"
            );
            tasks.push(tokio::spawn(reload::watch(Arc::clone(limiter), r, loaded)));
        }
        tasks
    }
}

fn envoy_stats(
    limiter: &Arc<RateLimiter>,
    stats: EnvoyStatsSettings,
    listener: Option<(TcpListener, SocketAddr, String)>,
) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    let metrics = limiter.telemetry().metrics.clone();
    if let Some(statsd) = stats.statsd {
        tracing::info!(
            host = %statsd.host,
            port = statsd.port,
            flush_interval = ?statsd.flush_interval,
            "sending envoyproxy's stats to statsd (UDP)"
        );
        let push =
            crate::telemetry::envoy_stats::run_statsd(metrics.clone(), statsd, stats.tags.clone());
        tasks.push(tokio::spawn(push));
    }
    if let Some((listener, addr, path)) = listener {
        tracing::info!(addr = %addr, path = %path, "serving envoyproxy's Prometheus series");
        let app = http::envoy_metrics_router(metrics, stats.tags, &path);
        tasks.push(serve_axum(
            listener,
            app,
            "the USE_PROMETHEUS listener failed",
        ));
    }
    tasks
}

fn serve_axum(listener: TcpListener, app: axum::Router, failed: &'static str) -> JoinHandle<()> {
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "{failed}");
        }
    })
}
