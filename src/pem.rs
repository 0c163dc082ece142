//! PEM files as sluice reads them, for the gRPC server's TLS and for TLS to Redis: one place
//! decides what a usable certificate chain and private key are, and what the error says, so a
//! bad file fails at start (or at reload) naming the problem, never at the first handshake.

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;

/// The certificates of a PEM chain: at least one, and the first (the leaf) parses as an X.509
/// certificate, so a CERTIFICATE block with other content inside is caught now.
pub(crate) fn cert_chain(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let chain = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    let Some(leaf) = chain.first() else {
        return Err("no PEM CERTIFICATE block found".into());
    };
    rustls::server::ParsedCertificate::try_from(leaf).map_err(|e| e.to_string())?;
    Ok(chain)
}

/// The first private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub(crate) fn private_key(pem: &[u8]) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => {
            "no PEM PRIVATE KEY, RSA PRIVATE KEY or EC PRIVATE KEY block found".into()
        }
        other => other.to_string(),
    })
}

/// Why a chain and a key do not make an identity.
#[derive(Debug)]
pub(crate) enum KeyPairError {
    /// The key itself cannot be used for signing.
    Key(String),
    /// The key is not the certificate's.
    Mismatch(String),
}

/// The chain and its key, checked to belong together. A key type that cannot tell its public
/// key passes: the handshake tells instead.
pub(crate) fn key_pair(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    provider: &CryptoProvider,
) -> Result<CertifiedKey, KeyPairError> {
    let signing_key = provider
        .key_provider
        .load_private_key(key)
        .map_err(|e| KeyPairError::Key(e.to_string()))?;
    let identity = CertifiedKey::new(chain, signing_key);
    match identity.keys_match() {
        Ok(()) | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => {
            Ok(identity)
        }
        Err(e) => Err(KeyPairError::Mismatch(e.to_string())),
    }
}
