//! Why this file: the domain comes with a stream's first report and decides everything after
//! it (its fair share, its limits, its labels), so it is checked there, once (issue 50, review
//! 5). A domain no config names could only ever be answered ALLOW_ALL, yet it joined the
//! fair-share census (junk domains shrank every real domain's share to nothing at the bucket
//! cap), and its stream held a place under `RLQS_MAX_STREAMS` for as long as it lived; a domain
//! of megabytes was held twice per stream. The first report must name a configured domain of at
//! most [`MAX_DOMAIN_BYTES`] (no config names a longer one), else the stream ends with
//! INVALID_ARGUMENT and nothing of it is kept.

use super::QuotaStream;
use crate::config::MAX_DOMAIN_BYTES;
use tonic::Status;

impl QuotaStream {
    /// Takes the domain of the stream's first report (a later report's is ignored, as the proto
    /// says), or refuses it.
    pub(super) fn admit(&mut self, domain: &str) -> Result<(), Status> {
        if self.domain.is_some() {
            return Ok(());
        }
        if domain.len() > MAX_DOMAIN_BYTES {
            self.refuse("bad_domain");
            return Err(Status::invalid_argument(format!(
                "the domain is {} bytes; no config names a domain longer than {MAX_DOMAIN_BYTES}",
                domain.len()
            )));
        }
        if !self.limiter.rules().domains.contains_key(domain) {
            self.refuse("bad_domain");
            return Err(Status::invalid_argument(format!(
                "the domain {domain:?} is in no config of this sluice: an RLQS stream must name a \
                 configured domain"
            )));
        }
        self.shared.census.join(domain);
        self.domain = Some(domain.to_string());
        self.empty_since = Some(self.now());
        Ok(())
    }
}
