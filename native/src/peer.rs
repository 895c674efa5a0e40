//! Peer GETs on the native plane (issue 30): a batch of objects from one node agent, over at most
//! ``per_peer`` kept-alive connections per peer, on tokio's workers (no thread per connection,
//! none per held request), each body verified before a byte of it is written.
//!
//! The policy stays in Python (dscache_stager.peers): which peer to ask, what a refusal, a busy
//! or a stalled peer means, who is written off. This module answers, per object, what happened in
//! the terms that policy needs, and never writes a body that does not check:
//! - the answer must name the revision asked for (REVISION_HEADER), have the manifest's size as
//!   its Content-Length and deliver exactly that many bytes;
//! - the body must hash to the listed ETag, a plain MD5 (multipart ETags stay on the Python path,
//!   which rebuilds them for candidate part sizes);
//! - only then is it written, into a new file (O_EXCL, read-only) that Python places; or, for
//!   a temp file named to grow (GROW_PREFIX), written as it comes for this node's agent to pass
//!   on meanwhile, and removed unless it checks (a peer that took those bytes checks them itself).
//!
//! The agents' certificate names one AGENT_TLS_NAME, and a peer is reached by its IP: the client
//! of each peer resolves that name to the peer's address (reqwest's ``resolve``), so the name is
//! what rustls checks, against the agents' CA only.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use md5::{Digest, Md5};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use tokio::runtime::Runtime;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::copy::{Growing, FILE_MODE};

/// (request target, listed size, ETag unquoted (a plain MD5), temp path to create)
pub type PeerItem = (String, u64, String, String);
/// Per item: (kind, HTTP status or errno, detail). Kinds: "placed" (verified, in the temp file);
/// "status" (a non-200 answer; detail: the 404 body's "state"); "suspect" (the body did not hash
/// to the ETag; detail: its MD5); "lied" (wrong revision header or length; detail: how);
/// "stalled" (no byte in time); "refused" (no connection); "transport" (reset, closed, other:
/// no verdict on the peer); "local" (our own write failed; errno); "cancelled".
pub type PeerOutcome = (String, i32, String);

/// The 404 bodies are small JSON; anything longer is no answer of an agent's.
const MAX_ERROR_BODY: usize = 64 << 10;
/// The agents' batch path (dscache_contract.peers.OBJECTS_BATCH_PATH), its most paths per request
/// (BATCH_MAX_OBJECTS) and the largest object it carries (BATCH_OBJECT_MAX).
const BATCH_PATH: &str = "/v1/objects-batch";
const BATCH_MAX_OBJECTS: usize = 64;
const BATCH_OBJECT_MAX: u64 = 64 << 10;

/// What a batch asks besides the items: (namespace, cache, per item its path under data/).
pub type BatchOf = (String, String, Vec<String>);

/// One peer: its client (its own pool, bounded idle connections) and the bound on requests at once.
struct Peer {
    client: reqwest::Client,
    base: String,
    slots: Semaphore,
    /// False once the peer answered the batch path 404 or 405 (an agent without it): asked alone.
    batches: AtomicBool,
}

#[pyclass(module = "dscache_native", frozen)]
pub struct PeerFetcher {
    runtime: Runtime,
    ca_pem: Option<Vec<u8>>,
    tls_name: String,
    revision_header: String,
    per_peer: usize,
    /// A held request answers within the agent's wait; past this, silence is a stalled peer.
    answer_timeout: Duration,
    /// The longest wait for one read of a body.
    read_timeout: Duration,
    /// The slowest body taken (bytes/s), after read_timeout of grace.
    min_rate: f64,
    idle: Duration,
    peers: Mutex<HashMap<String, Arc<Peer>>>,
    stop: CancellationToken,
    done: Arc<Done>,
}

/// The batches ``start``ed that completed, and the pipe that says so to an event loop.
struct Done {
    batches: Mutex<Vec<(u64, Vec<(usize, PeerOutcome)>)>>,
    read_fd: i32,
    write_fd: i32,
}

