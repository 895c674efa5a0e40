//! The stager's listing and HEADs on the native plane (issue 30: one S3 client on the common path).
//!
//! A cold start that imports and builds two S3 clients (obstore's for the listing, this module's
//! Copier for the GETs) reads both extensions after a page-cache drop (obstore's is 15 MiB); with
//! the access proof, the listing and the HEADs of empty objects here, the common path
//! (dscache_stager.store) never loads obstore. The client is object_store's AmazonS3, built from
//! the same settings as the Copier's and obstore's, so requests, retries and error kinds match.
//!
//! Pages are ListObjectsV2 pages as object_store streams them (its own pagination, continuation
//! tokens), collected ``chunk`` objects at a time as obstore's ``list(chunk_size=...)`` does, and
//! handed to Python once per chunk with the GIL released while the page is fetched.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures::stream::{BoxStream, StreamExt};
use object_store::aws::AmazonS3;
use object_store::path::Path;
use object_store::{ObjectMeta, ObjectStore};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use tokio::runtime::Runtime;
use tokio_util::sync::CancellationToken;

use crate::copy::{store_failure, Failure};
use crate::{creds, settings};

/// A failure as Python takes it: (kind, errno, message, key), as the Copier's.
type FailureTuple = (String, i32, String, String);
/// One listed object: (key, size, ETag unquoted or "").
type Listed = (String, u64, String);

/// An S3 client for listing and HEADs, on a runtime of one worker thread (the requests are few
/// and sequential: a page at a time, or the HEADs of empty objects).
#[pyclass(module = "dscache_native", frozen)]
pub struct Store {
    runtime: Arc<Runtime>,
    store: Arc<AmazonS3>,
}

#[pymethods]
impl Store {
    #[new]
    #[pyo3(signature = (bucket, config, *, access_key_id=None, secret_access_key=None, session_token=None,
                        skip_signature=false, credential_provider=None))]
    fn new(
        bucket: &str,
        config: HashMap<String, String>,
        access_key_id: Option<String>,
        secret_access_key: Option<String>,
        session_token: Option<String>,
        skip_signature: bool,
        credential_provider: Option<PyObject>,
    ) -> PyResult<Self> {
        let given =
            creds::Given { access_key_id, secret_access_key, session_token, skip_signature, credential_provider };
        let builder = creds::apply(settings::builder(bucket, &config)?, given, "Store")?;
        let store =
            builder.build().map_err(|e| PyValueError::new_err(format!("cannot configure the S3 client: {e}")))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("dscache-list")
            .enable_all()
            .build()
            .map_err(|e| PyValueError::new_err(format!("cannot start the native runtime: {e}")))?;
        Ok(Store { runtime: Arc::new(runtime), store: Arc::new(store) })
    }

    /// A listing of ``prefix`` ("" or ending in "/"), starting after ``offset`` when given
    /// (S3's start-after), read ``chunk`` objects at a time with Pages.next.
    #[pyo3(signature = (prefix, offset=None, chunk=1000))]
    fn list(&self, prefix: &str, offset: Option<&str>, chunk: usize) -> PyResult<Pages> {
        let prefix = path(prefix.trim_end_matches('/'))?;
        let prefix = (!prefix.as_ref().is_empty()).then_some(prefix);
        // Entered: object_store spawns nothing here, but its stream is polled on this runtime.
        let _guard = self.runtime.enter();
        let stream = match offset {
            Some(offset) => self.store.list_with_offset(prefix.as_ref(), &path(offset)?),
            None => self.store.list(prefix.as_ref()),
        };
        Ok(Pages {
            runtime: self.runtime.clone(),
            stream: Mutex::new(Some(stream)),
            chunk: chunk.max(1),
            stop: CancellationToken::new(),
        })
    }

    /// HEAD ``key``: ((size, ETag unquoted), None), (None, None) when there is no such
    /// object, or (None, failure).
    fn head(&self, py: Python<'_>, key: &str) -> PyResult<(Option<(u64, String)>, Option<FailureTuple>)> {
        let location = path(key)?;
        let store = self.store.clone();
        let runtime = self.runtime.clone();
        let outcome = py.allow_threads(|| runtime.block_on(async move { store.head(&location).await }));
        Ok(match outcome {
            Ok(meta) => (Some((meta.size, etag(&meta))), None),
            Err(object_store::Error::NotFound { .. }) => (None, None),
            Err(e) => (None, Some(list_failure(e).into_tuple(key.to_string()))),
        })
    }
}

/// One listing, a chunk at a time.
#[pyclass(module = "dscache_native", frozen)]
pub struct Pages {
    runtime: Arc<Runtime>,
    /// None once the listing ended or failed.
    stream: Mutex<Option<BoxStream<'static, object_store::Result<ObjectMeta>>>>,
    chunk: usize,
    /// Cancelled by Pages.cancel: the listing's consumer is gone (the run failed or ended).
    stop: CancellationToken,
}

#[pymethods]
impl Pages {
    /// End the listing: a page in flight is dropped, and its next() answers at once ("cancelled").
    /// Called from another thread than the one blocked in next(), which holds the stream.
    fn cancel(&self) {
        self.stop.cancel();
    }

    /// The next objects, up to ``chunk`` of them (fewer only at the end of the listing), and the
    /// failure that ended it: what was listed before a failure is handed back with it, so a
    /// resumed listing goes on after the last of them. ([], None): the listing is done.
    fn next(&self, py: Python<'_>) -> (Vec<Listed>, Option<FailureTuple>) {
        let mut slot = self.stream.lock().unwrap_or_else(|e| e.into_inner());
        let Some(stream) = slot.as_mut() else {
            return (Vec::new(), None);
        };
        let chunk = self.chunk;
        let runtime = self.runtime.clone();
        let stop = self.stop.clone();
        let (batch, failure, ended) = py.allow_threads(|| {
            runtime.block_on(async {
                let mut batch = Vec::with_capacity(chunk.min(1000));
                while batch.len() < chunk {
                    let item = tokio::select! {
                        biased;
                        _ = stop.cancelled() => {
                            return (Vec::new(), Some(Failure::Cancelled.into_tuple(String::new())), true);
                        }
                        item = stream.next() => item,
                    };
                    match item {
                        Some(Ok(meta)) => batch.push((meta.location.to_string(), meta.size, etag(&meta))),
                        Some(Err(e)) => return (batch, Some(list_failure(e).into_tuple(String::new())), true),
                        None => return (batch, None, true),
                    }
                }
                (batch, None, false)
            })
        });
        if ended {
            *slot = None;
        }
        (batch, failure)
    }
}

/// A key or prefix as object_store takes it verbatim (obstore parses its paths alike).
fn path(key: &str) -> PyResult<Path> {
    Path::parse(key).map_err(|e| PyValueError::new_err(format!("cannot list or HEAD {key:?}: {e}")))
}

fn etag(meta: &ObjectMeta) -> String {
    meta.e_tag.as_deref().unwrap_or("").trim_matches('"').to_string()
}

/// The Copier's mapping, plus the kind a listing alone meets: a key object_store cannot
/// represent (empty segments, '.', '..', control characters), obstore's InvalidPathError.
fn list_failure(e: object_store::Error) -> Failure {
    let invalid = matches!(e, object_store::Error::InvalidPath { .. });
    match store_failure(e) {
        Failure::Store { message, .. } if invalid => Failure::Store { kind: "invalid_path", message },
        other => other,
    }
}
