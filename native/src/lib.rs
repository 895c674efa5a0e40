//! dscache_native: the stager's per-object data plane in native code.
//!
//! Python (dscache_stager.sync) keeps the control plane: listing, the revision
//! hash, hostile-key checks, leases, the journal, progress. It hands this
//! module batches of small objects, and large objects one at a time
//! (large.rs: ranged parts in parallel, pwrite, rename). For each small object a native task does
//! GET (If-Match on the listed ETag, or the pinned versionId) -> write a temp
//! file -> rename it to its final name, on tokio's worker threads, with the
//! GIL released. The batch completes to Python once, not twice per object as
//! obstore's get_async + bytes_async do (fetch.py explains that cost).
//!
//! The S3 client is object_store's, the library obstore wraps, built from the
//! same settings (source.S3Source.store_settings), so signing, retries with
//! backoff, pooled connections and the error kinds match the Python path.

mod copy;
mod creds;
mod large;
mod list;
mod peer;
mod settings;
mod splice;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use object_store::aws::AmazonS3;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use tokio::runtime::Runtime;
use tokio_util::sync::CancellationToken;

use copy::{Item, Shared};

/// A failure as Python takes it: (kind, errno, message, key).
type FailureTuple = (String, i32, String, String);
/// What Copier.fetch answers: (index, size, ETag) of each object placed, and the failure.
type BatchAnswer = (Vec<(usize, u64, String)>, Option<FailureTuple>);
/// What Copier.fetch_large answers: (size, ETag), or the failure.
type LargeAnswer = (Option<(u64, String)>, Option<FailureTuple>);

/// A copier for one bucket: its own runtime (``workers`` threads), connection
/// pool and request limit. One per staging run.
#[pyclass(module = "dscache_native", frozen)]
struct Copier {
    runtime: Runtime,
    shared: Arc<Shared>,
    workers: usize,
}