impl Done {
    fn new() -> std::io::Result<Self> {
        let mut fds = [0i32; 2];
        // SAFETY: pipe2 writes two descriptors into the array it is given.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Done {
            batches: Mutex::new(Vec::new()),
            read_fd: fds[0],
            write_fd: fds[1],
        })
    }

    fn push(&self, id: u64, outs: Vec<(usize, PeerOutcome)>) {
        self.batches.lock().expect("done lock").push((id, outs));
        // One byte per batch; a full pipe (EAGAIN) already says "readable": nothing is lost.
        let byte = 1u8;
        // SAFETY: a one-byte write from a live buffer to our own descriptor.
        unsafe { libc::write(self.write_fd, std::ptr::addr_of!(byte).cast(), 1) };
    }

    fn take(&self) -> Vec<(u64, Vec<(usize, PeerOutcome)>)> {
        // The pipe first, then the batches: a batch pushed after this drain writes a byte anew.
        let mut buf = [0u8; 512];
        // SAFETY: reads into a live buffer of its length from our own non-blocking descriptor.
        while unsafe { libc::read(self.read_fd, buf.as_mut_ptr().cast(), buf.len()) } > 0 {}
        std::mem::take(&mut *self.batches.lock().expect("done lock"))
    }
}

impl Drop for Done {
    fn drop(&mut self) {
        // SAFETY: the descriptors are ours and closed once.
        unsafe {
            libc::close(self.read_fd);
            libc::close(self.write_fd);
        }
    }
}

#[pymethods]
impl PeerFetcher {
    #[new]
    #[pyo3(signature = (*, revision_header, ca_pem=None, tls_name=String::new(), workers=1, per_peer=12,
                        answer_timeout_s=50.0, read_timeout_s=30.0, min_rate=1048576.0, idle_s=10.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        revision_header: String,
        ca_pem: Option<String>,
        tls_name: String,
        workers: usize,
        per_peer: usize,
        answer_timeout_s: f64,
        read_timeout_s: f64,
        min_rate: f64,
        idle_s: f64,
    ) -> PyResult<Self> {
        let ca_pem = ca_pem
            .filter(|p| !p.trim().is_empty())
            .map(String::into_bytes);
        if let Some(pem) = &ca_pem {
            // Refuse a bad CA now, not per peer later.
            reqwest::Certificate::from_pem(pem)
                .map_err(|e| PyValueError::new_err(format!("the agents' CA: {e}")))?;
            if tls_name.is_empty() {
                return Err(PyValueError::new_err(
                    "TLS to the agents needs the name their certificate holds",
                ));
            }
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers.max(1))
            .thread_name("dscache-peer")
            .enable_all()
            .build()
            .map_err(|e| PyValueError::new_err(format!("cannot start the peers' runtime: {e}")))?;
        Ok(PeerFetcher {
            runtime,
            ca_pem,
            tls_name,
            revision_header,
            per_peer: per_peer.max(1),
            answer_timeout: Duration::from_secs_f64(answer_timeout_s.max(0.1)),
            read_timeout: Duration::from_secs_f64(read_timeout_s.max(0.1)),
            min_rate: min_rate.max(1.0),
            idle: Duration::from_secs_f64(idle_s.max(0.1)),
            peers: Mutex::new(HashMap::new()),
            stop: CancellationToken::new(),
            done: Arc::new(Done::new().map_err(|e| {
                PyValueError::new_err(format!("cannot open the completion pipe: {e}"))
            })?),
        })
    }

    /// GET every item from the agent at ``addr`` (``host:port``, ``[v6]:port``) with ``token``,
    /// for ``revision``; one outcome per item, in order. Blocks without the GIL.
    #[pyo3(signature = (addr, token, revision, items, batch=None))]
    fn fetch(
        &self,
        py: Python<'_>,
        addr: String,
        token: String,
        revision: String,
        items: Vec<PeerItem>,
        batch: Option<BatchOf>,
    ) -> PyResult<Vec<PeerOutcome>> {
        let n = items.len();
        let (reply, answer) = tokio::sync::oneshot::channel();
        let reply = Mutex::new((vec![None; n], 0usize, Some(reply)));
        self.launch(&addr, token, revision, items, batch, move |piece| {
            let mut got = reply.lock().expect("reply lock");
            let (outs, count, reply) = &mut *got;
            for (i, out) in piece {
                *count += usize::from(outs[i].is_none());
                outs[i] = Some(out);
            }
            if *count == outs.len() {
                if let Some(reply) = reply.take() {
                    let _ = reply.send(
                        outs.iter_mut()
                            .map(|o| o.take().unwrap_or_else(cancelled))
                            .collect(),
                    );
                }
            }
        })?;
        let outs = py
            .allow_threads(|| answer.blocking_recv())
            .unwrap_or_else(|_| vec![cancelled(); n]);
        Ok(outs)
    }

    /// As ``fetch``, without blocking: the outcomes of batch ``id`` come out of ``completed`` as
    /// they come (each object's as soon as it has one: an object placed is not held back by a
    /// slower one of its call, which its children may be waiting for), and a byte is written to
    /// ``notify_fd`` then (an event loop's reader). No thread waits on the batch: sync's native peer worker asked one batch per
    /// thread of a pool (a thread start, a hop and a wake-up each), hundreds per node (issue 30).
    /// ``batch``: (namespace, cache, each item's path under data/): the small items are asked in
    /// one request of the agents' batch path first (each one whole there now comes in it, checked
    /// as alone), the others, and those it does not carry, alone as without it.
    #[pyo3(signature = (addr, token, revision, items, id, batch=None))]
    fn start(
        &self,
        addr: String,
        token: String,
        revision: String,
        items: Vec<PeerItem>,
        id: u64,
        batch: Option<BatchOf>,
    ) -> PyResult<()> {
        let done = self.done.clone();
        self.launch(&addr, token, revision, items, batch, move |outs| {
            done.push(id, outs)
        })
    }

    /// The file descriptor that becomes readable when a batch ``start``ed has completed.
    fn notify_fd(&self) -> i32 {
        self.done.read_fd
    }

    /// The outcomes come since the last call: (id, [(item's index, its outcome)]), in order of coming.
    fn completed(&self) -> Vec<(u64, Vec<(usize, PeerOutcome)>)> {
        self.done.take()
    }

    /// Stop every batch: requests in flight are dropped, nothing more is written.
    fn cancel(&self) {
        self.stop.cancel();
    }
}

