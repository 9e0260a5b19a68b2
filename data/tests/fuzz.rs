//! Fuzzing the file readers of accel-data (issue 20: "a fuzz test of the
//! safetensors readers: no panic"): [`SafetensorsDataset`], [`TokenFile`]
//! and [`JsonLines`] on random bytes and on valid files that were then
//! truncated or mutated (bytes flipped, the 8-byte header length and the
//! JSON header rewritten). Opening gives a dataset or an error naming the
//! file; `get(i)` of every valid index gives a sample or an error, never a
//! panic; files left intact read back exactly.
//!
//! The case counts add up to 32,000 per `cargo test` run; set
//! `ACCEL_FUZZ_SCALE=10` (a multiplier) to fuzz longer.

use accel_data::{
    DataError, Dataset, JsonLines, SafetensorsDataset, Sample, TokenDtype, TokenFile,
};
use accel_test_kit::safetensors::{join, mutate};
use accel_test_kit::{cases, CaseFile, Rng};
use proptest::prelude::*;
use serde_json::{json, Value};
use std::path::Path;
use tch::{Kind, Tensor};

/// A few indices of `0..len`: all of them when there are few, else the
/// first, the last and some in between.
fn indices(len: usize, r: &mut Rng) -> Vec<usize> {
    if len <= 64 {
        return (0..len).collect();
    }
    let mut v = vec![0, 1, len / 2, len - 2, len - 1];
    v.extend((0..16).map(|_| r.below(len)));
    v
}

/// An error names the file it is about.
fn check_error(e: &DataError, path: &Path) -> Result<(), TestCaseError> {
    let text = e.to_string();
    prop_assert!(!text.trim().is_empty());
    if matches!(e, DataError::Io { .. } | DataError::Format { .. }) {
        prop_assert!(
            text.starts_with(&path.display().to_string()),
            "{text:?} does not name {}",
            path.display()
        );
    }
    Ok(())
}

/// The raw bytes of a (contiguous CPU) tensor.
fn raw(t: &Tensor) -> Vec<u8> {
    let t = t.contiguous();
    let mut out = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
    t.copy_data_u8(&mut out, t.numel());
    out
}

// ---------------------------------------------------------------------------
// Safetensors

const KINDS: &[Kind] = &[
    Kind::Bool,
    Kind::Uint8,
    Kind::Int8,
    Kind::Int16,
    Kind::Int,
    Kind::Int64,
    Kind::Half,
    Kind::BFloat16,
    Kind::Float,
    Kind::Double,
];

/// A tensor written to a valid file: its name and the rows' raw bytes.
struct Written {
    name: String,
    tensor: Tensor,
}

/// Random named tensors of random kinds and shapes (usually sharing their
/// number of rows, as a dataset wants), with random contents (NaNs too).
fn random_tensors(r: &mut Rng) -> Vec<Written> {
    let n = r.below(5);
    let rows = r.pick(&[0i64, 1, 2, 3, 5, 8]);
    (0..n)
        .map(|i| {
            let kind = r.pick(KINDS);
            let shape: Vec<i64> = if r.chance(12) {
                vec![] // a scalar: not a dataset column
            } else {
                let rows = if r.chance(10) { rows + 1 } else { rows };
                let mut s = vec![rows];
                s.extend((0..r.below(3)).map(|_| r.pick(&[0i64, 1, 2, 3, 4])));
                s
            };
            let numel: i64 = shape.iter().product();
            let mut data = r.bytes(numel as usize * kind.elt_size_in_bytes());
            if kind == Kind::Bool {
                data.iter_mut().for_each(|b| *b &= 1);
            }
            let tensor = Tensor::from_data_size(&data, &shape, kind);
            let name = match r.below(6) {
                0 => format!("t{i}.ü🤗\u{202e}"),
                1 => format!("{i}"),
                2 => format!("layer.{i}.weight"),
                _ => format!("t{i}"),
            };
            Written { name, tensor }
        })
        .collect()
}

/// Opens `path` as a dataset and reads every valid index (a sample of them
/// for huge lengths): no panic, errors that name the file.
fn read_dataset(path: &Path, r: &mut Rng) -> Result<Option<SafetensorsDataset>, TestCaseError> {
    match SafetensorsDataset::open(path) {
        Err(e) => {
            check_error(&e, path)?;
            Ok(None)
        }
        Ok(ds) => {
            for i in indices(ds.len(), r) {
                if let Err(e) = ds.get(i) {
                    check_error(&e, path)?;
                }
            }
            prop_assert!(ds.get(ds.len()).is_err());
            Ok(Some(ds))
        }
    }
}

