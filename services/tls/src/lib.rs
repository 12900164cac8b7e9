//! TLS for every ctxsync process: rustls on the `ring` crypto provider (pure
//! Rust plus assembly, built with `cc` alone: no cmake, no Go, no OpenSSL),
//! PEM files read with errors that name the option they came from, and the
//! server and client configs the services use.
//!
//! Every process calls [`install_default_provider`] early: clients built by
//! libraries (reqwest's, opentelemetry's) take rustls' process default, and
//! this build ships no other provider.

use std::path::PathBuf;
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore, ServerConfig};

pub use rustls;

/// A PEM file named by an option, e.g. `CTXSYNC_TLS_CERT` and its path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PemFile {
    /// The env var (or flag) it was given by, for messages.
    pub option: &'static str,
    pub path: PathBuf,
}

impl PemFile {
    pub fn new(option: &'static str, path: impl Into<PathBuf>) -> Self {
        Self {
            option,
            path: path.into(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("invalid {option} {path:?}: {reason}")]
    File {
        option: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("{given} is set but {missing} is not: give both or neither")]
    Pair {
        given: &'static str,
        missing: &'static str,
    },
    #[error("invalid {cert} {cert_path:?} and {key} {key_path:?}: {reason}")]
    Mismatch {
        cert: &'static str,
        cert_path: PathBuf,
        key: &'static str,
        key_path: PathBuf,
        reason: String,
    },
}

impl TlsError {
    fn file(file: &PemFile, reason: impl Into<String>) -> Self {
        Self::File {
            option: file.option,
            path: file.path.clone(),
            reason: reason.into(),
        }
    }
}

/// The one crypto provider of this build.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Makes ring rustls' process-wide default (idempotent): reqwest built with
/// `rustls-no-provider` panics on building a client without one.
pub fn install_default_provider() {
    if CryptoProvider::get_default().is_none() {
        // Losing a race to another installer of the same provider is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// `cert` and `key` given together or not at all.
pub fn pair(
    cert: Option<PemFile>,
    key: Option<PemFile>,
    cert_option: &'static str,
    key_option: &'static str,
) -> Result<Option<(PemFile, PemFile)>, TlsError> {
    match (cert, key) {
        (Some(cert), Some(key)) => Ok(Some((cert, key))),
        (None, None) => Ok(None),
        (Some(_), None) => Err(TlsError::Pair {
            given: cert_option,
            missing: key_option,
        }),
        (None, Some(_)) => Err(TlsError::Pair {
            given: key_option,
            missing: cert_option,
        }),
    }
}

fn read(file: &PemFile) -> Result<Vec<u8>, TlsError> {
    std::fs::read(&file.path).map_err(|e| TlsError::file(file, format!("cannot read it: {e}")))
}

/// The certificates of a PEM file; none is an error.
pub fn load_certs(file: &PemFile) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read(file)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::file(file, format!("not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(TlsError::file(file, "holds no PEM certificate"));
    }
    Ok(certs)
}

/// The first private key (PKCS#8, PKCS#1 or SEC1) of a PEM file.
pub fn load_key(file: &PemFile) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes = read(file)?;
    // The reason never quotes the file: it is a secret.
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| {
        let reason = match e {
            rustls::pki_types::pem::Error::NoItemsFound => "holds no PEM private key".to_owned(),
            _ => "not a PEM private key file".to_owned(),
        };
        TlsError::file(file, reason)
    })
}

/// A server config for `cert` (the chain, leaf first) and `key`, speaking
/// HTTP/1.1 over TLS 1.2 or 1.3.
pub fn server_config(cert: &PemFile, key: &PemFile) -> Result<Arc<ServerConfig>, TlsError> {
    let chain = load_certs(cert)?;
    let private_key = load_key(key)?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_no_client_auth()
        .with_single_cert(chain, private_key)
        .map_err(|e| TlsError::Mismatch {
            cert: cert.option,
            cert_path: cert.path.clone(),
            key: key.option,
            key_path: key.path.clone(),
            reason: e.to_string(),
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The roots a client trusts: the system's (`SSL_CERT_FILE`/`SSL_CERT_DIR`
/// or the platform store) plus the certificates of `extra_ca`.
pub fn root_store(extra_ca: Option<&PemFile>) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for error in &native.errors {
        tracing::debug!(%error, "cannot load a system root certificate");
    }
    let (added, ignored) = roots.add_parsable_certificates(native.certs);
    tracing::debug!(added, ignored, "system root certificates");
    if let Some(ca) = extra_ca {
        for cert in load_certs(ca)? {
            roots
                .add(cert)
                .map_err(|e| TlsError::file(ca, format!("not a usable CA certificate: {e}")))?;
        }
    }
    Ok(roots)
}

/// A client config trusting [`root_store`], presenting `client_auth` (a
/// certificate chain and its key) when given.
pub fn client_config(
    extra_ca: Option<&PemFile>,
    client_auth: Option<(&PemFile, &PemFile)>,
) -> Result<ClientConfig, TlsError> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_root_certificates(root_store(extra_ca)?);
    match client_auth {
        None => Ok(builder.with_no_client_auth()),
        Some((cert, key)) => builder
            .with_client_auth_cert(load_certs(cert)?, load_key(key)?)
            .map_err(|e| TlsError::Mismatch {
                cert: cert.option,
                cert_path: cert.path.clone(),
                key: key.option,
                key_path: key.path.clone(),
                reason: e.to_string(),
            }),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    fn self_signed() -> (String, String) {
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
        (cert.cert.pem(), cert.signing_key.serialize_pem())
    }

    #[test]
    fn a_server_config_loads_a_matching_pair() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = self_signed();
        let cert = PemFile::new("CTXSYNC_TLS_CERT", write(dir.path(), "c.pem", &cert));
        let key = PemFile::new("CTXSYNC_TLS_KEY", write(dir.path(), "k.pem", &key));
        let config = server_config(&cert, &key).unwrap();
        assert_eq!(config.alpn_protocols, vec![b"http/1.1".to_vec()]);
    }

    #[test]
    fn bad_files_name_the_option_and_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let (cert_pem, key_pem) = self_signed();
        let (_, other_key) = self_signed();
        let cert = PemFile::new("CTXSYNC_TLS_CERT", write(dir.path(), "c.pem", &cert_pem));
        let key = PemFile::new("CTXSYNC_TLS_KEY", write(dir.path(), "k.pem", &key_pem));
        let missing = PemFile::new("CTXSYNC_TLS_CERT", dir.path().join("absent.pem"));
        let message = server_config(&missing, &key).unwrap_err().to_string();
        assert!(
            message.starts_with(&format!(
                "invalid CTXSYNC_TLS_CERT {:?}: cannot read it",
                missing.path
            )),
            "{message}"
        );
        // A key where the certificate should be, and the reverse.
        let swapped = server_config(
            &PemFile::new("CTXSYNC_TLS_CERT", key.path.clone()),
            &PemFile::new("CTXSYNC_TLS_KEY", cert.path.clone()),
        )
        .unwrap_err()
        .to_string();
        assert!(
            swapped.contains("CTXSYNC_TLS_CERT") && swapped.contains("holds no PEM certificate"),
            "{swapped}"
        );
        let no_key = server_config(&cert, &PemFile::new("CTXSYNC_TLS_KEY", cert.path.clone()))
            .unwrap_err()
            .to_string();
        assert!(
            no_key.contains("CTXSYNC_TLS_KEY") && no_key.contains("holds no PEM private key"),
            "{no_key}"
        );
        let other = PemFile::new("CTXSYNC_TLS_KEY", write(dir.path(), "o.pem", &other_key));
        let mismatch = server_config(&cert, &other).unwrap_err().to_string();
        assert!(
            mismatch.starts_with("invalid CTXSYNC_TLS_CERT")
                && mismatch.contains("CTXSYNC_TLS_KEY"),
            "{mismatch}"
        );
        // A key's content never appears in a message.
        assert!(!no_key.contains("PRIVATE KEY-----\n"), "{no_key}");
    }

    #[test]
    fn cert_and_key_come_in_pairs() {
        let file = |option| Some(PemFile::new(option, "/x"));
        let err = pair(file("A"), None, "A", "B").unwrap_err().to_string();
        assert_eq!(err, "A is set but B is not: give both or neither");
        let err = pair(None, file("B"), "A", "B").unwrap_err().to_string();
        assert_eq!(err, "B is set but A is not: give both or neither");
        assert!(pair(None, None, "A", "B").unwrap().is_none());
        assert!(pair(file("A"), file("B"), "A", "B").unwrap().is_some());
    }

    #[test]
    fn an_extra_ca_is_trusted() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, _) = self_signed();
        let ca = PemFile::new("CTXSYNC_MCP_CA_FILE", write(dir.path(), "ca.pem", &cert));
        let with = root_store(Some(&ca)).unwrap().len();
        let without = root_store(None).unwrap().len();
        assert_eq!(with, without + 1);
        client_config(Some(&ca), None).unwrap();
    }
}
