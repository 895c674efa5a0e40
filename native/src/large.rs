//! One large object: ranged GETs in parallel -> pwrite into one temp file -> rename.
//!
//! fetch.Fetcher._fetch_parts does the same in Python (splice on plain HTTP,
//! obstore streaming otherwise). Here every part is a task on the runtime's
//! threads: GET with Range and the pin (If-Match on the listed ETag, or the
//! versionId), its body written where it belongs with pwritev as it arrives,
//! a part that fails retried on its own (object_store already resumes a body
//! cut mid-way from where it stopped; a short body or a failed request is
//! tried again here), and the object answered to Python once, when its file is
//! in place. Parts in flight are bounded per copier (Shared.parts), not per
//! object, so two objects share them as the Python path's splice threads do.
//!
//! Measured in issue 30's large35 round (fetch.py's docstring has the figures):
//! 32 MiB parts x 16 in flight, a 1 MiB splice pipe and splice itself (not
//! recv + pwrite) each cost the least client CPU of what was tried, and the
//! data phase is within ~15 ms of CPU per 512 MiB of curl reading the same
//! ranges into /dev/null. A one-page revision's large objects are called from
//! onepage.py's thread pool, without asyncio on the way to the first part.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use object_store::path::Path;
use object_store::{GetOptions, GetRange, ObjectStore};
use tokio::task::JoinSet;

use crate::copy::{jitter, os_failure, pinned, place, store_failure, Failure, Item, Shared, BUFFER_UNIT, FILE_MODE};
use crate::splice::{self, Target};

/// How long a presigned URL stays valid: longer than any part takes.
const SIGNED_FOR: Duration = Duration::from_secs(6 * 3600);

/// A part's body is written once this much of it has arrived (one pwritev of
/// the chunks as hyper handed them over: no copy to gather them). It is also
/// what a part in flight takes from the copier's byte budget.
const FLUSH_BYTES: usize = 1 << 20;
/// pwritev takes at most IOV_MAX (1024 on Linux) buffers.
const MAX_IOV: usize = 1024;

/// The temp file of one object; removed when dropped unless it was placed.
struct Temp {
    path: String,
    placed: bool,
}