proptest! {
    #![proptest_config(cases(12_000))]

    /// Valid files, then 1 to 4 mutations: bytes flipped, truncated, header
    /// length set to edge values, the JSON header rewritten.
    #[test]
    fn safetensors_mutated_open_or_refuse(seed in any::<u64>(), edits in 0usize..5) {
        let r = &mut Rng(seed);
        let written = random_tensors(r);
        let file = CaseFile::new("data.safetensors");
        let path = file.path();
        let named: Vec<(&str, &Tensor)> =
            written.iter().map(|w| (w.name.as_str(), &w.tensor)).collect();
        Tensor::write_safetensors(&named, path).unwrap();
        if edits == 0 {
            // intact: reads back exactly, or is refused for a reason
            let ds = read_dataset(path, r)?;
            let dataset_like = written.iter().all(|w| w.tensor.dim() > 0)
                && written.windows(2).all(|p| p[0].tensor.size()[0] == p[1].tensor.size()[0]);
            prop_assert_eq!(ds.is_some(), dataset_like);
            if let Some(ds) = ds {
                let rows = written.first().map_or(0, |w| w.tensor.size()[0] as usize);
                prop_assert_eq!(ds.len(), rows);
                for i in 0..rows {
                    let sample: Sample = ds.get(i).unwrap();
                    for w in &written {
                        let got = &sample[w.name.as_str()];
                        let want = w.tensor.get(i as i64);
                        prop_assert_eq!(got.kind(), want.kind());
                        prop_assert_eq!(got.size(), want.size());
                        prop_assert_eq!(raw(got), raw(&want));
                    }
                }
            }
        } else {
            let mut bytes = std::fs::read(path).unwrap();
            for _ in 0..edits {
                mutate(&mut bytes, r);
            }
            std::fs::write(path, &bytes).unwrap();
            read_dataset(path, r)?;
        }
    }

}

proptest! {
    #![proptest_config(cases(4_000))]

    /// Random bytes, mostly behind a plausible header length.
    #[test]
    fn safetensors_random_bytes_refused(seed in any::<u64>(), len in 0usize..300) {
        let r = &mut Rng(seed);
        let mut bytes = r.bytes(len);
        if len >= 8 && r.chance(2) {
            let n = r.below(len - 7) as u64;
            bytes[..8].copy_from_slice(&n.to_le_bytes());
            if r.chance(2) && n >= 2 {
                bytes[8] = b'{';
                bytes[8 + n as usize - 1] = b'}';
            }
        }
        let file = CaseFile::new("random.safetensors");
        let path = file.path();
        std::fs::write(path, &bytes).unwrap();
        read_dataset(path, r)?;
    }
}

// ---------------------------------------------------------------------------
// Token files

proptest! {
    #![proptest_config(cases(8_000))]

    /// Random token files, both widths, block sizes from 0 to usize::MAX:
    /// opened or refused; every window holds the file's tokens.
    #[test]
    fn token_files_open_or_refuse(seed in any::<u64>(), len in 0usize..400, wide in any::<bool>()) {
        let r = &mut Rng(seed);
        let bytes = r.bytes(len);
        let dtype = if wide { TokenDtype::U32 } else { TokenDtype::U16 };
        let w = dtype.width();
        let tokens = len / w;
        let block = match r.below(8) {
            0 => r.pick(&[0, 1, 2, usize::MAX, usize::MAX - 1, usize::MAX / 2, 1 << 32]),
            1 => tokens.saturating_sub(1),
            2 => tokens,
            3 => tokens + 1,
            _ => r.below(40),
        };
        let file = CaseFile::new("train.bin");
        let path = file.path();
        std::fs::write(path, &bytes).unwrap();
        match TokenFile::open(path, dtype, block) {
            Err(e) => {
                check_error(&e, path)?;
                let fits = len % w == 0 && block > 0 && tokens > block;
                prop_assert!(!fits, "a good file refused: {}", e);
            }
            Ok(ds) => {
                prop_assert!(len % w == 0 && block > 0 && tokens > block);
                prop_assert_eq!(ds.len(), (tokens - 1) / block);
                let token = |i: usize| -> i64 {
                    let b = &bytes[i * w..(i + 1) * w];
                    if wide {
                        i64::from(u32::from_le_bytes(b.try_into().unwrap()))
                    } else {
                        i64::from(u16::from_le_bytes(b.try_into().unwrap()))
                    }
                };
                for i in 0..ds.len() {
                    let s = ds.get(i).unwrap();
                    let ids = Vec::<i64>::try_from(&s["input_ids"]).unwrap();
                    let labels = Vec::<i64>::try_from(&s["labels"]).unwrap();
                    let want: Vec<i64> = (i * block..i * block + block).map(token).collect();
                    let want_labels: Vec<i64> =
                        (i * block + 1..i * block + block + 1).map(token).collect();
                    prop_assert_eq!(ids, want);
                    prop_assert_eq!(labels, want_labels);
                }
                prop_assert!(ds.get(ds.len()).is_err());
                prop_assert!(ds.get(usize::MAX).is_err());
            }
        }
    }
}

