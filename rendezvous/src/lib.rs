//! # accel-rendezvous
//!
//! The key-value store `accel launch` hosts on `main_process_port` of
//! machine 0 (torchrun's c10d store, in spirit). Launchers on the other
//! machines join through it before starting their ranks, ranks exchange
//! what they must agree on through it (the NCCL unique id, PJRT's key-value
//! pairs), and a failure on one machine is announced through it.
//!
//! The protocol is line-based over TCP, one request and one reply at a time:
//!
//! | request | reply |
//! | --- | --- |
//! | `SET <key> <len>\n<len bytes>` | `OK\n` |
//! | `GET <key> <timeout_ms>\n` (waits until the key is set) | `VAL <len>\n<len bytes>` or `TIMEOUT\n` |
//! | `TRY <key>\n` (does not wait) | `VAL <len>\n<bytes>` or `NONE\n` |
//! | `ADD <key> <delta>\n` (integer counter, created at 0) | `INT <value>\n` |
//!
//! Keys are non-empty and contain no whitespace.
//!
//! ```
//! use accel_rendezvous::{Client, Server};
//! use std::time::Duration;
//! let server = Server::bind("127.0.0.1:0").unwrap();
//! let addr = server.local_addr();
//! let mut a = Client::connect(&addr.to_string(), Duration::from_secs(5)).unwrap();
//! let mut b = Client::connect(&addr.to_string(), Duration::from_secs(5)).unwrap();
//! a.set("nccl/id", b"\x01\x02").unwrap();
//! assert_eq!(b.get("nccl/id", Duration::from_secs(1)).unwrap(), b"\x01\x02");
//! assert_eq!(a.add("joined", 1).unwrap(), 1);
//! assert_eq!(b.add("joined", 1).unwrap(), 2);
//! ```

pub mod torch;

use std::{
    collections::HashMap,
    io::{self, BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs},
    sync::{Arc, Condvar, Mutex},
    thread,
    time::{Duration, Instant},
};

/// Largest value accepted, so a bad peer cannot make the store allocate
/// without bound.
pub const MAX_VALUE_LEN: usize = 64 << 20;

/// Errors of the store client.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The connection failed.
    #[error("rendezvous store {addr}: {source}")]
    Io {
        /// The store address.
        addr: String,
        /// The cause.
        source: io::Error,
    },
    /// The store could not be reached before the deadline.
    #[error("rendezvous store {addr} not reachable within {secs} s: {last}")]
    Unreachable {
        /// The store address.
        addr: String,
        /// How long we tried.
        secs: u64,
        /// The last connection error.
        last: String,
    },
    /// A key was not set in time.
    #[error("rendezvous store: key `{0}` was not set in time")]
    Timeout(String),
    /// The peer spoke something else.
    #[error("rendezvous store: bad reply `{0}`")]
    Protocol(String),
    /// A key is empty or contains whitespace.
    #[error("rendezvous store: invalid key `{0}` (non-empty, no whitespace)")]
    BadKey(String),
}

#[derive(Default)]
struct State {
    values: HashMap<String, Vec<u8>>,
}

/// The store, serving every connection on its own thread until the process ends.
pub struct Server {
    addr: SocketAddr,
}