#[pymethods]
impl Copier {
    #[new]
    #[pyo3(signature = (bucket, config, *, access_key_id=None, secret_access_key=None, session_token=None,
                        skip_signature=false, credential_provider=None, workers=1, concurrency=64,
                        buffer_bytes=64 << 20, attempts=5, parts=16, splice=false, tmpfile=true,
                        link_proc=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        bucket: &str,
        config: std::collections::HashMap<String, String>,
        access_key_id: Option<String>,
        secret_access_key: Option<String>,
        session_token: Option<String>,
        skip_signature: bool,
        credential_provider: Option<PyObject>,
        workers: usize,
        concurrency: usize,
        buffer_bytes: u64,
        attempts: u32,
        parts: usize,
        splice: bool,
        tmpfile: bool,
        link_proc: bool,
    ) -> PyResult<Self> {
        let timeout = std::time::Duration::from_millis(
            config
                .get("timeout_ms")
                .and_then(|t| t.parse().ok())
                .unwrap_or(60_000),
        );
        let workers = workers.max(1);
        let buffer_units =
            u32::try_from(buffer_bytes.div_ceil(copy::BUFFER_UNIT).max(1)).map_err(|_| {
                PyValueError::new_err(format!("buffer_bytes={buffer_bytes} is too large"))
            })?;
        let given = creds::Given {
            access_key_id,
            secret_access_key,
            session_token,
            skip_signature,
            credential_provider,
        };
        let builder = creds::apply(settings::builder(bucket, &config)?, given, "Copier")?;
        let store: AmazonS3 = builder
            .build()
            .map_err(|e| PyValueError::new_err(format!("cannot configure the S3 client: {e}")))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .thread_name("dscache-native")
            .enable_all()
            .build()
            .map_err(|e| PyValueError::new_err(format!("cannot start the native runtime: {e}")))?;
        let shared = Arc::new(Shared {
            store,
            requests: tokio::sync::Semaphore::new(concurrency.max(1)),
            buffers: tokio::sync::Semaphore::new(buffer_units as usize),
            buffer_units,
            attempts: attempts.max(1),
            seq: AtomicU64::new(0),
            pid: std::process::id(),
            stop: CancellationToken::new(),
            parts: tokio::sync::Semaphore::new(parts.max(1)),
            large_objects: AtomicU64::new(0),
            large_parts: AtomicU64::new(0),
            parts_retried: AtomicU64::new(0),
            spliced_parts: AtomicU64::new(0),
            large_bytes: AtomicU64::new(0),
            splice,
            timeout,
            // The link goes through /proc (write_unnamed): without it, temp + rename.
            tmpfile: tmpfile && std::path::Path::new("/proc/self/fd").is_dir(),
            // Only through /proc, as kernels before 6.10 allow (tests of that way on newer ones).
            link: std::sync::atomic::AtomicU8::new(if link_proc {
                copy::LINK_PROC
            } else {
                copy::LINK_UNKNOWN
            }),
        });
        Ok(Copier {
            runtime,
            shared,
            workers,
        })
    }

    #[getter]
    fn workers(&self) -> usize {
        self.workers
    }

    /// Copy every item of the batch; return (done, failure). ``done`` lists
    /// (index, size, etag) of each object placed under its final name, also
    /// when the batch failed, so the caller journals them. The first failure
    /// stops the rest of the batch (what has started finishes or is dropped
    /// before its temp file is renamed).
    ///
    /// ``grow``: per item, a named temp file its body is written into as it comes, so that the
    /// node agent can serve it before it is whole (copy::growing; "": held in memory as always).
    #[pyo3(signature = (tmp_dir, items, grow=Vec::new()))]
    fn fetch(&self, py: Python<'_>, tmp_dir: String, items: Vec<Item>, grow: Vec<String>) -> PyResult<BatchAnswer> {
        let shared = self.shared.clone();
        let (reply, answer) = tokio::sync::oneshot::channel();
        // One task onto the runtime (one wake of a worker); it spawns the
        // objects' tasks from inside, and the last of them answers (one wake
        // of this thread per batch).
        self.runtime
            .spawn(async move { copy::batch(shared, tmp_dir, items, grow, reply) });
        let outcome = py.allow_threads(|| answer.blocking_recv());
        let (done, failure) = outcome.unwrap_or_else(|_| {
            let f = copy::Failure::Store {
                kind: "generic",
                message: "native batch ended without an answer".into(),
            };
            (Vec::new(), Some((f, String::new())))
        });
        Ok((done, failure.map(|(f, key)| f.into_tuple(key))))
    }

    /// Copy one large object in ranged parts of ``part_bytes`` (large.rs) and
    /// place it; (size, ETag unquoted), or the failure, once the object ends.
    ///
    /// ``grow``: the object's grow file, so that the node agent passes it on as its parts land
    /// (large::object; "": a temp file of its own, passed on once whole).
    #[pyo3(signature = (tmp_dir, item, part_bytes, grow=String::new()))]
    fn fetch_large(
        &self,
        py: Python<'_>,
        tmp_dir: String,
        item: Item,
        part_bytes: u64,
        grow: String,
    ) -> PyResult<LargeAnswer> {
        let shared = self.shared.clone();
        let key = item.0.clone();
        let (reply, answer) = tokio::sync::oneshot::channel();
        let stop = shared.stop.clone();
        self.runtime.spawn(async move {
            let result = tokio::select! {
                biased;
                _ = stop.cancelled() => Err(copy::Failure::Cancelled),
                r = large::object(shared, tmp_dir, item, part_bytes, grow) => r,
            };
            let _ = reply.send(result);
        });
        let outcome = py
            .allow_threads(|| answer.blocking_recv())
            .unwrap_or_else(|_| {
                Err(copy::Failure::Store {
                    kind: "generic",
                    message: "native copy ended without an answer".into(),
                })
            });
        Ok(match outcome {
            Ok(done) => (Some(done), None),
            Err(f) => (None, Some(f.into_tuple(key))),
        })
    }

    /// What the large-object path did so far: objects placed, parts written (their bytes), parts
    /// tried again, parts written by splice.
    fn counters(&self) -> std::collections::HashMap<&'static str, u64> {
        let s = &self.shared;
        std::collections::HashMap::from([
            ("large_objects", s.large_objects.load(Ordering::Relaxed)),
            ("large_parts", s.large_parts.load(Ordering::Relaxed)),
            ("parts_retried", s.parts_retried.load(Ordering::Relaxed)),
            ("spliced_parts", s.spliced_parts.load(Ordering::Relaxed)),
            ("large_bytes", s.large_bytes.load(Ordering::Relaxed)),
        ])
    }

    /// Stop every batch of this copier: queued objects are not started, and
    /// requests in flight are dropped. Called when the run fails elsewhere.
    fn cancel(&self) {
        self.shared.stop.cancel();
    }
}

#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

#[pymodule]
fn dscache_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Copier>()?;
    // Listing and HEADs (list.rs): the common path's only S3 client with the Copier.
    m.add_class::<list::Store>()?;
    m.add_class::<list::Pages>()?;
    m.add_class::<peer::PeerFetcher>()?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    Ok(())
}
