//! Hostile changes to safetensors files, for the fuzz tests of their
//! readers (accel-data's datasets, accel's checkpoints): bits flipped, the
//! file cut or padded, the 8-byte header length and the JSON header
//! rewritten with values at the edges of the integer types.

use crate::Rng;
use serde_json::{json, Value};

/// The JSON header of safetensors `bytes`, and where the data starts.
pub fn split(bytes: &[u8]) -> Option<(Value, &[u8])> {
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?) as usize;
    let header = bytes.get(8..8usize.checked_add(n)?)?;
    Some((serde_json::from_slice(header).ok()?, &bytes[8 + n..]))
}

/// Safetensors bytes of a JSON `header` text and the `data` after it.
pub fn join(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// Numbers a header may hold: small, at the edges of every integer type,
/// and far beyond the file.
pub fn number(r: &mut Rng) -> Value {
    match r.below(4) {
        0 => json!(r.below(40)),
        1 => json!(r.next_u64()),
        2 => json!(r.pick(&[
            0u64,
            1,
            7,
            8,
            (1 << 31) - 1,
            1 << 31,
            1 << 32,
            1 << 40,
            1 << 62,
            (1 << 63) - 1,
            1 << 63,
            u64::MAX - 8,
            u64::MAX - 7,
            u64::MAX,
        ])),
        _ => r.pick(&[
            json!(-1),
            json!(1.5),
            json!("3"),
            json!(null),
            json!(1e300),
            json!([]),
        ]),
    }
}

/// One change to a safetensors file.
pub fn mutate(bytes: &mut Vec<u8>, r: &mut Rng) {
    match r.below(9) {
        // flip bits
        0 if !bytes.is_empty() => {
            let i = r.below(bytes.len());
            bytes[i] ^= (r.below(255) + 1) as u8;
        }
        // flip bits in the header length or just after
        1 if !bytes.is_empty() => {
            let i = r.below(bytes.len().min(24));
            bytes[i] ^= 1 << r.below(8);
        }
        // truncate
        2 => {
            let at = r.below(bytes.len() + 1);
            bytes.truncate(at);
        }
        // a header length from the edges
        3 if bytes.len() >= 8 => {
            let len = bytes.len() as u64;
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap());
            let v = r.pick(&[
                0,
                1,
                2,
                n.wrapping_sub(1),
                n.wrapping_add(1),
                len - 8,
                len.wrapping_sub(7),
                len,
                u32::MAX as u64,
                100_000_000,
                100_000_001,
                1 << 63,
                u64::MAX,
                u64::MAX - 7,
            ]);
            bytes[..8].copy_from_slice(&v.to_le_bytes());
        }
        // append or insert garbage
        4 => {
            let n = r.below(16) + 1;
            let extra = r.bytes(n);
            let at = if r.chance(2) {
                bytes.len()
            } else {
                r.below(bytes.len() + 1)
            };
            bytes.splice(at..at, extra);
        }
        // rewrite the JSON header
        _ => {
            let Some((mut header, data)) = split(bytes) else {
                return;
            };
            let data = data.to_vec();
            mutate_header(&mut header, r);
            let mut text = header.to_string();
            if r.chance(3) {
                // safetensors pads headers with spaces to 8 bytes
                while text.len() % 8 != 0 {
                    text.push(' ');
                }
            }
            *bytes = join(&text, &data);
        }
    }
}

/// One change to a safetensors JSON header: an entry's shape, offsets or
/// dtype made odd, a field removed, an entry copied or removed, metadata
/// added, or the header replaced.
pub fn mutate_header(header: &mut Value, r: &mut Rng) {
    let names: Vec<String> = header
        .as_object()
        .map(|o| o.keys().cloned().collect())
        .unwrap_or_default();
    let Some(obj) = header.as_object_mut() else {
        return;
    };
    let name = if names.is_empty() {
        "x".to_string()
    } else {
        names[r.below(names.len())].clone()
    };
    let entry = obj.entry(name.clone()).or_insert_with(|| json!({}));
    if !entry.is_object() {
        *entry = json!({});
    }
    match r.below(11) {
        0 => {
            let dims: Vec<Value> = (0..r.below(5)).map(|_| number(r)).collect();
            entry["shape"] = Value::Array(dims);
        }
        1 => {
            // a shape whose product overflows but holds a zero
            let big = r.pick(&[1u64 << 32, 1 << 40, 1 << 62, u64::MAX]);
            let zero_at = r.below(3);
            let mut dims = vec![json!(big), json!(big), json!(big)];
            dims[zero_at] = json!(0);
            entry["shape"] = json!(dims);
        }
        2 => entry["data_offsets"] = json!([number(r), number(r)]),
        3 => {
            // a tensor that claims the whole address space
            let n = r.pick(&[u64::MAX, u64::MAX - 7, 1 << 63, (1 << 63) - 1]);
            entry["shape"] = json!([n]);
            entry["data_offsets"] = json!([0, n]);
            entry["dtype"] = json!("U8");
        }
        4 => {
            entry["dtype"] = json!(r.pick(&[
                "F8_E4M3", "F8_E5M2", "C64", "U16", "U32", "U64", "F64", "BOOL", "bool", "f32", "",
                "X",
            ]))
        }
        5 => {
            let field = r.pick(&["dtype", "shape", "data_offsets"]);
            if let Some(o) = entry.as_object_mut() {
                o.remove(field);
            }
        }
        6 => *entry = r.pick(&[json!(1), json!("x"), json!([]), json!(null), json!(true)]),
        7 => {
            obj.insert(
                "__metadata__".into(),
                r.pick(&[
                    json!({"format": "pt"}),
                    json!({"a": 1}),
                    json!("x"),
                    json!(null),
                ]),
            );
        }
        8 => {
            let copy = entry.clone();
            obj.insert(format!("{name}.copy"), copy);
        }
        9 => {
            obj.remove(&name);
        }
        _ => *header = r.pick(&[json!([]), json!(1), json!("x"), json!(null), json!({})]),
    }
}
