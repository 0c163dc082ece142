//! The standalone backend (a direct Redis, or the master a set of sentinels names: the same
//! backend behind another connector): every limit of a request in ONE script call, and
//! concurrent requests batched into one EVALSHA by the batcher task (`batch.rs`).

use super::batch::{batcher, single_connection, Job, BATCH_QUEUE};
use super::conn::{sentinels, Conn, ConnectErrors, Manager, Target};
use super::settings::{is_tls, tls_client};
use super::{codec, Common, RedisKind, RedisSettings, DENIED};
use crate::store::{Decision, LimitCheck, StoreError};
use std::sync::OnceLock;

/// A standalone Redis behind a bb8 pool of multiplexed connections.
pub(super) struct Standalone {
    pool: bb8::Pool<Manager>,
    /// The queue of the batcher task, started on first use (inside the runtime).
    batcher: OnceLock<tokio::sync::mpsc::Sender<Job>>,
    /// Script calls the batcher keeps outstanding (`REDIS_POOL_SIZE`).
    in_flight: usize,
}

impl Standalone {
    /// The pool for `settings` (direct, or through the sentinels), connecting on first use.
    pub(super) fn new(
        settings: &RedisSettings,
        infos: Vec<redis::ConnectionInfo>,
        certs: Option<redis::TlsCertificates>,
    ) -> Result<Self, StoreError> {
        let target = if settings.kind == RedisKind::Sentinel {
            Target::Sentinel(sentinels(settings, infos, certs)?)
        } else {
            let [info] = <[_; 1]>::try_from(infos).map_err(|v: Vec<_>| {
                StoreError::Permanent(format!(
                    "REDIS_TYPE=single takes one Redis URL, got {}; set REDIS_TYPE=cluster for a seed list",
                    v.len()
                ))
            })?;
            let client = match &certs {
                Some(certs) if is_tls(&info) => {
                    tls_client(info, certs, settings.tls.skip_hostname_verification)
                }
                _ => redis::Client::open(info),
            }
            .map_err(|e| StoreError::Permanent(format!("Redis client: {e}")))?;
            Target::Direct(client)
        };
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(settings.timeout))
            .set_response_timeout(Some(settings.timeout));
        let errors = ConnectErrors::default();
        let pool = bb8::Pool::builder()
            .max_size(settings.pool_size.max(1))
            .min_idle(Some(settings.pool_size.max(1)))
            .connection_timeout(settings.timeout)
            // `is_valid` only reads the broken flag, so this costs no round trip.
            .test_on_check_out(true)
            // A refused connection fails the call at once instead of retrying until the
            // timeout: the breaker and the health probe handle recovery.
            .retry_connection(false)
            .error_sink(Box::new(errors.clone()))
            .build_unchecked(Manager {
                target,
                epoch: std::sync::Arc::default(),
                config,
                errors,
            });
        Ok(Self {
            pool,
            batcher: OnceLock::new(),
            in_flight: settings.pool_size.max(1) as usize,
        })
    }

    /// The pool (shared: a clone is a handle), for the demand boards' calls.
    pub(super) fn pool(&self) -> bb8::Pool<Manager> {
        self.pool.clone()
    }

    pub(super) async fn connection(&self) -> Result<Conn, StoreError> {
        single_connection(&self.pool).await
    }

    /// The whole request in one call, through the batcher; its candidate checks
    /// (`CANDIDATE_CONFIG`), if any, beside it in the same EVALSHA as a request of their own.
    pub(super) async fn decide(
        &self,
        common: &Common,
        checks: &[LimitCheck],
    ) -> Result<Decision, StoreError> {
        let tx = self.batcher.get_or_init(|| {
            let (tx, rx) = tokio::sync::mpsc::channel(BATCH_QUEUE);
            common.runtime.spawn(batcher(
                rx,
                self.pool.clone(),
                common.script.clone(),
                common.time.clone(),
                common.timeout,
                self.in_flight,
            ));
            tx
        });
        // A request of candidate checks alone has nothing enforced: it is admitted, and its
        // candidates go as the one call.
        let (own, beside, enforced) = match super::beside::split(checks) {
            (own, beside) if own.is_empty() => (beside, Vec::new(), false),
            (own, beside) => (own, beside, true),
        };
        let (reply, answer) = tokio::sync::oneshot::channel();
        let call = common.call_for(checks, &own, true);
        let layout = call.layout();
        let beside_call = (!beside.is_empty()).then(|| common.call_for(checks, &beside, true));
        let beside_layout = beside_call.as_ref().map(|c| c.layout());
        let r = async {
            tx.send(Job {
                call,
                beside: beside_call,
                candidates_only: !enforced,
                reply,
            })
            .await
            .map_err(|_| StoreError::Permanent("the Redis batcher stopped".into()))?;
            answer
                .await
                .map_err(|_| StoreError::Permanent("the Redis batcher dropped a call".into()))?
        };
        let r = match tokio::time::timeout(common.timeout, r).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Transient(format!(
                "Redis did not answer within {:?}",
                common.timeout
            ))),
        };
        common.record_health(None, &r);
        let (values, beside_values) = r?;
        let (mut outcomes, mut leases) = (vec![DENIED; checks.len()], Vec::new());
        let into = codec::Fold {
            outcomes: &mut outcomes,
            leases: &mut leases,
        };
        let admitted = codec::decode(&values, layout, &own, into)? || !enforced;
        let mut beside_lost = false;
        if let (Some(v), Some(layout)) = (beside_values, beside_layout) {
            let mut no_leases = Vec::new();
            let into = codec::Fold {
                outcomes: &mut outcomes,
                leases: &mut no_leases,
            };
            // A candidates' reply that cannot be read loses them, never the answer.
            beside_lost = codec::decode(&v, layout, &beside, into).is_err();
        }
        Ok(Decision {
            admitted,
            outcomes,
            steps: 1,
            beside_lost,
            leases,
            ..Decision::default()
        })
    }
}