/// The outcome of an item whose task failed (a panic): no verdict on the peer.
fn failed(e: &tokio::task::JoinError) -> PeerOutcome {
    ("transport".into(), 0, format!("task failed: {e}"))
}

fn cancelled() -> PeerOutcome {
    ("cancelled".into(), 0, String::new())
}

impl PeerFetcher {
    /// Spawn every item of a batch on the runtime; ``reply`` gets their outcomes, in order.
    fn launch(
        &self,
        addr: &str,
        token: String,
        revision: String,
        items: Vec<PeerItem>,
        batch: Option<BatchOf>,
        reply: impl Fn(Vec<(usize, PeerOutcome)>) + Send + Sync + 'static,
    ) -> PyResult<()> {
        let reply = Arc::new(reply);
        if let Some((_, _, rels)) = &batch {
            if rels.len() != items.len() {
                return Err(PyValueError::new_err("batch: one path per item"));
            }
        }
        let peer = self.peer(addr)?;
        let job = Arc::new(Job {
            peer,
            auth: format!("Bearer {token}"),
            revision,
            header: self.revision_header.clone(),
            answer_timeout: self.answer_timeout,
            read_timeout: self.read_timeout,
            min_rate: self.min_rate,
        });
        let stop = self.stop.clone();
        self.runtime.spawn(async move {
            // The small ones in batches first (one request each, not one per object); what a
            // batch does not settle is asked alone. Each outcome goes out as soon as it is known.
            let mut alone: Vec<(usize, PeerItem)> = Vec::with_capacity(items.len());
            let mut asks = Vec::new();
            let small: Vec<usize> = match &batch {
                Some(_) => (0..items.len())
                    .filter(|&i| items[i].1 <= BATCH_OBJECT_MAX)
                    .collect(),
                None => Vec::new(),
            };
            let batched = small.len() >= 2;
            if let (true, Some((namespace, cache, rels))) = (batched, &batch) {
                for chunk in small.chunks(BATCH_MAX_OBJECTS) {
                    let (job, stop, reply) = (job.clone(), stop.clone(), reply.clone());
                    let picked: Vec<(usize, PeerItem, String)> = chunk
                        .iter()
                        .map(|&i| (i, items[i].clone(), rels[i].clone()))
                        .collect();
                    let (namespace, cache) = (namespace.clone(), cache.clone());
                    let indices: Vec<usize> = chunk.to_vec();
                    asks.push((
                        indices,
                        tokio::spawn(async move {
                            let wants: Vec<(PeerItem, String)> = picked
                                .iter()
                                .map(|(_, item, rel)| (item.clone(), rel.clone()))
                                .collect();
                            let outs = tokio::select! {
                                biased;
                                _ = stop.cancelled() => vec![Some(cancelled()); wants.len()],
                                outs = job.batch(&namespace, &cache, &wants) => outs,
                            };
                            let mut settled = Vec::new();
                            let mut rest = Vec::new();
                            for ((i, item, _), out) in picked.into_iter().zip(outs) {
                                match out {
                                    Some(out) => settled.push((i, out)),
                                    None => rest.push((i, item)),
                                }
                            }
                            if !settled.is_empty() {
                                reply(settled);
                            }
                            rest
                        }),
                    ));
                }
            }
            for (i, item) in items.into_iter().enumerate() {
                if !(batched && item.1 <= BATCH_OBJECT_MAX) {
                    alone.push((i, item));
                }
            }
            let single = |(i, item): (usize, PeerItem)| {
                let (job, stop, reply) = (job.clone(), stop.clone(), reply.clone());
                let task = tokio::spawn(async move {
                    let out = tokio::select! {
                        biased;
                        _ = stop.cancelled() => cancelled(),
                        out = job.one(item) => out,
                    };
                    reply(vec![(i, out)]);
                });
                (vec![i], task)
            };
            let mut handles: Vec<_> = alone.into_iter().map(single).collect();
            for (indices, a) in asks {
                match a.await {
                    Ok(rest) => handles.extend(rest.into_iter().map(single)),
                    Err(e) => reply(indices.into_iter().map(|i| (i, failed(&e))).collect()),
                }
            }
            for (indices, h) in handles {
                if let Err(e) = h.await {
                    reply(indices.into_iter().map(|i| (i, failed(&e))).collect());
                }
            }
        });
        Ok(())
    }

