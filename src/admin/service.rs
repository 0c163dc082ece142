//! The admin gRPC service (`sluice.admin.v1.Admin`): each call authorized (see `auth.rs`), each
//! write audited (see `audit.rs`), then handed to the limiter (Inspect) or the store's admin
//! side (Reset, overrides). After a write this replica reloads the overrides and drops its deny
//! cache at once; the others do on their next poll (see `poll.rs`).

use super::audit::{entries_text, Write};
use super::auth::{AuthSettings, Caller, Need};
use super::convert;
use crate::proto::sluice::admin::v1 as pb;
use crate::proto::sluice::admin::v1::admin_server::{Admin, AdminServer};
use crate::service::RateLimiter;
use crate::store::admin::{OverrideId, StoredOverride, MAX_OVERRIDES};
use crate::store::StoreError;
use std::sync::Arc;
use tonic::{Request, Response, Status};

/// Consumers one Top page holds at most.
const MAX_PAGE: usize = 1000;

#[derive(Debug, Clone)]
pub struct AdminService {
    limiter: Arc<RateLimiter>,
    auth: AuthSettings,
}

impl AdminService {
    pub fn new(limiter: Arc<RateLimiter>, auth: AuthSettings) -> Self {
        Self { limiter, auth }
    }

    pub fn into_server(self) -> AdminServer<Self> {
        AdminServer::new(self)
    }

    fn authorize<T>(&self, request: &Request<T>, need: Need) -> Result<Caller, Status> {
        self.auth.authorize(request, need).inspect_err(|s| {
            let reason = match s.code() {
                tonic::Code::PermissionDenied => "permission_denied",
                _ => "unauthenticated",
            };
            self.limiter
                .telemetry()
                .metrics
                .admin
                .refused
                .with_label_values(&[reason])
                .inc();
        })
    }

    /// The domain's `hash_tag: domain`, or NOT_FOUND for a domain the config does not have.
    fn domain_tag(&self, domain: &str) -> Result<bool, Status> {
        self.limiter
            .rules()
            .domains
            .get(domain)
            .map(|d| d.domain_tag)
            .ok_or_else(|| Status::not_found(format!("domain {domain:?} is not in the config")))
    }

    /// After a write: this replica applies it now, the others on their next poll.
    async fn reload(&self) {
        super::poll::reload(&self.limiter).await;
    }

    /// Ends an override write (set or delete): its audit line with what was there before, and
    /// when it went through, this replica applies it now.
    async fn finish_override<T>(
        &self,
        mut write: Write<'_>,
        result: Result<Option<StoredOverride>, StoreError>,
        answer: impl FnOnce(Option<StoredOverride>) -> T,
    ) -> Result<Response<T>, Status> {
        let metrics = &self.limiter.telemetry().metrics.admin;
        match result {
            Ok(before) => {
                write.before = convert::override_text(before.as_ref());
                write.record(metrics, Ok(()));
                self.reload().await;
                Ok(Response::new(answer(before)))
            }
            Err(e) => {
                write.before = "unknown".into();
                write.record(metrics, Err(&e.to_string()));
                Err(status(e))
            }
        }
    }
}

fn status(e: StoreError) -> Status {
    match e {
        StoreError::Permanent(m) => Status::failed_precondition(m),
        e => Status::unavailable(e.to_string()),
    }
}

#[tonic::async_trait]
impl Admin for AdminService {
    async fn inspect(
        &self,
        request: Request<pb::InspectRequest>,
    ) -> Result<Response<pb::InspectResponse>, Status> {
        self.authorize(&request, Need::Read)?;
        let r = request.into_inner();
        let caps = &self.limiter.options().caps;
        let entries = convert::entries(&r.entries, caps, "entries")?;
        self.domain_tag(&r.domain)?;
        let limits = self.limiter.inspect(&r.domain, &entries).await?;
        Ok(Response::new(pb::InspectResponse {
            limits: limits.iter().map(convert::limit_state).collect(),
            store: self.limiter.store_backend().to_string(),
        }))
    }

