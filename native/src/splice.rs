//! A ranged GET from a plain-HTTP endpoint written with splice(2): socket -> pipe -> file,
//! the bytes never copied into user space (rawhttp.py does the same in Python).
//!
//! In-cluster object stores (MinIO, Ceph RGW) are often plain HTTP; there the
//! streaming path (large.rs: hyper reads into user-space buffers, pwritev copies
//! them into the page cache) costs a copy per byte that this one does not. The
//! request is a presigned URL (object_store signs it with the store's own
//! credentials, once per object), sent on its own connection, blocking, on one
//! of tokio's blocking threads: a part is a long sequential read, and each
//! splice call moves up to PIPE_BYTES.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

use crate::copy::Failure;

const PIPE_BYTES: usize = 1 << 20;
const HEAD_LIMIT: usize = 64 << 10;

/// The parts of a presigned URL a request needs.
pub struct Target {
    pub host: String,
    pub port: u16,
    /// Path and query, as signed.
    pub path: String,
    /// ``host`` resolved once for the object's parts (large.rs), tried in order. Not once per
    /// part: in a pod, a service name under ndots:5 costs several DNS queries per lookup.
    /// Empty (that lookup failed): each part resolves for itself.
    pub addrs: Vec<SocketAddr>,
}

/// ``host``'s addresses, for Target.addrs.
pub fn resolve(host: &str, port: u16) -> Result<Vec<SocketAddr>, Failure> {
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| generic(format!("resolving {host}:{port}: {e}")))?
        .collect();
    if addrs.is_empty() {
        return Err(generic(format!("{host} resolves to no address")));
    }
    Ok(addrs)
}

fn generic(message: String) -> Failure {
    Failure::Store { kind: "generic", message }
}

/// A status other than 206, as fetch.Fetcher._splice_part maps it: 5xx, 429 and a
/// misframed 206 are tried again ("generic"); other statuses are final.
fn status_failure(status: u16, detail: &str) -> Failure {
    let message = format!("HTTP {status}: {detail}");
    match status {
        404 => Failure::Store { kind: "gone", message },
        401 | 403 => Failure::Store { kind: "permission", message },
        412 => Failure::Store { kind: "precondition", message },
        s if s >= 500 || s == 429 || s == 206 => generic(message),
        _ => Failure::Store { kind: "http", message },
    }
}

/// Bytes [start, end) of ``target`` into ``fd`` at the same offsets.
pub fn get_range_into(target: &Target, fd: RawFd, etag: &str, start: u64, end: u64, timeout: Duration) -> Result<(), Failure> {
    let peer = |e: io::Error, what: &str| generic(format!("{what} {}:{}: {e}", target.host, target.port));
    let resolved;
    let addrs = if target.addrs.is_empty() {
        resolved = resolve(&target.host, target.port)?;
        &resolved
    } else {
        &target.addrs
    };
    let mut sock = connect(addrs, timeout).map_err(|e| peer(e, "connecting to"))?;
    // SO_RCVTIMEO also bounds each splice from the socket.
    sock.set_read_timeout(Some(timeout)).map_err(|e| peer(e, "configuring"))?;
    sock.set_write_timeout(Some(timeout)).map_err(|e| peer(e, "configuring"))?;
    let host = if target.port == 80 { target.host.clone() } else { format!("{}:{}", target.host, target.port) };
    let mut request = format!(
        "GET {} HTTP/1.1\r\nHost: {host}\r\nRange: bytes={start}-{}\r\nConnection: close\r\n",
        target.path,
        end - 1
    );
    if !etag.is_empty() {
        request.push_str(&format!("If-Match: \"{etag}\"\r\n"));
    }
    request.push_str("\r\n");
    sock.write_all(request.as_bytes()).map_err(|e| peer(e, "sending to"))?;

    let (head, body) = read_head(&mut sock).map_err(|e| peer(e, "reading the answer of"))?;
    let (status, length, chunked) = parse_head(&head)?;
    if status != 206 {
        let detail = String::from_utf8_lossy(if body.is_empty() { &head } else { &body });
        return Err(status_failure(status, &detail.chars().take(300).collect::<String>()));
    }
    if chunked || length != Some(end - start) {
        return Err(status_failure(206, &format!("unexpected framing (chunked {chunked}, length {length:?}) for {} bytes", end - start)));
    }
    if body.len() as u64 > end - start {
        return Err(generic(format!("the answer runs past bytes {start}-{end}")));
    }
    let mut offset = start;
    if !body.is_empty() {
        pwrite_all(fd, &body, offset).map_err(os)?;
        offset += body.len() as u64;
    }
    splice_body(sock.as_raw_fd(), fd, offset, end)
}

