//! One object: GET -> temp file -> rename, retried as fetch.Fetcher.fetch retries.

use std::ffi::{CStr, CString};
use std::fs::{self, OpenOptions};
use std::io::{self, IoSlice, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::stream::{BoxStream, StreamExt};
use object_store::aws::AmazonS3;
use object_store::path::Path;
use object_store::{GetOptions, ObjectStore};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// (key, final path, ETag unquoted or "", versionId, listed size)
pub type Item = (String, String, String, Option<String>, u64);

/// The unit of Shared.buffers: a permit per KiB, so a budget of many MiB fits
/// tokio's u32 permit counts.
pub const BUFFER_UNIT: u64 = 1024;

/// Files are born read-only, as fetch.FILE_MODE: a complete revision must not change.
pub const FILE_MODE: u32 = 0o444;

pub struct Shared {
    pub store: AmazonS3,
    /// Requests in flight (GET and body), as the Python path's semaphore.
    pub requests: Semaphore,
    /// Bodies held in memory, in BUFFER_UNITs: an object takes its listed
    /// size from here before its GET and gives it back once written. Small
    /// objects are latency-bound, so many requests fly; this, not the request
    /// count, bounds the memory (256 x 1 MiB objects would be 256 MiB).
    pub buffers: Semaphore,
    /// The budget's size in BUFFER_UNITs: no object asks for more (one larger alone still runs).
    pub buffer_units: u32,
    pub attempts: u32,
    pub seq: AtomicU64,
    pub pid: u32,
    /// Cancelled by Copier.cancel: the run failed elsewhere.
    pub stop: CancellationToken,
    /// Ranged parts of large objects in flight, over all objects (large.rs).
    pub parts: Semaphore,
    /// Large objects placed, parts written, and parts tried again: what Copier.counters reports.
    pub large_objects: AtomicU64,
    pub large_parts: AtomicU64,
    pub parts_retried: AtomicU64,
    /// Bytes of the parts written so far (progress while a large object is copied).
    pub large_bytes: AtomicU64,
    /// Parts written by splice(2) (plain HTTP, large.rs): the others streamed.
    pub spliced_parts: AtomicU64,
    /// Large objects' parts by splice(2) from presigned URLs (plain-HTTP endpoints).
    pub splice: bool,
    /// A splice part's connect and read timeout (the S3 client's own for the others).
    pub timeout: Duration,
    /// Small objects into unnamed files linked into place (write_unnamed), not temp + rename.
    pub tmpfile: bool,
    /// How those files are linked (link): LINK_UNKNOWN, found out by the first, or LINK_PROC.
    pub link: AtomicU8,
}

/// Why an object failed, in the terms fetch.py's callers understand.
#[derive(Debug)]
pub enum Failure {
    /// Mapped by the Python wrapper (store.failure) onto the exception of that kind.
    Store {
        kind: &'static str,
        message: String,
    },
    /// Writing the destination failed: raised as OSError(errno).
    Os {
        errno: i32,
        message: String,
    },
    Cancelled,
}

impl Failure {
    pub fn into_tuple(self, key: String) -> (String, i32, String, String) {
        match self {
            Failure::Store { kind, message } => (kind.to_string(), 0, message, key),
            Failure::Os { errno, message } => ("os".to_string(), errno, message, key),
            Failure::Cancelled => ("cancelled".to_string(), 0, "cancelled".to_string(), key),
        }
    }

    /// Not worth another try: fetch.FATAL (the object is gone or changed,
    /// access is refused) and every local error (the Python path retries
    /// only obstore's errors).
    pub fn fatal(&self) -> bool {
        match self {
            Failure::Store { kind, .. } => *kind != "generic",
            _ => true,
        }
    }
}

pub fn store_failure(e: object_store::Error) -> Failure {
    use object_store::Error as E;
    let kind = match &e {
        E::NotFound { .. } => "gone",
        E::Precondition { .. } => "precondition",
        E::PermissionDenied { .. } => "permission",
        E::Unauthenticated { .. } => "unauthenticated",
        _ => "generic",
    };
    // As obstore words its exceptions: the message, then the error's chain,
    // which source.source_error searches ("Connection refused", "403"...).
    Failure::Store { kind, message: format!("{e}\n\nDebug source:\n{e:#?}") }
}

pub fn os_failure(e: io::Error, what: &str, path: &str) -> Failure {
    Failure::Os { errno: e.raw_os_error().unwrap_or(libc::EIO), message: format!("{what} {path}: {e}") }
}

/// What a batch hands back: (index, size, etag) of each object placed, and the failure that stopped the rest.
pub type Outcome = (Vec<(usize, u64, String)>, Option<(Failure, String)>);

/// A batch's results, filled in by its objects' tasks as they end.
struct Gather {
    keys: Vec<String>,
    done: Vec<(usize, u64, String)>,
    failure: Option<(Failure, String)>,
    left: usize,
    reply: Option<tokio::sync::oneshot::Sender<Outcome>>,
}

/// One object's slot in its batch. Its Drop records the result, so a task
/// that panics or is dropped (the runtime shutting down) still counts, and
/// the batch's waiter is woken once, by the last object, not once per object
/// (a JoinSet wakes the waiting thread for each task that ends).
struct Slot {
    gather: Arc<std::sync::Mutex<Gather>>,
    stop: CancellationToken,
    index: usize,
    result: Option<Result<(u64, String), Failure>>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let result = self.result.take().unwrap_or_else(|| {
            Err(Failure::Store { kind: "generic", message: "native task failed: it ended without a result".into() })
        });
        let mut g = self.gather.lock().unwrap_or_else(|e| e.into_inner());
        match result {
            Ok((size, etag)) => g.done.push((self.index, size, etag)),
            Err(f) => {
                self.stop.cancel();
                // The first real failure wins over the cancellations it causes.
                let first = match &g.failure {
                    None => true,
                    Some((prev, _)) => matches!(prev, Failure::Cancelled) && !matches!(f, Failure::Cancelled),
                };
                if first {
                    let key = g.keys[self.index].clone();
                    g.failure = Some((f, key));
                }
            }
        }
        g.left -= 1;
        if g.left == 0 {
            let out = (std::mem::take(&mut g.done), g.failure.take());
            if let Some(reply) = g.reply.take() {
                let _ = reply.send(out);
            }
        }
    }
}

