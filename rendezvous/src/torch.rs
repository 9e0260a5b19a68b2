//! A client of PyTorch's `TCPStore`, the store torchrun's agent serves on
//! `MASTER_ADDR:MASTER_PORT` for its workers
//! (`TORCHELASTIC_USE_AGENT_STORE=True`), so ranks torchrun started can
//! exchange what they must agree on (the NCCL unique id) through it.
//!
//! Only what that needs: `set` and a waiting `get`, in TCPStore's binary
//! protocol (`torch/csrc/distributed/c10d/TCPStoreBackend.hpp`): a one-byte
//! query type, then little-endian `u64`-length-prefixed keys and values;
//! the connection starts with `VALIDATE` and the magic number. Keys carry
//! TCPStore's own `/` prefix, so Python's `store.get("k")` sees our `k`.

use crate::{connect_retrying, StoreError};
use std::{
    io::{self, Read, Write},
    net::TcpStream,
    time::Duration,
};

/// TCPStore's `QueryType`s this client sends (the first byte of a request).
#[repr(u8)]
#[derive(Clone, Copy)]
enum Query {
    Validate = 0,
    Set = 1,
    Get = 3,
    Wait = 6,
}

/// The number a `VALIDATE` request carries.
const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;
/// TCPStore's `WaitResponseType::STOP_WAITING`.
const STOP_WAITING: u8 = 0;
/// TCPStore's `keyPrefix_`.
const KEY_PREFIX: &str = "/";

/// A connection to a PyTorch `TCPStore`.
pub struct TorchStoreClient {
    addr: String,
    stream: TcpStream,
}

fn put_bytes(buf: &mut Vec<u8>, bytes: &[u8]) {
    buf.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    buf.extend_from_slice(bytes);
}

impl TorchStoreClient {
    /// Connects to the TCPStore at `addr` (`host:port`), retrying until
    /// `wait` has passed, and validates the connection.
    pub fn connect(addr: &str, wait: Duration) -> Result<TorchStoreClient, StoreError> {
        let stream = connect_retrying(addr, wait)?;
        let _ = stream.set_nodelay(true);
        let mut client = TorchStoreClient {
            addr: addr.to_owned(),
            stream,
        };
        let mut buf = vec![Query::Validate as u8];
        buf.extend_from_slice(&VALIDATION_MAGIC.to_le_bytes());
        client.send(&buf)?;
        Ok(client)
    }

    fn io(&self, source: io::Error) -> StoreError {
        StoreError::Io {
            addr: self.addr.clone(),
            source,
        }
    }

    fn send(&mut self, bytes: &[u8]) -> Result<(), StoreError> {
        self.stream.write_all(bytes).map_err(|e| self.io(e))
    }

    /// Sets `key` to `value`.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let mut buf = vec![Query::Set as u8];
        put_bytes(&mut buf, format!("{KEY_PREFIX}{key}").as_bytes());
        put_bytes(&mut buf, value);
        self.send(&buf)
    }

    /// The value of `key`, waiting up to `timeout` for it to be set.
    pub fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        let full = format!("{KEY_PREFIX}{key}");
        let mut buf = vec![Query::Wait as u8];
        buf.extend_from_slice(&1u64.to_le_bytes());
        put_bytes(&mut buf, full.as_bytes());
        self.send(&buf)?;
        self.stream
            .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))
            .map_err(|e| self.io(e))?;
        let mut reply = [0u8; 1];
        let read = self.stream.read_exact(&mut reply);
        let _ = self.stream.set_read_timeout(None);
        match read {
            Ok(()) if reply[0] == STOP_WAITING => {}
            Ok(()) => return Err(StoreError::Protocol(format!("wait reply {}", reply[0]))),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                // The wait is still registered with the server; this
                // connection cannot be used again.
                let _ = self.stream.shutdown(std::net::Shutdown::Both);
                return Err(StoreError::Timeout(key.to_owned()));
            }
            Err(e) => return Err(self.io(e)),
        }
        let mut buf = vec![Query::Get as u8];
        put_bytes(&mut buf, full.as_bytes());
        self.send(&buf)?;
        let mut len = [0u8; 8];
        self.stream.read_exact(&mut len).map_err(|e| self.io(e))?;
        let len = u64::from_le_bytes(len) as usize;
        if len > crate::MAX_VALUE_LEN {
            return Err(StoreError::Protocol(format!("value of {len} bytes")));
        }
        let mut value = vec![0; len];
        self.stream.read_exact(&mut value).map_err(|e| self.io(e))?;
        Ok(value)
    }
}
