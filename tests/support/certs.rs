//! Test certificates, generated at test time with rcgen (no key is ever committed): a CA, a
//! server certificate for `localhost` and `127.0.0.1` and client certificates signed by it,
//! as PEM strings and, through [`TlsFiles`], as files in a temporary directory.
#![allow(dead_code)]

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use std::path::{Path, PathBuf};
use tempfile::TempDir;

/// A certificate and its private key, PEM encoded.
#[derive(Clone)]
pub struct Leaf {
    pub cert_pem: String,
    pub key_pem: String,
}

/// A self-signed certificate authority that issues server and client certificates.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    /// The CA certificate, PEM encoded (what clients and servers trust).
    pub pem: String,
}

impl Ca {
    pub fn new(name: &str) -> Self {
        let key = KeyPair::generate().expect("CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key).expect("self-signed CA");
        Self {
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// A server certificate for `localhost` and `127.0.0.1`. It may also authenticate as a
    /// client (redis-cli uses it to talk to a Redis that requires client certificates).
    pub fn server(&self) -> Leaf {
        self.leaf(
            "sluice test server",
            &[
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        )
    }

    /// A server certificate for the DNS name `dns` only: connecting by IP address (or any other
    /// name) does not match it.
    pub fn server_named(&self, dns: &str) -> Leaf {
        self.issue(
            vec![SanType::DnsName(dns.try_into().expect("DNS name"))],
            dns,
            &[
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        )
    }

    /// A client certificate named `name`.
    pub fn client(&self, name: &str) -> Leaf {
        self.leaf(name, &[ExtendedKeyUsagePurpose::ClientAuth])
    }

    /// A certificate for `localhost` and `127.0.0.1`.
    fn leaf(&self, name: &str, usages: &[ExtendedKeyUsagePurpose]) -> Leaf {
        let sans = vec![
            SanType::DnsName("localhost".try_into().expect("DNS name")),
            SanType::IpAddress([127, 0, 0, 1].into()),
        ];
        self.issue(sans, name, usages)
    }

    fn issue(&self, sans: Vec<SanType>, name: &str, usages: &[ExtendedKeyUsagePurpose]) -> Leaf {
        let key = KeyPair::generate().expect("leaf key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("leaf params");
        params.subject_alt_names = sans;
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = usages.to_vec();
        let cert = params.signed_by(&key, &self.issuer).expect("signed leaf");
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }
}

/// One CA with a server and a client certificate, written as PEM files into a temporary
/// directory that lives as long as this value.
pub struct TlsFiles {
    pub ca: Ca,
    pub server: Leaf,
    pub client: Leaf,
    pub ca_cert: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    dir: TempDir,
}

impl TlsFiles {
    pub fn new(ca_name: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("sluice-tls-")
            .tempdir()
            .expect("temporary directory for certificates");
        let ca = Ca::new(ca_name);
        let server = ca.server();
        let client = ca.client("sluice test client");
        let d = dir.path();
        Self {
            ca_cert: write(d, "ca.crt", &ca.pem),
            server_cert: write(d, "server.crt", &server.cert_pem),
            server_key: write(d, "server.key", &server.key_pem),
            client_cert: write(d, "client.crt", &client.cert_pem),
            client_key: write(d, "client.key", &client.key_pem),
            ca,
            server,
            client,
            dir,
        }
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

/// Writes `contents` to `dir/name` and returns the path.
pub fn write(dir: &Path, name: &str, contents: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    path
}

/// Replaces `path` atomically: the new content is written next to it, then renamed over it, so
/// a reader sees the old file or the new one, never half of one.
pub fn replace_atomically(path: &Path, contents: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, contents).unwrap_or_else(|e| panic!("write {}: {e}", tmp.display()));
    std::fs::rename(&tmp, path).unwrap_or_else(|e| panic!("rename to {}: {e}", path.display()));
}