/// Copy every item; the first failure stops the rest of this batch only (the
/// caller fails the run and cancels the others through Shared.stop). Called
/// from a runtime worker, so the objects' tasks go to its local queue; the
/// answer comes through ``reply`` once the last object has ended.
///
/// ``grow``: per item (or none at all), the named temp file its body is written into as it
/// comes (``""``: held in memory and written at once, as always): the node agent serves the bytes
/// written so far to peers that ask for the object meanwhile (dscache_contract.peers.grow_name).
pub fn batch(
    shared: Arc<Shared>,
    tmp_dir: String,
    items: Vec<Item>,
    grow: Vec<String>,
    reply: tokio::sync::oneshot::Sender<Outcome>,
) {
    let n = items.len();
    if n == 0 {
        let _ = reply.send((Vec::new(), None));
        return;
    }
    let stop = shared.stop.child_token();
    let tmp_dir = Arc::new(tmp_dir);
    let keys: Vec<String> = items.iter().map(|i| i.0.clone()).collect();
    let gather = Arc::new(std::sync::Mutex::new(Gather {
        keys,
        done: Vec::with_capacity(n),
        failure: None,
        left: n,
        reply: Some(reply),
    }));
    let mut grow = grow.into_iter();
    for (index, item) in items.into_iter().enumerate() {
        let grow = grow.next().unwrap_or_default();
        let mut slot = Slot { gather: gather.clone(), stop: stop.clone(), index, result: None };
        let (shared, tmp_dir) = (shared.clone(), tmp_dir.clone());
        tokio::spawn(async move {
            let stop = slot.stop.clone();
            let result = tokio::select! {
                biased;
                _ = stop.cancelled() => Err(Failure::Cancelled),
                r = object(&shared, &tmp_dir, &item, &grow) => r,
            };
            slot.result = Some(result);
            drop(slot); // records the result (Slot's Drop)
        });
    }
}