    fn peer(&self, addr: &str) -> PyResult<Arc<Peer>> {
        let mut peers = self.peers.lock().expect("peers lock");
        if let Some(p) = peers.get(addr) {
            return Ok(p.clone());
        }
        let mut builder = reqwest::Client::builder()
            .http1_only()
            // The stager talks to the agents directly, as http.client does: never through HTTP_PROXY.
            .no_proxy()
            .pool_max_idle_per_host(self.per_peer)
            // Shorter than the agent keeps an idle connection (IDLE_S), so a reused one is seldom
            // one the agent is closing.
            .pool_idle_timeout(self.idle)
            .connect_timeout(self.read_timeout)
            .tcp_nodelay(true)
            // The agents' own CA is the one root a peer connection trusts (below); over plain HTTP
            // none is used. The system's roots cost each peer's client 1.8 ms of CPU, the first
            // 39 ms (/etc/ssl/certs parsed; 0.6 ms with source.roots_from_one_file's narrowing):
            // up to 0.1 s per stager at N = 32 (issue 30), for roots no peer connection trusts.
            .tls_built_in_root_certs(false);
        let base = if let Some(pem) = &self.ca_pem {
            let ip: SocketAddr = addr.parse().map_err(|e| {
                PyValueError::new_err(format!("peer address {addr:?} is no ip:port: {e}"))
            })?;
            let ca = reqwest::Certificate::from_pem(pem)
                .map_err(|e| PyValueError::new_err(format!("{e}")))?;
            builder = builder
                .use_rustls_tls()
                .add_root_certificate(ca)
                .min_tls_version(reqwest::tls::Version::TLS_1_2)
                .resolve(&self.tls_name, ip);
            format!("https://{}:{}", self.tls_name, ip.port())
        } else {
            format!("http://{addr}")
        };
        let client = builder
            .build()
            .map_err(|e| PyValueError::new_err(format!("peer client: {e}")))?;
        let peer = Arc::new(Peer {
            client,
            base,
            slots: Semaphore::new(self.per_peer),
            batches: AtomicBool::new(true),
        });
        peers.insert(addr.to_string(), peer.clone());
        Ok(peer)
    }
}