    async fn top(
        &self,
        request: Request<pb::TopRequest>,
    ) -> Result<Response<pb::TopResponse>, Status> {
        self.authorize(&request, Need::Read)?;
        let r = request.into_inner();
        let size = match r.page_size {
            0 => 20,
            n => (n as usize).min(MAX_PAGE),
        };
        let start: usize = match r.page_token.as_str() {
            "" => 0,
            t => t
                .parse()
                .map_err(|_| Status::invalid_argument("page_token: not one this API gave"))?,
        };
        let offenders = &self.limiter.telemetry().offenders;
        let Some(report) = offenders.top(&r.domain, start.saturating_add(size + 1)) else {
            return Ok(Response::new(pb::TopResponse {
                window_seconds: offenders.settings().window_seconds(),
                ..Default::default()
            }));
        };
        let more = report.offenders.len() > start + size;
        Ok(Response::new(pb::TopResponse {
            consumers: report
                .offenders
                .iter()
                .skip(start)
                .take(size)
                .map(|o| pb::Consumer {
                    descriptor: o.descriptor.clone(),
                    denied: o.denied,
                    max_error: o.max_error,
                })
                .collect(),
            window_seconds: report.window_seconds,
            next_page_token: if more {
                (start + size).to_string()
            } else {
                String::new()
            },
        }))
    }

    async fn reset(
        &self,
        request: Request<pb::ResetRequest>,
    ) -> Result<Response<pb::ResetResponse>, Status> {
        let caller = self.authorize(&request, Need::Write)?;
        let r = request.into_inner();
        let prefix = convert::entries(&r.prefix, &self.limiter.options().caps, "prefix")?;
        let domain_tag = self.domain_tag(&r.domain)?;
        let result = self
            .limiter
            .counter_admin()
            .reset(&r.domain, &prefix, domain_tag)
            .await;
        let metrics = &self.limiter.telemetry().metrics.admin;
        let mut audit = Write {
            caller: &caller.name,
            operation: "reset",
            domain: &r.domain,
            target: entries_text(&prefix),
            before: "counted".into(),
            after: "reset".into(),
            reason: &r.reason,
        };
        match result {
            Ok(n) => {
                if n.counted {
                    metrics.counters_reset.inc_by(n.counters);
                    audit.after = format!("{} counters reset", n.counters);
                }
                audit.record(metrics, Ok(()));
                self.reload().await;
                Ok(Response::new(pb::ResetResponse {
                    counters: n.counters,
                    counted: n.counted,
                }))
            }
            Err(e) => {
                audit.record(metrics, Err(&e.to_string()));
                Err(status(e))
            }
        }
    }

    async fn set_override(
        &self,
        request: Request<pb::SetOverrideRequest>,
    ) -> Result<Response<pb::Override>, Status> {
        let caller = self.authorize(&request, Need::Write)?;
        let r = request.into_inner();
        let now = self.limiter.now_ms();
        let o = convert::override_of(&r, &self.limiter.options().caps, &caller.name, now)?;
        self.domain_tag(&r.domain)?;
        let result = self
            .limiter
            .counter_admin()
            .put_override(&o, now, MAX_OVERRIDES)
            .await;
        let write = Write {
            caller: &caller.name,
            operation: "set_override",
            domain: &r.domain,
            target: entries_text(&o.id.entries),
            before: String::new(),
            after: convert::override_text(Some(&o)),
            reason: &r.reason,
        };
        self.finish_override(write, result, |_| convert::to_pb(&o))
            .await
    }

    async fn delete_override(
        &self,
        request: Request<pb::DeleteOverrideRequest>,
    ) -> Result<Response<pb::DeleteOverrideResponse>, Status> {
        let caller = self.authorize(&request, Need::Write)?;
        let r = request.into_inner();
        let id = OverrideId {
            domain: r.domain.clone(),
            entries: convert::entries(&r.entries, &self.limiter.options().caps, "entries")?,
            limit_name: r.limit_name.clone(),
        };
        let now = self.limiter.now_ms();
        let result = self.limiter.counter_admin().delete_override(&id, now).await;
        let write = Write {
            caller: &caller.name,
            operation: "delete_override",
            domain: &r.domain,
            target: entries_text(&id.entries),
            before: String::new(),
            after: "none".into(),
            reason: &r.reason,
        };
        self.finish_override(write, result, |before| pb::DeleteOverrideResponse {
            deleted: before.is_some(),
        })
        .await
    }

    async fn list_overrides(
        &self,
        request: Request<pb::ListOverridesRequest>,
    ) -> Result<Response<pb::ListOverridesResponse>, Status> {
        self.authorize(&request, Need::Read)?;
        let r = request.into_inner();
        // From the store, not this replica's copy: what every replica is about to apply.
        let (_, all) = self
            .limiter
            .counter_admin()
            .overrides()
            .await
            .map_err(status)?;
        let now = self.limiter.now_ms();
        let mut live: Vec<_> = all
            .into_iter()
            .filter(|o| o.live(now) && (r.domain.is_empty() || o.id.domain == r.domain))
            .collect();
        live.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(Response::new(pb::ListOverridesResponse {
            overrides: live.iter().map(convert::to_pb).collect(),
        }))
    }
}