impl Drop for Temp {
    fn drop(&mut self) {
        if !self.placed {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// How much of a grow file is written from its start, when the file was sized first (its parts
/// land in any order): dscache_contract.peers.GROWN_XATTR, read by the node agent.
const GROWN_XATTR: &std::ffi::CStr = c"user.dscache.grown";
/// A grow file's mode until it is whole (then FILE_MODE).
const GROW_MODE: u32 = 0o644;

/// The parts of a grow file written so far, and how far from its start it is whole (GROWN_XATTR).
struct Grown {
    file: Arc<File>,
    state: std::sync::Mutex<GrownState>,
}

struct GrownState {
    /// Per part in order: (its start, its end, where it is written up to from its start).
    parts: Vec<(u64, u64, u64)>,
    /// The prefix last set in GROWN_XATTR.
    published: u64,
}

impl Grown {
    fn new(file: Arc<File>, size: u64, part_bytes: u64) -> Grown {
        let parts = (0..size).step_by(part_bytes as usize).map(|s| (s, (s + part_bytes).min(size), s)).collect();
        Grown { file, state: std::sync::Mutex::new(GrownState { parts, published: 0 }) }
    }

    /// Part ``index`` is written up to ``upto``: publish the whole prefix if it grew. A part tried
    /// again writes the same pinned bytes at the same offsets, so what was published stays true.
    fn written(&self, index: usize, upto: u64) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let part = &mut state.parts[index];
        part.2 = part.2.max(upto);
        let mut prefix = 0;
        for &(_, end, upto) in &state.parts {
            prefix = upto;
            if upto < end {
                break;
            }
        }
        if prefix > state.published && set_grown(&self.file, prefix).is_ok() {
            state.published = prefix;
        }
    }
}

fn set_grown(file: &File, prefix: u64) -> io::Result<()> {
    let value = prefix.to_string();
    // SAFETY: a live fd, a NUL-terminated name and a buffer of the given length.
    let r = unsafe {
        libc::fsetxattr(file.as_raw_fd(), GROWN_XATTR.as_ptr(), value.as_ptr().cast(), value.len(), 0)
    };
    if r == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// The file's GROWN_XATTR gone, once it is whole (the placed file carries no trace of it).
fn clear_grown(file: &File) {
    // SAFETY: a live fd and a NUL-terminated name.
    unsafe { libc::fremovexattr(file.as_raw_fd(), GROWN_XATTR.as_ptr()) };
}

/// Copy one object of ``item.4`` bytes in parts of ``part_bytes``; (size, ETag unquoted).
/// ``grow``: the object's grow file (dscache_contract.peers.grow_name), so that the node agent
/// passes it on as its parts land, from its start (GROWN_XATTR says how far); "": a temp file.
pub async fn object(
    shared: Arc<Shared>,
    tmp_dir: String,
    item: Item,
    part_bytes: u64,
    grow: String,
) -> Result<(u64, String), Failure> {
    let (key, dest, etag, version, size) = item;
    let path =
        Path::parse(&key).map_err(|e| Failure::Store { kind: "generic", message: format!("bad key {key:?}: {e}") })?;
    let (mut temp, file, growing) = create(&shared, &tmp_dir, &grow)?;
    // The file has its final size before any part lands, so parts write at
    // their offsets in any order. Not fallocate: ext4 then converts unwritten
    // extents on every write (fetch.py measured 0.3 s per 512 MiB); the free
    // space was checked against the whole revision before the copy began.
    // A grow file has its GROWN_XATTR (0) before: its size says nothing of what is there.
    file.set_len(size).map_err(|e| os_failure(e, "sizing", &temp.path))?;
    let file = Arc::new(file);
    let part_bytes = part_bytes.max(1);
    let grown = growing.then(|| Arc::new(Grown::new(file.clone(), size, part_bytes)));
    // Plain HTTP: splice(2) on a presigned URL, signed once for all the parts. A URL
    // cannot name a version (its query is signed), so a pinned version streams.
    let target = if shared.splice && version.is_none() { Some(Arc::new(presign(&shared, &path).await?)) } else { None };
    let mut parts = JoinSet::new();
    let path = Arc::new(path);
    let pin = Arc::new((etag, version));
    let mut start = 0;
    let mut index = 0;
    while start < size {
        let end = (start + part_bytes).min(size);
        let (shared, path, pin, file, target) = (shared.clone(), path.clone(), pin.clone(), file.clone(), target.clone());
        let grown = grown.clone().map(|g| (g, index));
        parts.spawn(async move { part(&shared, &path, &pin.0, &pin.1, &file, &target, start, end, grown).await });
        start = end;
        index += 1;
    }
    // Every part must end (or fail) before the file is renamed: JoinSet aborts
    // the rest when this future is dropped (cancelled), and a part aborted
    // mid-write only ever writes into the temp file, which Temp removes.
    let mut etags: Option<String> = None;
    while let Some(joined) = parts.join_next().await {
        let got = joined.map_err(|e| Failure::Store { kind: "generic", message: format!("a part's task failed: {e}") })??;
        match &etags {
            // Without a listed ETag nothing pinned the parts: they must at least agree.
            Some(first) if *first != got => {
                return Err(Failure::Store {
                    kind: "precondition",
                    message: format!("{key} changed while its parts were read: ETag {first} then {got}"),
                })
            }
            _ => etags = Some(got),
        }
    }
    if growing {
        clear_grown(&file); // whole: its size says so now
        // Read-only from now on, as every placed file (writable until now: see create).
        file.set_permissions(fs::Permissions::from_mode(FILE_MODE)).map_err(|e| os_failure(e, "sealing", &temp.path))?;
    }
    drop(grown);
    drop(file);
    place(&temp.path, &dest).map_err(|e| os_failure(e, "placing", &dest))?;
    temp.placed = true;
    shared.large_objects.fetch_add(1, Ordering::Relaxed);
    Ok((size, etags.unwrap_or_default().trim_matches('"').to_string()))
}

/// The object's temp file, new: its grow file (with GROWN_XATTR at 0) when ``grow`` names one and
/// the filesystem keeps user xattrs, else a temp file of its own; (it, its file, whether it grows).
fn create(shared: &Shared, tmp_dir: &str, grow: &str) -> Result<(Temp, File, bool), Failure> {
    // O_EXCL: never write through a file (or symlink) someone left there.
    let open = |path: &str, mode: u32| OpenOptions::new().write(true).create_new(true).mode(mode).open(path);
    if !grow.is_empty() {
        // Owner-writable while it grows: a user xattr is set by permission on the file, not the
        // descriptor (a stager that is not root could not raise it on a read-only file).
        let file = match open(grow, GROW_MODE) {
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                // An earlier attempt's (a peer following it sees it gone).
                fs::remove_file(grow).map_err(|e| os_failure(e, "replacing", grow))?;
                open(grow, GROW_MODE)
            }
            other => other,
        }
        .map_err(|e| os_failure(e, "creating", grow))?;
        let temp = Temp { path: grow.to_string(), placed: false };
        if set_grown(&file, 0).is_ok() {
            return Ok((temp, file, true));
        }
        drop(temp); // no user xattrs here: passed on once whole, from a temp file of its own
    }
    let seq = shared.seq.fetch_add(1, Ordering::Relaxed) + 1;
    let temp = Temp { path: format!("{tmp_dir}/{}-L{seq}", shared.pid), placed: false };
    let file = open(&temp.path, FILE_MODE).map_err(|e| os_failure(e, "creating", &temp.path))?;
    Ok((temp, file, false))
}

async fn presign(shared: &Shared, path: &Path) -> Result<Target, Failure> {
    use object_store::signer::Signer;
    let url = shared.store.signed_url(http::Method::GET, path, SIGNED_FOR).await.map_err(store_failure)?;
    let host = url.host_str().ok_or_else(|| Failure::Store { kind: "generic", message: format!("no host in {url}") })?;
    let path = match url.query() {
        Some(q) => format!("{}?{q}", url.path()),
        None => url.path().to_string(),
    };
    let (host, port) = (host.to_string(), url.port_or_known_default().unwrap_or(80));
    // getaddrinfo blocks: on a blocking thread, as the parts' connects are.
    // A failed lookup leaves the list empty: each part then resolves for itself, within its retries.
    let lookup = host.clone();
    let addrs = tokio::task::spawn_blocking(move || splice::resolve(&lookup, port).unwrap_or_default())
        .await
        .unwrap_or_default();
    Ok(Target { host, port, path, addrs })
}

/// Bytes [start, end) of the object into ``file`` at the same offsets, retried
/// as fetch.Fetcher.fetch retries an object; the ETag the server answered with.
#[allow(clippy::too_many_arguments)]
async fn part(
    shared: &Shared,
    path: &Path,
    etag: &str,
    version: &Option<String>,
    file: &Arc<File>,
    target: &Option<Arc<Target>>,
    start: u64,
    end: u64,
    grown: Option<(Arc<Grown>, usize)>,
) -> Result<String, Failure> {
    // Parts in flight (per copier), then the request limit and the byte budget
    // every request shares: a part holds at most FLUSH_BYTES of body at once.
    let _part = shared.parts.acquire().await.expect("the parts semaphore is never closed");
    let units = (FLUSH_BYTES as u64 / BUFFER_UNIT).min(u64::from(shared.buffer_units)) as u32;
    let _bytes = shared.buffers.acquire_many(units).await.expect("the buffer semaphore is never closed");
    let mut attempt = 1;
    loop {
        let tried = match target {
            Some(target) => spliced(shared, target, etag, file, start, end).await,
            None => once(shared, path, etag, version, file, start, end, &grown).await,
        };
        match tried {
            Ok(got) => {
                if let Some((g, index)) = &grown {
                    g.written(*index, end);
                }
                shared.large_parts.fetch_add(1, Ordering::Relaxed);
                shared.large_bytes.fetch_add(end - start, Ordering::Relaxed);
                return Ok(got);
            }
            Err(f) if f.fatal() || attempt >= shared.attempts => return Err(f),
            Err(_) => {
                shared.parts_retried.fetch_add(1, Ordering::Relaxed);
                let cap = 0.2 * f64::from(1u32 << attempt.min(16));
                tokio::time::sleep(Duration::from_secs_f64(cap * jitter())).await;
                attempt += 1;
            }
        }
    }
}

/// A part by splice(2) on a blocking thread (splice.rs); the pin is If-Match, so
/// the ETag is the listed one.
async fn spliced(
    shared: &Shared,
    target: &Arc<Target>,
    etag: &str,
    file: &Arc<File>,
    start: u64,
    end: u64,
) -> Result<String, Failure> {
    let _request = shared.requests.acquire().await.expect("the request semaphore is never closed");
    let (target, file, pin, timeout) = (target.clone(), file.clone(), etag.to_string(), shared.timeout);
    // Not abortable once started: a cancelled object's part ends on its own (or
    // times out), writing only into the temp file Temp removed.
    tokio::task::spawn_blocking(move || splice::get_range_into(&target, file.as_raw_fd(), &pin, start, end, timeout))
        .await
        .map_err(|e| Failure::Store { kind: "generic", message: format!("a part's thread failed: {e}") })??;
    shared.spliced_parts.fetch_add(1, Ordering::Relaxed);
    Ok(etag.to_string())
}

#[allow(clippy::too_many_arguments)]
async fn once(
    shared: &Shared,
    path: &Path,
    etag: &str,
    version: &Option<String>,
    file: &File,
    start: u64,
    end: u64,
    grown: &Option<(Arc<Grown>, usize)>,
) -> Result<String, Failure> {
    let options = GetOptions { range: Some(GetRange::Bounded(start..end)), ..pinned(etag, version) };
    let _request = shared.requests.acquire().await.expect("the request semaphore is never closed");
    let result = shared.store.get_opts(path, options).await.map_err(store_failure)?;
    if result.range != (start..end) {
        return Err(Failure::Store {
            kind: "generic",
            message: format!("{path}: asked for bytes {start}-{end}, the server sent {:?}", result.range),
        });
    }
    let got_etag = result.meta.e_tag.clone().unwrap_or_default();
    let mut body = result.into_stream();
    let mut offset = start;
    let mut pending: Vec<Bytes> = Vec::new();
    let mut held = 0usize;
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(store_failure)?;
        if offset + (held + chunk.len()) as u64 > end {
            return Err(Failure::Store {
                kind: "generic",
                message: format!("{path}: the body of bytes {start}-{end} runs past its end"),
            });
        }
        held += chunk.len();
        pending.push(chunk);
        if held >= FLUSH_BYTES || pending.len() >= MAX_IOV {
            offset = write_at(file, &pending, offset).map_err(|e| os_failure(e, "writing", path.as_ref()))?;
            pending.clear();
            held = 0;
            if let Some((g, index)) = grown {
                g.written(*index, offset);
            }
        }
    }
    offset = write_at(file, &pending, offset).map_err(|e| os_failure(e, "writing", path.as_ref()))?;
    if offset != end {
        // Retried: the next attempt writes the whole part again at the same offsets.
        return Err(Failure::Store {
            kind: "generic",
            message: format!("short read of {path} bytes {start}-{end}: got {}", offset - start),
        });
    }
    Ok(got_etag)
}

/// pwritev every chunk at ``offset`` onwards (again for what a short write left); the offset after them.
fn write_at(file: &File, chunks: &[Bytes], mut offset: u64) -> io::Result<u64> {
    let mut skip = 0usize; // bytes of chunks already written
    let total: usize = chunks.iter().map(Bytes::len).sum();
    while skip < total {
        let mut iov: Vec<libc::iovec> = Vec::with_capacity(chunks.len());
        let mut seen = 0usize;
        for c in chunks {
            let (lo, hi) = (seen, seen + c.len());
            seen = hi;
            if hi <= skip {
                continue;
            }
            let from = skip.saturating_sub(lo);
            iov.push(libc::iovec { iov_base: c[from..].as_ptr() as *mut libc::c_void, iov_len: c.len() - from });
        }
        // SAFETY: every iovec points into a live Bytes of ``chunks`` for the call's duration.
        let n = unsafe {
            libc::pwritev(file.as_raw_fd(), iov.as_ptr(), iov.len() as libc::c_int, offset as libc::off_t)
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "pwritev wrote nothing"));
        }
        skip += n as usize;
        offset += n as u64;
    }
    Ok(offset)
}