struct Job {
    peer: Arc<Peer>,
    auth: String,
    revision: String,
    header: String,
    answer_timeout: Duration,
    read_timeout: Duration,
    min_rate: f64,
}

impl Job {
    /// One request of the batch path for ``picked`` (item, its path under data/): per item its
    /// outcome, or None when it is to be asked alone (not carried: "staging" is held alone, an
    /// absent or refused one gets its verdict alone; or the batch failed below HTTP, or the agent
    /// has no batch path). Each body carried is checked as ``one`` checks it before it is written.
    async fn batch(
        &self,
        namespace: &str,
        cache: &str,
        picked: &[(PeerItem, String)],
    ) -> Vec<Option<PeerOutcome>> {
        let n = picked.len();
        if !self.peer.batches.load(Ordering::Relaxed) {
            return vec![None; n];
        }
        let Ok(_slot) = self.peer.slots.acquire().await else {
            return vec![Some(cancelled()); n];
        };
        let body = serde_json::json!({
            "namespace": namespace,
            "cache": cache,
            "revision": self.revision,
            "paths": picked.iter().map(|(_, rel)| rel.as_str()).collect::<Vec<_>>(),
            "relay": true,
        })
        .to_string();
        let url = format!("{}{}", self.peer.base, BATCH_PATH);
        let send = self
            .peer
            .client
            .post(url)
            .header("Authorization", &self.auth)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(body)
            .send();
        let resp = match tokio::time::timeout(self.answer_timeout, send).await {
            Ok(Ok(r)) => r,
            // No answer, or no connection: each item alone, where its failure gets its verdict.
            _ => return vec![None; n],
        };
        let status = resp.status().as_u16();
        if status != 200 {
            if status == 404 || status == 405 {
                self.peer.batches.store(false, Ordering::Relaxed); // an agent without the batch path
            }
            return vec![None; n];
        }
        let said = resp
            .headers()
            .get(&self.header)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        if said != self.revision {
            let lied = (
                "lied".to_string(),
                200,
                format!("it answered for revision {said:?}"),
            );
            return vec![Some(lied); n];
        }
        // Frames: a line "<status> <length> <state>" and <length> bytes, per path in order. The
        // whole answer within read_timeout plus the bodies asked for at min_rate.
        let most: u64 = picked.iter().map(|((_, size, _, _), _)| size + 64).sum();
        let deadline = self.read_timeout + Duration::from_secs_f64(most as f64 / self.min_rate);
        let all = match tokio::time::timeout(deadline, read_most(resp, most as usize + 4096)).await
        {
            Ok(Ok(Some(b))) => b,
            Ok(Ok(None)) => {
                let lied = (
                    "lied".to_string(),
                    200,
                    "a batch answer longer than its objects".to_string(),
                );
                return vec![Some(lied); n];
            }
            _ => return vec![None; n], // cut or stalled: each alone (a stalled peer is told there)
        };
        let mut outs = Vec::with_capacity(n);
        let mut at = 0usize;
        for ((_, size, etag, tmp), _) in picked {
            let Some((code, length, state, next)) = frame(&all, at) else {
                let lied = (
                    "lied".to_string(),
                    200,
                    "a batch answer that does not parse".to_string(),
                );
                outs.resize(n, Some(lied));
                return outs;
            };
            at = next + length;
            if code != 200 {
                // "unclaimed" is the answer the probe alone would get; the rest are asked alone.
                outs.push(
                    (code == 404 && state == "unclaimed")
                        .then(|| ("status".to_string(), 404, state)),
                );
                continue;
            }
            if length as u64 != *size {
                outs.push(Some((
                    "lied".into(),
                    200,
                    format!("{length} bytes where the manifest says {size}"),
                )));
                continue;
            }
            let body = &all[next..next + length];
            let md5 = hex(&Md5::digest(body));
            if md5 != etag.trim_matches('"').to_ascii_lowercase() {
                outs.push(Some(("suspect".into(), 200, md5)));
                continue;
            }
            outs.push(Some(
                match write_new(tmp, &[Bytes::copy_from_slice(body)]) {
                    Ok(()) => ("placed".into(), 200, String::new()),
                    Err(e) => {
                        let _ = std::fs::remove_file(tmp);
                        (
                            "local".into(),
                            e.raw_os_error().unwrap_or(libc::EIO),
                            format!("writing {tmp}: {e}"),
                        )
                    }
                },
            ));
        }
        outs
    }