impl Server {
    /// Binds `addr` (port 0 picks a free port) and starts serving.
    pub fn bind(addr: impl ToSocketAddrs) -> io::Result<Server> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new((Mutex::new(State::default()), Condvar::new()));
        thread::Builder::new()
            .name("rendezvous-accept".into())
            .spawn(move || {
                for stream in listener.incoming().flatten() {
                    let shared = Arc::clone(&shared);
                    let _ =
                        thread::Builder::new()
                            .name("rendezvous-conn".into())
                            .spawn(move || {
                                let _ = serve(stream, &shared);
                            });
                }
            })?;
        Ok(Server { addr })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

type Shared = (Mutex<State>, Condvar);

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn reply_value(out: &mut TcpStream, v: &[u8]) -> io::Result<()> {
    out.write_all(format!("VAL {}\n", v.len()).as_bytes())?;
    out.write_all(v)
}

fn serve(stream: TcpStream, shared: &Shared) -> io::Result<()> {
    let mut out = stream.try_clone()?;
    let mut input = BufReader::new(stream);
    let (state, cond) = shared;
    let mut line = String::new();
    loop {
        line.clear();
        if input.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let parts: Vec<&str> = line.split_whitespace().collect();
        match parts.as_slice() {
            ["SET", key, len] => {
                let len: usize = len.parse().unwrap_or(usize::MAX);
                if len > MAX_VALUE_LEN {
                    out.write_all(b"ERR too large\n")?;
                    return Ok(());
                }
                let mut value = vec![0; len];
                input.read_exact(&mut value)?;
                lock(state).values.insert((*key).to_owned(), value);
                cond.notify_all();
                out.write_all(b"OK\n")?;
            }
            ["GET", key, timeout_ms] => {
                let deadline =
                    Instant::now() + Duration::from_millis(timeout_ms.parse().unwrap_or(0));
                let mut guard = lock(state);
                loop {
                    if let Some(v) = guard.values.get(*key) {
                        let v = v.clone();
                        drop(guard);
                        reply_value(&mut out, &v)?;
                        break;
                    }
                    let now = Instant::now();
                    if now >= deadline {
                        drop(guard);
                        out.write_all(b"TIMEOUT\n")?;
                        break;
                    }
                    guard = cond
                        .wait_timeout(guard, deadline - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
            ["TRY", key] => {
                let v = lock(state).values.get(*key).cloned();
                match v {
                    Some(v) => reply_value(&mut out, &v)?,
                    None => out.write_all(b"NONE\n")?,
                }
            }
            ["ADD", key, delta] => {
                let delta: i64 = delta.parse().unwrap_or(0);
                let mut guard = lock(state);
                let current = guard
                    .values
                    .get(*key)
                    .and_then(|v| std::str::from_utf8(v).ok()?.parse::<i64>().ok())
                    .unwrap_or(0);
                let next = current + delta;
                guard
                    .values
                    .insert((*key).to_owned(), next.to_string().into_bytes());
                drop(guard);
                cond.notify_all();
                out.write_all(format!("INT {next}\n").as_bytes())?;
            }
            _ => {
                out.write_all(b"ERR bad request\n")?;
                return Ok(());
            }
        }
    }
}

/// A connection to the store.
pub struct Client {
    addr: String,
    out: TcpStream,
    input: BufReader<TcpStream>,
}

fn check_key(key: &str) -> Result<(), StoreError> {
    if key.is_empty() || key.contains(char::is_whitespace) {
        Err(StoreError::BadKey(key.to_owned()))
    } else {
        Ok(())
    }
}

/// A TCP connection to `addr`, retried every 100 ms until `wait` has
/// passed (the other side may start later than this one).
pub(crate) fn connect_retrying(addr: &str, wait: Duration) -> Result<TcpStream, StoreError> {
    let deadline = Instant::now() + wait;
    loop {
        match TcpStream::connect(addr) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => {
                return Err(StoreError::Unreachable {
                    addr: addr.to_owned(),
                    secs: wait.as_secs(),
                    last: e.to_string(),
                })
            }
            Err(_) => thread::sleep(Duration::from_millis(100)),
        }
    }
}

impl Client {
    /// Connects to `addr` (`host:port`), retrying until `wait` has passed
    /// (machine 0 may start later than this one).
    pub fn connect(addr: &str, wait: Duration) -> Result<Client, StoreError> {
        let stream = connect_retrying(addr, wait)?;
        let _ = stream.set_nodelay(true);
        let input = BufReader::new(stream.try_clone().map_err(|source| StoreError::Io {
            addr: addr.to_owned(),
            source,
        })?);
        Ok(Client {
            addr: addr.to_owned(),
            out: stream,
            input,
        })
    }

    fn io(&self, source: io::Error) -> StoreError {
        StoreError::Io {
            addr: self.addr.clone(),
            source,
        }
    }

    fn read_reply(&mut self) -> Result<String, StoreError> {
        let mut line = String::new();
        let n = self.input.read_line(&mut line).map_err(|e| self.io(e))?;
        if n == 0 {
            return Err(self.io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed",
            )));
        }
        Ok(line.trim_end().to_owned())
    }

    fn read_value(&mut self, reply: &str) -> Result<Vec<u8>, StoreError> {
        let len: usize = reply
            .strip_prefix("VAL ")
            .and_then(|n| n.parse().ok())
            .filter(|n| *n <= MAX_VALUE_LEN)
            .ok_or_else(|| StoreError::Protocol(reply.to_owned()))?;
        let mut value = vec![0; len];
        self.input.read_exact(&mut value).map_err(|e| self.io(e))?;
        Ok(value)
    }

    fn send(&mut self, bytes: &[u8]) -> Result<(), StoreError> {
        self.out.write_all(bytes).map_err(|e| self.io(e))
    }

    /// Sets `key` to `value`, waking everyone waiting for it.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        check_key(key)?;
        self.send(format!("SET {key} {}\n", value.len()).as_bytes())?;
        self.send(value)?;
        match self.read_reply()?.as_str() {
            "OK" => Ok(()),
            other => Err(StoreError::Protocol(other.to_owned())),
        }
    }

