//! The admin gRPC service (`sluice.admin.v1.Admin`): each call authorized (see `auth.rs`), each
//! write audited (see `audit.rs`), then handed to the limiter (Inspect) or the store's admin
//! side (Reset, overrides). A write's store call, outcome line and reload run on a task of
//! their own that its caller cannot cut (see `AdminService::write`). After a write this replica
//! reloads the overrides and drops its deny cache at once; the others do on their next poll
//! (see `poll.rs`).

use super::audit::{entries_text, Write};
use super::auth::{AuthSettings, Caller, Need};
use super::convert;
use crate::proto::sluice::admin::v1 as pb;
use crate::proto::sluice::admin::v1::admin_server::{Admin, AdminServer};
use crate::service::RateLimiter;
use crate::store::admin::{OverrideId, MAX_OVERRIDES};
use crate::store::StoreError;
use std::future::Future;
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

    /// Runs one write: its attempt line, then the store call, its outcome line and this
    /// replica's reload on a task of its own. Why a task: a caller that goes away (its
    /// `grpc-timeout`, an RST_STREAM) drops this handler's future, and with it anything it
    /// awaits; a store call cut there may have written (an override set, some counters of a
    /// reset gone) with no outcome line, no metric and no generation bump. The task is not
    /// cut: the write, its record and its bump always finish.
    async fn write<T: Send + 'static>(
        &self,
        audit: Write,
        store: impl Future<Output = Result<Applied<T>, StoreError>> + Send + 'static,
    ) -> Result<Response<T>, Status> {
        audit.attempt();
        let task = tokio::spawn(finish(Arc::clone(&self.limiter), audit, store));
        match task.await {
            Ok(answer) => answer.map(Response::new),
            Err(e) => Err(Status::internal(format!("the admin write failed: {e}"))),
        }
    }
}

/// What a write's store call gives back: the answer, and for the outcome line what was there
/// before and what is there after (`None`: as the attempt said).
struct Applied<T> {
    answer: T,
    before: Option<String>,
    after: Option<String>,
}

/// The rest of a write, on its own task: the store call, the outcome line and, when it went
/// through, this replica applies it now (the others on their next poll).
async fn finish<T>(
    limiter: Arc<RateLimiter>,
    mut audit: Write,
    store: impl Future<Output = Result<Applied<T>, StoreError>>,
) -> Result<T, Status> {
    let result = store.await;
    let metrics = &limiter.telemetry().metrics.admin;
    match result {
        Ok(applied) => {
            audit.before = applied.before.unwrap_or(audit.before);
            audit.after = applied.after.unwrap_or(audit.after);
            audit.record(metrics, Ok(()));
            super::poll::reload(&limiter).await;
            Ok(applied.answer)
        }
        Err(e) => {
            if audit.before.is_empty() {
                audit.before = "unknown".into();
            }
            audit.record(metrics, Err(&e.to_string()));
            Err(status(e))
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
        let Some(report) = offenders.top(&r.domain, start.saturating_add(size).saturating_add(1))
        else {
            return Ok(Response::new(pb::TopResponse {
                window_seconds: offenders.settings().window_seconds(),
                ..Default::default()
            }));
        };
        // Saturating: a page token is the caller's text, `usize::MAX` included.
        let end = start.saturating_add(size);
        let more = report.offenders.len() > end;
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
            next_page_token: if more { end.to_string() } else { String::new() },
        }))
    }

    async fn reset(
        &self,
        request: Request<pb::ResetRequest>,
    ) -> Result<Response<pb::ResetResponse>, Status> {
        let caller = self.authorize(&request, Need::Write)?;
        let r = request.into_inner();
        let prefix = convert::entries(&r.prefix, &self.limiter.options().caps, "prefix")?;
        convert::capped("reason", &r.reason)?;
        let domain_tag = self.domain_tag(&r.domain)?;
        let mut audit = Write::new(
            &caller.name,
            "reset",
            &r.domain,
            entries_text(&prefix),
            "reset".into(),
            &r.reason,
        );
        audit.before = "counted".into();
        let admin = Arc::clone(self.limiter.counter_admin());
        let limiter = Arc::clone(&self.limiter);
        self.write(audit, async move {
            let n = admin.reset(&r.domain, &prefix, domain_tag).await?;
            let mut after = None;
            if n.counted {
                let metrics = &limiter.telemetry().metrics.admin;
                metrics.counters_reset.inc_by(n.counters);
                after = Some(format!("{} counters reset", n.counters));
            }
            Ok(Applied {
                answer: pb::ResetResponse {
                    counters: n.counters,
                    counted: n.counted,
                },
                before: None,
                after,
            })
        })
        .await
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
        let audit = Write::new(
            &caller.name,
            "set_override",
            &r.domain,
            entries_text(&o.id.entries),
            convert::override_text(Some(&o)),
            &r.reason,
        );
        let admin = Arc::clone(self.limiter.counter_admin());
        self.write(audit, async move {
            let before = admin.put_override(&o, now, MAX_OVERRIDES).await?;
            Ok(Applied {
                answer: convert::to_pb(&o),
                before: Some(convert::override_text(before.as_ref())),
                after: None,
            })
        })
        .await
    }

    async fn delete_override(
        &self,
        request: Request<pb::DeleteOverrideRequest>,
    ) -> Result<Response<pb::DeleteOverrideResponse>, Status> {
        let caller = self.authorize(&request, Need::Write)?;
        let r = request.into_inner();
        convert::capped("reason", &r.reason)?;
        convert::capped("limit_name", &r.limit_name)?;
        let id = OverrideId {
            domain: r.domain.clone(),
            entries: convert::entries(&r.entries, &self.limiter.options().caps, "entries")?,
            limit_name: r.limit_name.clone(),
        };
        let audit = Write::new(
            &caller.name,
            "delete_override",
            &r.domain,
            entries_text(&id.entries),
            "none".into(),
            &r.reason,
        );
        let now = self.limiter.now_ms();
        let admin = Arc::clone(self.limiter.counter_admin());
        self.write(audit, async move {
            let before = admin.delete_override(&id, now).await?;
            Ok(Applied {
                answer: pb::DeleteOverrideResponse {
                    deleted: before.is_some(),
                },
                before: Some(convert::override_text(before.as_ref())),
                after: None,
            })
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

    async fn candidates(
        &self,
        request: Request<pb::CandidatesRequest>,
    ) -> Result<Response<pb::CandidatesResponse>, Status> {
        self.authorize(&request, Need::Read)?;
        let r = request.into_inner();
        let c = self.limiter.candidates();
        let top = match r.top {
            0 => 10,
            n => (n as usize).min(crate::candidates::sketch::CAPACITY),
        };
        let limits = c
            .report(&r.domain, top)
            .into_iter()
            .map(|l| pb::CandidateLimit {
                domain: l.domain,
                key: l.key,
                name: l.name,
                limit: l.limit,
                would_admit: l.would_admit,
                would_deny: l.would_deny,
                denied_where_admitted: l.denied_where_admitted,
                admitted_where_denied: l.admitted_where_denied,
                top: l
                    .top
                    .into_iter()
                    .map(|s| pb::Stopped {
                        consumer: s.consumer,
                        denied: s.denied,
                        max_error: s.max_error,
                    })
                    .collect(),
            });
        Ok(Response::new(pb::CandidatesResponse {
            enabled: c.rules().is_some(),
            since: c.since(),
            limits: limits.collect(),
            lost: c.lost(),
            overflow: c.overflow(),
            over_budget: c.over_budget(),
        }))
    }
}
