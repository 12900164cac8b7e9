//! A certificate authority made at test time ([`rcgen`], ring): it issues
//! server certificates for `127.0.0.1`, `::1` and `localhost`, and client
//! certificates, as PEM files in a temp dir of its own.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// A PEM certificate (leaf first, then the CA) and its private key, on disk.
#[derive(Debug, Clone)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A test CA; its files are removed when it is dropped.
pub struct TestCa {
    dir: tempfile::TempDir,
    issuer: Issuer<'static, KeyPair>,
    ca_pem: String,
    ca_path: PathBuf,
}

impl TestCa {
    pub fn new() -> Self {
        Self::named("ctxsync test CA")
    }

    /// A CA whose subject is `name` (two CAs of one test are told apart by it).
    pub fn named(name: &str) -> Self {
        ctxsync_tls::install_default_provider();
        let dir = tempfile::Builder::new()
            .prefix("ctxsync-tls-")
            .tempdir()
            .expect("cannot create a temp dir for the test CA");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("no names");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().expect("ca key");
        let ca_pem = params.self_signed(&key).expect("ca certificate").pem();
        let ca_path = dir.path().join("ca.pem");
        std::fs::write(&ca_path, &ca_pem).expect("write ca.pem");
        Self {
            dir,
            issuer: Issuer::new(params, key),
            ca_pem,
            ca_path,
        }
    }

    /// The CA certificate's PEM file (what clients are told to trust).
    pub fn ca_path(&self) -> &Path {
        &self.ca_path
    }

    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// A server certificate for `127.0.0.1`, `::1` and `localhost`, written
    /// as `<name>.pem` and `<name>.key`.
    pub fn issue_server(&self, name: &str) -> CertFiles {
        self.issue(
            name,
            vec!["127.0.0.1".into(), "::1".into(), "localhost".into()],
            ExtendedKeyUsagePurpose::ServerAuth,
        )
    }

    /// A client certificate whose common name is `name`.
    pub fn issue_client(&self, name: &str) -> CertFiles {
        self.issue(name, Vec::new(), ExtendedKeyUsagePurpose::ClientAuth)
    }

    fn issue(&self, name: &str, sans: Vec<String>, usage: ExtendedKeyUsagePurpose) -> CertFiles {
        let mut params = CertificateParams::new(sans).expect("valid names");
        params.distinguished_name.push(DnType::CommonName, name);
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![usage];
        let key = KeyPair::generate().expect("leaf key");
        let cert = params
            .signed_by(&key, &self.issuer)
            .expect("leaf certificate");
        let files = CertFiles {
            cert: self.dir.path().join(format!("{name}.pem")),
            key: self.dir.path().join(format!("{name}.key")),
        };
        std::fs::write(&files.cert, format!("{}{}", cert.pem(), self.ca_pem)).expect("write cert");
        std::fs::write(&files.key, key.serialize_pem()).expect("write key");
        files
    }

    /// A rustls client config trusting this CA only.
    pub fn client_config(&self) -> ctxsync_tls::rustls::ClientConfig {
        let mut roots = ctxsync_tls::rustls::RootCertStore::empty();
        let ca = ctxsync_tls::load_certs(&ctxsync_tls::PemFile::new("test CA", &self.ca_path))
            .expect("the test CA loads");
        for cert in ca {
            roots.add(cert).expect("the test CA is a usable root");
        }
        ctxsync_tls::rustls::ClientConfig::builder_with_provider(ctxsync_tls::provider())
            .with_safe_default_protocol_versions()
            .expect("ring supports the default versions")
            .with_root_certificates(roots)
            .with_no_client_auth()
    }

    /// An HTTP client trusting this CA only.
    pub fn https_client(&self) -> reqwest::Client {
        reqwest::Client::builder()
            .tls_backend_preconfigured(self.client_config())
            .build()
            .expect("an https client")
    }

    /// The client config as an `Arc`, for connectors that take one.
    pub fn client_config_arc(&self) -> Arc<ctxsync_tls::rustls::ClientConfig> {
        Arc::new(self.client_config())
    }
}

impl Default for TestCa {
    fn default() -> Self {
        Self::new()
    }
}
