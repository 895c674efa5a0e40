//! Credentials that only Python can produce (boto3's chain: IRSA web identity,
//! profiles, SSO, container and instance roles), asked for from native threads.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use object_store::aws::AwsCredential;
use object_store::CredentialProvider;
use pyo3::prelude::*;

/// Calls a Python callable returning (key, secret, token | None, seconds valid)
/// and keeps the answer until shortly before it expires, so the GIL is taken
/// about once per expiry, not once per request (object_store asks per request).
pub struct PyCredentials {
    provider: PyObject,
    cached: Mutex<Option<(Arc<AwsCredential>, Instant)>>,
}

impl std::fmt::Debug for PyCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PyCredentials")
    }
}

impl PyCredentials {
    pub fn new(provider: PyObject) -> Self {
        PyCredentials { provider, cached: Mutex::new(None) }
    }

    fn refresh(&self) -> object_store::Result<(Arc<AwsCredential>, Instant)> {
        let (key, secret, token, valid_s): (String, String, Option<String>, f64) =
            Python::with_gil(|py| self.provider.call0(py)?.extract(py)).map_err(|e: PyErr| {
                object_store::Error::Unauthenticated {
                    path: String::new(),
                    source: format!("the credential provider failed: {e}").into(),
                }
            })?;
        // Renew a minute early (or at once for odd answers), as a request
        // signed just before expiry may reach S3 just after it.
        let valid = Duration::from_secs_f64((valid_s - 60.0).clamp(0.0, 86_400.0));
        Ok((Arc::new(AwsCredential { key_id: key, secret_key: secret, token }), Instant::now() + valid))
    }
}

#[async_trait]
impl CredentialProvider for PyCredentials {
    type Credential = AwsCredential;

    async fn get_credential(&self) -> object_store::Result<Arc<AwsCredential>> {
        {
            let cached = self.cached.lock().unwrap();
            if let Some((cred, until)) = cached.as_ref() {
                if Instant::now() < *until {
                    return Ok(cred.clone());
                }
            }
        }
        // boto3's refresh may block on the network: keep it off tokio's workers' hot path.
        let fresh = tokio::task::block_in_place(|| self.refresh())?;
        let cred = fresh.0.clone();
        *self.cached.lock().unwrap() = Some(fresh);
        Ok(cred)
    }
}

/// The credentials a client was given, as the Copier and the Store take them from Python:
/// no signature (a public bucket), a Python provider (boto3's chain), or static keys.
pub struct Given {
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    pub session_token: Option<String>,
    pub skip_signature: bool,
    pub credential_provider: Option<PyObject>,
}

/// ``builder`` with ``given`` applied; ``who`` names the class in the error for none at all.
pub fn apply(
    mut builder: object_store::aws::AmazonS3Builder,
    given: Given,
    who: &str,
) -> PyResult<object_store::aws::AmazonS3Builder> {
    if given.skip_signature {
        builder = builder.with_skip_signature(true);
    } else if let Some(provider) = given.credential_provider {
        builder = builder.with_credentials(Arc::new(PyCredentials::new(provider)));
    } else if let (Some(key), Some(secret)) = (given.access_key_id, given.secret_access_key) {
        let cred = AwsCredential { key_id: key, secret_key: secret, token: given.session_token };
        builder = builder.with_credentials(Arc::new(object_store::StaticCredentialProvider::new(cred)));
    } else {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "dscache_native.{who} needs static keys, a credential_provider or skip_signature=True"
        )));
    }
    Ok(builder)
}
