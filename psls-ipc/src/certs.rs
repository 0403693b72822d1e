//! The cluster's certificate authority and one certificate per node (rcgen). Node `NAME`'s
//! certificate carries the DNS name `NAME.psls`; peers verify it against the cluster CA.
//!
//! Files in the cert folder: `ca.pem`, `ca.key`, `NAME.pem`, `NAME.key` (keys mode 0600).

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("certificate generation failed: {0}")]
    Gen(#[from] rcgen::Error),
    #[error("cannot write {path}: {err}")]
    Io { path: String, err: std::io::Error },
}

/// The DNS name in node `name`'s certificate.
pub fn dns_name(name: &str) -> String {
    format!("{name}.psls")
}

fn write(path: &Path, data: &str, mode: u32) -> Result<(), CertError> {
    let io = |err| CertError::Io {
        path: path.display().to_string(),
        err,
    };
    fs::write(path, data).map_err(io)?;
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).map_err(io)
}

/// Creates a new CA and certificates for `names` in `dir`.
pub fn generate(dir: &Path, cluster: &str, names: &[String]) -> Result<(), CertError> {
    fs::create_dir_all(dir).map_err(|err| CertError::Io {
        path: dir.display().to_string(),
        err,
    })?;
    let ca_key = rcgen::KeyPair::generate()?;
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, format!("{cluster} cluster CA"));
    ca_params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::CrlSign];
    let ca_cert = ca_params.self_signed(&ca_key)?;
    write(&dir.join("ca.pem"), &ca_cert.pem(), 0o644)?;
    write(&dir.join("ca.key"), &ca_key.serialize_pem(), 0o600)?;
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    for name in names {
        let key = rcgen::KeyPair::generate()?;
        let mut p = rcgen::CertificateParams::new(vec![dns_name(name)])?;
        p.distinguished_name.push(rcgen::DnType::CommonName, name.clone());
        p.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = p.signed_by(&key, &issuer)?;
        write(&dir.join(format!("{name}.pem")), &cert.pem(), 0o644)?;
        write(&dir.join(format!("{name}.key")), &key.serialize_pem(), 0o600)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn generates_files() {
        let dir = tempfile::tempdir().unwrap();
        super::generate(dir.path(), "t", &["n0".into(), "n1".into()]).unwrap();
        for f in ["ca.pem", "ca.key", "n0.pem", "n0.key", "n1.pem", "n1.key"] {
            assert!(dir.path().join(f).exists(), "{f}");
        }
        let k = std::fs::read_to_string(dir.path().join("n0.key")).unwrap();
        assert!(k.contains("PRIVATE KEY"));
    }
}