// ---------------------------------------------------------------------------
// JSON Lines

/// One line of a JSON Lines file: records, blanks, broken JSON, odd bytes.
fn jsonl_line(r: &mut Rng) -> Vec<u8> {
    match r.below(12) {
        0..=3 => {
            let ids: Vec<i64> = (0..r.below(6))
                .map(|_| r.next_u64() as i64 % 1000)
                .collect();
            json!({ "ids": ids }).to_string().into_bytes()
        }
        4 => json!({ "text": "no ids here" }).to_string().into_bytes(),
        5 => r
            .pick(&[
                "", " ", "\t", "\r", " \t \r", "\u{a0}", "\u{3000}", "\u{feff}",
            ])
            .as_bytes()
            .to_vec(),
        6 => r
            .pick(&[
                "{",
                "}",
                "{\"ids\": [1, 2",
                "{\"ids\": [1e999]}",
                "{\"ids\": [9223372036854775808]}",
                "{\"ids\": \"x\"}",
                "null",
                "[]",
                "1",
                "\"s\"",
                "{\"ids\": [1]} trailing",
                "{\"ids\": [1]}{\"ids\": [2]}",
                "\u{feff}{\"ids\": [1]}",
                "{\"ids\": [-1]}",
                "{'ids': [1]}",
                "{\"ids\": [NaN]}",
            ])
            .as_bytes()
            .to_vec(),
        7 => {
            let n = r.below(40);
            r.bytes(n)
        }
        8 => {
            let depth = r.pick(&[10, 127, 128, 129, 5000]);
            let mut s = "[".repeat(depth);
            s.push_str(&"]".repeat(depth));
            s.into_bytes()
        }
        9 => format!("{{\"ids\": [{}]}}", "7,".repeat(r.below(1000)) + "7").into_bytes(),
        10 => b"{\"ids\": [1, 2]}\r".to_vec(),
        _ => vec![0xff, 0xfe, b'{', b'}'],
    }
}

fn tokenize(v: &Value) -> accel_data::TokenizeResult {
    let ids = v["ids"].as_array().ok_or("no `ids` list")?;
    let ids: Vec<i64> = ids
        .iter()
        .map(|x| x.as_i64().ok_or("an id is not an integer"))
        .collect::<Result<_, _>>()?;
    Ok(Sample::new().with("input_ids", Tensor::from_slice(&ids)))
}