    async fn one(&self, (target, size, etag, tmp): PeerItem) -> PeerOutcome {
        let Ok(_slot) = self.peer.slots.acquire().await else {
            return cancelled();
        };
        let url = format!("{}{}", self.peer.base, target);
        let send = self
            .peer
            .client
            .get(url)
            .header("Authorization", &self.auth)
            .send();
        let mut resp = match tokio::time::timeout(self.answer_timeout, send).await {
            Err(_) => {
                return (
                    "stalled".into(),
                    0,
                    format!("no answer in {:?}", self.answer_timeout),
                )
            }
            Ok(Err(e)) => return transport(e),
            Ok(Ok(r)) => r,
        };
        let status = resp.status().as_u16();
        if status != 200 {
            // Read whole (the connection is reused), within the read timeout.
            let mut body = Vec::new();
            let read = async {
                while let Some(chunk) = resp.chunk().await? {
                    if body.len() + chunk.len() > MAX_ERROR_BODY {
                        break;
                    }
                    body.extend_from_slice(&chunk);
                }
                Ok::<(), reqwest::Error>(())
            };
            let _ = tokio::time::timeout(self.read_timeout, read).await;
            let state = if status == 404 {
                state_of(&body)
            } else {
                String::new()
            };
            return ("status".into(), i32::from(status), state);
        }
        let said = resp
            .headers()
            .get(&self.header)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if said != self.revision {
            return (
                "lied".into(),
                200,
                format!("it answered for revision {said:?}"),
            );
        }
        // The header itself, not reqwest's content_length() (which a body's hint may fill in).
        let length = resp
            .headers()
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        if length != Some(size) {
            let shown = length.map_or("no".to_string(), |n| n.to_string());
            return (
                "lied".into(),
                200,
                format!("{shown} bytes where the manifest says {size}"),
            );
        }
        // The whole body within read_timeout plus its size at min_rate; each read within read_timeout.
        let deadline = Instant::now()
            + self.read_timeout
            + Duration::from_secs_f64(size as f64 / self.min_rate);
        let mut chunks: Vec<Bytes> = Vec::new();
        // A growing temp file (its name says so: GROW_PREFIX) takes each chunk as it comes, for
        // this node's agent to pass on to the peers that ask meanwhile (copy::growing); removed
        // unless the body is whole and hashes to the ETag. Any other is written once checked.
        let mut growing = None;
        if is_growing(&tmp) {
            match Growing::create(&tmp) {
                Ok(g) => growing = Some(g),
                Err(e) => return local(&tmp, &e),
            }
        }
        let mut hash = Md5::new();
        let mut got: u64 = 0;
        while got < size {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .min(self.read_timeout);
            if left.is_zero() {
                return (
                    "stalled".into(),
                    0,
                    format!("{got} of {size} bytes in time"),
                );
            }
            let chunk = match tokio::time::timeout(left, resp.chunk()).await {
                Err(_) => {
                    return (
                        "stalled".into(),
                        0,
                        format!("{got} of {size} bytes in time"),
                    )
                }
                Ok(Err(e)) => return transport(e),
                Ok(Ok(None)) => {
                    return (
                        "transport".into(),
                        0,
                        format!("the body ended after {got} of {size} bytes"),
                    )
                }
                Ok(Ok(Some(c))) => c,
            };
            got += chunk.len() as u64;
            if got > size {
                return (
                    "lied".into(),
                    200,
                    format!("more than the {size} bytes it announced"),
                );
            }
            hash.update(&chunk);
            match growing.as_mut() {
                Some(g) => {
                    if let Err(e) = g.file.write_all(&chunk) {
                        return local(&tmp, &e);
                    }
                }
                None => chunks.push(chunk),
            }
        }
        let md5 = hex(&hash.finalize());
        if md5 != etag.trim_matches('"').to_ascii_lowercase() {
            return ("suspect".into(), 200, md5);
        }
        if let Some(mut g) = growing {
            g.kept = true; // whole and checked: the caller places it
            return ("placed".into(), 200, String::new());
        }
        match write_new(&tmp, &chunks) {
            Ok(()) => ("placed".into(), 200, String::new()),
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                local(&tmp, &e)
            }
        }
    }
}