/// The first of ``addrs`` that accepts a connection (the last error otherwise), as std's
/// TcpStream::connect tries a name's addresses.
fn connect(addrs: &[SocketAddr], timeout: Duration) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::InvalidInput, "no address to connect to");
    for addr in addrs {
        match TcpStream::connect_timeout(addr, timeout) {
            Ok(sock) => return Ok(sock),
            Err(e) => last = e,
        }
    }
    Err(last)
}

fn os(e: io::Error) -> Failure {
    Failure::Os { errno: e.raw_os_error().unwrap_or(libc::EIO), message: format!("writing a part: {e}") }
}

fn read_head(sock: &mut TcpStream) -> io::Result<(Vec<u8>, Vec<u8>)> {
    let mut buf = Vec::with_capacity(16 << 10);
    let mut chunk = [0u8; 16 << 10];
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let body = buf.split_off(i + 4);
            buf.truncate(i);
            return Ok((buf, body));
        }
        if buf.len() > HEAD_LIMIT {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "response head too long"));
        }
        let n = sock.read(&mut chunk)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed before the response head"));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// (status, Content-Length, chunked)
fn parse_head(head: &[u8]) -> Result<(u16, Option<u64>, bool), Failure> {
    let text = String::from_utf8_lossy(head);
    let mut lines = text.split("\r\n");
    let first = lines.next().unwrap_or_default();
    let status = first
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| generic(format!("bad status line {first:?}")))?;
    let (mut length, mut chunked) = (None, false);
    for line in lines {
        let Some((name, value)) = line.split_once(':') else { continue };
        let (name, value) = (name.trim().to_ascii_lowercase(), value.trim().to_ascii_lowercase());
        if name == "content-length" {
            length = value.parse().ok();
        } else if name == "transfer-encoding" && value != "identity" {
            chunked = true;
        }
    }
    Ok((status, length, chunked))
}

fn pwrite_all(fd: RawFd, mut data: &[u8], mut offset: u64) -> io::Result<()> {
    while !data.is_empty() {
        // SAFETY: data is a live slice for the call's duration.
        let n = unsafe { libc::pwrite(fd, data.as_ptr() as *const libc::c_void, data.len(), offset as libc::off_t) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        data = &data[n as usize..];
        offset += n as u64;
    }
    Ok(())
}

fn splice_body(src: RawFd, dst: RawFd, mut offset: u64, end: u64) -> Result<(), Failure> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: fds has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(os(io::Error::last_os_error()));
    }
    // SAFETY: pipe2 just returned these two descriptors, owned by nothing else.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // Above /proc/sys/fs/pipe-max-size this fails; the default 64 KiB works too.
    let _ = unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_BYTES as libc::c_int) };
    while offset < end {
        let want = PIPE_BYTES.min((end - offset) as usize);
        // SAFETY: plain descriptors; null offsets (the socket and the pipe have none).
        let n = unsafe {
            libc::splice(src, std::ptr::null_mut(), w.as_raw_fd(), std::ptr::null_mut(), want, libc::SPLICE_F_MOVE)
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(generic(format!("reading the body: {e}")));
        }
        if n == 0 {
            return Err(generic(format!("short read: the connection closed {} bytes early", end - offset)));
        }
        let mut left = n as usize;
        while left > 0 {
            let mut off = offset as libc::loff_t;
            // SAFETY: off is a live loff_t the kernel advances; the pipe holds ``left`` bytes.
            let m = unsafe {
                libc::splice(r.as_raw_fd(), std::ptr::null_mut(), dst, &mut off, left, libc::SPLICE_F_MOVE)
            };
            if m < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(os(e));
            }
            if m == 0 {
                return Err(os(io::Error::new(io::ErrorKind::WriteZero, "splice into the file wrote nothing")));
            }
            left -= m as usize;
            offset += m as u64;
        }
    }
    Ok(())
}