async fn object(shared: &Shared, tmp_dir: &str, item: &Item, grow: &str) -> Result<(u64, String), Failure> {
    let (key, dest, etag, version, size) = item;
    // Held until the body is written (also across retries): what bounds memory.
    let units = size.div_ceil(BUFFER_UNIT).clamp(1, u64::from(shared.buffer_units)) as u32;
    let _bytes = shared.buffers.acquire_many(units).await.expect("the buffer semaphore is never closed");
    let path =
        Path::parse(key).map_err(|e| Failure::Store { kind: "generic", message: format!("bad key {key:?}: {e}") })?;
    let mut attempt = 1;
    loop {
        let got = if grow.is_empty() {
            once(shared, tmp_dir, &path, dest, etag, version).await
        } else {
            growing(shared, &path, dest, etag, version, grow).await
        };
        match got {
            Ok(got) => return Ok(got),
            Err(f) if f.fatal() || attempt >= shared.attempts => return Err(f),
            Err(_) => {
                // fetch.py's jittered backoff: uniform(0, 0.2 * 2**attempt) seconds.
                let cap = 0.2 * f64::from(1u32 << attempt.min(16));
                tokio::time::sleep(Duration::from_secs_f64(cap * jitter())).await;
                attempt += 1;
            }
        }
    }
}

/// A GET's options that pin its bytes to the listed revision: If-Match on the listed ETag (when
/// there is one) and the versionId (fetch._pinned).
pub fn pinned(etag: &str, version: &Option<String>) -> GetOptions {
    GetOptions {
        if_match: (!etag.is_empty()).then(|| format!("\"{etag}\"")),
        version: version.clone(),
        ..Default::default()
    }
}

async fn once(
    shared: &Shared,
    tmp_dir: &str,
    path: &Path,
    dest: &str,
    etag: &str,
    version: &Option<String>,
) -> Result<(u64, String), Failure> {
    let options = pinned(etag, version);
    let (body, got_etag) = {
        let _permit = shared.requests.acquire().await.expect("the request semaphore is never closed");
        let result = shared.store.get_opts(path, options).await.map_err(store_failure)?;
        let got_etag = result.meta.e_tag.clone().unwrap_or_default();
        (Body::collect(result.into_stream()).await?, got_etag)
    };
    // From here on nothing awaits: a cancelled task is dropped either before
    // its temp file exists or after its rename, never between.
    if shared.tmpfile {
        match write_unnamed(dest, &body, &shared.link) {
            Ok(()) => return Ok((body.len, got_etag.trim_matches('"').to_string())),
            // A filesystem without O_TMPFILE: the named temp file below.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP) | Some(libc::EISDIR)) => {}
            Err(e) => return Err(os_failure(e, "placing", dest)),
        }
    }
    let seq = shared.seq.fetch_add(1, Ordering::Relaxed) + 1;
    let tmp = format!("{tmp_dir}/{}-n{seq}", shared.pid);
    if let Err(e) = write_new(&tmp, &body) {
        let _ = fs::remove_file(&tmp);
        return Err(os_failure(e, "writing", &tmp));
    }
    if let Err(e) = place(&tmp, dest) {
        let _ = fs::remove_file(&tmp);
        return Err(os_failure(e, "placing", dest));
    }
    Ok((body.len, got_etag.trim_matches('"').to_string()))
}

