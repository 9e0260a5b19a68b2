//! TFRecord framing: how an event file stores its records.
//!
//! Each record is
//!
//! ```text
//! u64  length of data, little-endian
//! u32  masked CRC-32C of those 8 bytes, little-endian
//! [u8] data (a serialized `Event`)
//! u32  masked CRC-32C of data, little-endian
//! ```
//!
//! with `mask(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8` (wrapping).

/// The constant TFRecord adds to a rotated CRC.
const MASK_DELTA: u32 = 0xa282_ead8;

/// TFRecord's masked CRC-32C (Castagnoli) of `data`.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(MASK_DELTA)
}

/// `data` framed as one TFRecord (header, data, footer) in one buffer, so a
/// writer can hand the whole record to the file at once.
pub fn frame(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    // Expected values from `tensorboard.compat.tensorflow_stub.
    // pywrap_tensorflow.{crc32c, masked_crc32c}` (TensorBoard 2.21.0).
    #[test]
    fn crc32c_and_mask_match_tensorboard() {
        assert_eq!(crc32c::crc32c(b""), 0);
        assert_eq!(crc32c::crc32c(b"a"), 0xc1d0_4330);
        // The CRC-32C check value.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(masked_crc32c(b""), 0xa282_ead8);
        assert_eq!(masked_crc32c(b"a"), 0x28e4_6e78);
        assert_eq!(masked_crc32c(b"123456789"), 0xc78a_b0e5);
        assert_eq!(masked_crc32c(&24u64.to_le_bytes()), 0x224b_7fa3);
    }

    #[test]
    #[allow(clippy::manual_rotate)] // spelled as the TFRecord docs spell it
    fn mask_is_the_documented_formula() {
        for data in [&b""[..], b"a", b"hello", &[0xff; 40]] {
            let crc = crc32c::crc32c(data);
            let by_formula = ((crc >> 15) | (crc << 17)).wrapping_add(0xa282_ead8);
            assert_eq!(masked_crc32c(data), by_formula);
        }
    }

    #[test]
    fn frame_matches_tensorboards_record_writer() {
        // `tensorboard.summary.writer.record_writer.RecordWriter(f).write(b"hello")`
        let expected = "0500000000000000eab2043e68656c6c6fbb1f1c19";
        assert_eq!(hex(&frame(b"hello")), expected);
    }

    #[test]
    fn frame_layout() {
        let data = vec![7u8; 300];
        let rec = frame(&data);
        assert_eq!(rec.len(), 8 + 4 + 300 + 4);
        assert_eq!(u64::from_le_bytes(rec[..8].try_into().unwrap()), 300);
        let len_crc = u32::from_le_bytes(rec[8..12].try_into().unwrap());
        assert_eq!(len_crc, masked_crc32c(&rec[..8]));
        assert_eq!(&rec[12..312], &data[..]);
        let data_crc = u32::from_le_bytes(rec[312..].try_into().unwrap());
        assert_eq!(data_crc, masked_crc32c(&data));
        // An empty record is legal too.
        assert_eq!(frame(b"").len(), 16);
    }

    pub(crate) fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }
}