proptest! {
    #![proptest_config(cases(8_000))]

    /// Lines of records, blanks and garbage: one record per non-blank line;
    /// a record either tokenizes to its ids or fails naming its line.
    #[test]
    fn json_lines_index_and_read(seed in any::<u64>(), n in 0usize..12, crlf in any::<bool>()) {
        let r = &mut Rng(seed);
        let lines: Vec<Vec<u8>> = (0..n).map(|_| jsonl_line(r)).collect();
        let sep: &[u8] = if crlf { b"\r\n" } else { b"\n" };
        let mut text = lines.join(sep);
        if r.chance(2) {
            text.extend_from_slice(sep);
        }
        let file = CaseFile::new("data.jsonl");
        let path = file.path();
        std::fs::write(path, &text).unwrap();
        let ds = match JsonLines::open(path, tokenize) {
            Ok(ds) => ds,
            Err(e) => {
                check_error(&e, path)?;
                return Err(TestCaseError::fail(format!("a readable file refused: {e}")));
            }
        };
        // the records, as the file's own lines (split at \n only)
        let records: Vec<(usize, &[u8])> = text
            .split(|&b| b == b'\n')
            .enumerate()
            .filter(|(_, l)| !l.iter().all(u8::is_ascii_whitespace))
            .map(|(no, l)| (no + 1, l))
            .collect();
        prop_assert_eq!(ds.len(), records.len());
        for (i, (no, line)) in records.iter().enumerate() {
            let want = serde_json::from_slice::<Value>(line)
                .ok()
                .and_then(|v| tokenize(&v).ok());
            match (ds.get(i), want) {
                (Ok(got), Some(want)) => {
                    let got = Vec::<i64>::try_from(&got["input_ids"]).unwrap();
                    let want = Vec::<i64>::try_from(&want["input_ids"]).unwrap();
                    prop_assert_eq!(got, want);
                }
                (Err(e), None) => {
                    check_error(&e, path)?;
                    let text = e.to_string();
                    prop_assert!(text.contains(&format!("line {no} ")), "{}", text);
                }
                (got, want) => {
                    return Err(TestCaseError::fail(format!(
                        "line {no}: read {:?}, expected {}",
                        got.map(|_| ()),
                        if want.is_some() { "a sample" } else { "an error" }
                    )));
                }
            }
        }
        prop_assert!(ds.get(ds.len()).is_err());
    }
}

// ---------------------------------------------------------------------------
// Corners

#[test]
fn missing_empty_and_directory_paths_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing");
    let empty = dir.path().join("empty");
    std::fs::write(&empty, b"").unwrap();
    for path in [missing.as_path(), empty.as_path(), dir.path()] {
        assert!(
            SafetensorsDataset::open(path).is_err(),
            "{}",
            path.display()
        );
        for dtype in [TokenDtype::U16, TokenDtype::U32] {
            assert!(
                TokenFile::open(path, dtype, 4).is_err(),
                "{}",
                path.display()
            );
        }
    }
    assert!(JsonLines::open(&missing, tokenize).is_err());
    assert!(JsonLines::open(dir.path(), tokenize).is_err());
    assert_eq!(JsonLines::open(&empty, tokenize).unwrap().len(), 0);
}

/// A safetensors file whose header is `header`, followed by `data`.
fn with_header(header: &Value, data: &[u8]) -> Vec<u8> {
    join(&header.to_string(), data)
}

/// Found by `safetensors_mutated_open_or_refuse`: a tensor said to end at
/// byte u64::MAX overflowed `buffer_end + 8 + n` inside the safetensors
/// crate (a panic in debug builds) when the dataset opened the file.
#[test]
fn a_tensor_said_to_end_past_u64_max_is_refused() {
    let file = CaseFile::new("huge.safetensors");
    for end in [u64::MAX, u64::MAX - 7, 1 << 63] {
        let header = json!({ "x": { "dtype": "U8", "shape": [end], "data_offsets": [0, end] } });
        std::fs::write(file.path(), with_header(&header, &[0; 16])).unwrap();
        let err = SafetensorsDataset::open(file.path())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("not a safetensors file") && err.contains("tensor `x` ends at byte"),
            "{err}"
        );
    }
}

/// Found by `safetensors_mutated_open_or_refuse`: a tensor of 0 rows may
/// say its rows have any shape; the bytes of a row overflowed usize.
#[test]
fn rows_larger_than_memory_are_refused() {
    let file = CaseFile::new("rows.safetensors");
    let big = 1u64 << 40;
    let header = json!({ "x": { "dtype": "F32", "shape": [0, big, big], "data_offsets": [0, 0] } });
    std::fs::write(file.path(), with_header(&header, &[])).unwrap();
    let err = SafetensorsDataset::open(file.path())
        .unwrap_err()
        .to_string();
    assert!(err.contains("more bytes than memory holds"), "{err}");
}

/// Found by `token_files_open_or_refuse`: `block_size + 1` overflowed for a
/// block size of usize::MAX.
#[test]
fn a_block_size_of_usize_max_is_refused() {
    let file = CaseFile::new("train.bin");
    std::fs::write(file.path(), [0u8; 64]).unwrap();
    for dtype in [TokenDtype::U16, TokenDtype::U32] {
        let err = TokenFile::open(file.path(), dtype, usize::MAX)
            .unwrap_err()
            .to_string();
        assert!(err.contains("fewer than one window"), "{err}");
    }
}