/// One GET whose body goes into the named temp file ``grow`` chunk by chunk as it comes, then
/// renamed into place: the file's size is how much of it is there, which the node agent serves to
/// the peers asking for the object meanwhile (issue 30: a node passed an object on only once it
/// was whole, so each hop of a large object's tree cost the whole object's time). A file left by
/// an earlier attempt is replaced (a peer following it sees it unlinked and ends its answer); the
/// file is removed unless placed, also when the task is dropped.
async fn growing(
    shared: &Shared,
    path: &Path,
    dest: &str,
    etag: &str,
    version: &Option<String>,
    grow: &str,
) -> Result<(u64, String), Failure> {
    let options = pinned(etag, version);
    let _permit = shared.requests.acquire().await.expect("the request semaphore is never closed");
    let result = shared.store.get_opts(path, options).await.map_err(store_failure)?;
    let got_etag = result.meta.e_tag.clone().unwrap_or_default();
    let mut temp = Growing::create(grow).map_err(|e| os_failure(e, "writing", grow))?;
    let mut stream = result.into_stream();
    let mut len: u64 = 0;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(store_failure)?;
        len += chunk.len() as u64;
        temp.file.write_all(&chunk).map_err(|e| os_failure(e, "writing", grow))?;
    }
    place(grow, dest).map_err(|e| os_failure(e, "placing", dest))?;
    temp.kept = true;
    Ok((len, got_etag.trim_matches('"').to_string()))
}

/// A growing temp file (``growing``, peer.rs): removed when dropped unless kept (placed, or
/// whole and checked for the caller to place).
pub struct Growing {
    pub file: fs::File,
    path: String,
    pub kept: bool,
}

impl Growing {
    /// A new file at ``path`` (O_EXCL: never written through a file or symlink someone left);
    /// one an earlier attempt of this node left there is unlinked first.
    pub fn create(path: &str) -> io::Result<Growing> {
        let open = || {
            OpenOptions::new().write(true).create_new(true).mode(FILE_MODE).custom_flags(libc::O_CLOEXEC).open(path)
        };
        let file = match open() {
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                fs::remove_file(path)?;
                open()?
            }
            other => other?,
        };
        Ok(Growing { file, path: path.to_string(), kept: false })
    }
}

