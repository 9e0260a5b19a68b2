//! W&B's `.wandb` transaction log: a LevelDB-style record log with W&B's
//! own file header.
//!
//! ```text
//! file   := header block*
//! header := ":W&B" magic:u16le=0xBEE1 version:u8=0      (7 bytes, part of block 0)
//! block  := chunk* zero-padding                          (32 KiB; the last may be short)
//! chunk  := crc:u32le len:u16le type:u8 data[len]
//! type   := FULL=1 | FIRST=2 | MIDDLE=3 | LAST=4
//! crc    := CRC-32 (IEEE, as zlib.crc32; not CRC-32C, not masked) of type ++ data
//! ```
//!
//! A record (one serialized `wandb_internal.Record`) that does not fit in
//! what is left of a block is split into FIRST, MIDDLE..., LAST chunks; a
//! block with fewer than 7 bytes left is padded with zeros. This is what
//! wandb-core's store writes (`leveldb.NewWriterExt(f, CRCAlgoIEEE,
//! wandbStoreVersion=0)`) and what its reader, `wandb sync` and
//! `wandb leet inspect` expect.

use std::io::{self, Write};

/// The 4-byte identifier at the start of every `.wandb` file.
pub const IDENT: &[u8; 4] = b":W&B";
/// The magic number after it (little-endian on disk).
pub const MAGIC: u16 = 0xBEE1;
/// The store version wandb 0.31 writes and reads.
pub const VERSION: u8 = 0;
/// Length of the file header.
pub const FILE_HEADER_LEN: usize = 7;
/// Block size.
pub const BLOCK_LEN: usize = 32 * 1024;
/// Chunk header length.
pub const CHUNK_HEADER_LEN: usize = 7;

const FULL: u8 = 1;
const FIRST: u8 = 2;
const MIDDLE: u8 = 3;
const LAST: u8 = 4;

/// The checksum of a chunk: CRC-32 (IEEE) of its type byte and its data.
pub fn chunk_crc(chunk_type: u8, data: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&[chunk_type]);
    h.update(data);
    h.finalize()
}

/// Writes records to a `.wandb` log.
pub struct Writer<W: Write> {
    out: W,
    /// Offset within the current block.
    block_offset: usize,
}

impl<W: Write> Writer<W> {
    /// Writes the file header and returns a writer positioned after it.
    pub fn new(mut out: W) -> io::Result<Self> {
        let mut header = [0u8; FILE_HEADER_LEN];
        header[..4].copy_from_slice(IDENT);
        header[4..6].copy_from_slice(&MAGIC.to_le_bytes());
        header[6] = VERSION;
        out.write_all(&header)?;
        Ok(Self {
            out,
            block_offset: FILE_HEADER_LEN,
        })
    }

    /// Appends one record.
    pub fn write_record(&mut self, data: &[u8]) -> io::Result<()> {
        let mut rest = data;
        let mut first = true;
        loop {
            let left = BLOCK_LEN - self.block_offset;
            if left < CHUNK_HEADER_LEN {
                self.out.write_all(&[0u8; CHUNK_HEADER_LEN][..left])?;
                self.block_offset = 0;
                continue;
            }
            let n = rest.len().min(left - CHUNK_HEADER_LEN);
            let last = n == rest.len();
            let chunk_type = match (first, last) {
                (true, true) => FULL,
                (true, false) => FIRST,
                (false, false) => MIDDLE,
                (false, true) => LAST,
            };
            let (chunk, tail) = rest.split_at(n);
            let mut header = [0u8; CHUNK_HEADER_LEN];
            header[..4].copy_from_slice(&chunk_crc(chunk_type, chunk).to_le_bytes());
            // n <= BLOCK_LEN - 7, so it fits a u16.
            header[4..6].copy_from_slice(&(n as u16).to_le_bytes());
            header[6] = chunk_type;
            self.out.write_all(&header)?;
            self.out.write_all(chunk)?;
            self.block_offset += CHUNK_HEADER_LEN + n;
            rest = tail;
            first = false;
            if last {
                return Ok(());
            }
        }
    }