    /// The value of `key`, waiting up to `timeout` for it to be set.
    pub fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        check_key(key)?;
        self.send(format!("GET {key} {}\n", timeout.as_millis()).as_bytes())?;
        let reply = self.read_reply()?;
        if reply == "TIMEOUT" {
            return Err(StoreError::Timeout(key.to_owned()));
        }
        self.read_value(&reply)
    }

    /// The value of `key` if it is set now.
    pub fn try_get(&mut self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        check_key(key)?;
        self.send(format!("TRY {key}\n").as_bytes())?;
        let reply = self.read_reply()?;
        if reply == "NONE" {
            return Ok(None);
        }
        self.read_value(&reply).map(Some)
    }

    /// Adds `delta` to the counter `key` and returns the new value.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64, StoreError> {
        check_key(key)?;
        self.send(format!("ADD {key} {delta}\n").as_bytes())?;
        let reply = self.read_reply()?;
        reply
            .strip_prefix("INT ")
            .and_then(|n| n.parse().ok())
            .ok_or(StoreError::Protocol(reply))
    }

    /// Waits until `n` parties have called `barrier(key, n)`.
    pub fn barrier(&mut self, key: &str, n: i64, timeout: Duration) -> Result<(), StoreError> {
        let arrived = self.add(&format!("{key}/arrived"), 1)?;
        let done = format!("{key}/done");
        if arrived == n {
            self.set(&done, b"1")?;
        }
        self.get(&done, timeout).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (Client, Client) {
        let server = Server::bind("127.0.0.1:0").unwrap();
        let addr = server.local_addr().to_string();
        (
            Client::connect(&addr, Duration::from_secs(5)).unwrap(),
            Client::connect(&addr, Duration::from_secs(5)).unwrap(),
        )
    }

    #[test]
    fn get_waits_for_a_later_set() {
        let (mut a, mut b) = pair();
        let waiter = thread::spawn(move || b.get("late", Duration::from_secs(10)).unwrap());
        thread::sleep(Duration::from_millis(100));
        a.set("late", b"value with\nnewline").unwrap();
        assert_eq!(waiter.join().unwrap(), b"value with\nnewline");
    }

    #[test]
    fn get_times_out_and_try_does_not_wait() {
        let (mut a, _) = pair();
        assert!(matches!(
            a.get("never", Duration::from_millis(50)),
            Err(StoreError::Timeout(k)) if k == "never"
        ));
        assert_eq!(a.try_get("never").unwrap(), None);
        a.set("now", b"").unwrap();
        assert_eq!(a.try_get("now").unwrap(), Some(Vec::new()));
    }

    #[test]
    fn barrier_releases_everyone_together() {
        let server = Server::bind("127.0.0.1:0").unwrap();
        let addr = server.local_addr().to_string();
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let addr = addr.clone();
                thread::spawn(move || {
                    let mut c = Client::connect(&addr, Duration::from_secs(5)).unwrap();
                    c.barrier("start", 4, Duration::from_secs(10)).unwrap();
                    c.add("after", 1).unwrap()
                })
            })
            .collect();
        let mut seen: Vec<i64> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        seen.sort();
        assert_eq!(seen, [1, 2, 3, 4]);
    }

    #[test]
    fn bad_keys_and_unreachable_stores_are_errors() {
        let (mut a, _) = pair();
        assert!(matches!(
            a.set("has space", b"x"),
            Err(StoreError::BadKey(_))
        ));
        let free = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let err = Client::connect(&free.to_string(), Duration::from_millis(200))
            .err()
            .unwrap();
        assert!(err.to_string().contains("not reachable within"), "{err}");
    }
}