impl Drop for Growing {
    fn drop(&mut self) {
        if !self.kept {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// A body as it came off the connection: the response's chunks, not copied into one buffer.
/// Collecting them into one (GetResult::bytes) cost a fresh allocation the size of the object
/// and a copy of every byte; a single writev puts the chunks into the file as they are.
struct Body {
    chunks: Vec<Bytes>,
    len: u64,
}

impl Body {
    async fn collect(mut stream: BoxStream<'static, object_store::Result<Bytes>>) -> Result<Body, Failure> {
        let mut body = Body { chunks: Vec::with_capacity(4), len: 0 };
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(store_failure)?;
            body.len += chunk.len() as u64;
            body.chunks.push(chunk);
        }
        Ok(body)
    }

    /// Every chunk into ``f``, in as few writev calls as the kernel takes them.
    fn write_to(&self, f: &mut fs::File) -> io::Result<()> {
        if let [one] = self.chunks.as_slice() {
            return f.write_all(one);
        }
        let mut slices: Vec<IoSlice<'_>> = self.chunks.iter().map(|c| IoSlice::new(c)).collect();
        let mut rest = &mut slices[..];
        while !rest.is_empty() {
            match f.write_vectored(rest) {
                Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
                Ok(n) => IoSlice::advance_slices(&mut rest, n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// The body into an unnamed file (O_TMPFILE) in ``dest``'s own directory, then linked
/// under its name: a file appears whole or not at all, as with temp + rename, but
/// with no entry created and removed in the shared tmp dir and no rename across
/// directories (which takes the filesystem-wide rename lock): two threads that
/// place small files contend on nothing but the destination directory. A run
/// killed mid-write leaves nothing behind: an unnamed file goes with its descriptor.
fn write_unnamed(dest: &str, body: &Body, way: &AtomicU8) -> io::Result<()> {
    let dir = match std::path::Path::new(dest).parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    };
    let mut f = OpenOptions::new().write(true).custom_flags(libc::O_TMPFILE).mode(FILE_MODE).open(dir)?;
    body.write_to(&mut f)?;
    let to = CString::new(dest).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    match link(&f, &to, way) {
        // What rename replaces (a resumed run's stale file; a stale directory where the bucket now has a file, as place does).
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
            match fs::symlink_metadata(dest) {
                Ok(m) if m.is_dir() => fs::remove_dir_all(dest)?,
                _ => fs::remove_file(dest)?,
            }
            link(&f, &to, way)
        }
        other => other,
    }
}

/// Shared.link: how unnamed files are linked. LINK_UNKNOWN until the first link says, then
/// LINK_EMPTY_PATH or LINK_PROC (also where the copier was told to use /proc only).
pub const LINK_UNKNOWN: u8 = 0;
const LINK_EMPTY_PATH: u8 = 1;
pub const LINK_PROC: u8 = 2;

/// Link the unnamed file ``f`` as ``to``. Since Linux 6.10 the file's opener may link it by its
/// descriptor (AT_EMPTY_PATH); before, that needs CAP_DAC_READ_SEARCH, which the stager has not
/// (ENOENT), and the /proc/self/fd link, which costs a walk of four path components through
/// procfs per file, is the way. The first link finds out which one works; the others go straight to it.
fn link(f: &fs::File, to: &CStr, way_seen: &AtomicU8) -> io::Result<()> {
    let way = way_seen.load(Ordering::Relaxed);
    if way == LINK_PROC {
        return link_proc(f, to);
    }
    // SAFETY: a live descriptor and two NUL-terminated paths.
    let r = unsafe { libc::linkat(f.as_raw_fd(), c"".as_ptr(), libc::AT_FDCWD, to.as_ptr(), libc::AT_EMPTY_PATH) };
    if r == 0 {
        way_seen.store(LINK_EMPTY_PATH, Ordering::Relaxed);
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if way == LINK_EMPTY_PATH || !matches!(e.raw_os_error(), Some(libc::ENOENT | libc::EPERM | libc::EINVAL)) {
        return Err(e);
    }
    // Refused, or the destination's directory is missing: /proc tells the two apart.
    let proc = link_proc(f, to);
    if proc.is_ok() {
        way_seen.store(LINK_PROC, Ordering::Relaxed);
    }
    proc
}

fn link_proc(f: &fs::File, to: &CStr) -> io::Result<()> {
    // linkat(AT_EMPTY_PATH) needs CAP_DAC_READ_SEARCH on older kernels; the /proc link does not.
    let from = CString::new(format!("/proc/self/fd/{}", f.as_raw_fd())).expect("no NUL in a number");
    // SAFETY: two live NUL-terminated paths.
    let r = unsafe { libc::linkat(libc::AT_FDCWD, from.as_ptr(), libc::AT_FDCWD, to.as_ptr(), libc::AT_SYMLINK_FOLLOW) };
    if r == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

fn write_new(tmp: &str, body: &Body) -> io::Result<()> {
    // O_EXCL: never write through a file (or symlink) someone left there.
    let mut f = OpenOptions::new().write(true).create_new(true).mode(FILE_MODE).open(tmp)?;
    body.write_to(&mut f)
}

/// tree.LocalTree.place: rename into place; a stale directory where the bucket
/// now has a file is removed first (remove_dir_all never follows symlinks).
pub fn place(tmp: &str, dest: &str) -> io::Result<()> {
    match fs::rename(tmp, dest) {
        Err(e) if e.raw_os_error() == Some(libc::EISDIR) => {
            fs::remove_dir_all(dest)?;
            fs::rename(tmp, dest)
        }
        other => other,
    }
}

/// A number in [0, 1) for backoff jitter; no RNG crate needed for this.
pub fn jitter() -> f64 {
    static STATE: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1);
    let mut x = STATE.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed) ^ nanos;
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    (x >> 11) as f64 / (1u64 << 53) as f64
}