    /// Flushes the underlying writer.
    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }

    /// The underlying writer.
    pub fn get_mut(&mut self) -> &mut W {
        &mut self.out
    }
}

/// Reads every record of a `.wandb` log (the tests' check of the writer,
/// independent of W&B's tools).
#[cfg(test)]
pub fn read_records(bytes: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    if bytes.len() < FILE_HEADER_LEN
        || &bytes[..4] != IDENT
        || bytes[4..6] != MAGIC.to_le_bytes()
        || bytes[6] != VERSION
    {
        return Err("bad file header".into());
    }
    let mut records = Vec::new();
    let mut pending: Option<Vec<u8>> = None;
    let mut pos = FILE_HEADER_LEN;
    while pos < bytes.len() {
        let left = BLOCK_LEN - pos % BLOCK_LEN;
        if left < CHUNK_HEADER_LEN {
            if bytes[pos..(pos + left).min(bytes.len())]
                .iter()
                .any(|&b| b != 0)
            {
                return Err(format!("non-zero block trailer at {pos}"));
            }
            pos += left;
            continue;
        }
        if pos + CHUNK_HEADER_LEN > bytes.len() {
            return Err(format!("truncated chunk header at {pos}"));
        }
        let crc = u32::from_le_bytes(bytes[pos..pos + 4].try_into().unwrap());
        let len = u16::from_le_bytes([bytes[pos + 4], bytes[pos + 5]]) as usize;
        let chunk_type = bytes[pos + 6];
        let start = pos + CHUNK_HEADER_LEN;
        if len > left - CHUNK_HEADER_LEN || start + len > bytes.len() {
            return Err(format!("chunk at {pos} overflows"));
        }
        let data = &bytes[start..start + len];
        if chunk_crc(chunk_type, data) != crc {
            return Err(format!("checksum mismatch at {pos}"));
        }
        match (chunk_type, pending.as_mut()) {
            (FULL, None) => records.push(data.to_vec()),
            (FIRST, None) => pending = Some(data.to_vec()),
            (MIDDLE, Some(p)) => p.extend_from_slice(data),
            (LAST, Some(p)) => {
                p.extend_from_slice(data);
                records.push(pending.take().unwrap());
            }
            (t, _) => return Err(format!("unexpected chunk type {t} at {pos}")),
        }
        pos = start + len;
    }
    if pending.is_some() {
        return Err("log ends inside a record".into());
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_and_one_full_chunk() {
        let mut w = Writer::new(Vec::new()).unwrap();
        w.write_record(b"abc").unwrap();
        let bytes = w.out;
        assert_eq!(&bytes[..7], b":W&B\xe1\xbe\x00");
        assert_eq!(
            &bytes[7..11],
            &crc32fast::hash(&[1, b'a', b'b', b'c']).to_le_bytes()
        );
        assert_eq!(&bytes[11..14], &[3, 0, FULL]);
        assert_eq!(&bytes[14..], b"abc");
        assert_eq!(read_records(&bytes).unwrap(), vec![b"abc".to_vec()]);
    }

    #[test]
    fn crc_is_plain_ieee_crc32() {
        // zlib.crc32(b"123456789") == 0xCBF43926, the IEEE check value.
        assert_eq!(crc32fast::hash(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn records_span_blocks_and_trailers_are_zeroed() {
        let mut w = Writer::new(Vec::new()).unwrap();
        let mut expected = Vec::new();
        // Sizes chosen to hit: a record ending exactly 7 bytes before a block
        // end (zero-length FIRST chunk), < 7 bytes left (padding), and
        // records longer than a block (MIDDLE chunks).
        let first = BLOCK_LEN - FILE_HEADER_LEN - CHUNK_HEADER_LEN - CHUNK_HEADER_LEN;
        for (i, len) in [first, 10, BLOCK_LEN - 7 - 17 - 3, 100_000, 5, 70_000, 1]
            .into_iter()
            .enumerate()
        {
            let rec: Vec<u8> = (0..len).map(|j| (i * 31 + j) as u8).collect();
            w.write_record(&rec).unwrap();
            expected.push(rec);
        }
        let bytes = w.out;
        assert_eq!(read_records(&bytes).unwrap(), expected);
    }
}