/// The temp files whose name starts with this grow as their body comes (dscache_contract.peers.GROW_PREFIX).
const GROW_PREFIX: &str = "grow-";

fn is_growing(tmp: &str) -> bool {
    tmp.rsplit('/').next().is_some_and(|name| name.starts_with(GROW_PREFIX))
}

fn local(tmp: &str, e: &std::io::Error) -> PeerOutcome {
    (
        "local".into(),
        e.raw_os_error().unwrap_or(libc::EIO),
        format!("writing {tmp}: {e}"),
    )
}

/// A request that failed below HTTP: no connection at all is "refused" (peers.py writes the peer
/// off, as for ConnectionRefusedError); the rest (a reset, a kept-alive connection closed under
/// the request) gets no verdict here: the object goes back to the Python path, which tells busy
/// from broken.
fn transport(e: reqwest::Error) -> PeerOutcome {
    let kind = if e.is_connect() && refused(&e) {
        "refused"
    } else if e.is_timeout() {
        "stalled"
    } else {
        "transport"
    };
    let mut message = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        message.push_str(&format!(": {s}"));
        source = s.source();
    }
    (kind.into(), 0, message)
}

fn refused(e: &reqwest::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            return io.kind() == std::io::ErrorKind::ConnectionRefused;
        }
        source = s.source();
    }
    false
}

/// The "state" of an agent's 404 body (``{"state": "staging", ...}``), "" if none.
fn state_of(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("state").and_then(|s| s.as_str()).map(str::to_string))
        .unwrap_or_default()
}

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// A new read-only file (O_EXCL: never through a file or symlink someone left there) with the body.
fn write_new(tmp: &str, chunks: &[Bytes]) -> std::io::Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(FILE_MODE)
        .custom_flags(libc::O_CLOEXEC)
        .open(tmp)?;
    for c in chunks {
        f.write_all(c)?;
    }
    Ok(())
}

/// The whole body, or None when it is longer than ``most`` bytes.
async fn read_most(
    mut resp: reqwest::Response,
    most: usize,
) -> Result<Option<Vec<u8>>, reqwest::Error> {
    let mut all = Vec::with_capacity(resp.content_length().map_or(0, |n| (n as usize).min(most)));
    while let Some(chunk) = resp.chunk().await? {
        if all.len() + chunk.len() > most {
            return Ok(None);
        }
        all.extend_from_slice(&chunk);
    }
    Ok(Some(all))
}

/// The frame at ``at`` of a batch answer: (status, body length, state, where its body starts),
/// None when it does not parse or its body runs past the end.
fn frame(all: &[u8], at: usize) -> Option<(u16, usize, String, usize)> {
    let rest = all.get(at..)?;
    let end = rest.iter().take(128).position(|&b| b == b'\n')?;
    let line = std::str::from_utf8(&rest[..end]).ok()?;
    let mut parts = line.splitn(3, ' ');
    let code = parts.next()?.parse::<u16>().ok()?;
    let length = parts.next()?.parse::<usize>().ok()?;
    let state = parts.next().unwrap_or("").trim().to_string();
    let start = at + end + 1;
    if start.checked_add(length)? > all.len() {
        return None;
    }
    Some((code, length, state, start))
}
