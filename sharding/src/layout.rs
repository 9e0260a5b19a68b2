//! The arithmetic of the layout, apart from any tensor or collective: how
//! a parameter splits into chunks, which elements a rank's chunk holds,
//! whether a wrap policy's units cover every parameter once, and how the
//! per-rank terms of a gradient norm combine.

use accel_sdk::tch::{Kind, Tensor};

/// Elements per chunk of a parameter of `numel` elements split `group`
/// ways: the parameter is padded with zeros to `group` equal chunks.
pub(crate) fn chunk_len(numel: i64, group: i64) -> i64 {
    (numel + group - 1) / group
}

/// The parameter's elements `(start, len)` that chunk `index` (of `chunk`
/// elements each) holds; the rest of the chunk is padding. The last chunks
/// of a small parameter hold none.
pub(crate) fn chunk_span(numel: i64, chunk: i64, index: i64) -> (i64, i64) {
    let start = (index * chunk).min(numel);
    (start, (start + chunk).min(numel) - start)
}

/// Elements from which a parameter is all-gathered in a collective of its
/// own, straight into its storage, and reduce-scattered from its gradient
/// (see [`gathered_in_place`]): 64 Ki, 256 KiB in f32.
pub const IN_PLACE_NUMEL: i64 = 1 << 16;

/// Whether a parameter of `numel` elements, sharded `group` ways beside
/// other parameters of its unit, gets collectives of its own: all-gathered
/// straight into its storage (no receive buffer to copy out of, its chunk
/// sent as it is) and reduce-scattered from its gradient (no buffer to lay
/// it out in). It must have at least [`IN_PLACE_NUMEL`] elements, whose
/// copies cost more than a collective's fixed latency, and chunks that tile
/// it (no padding). The others of a unit share one collective through a
/// buffer.
///
/// ```
/// use accel_sharding::gathered_in_place;
/// assert!(gathered_in_place(768 * 768, 2));
/// assert!(!gathered_in_place(768, 2)); // small: with the rest
/// assert!(!gathered_in_place(768 * 768 + 1, 2)); // padded
/// ```
pub fn gathered_in_place(numel: i64, group: i64) -> bool {
    numel >= IN_PLACE_NUMEL && tiles(numel, group)
}

/// Whether `group` chunks of a parameter of `numel` elements hold it with
/// no padding: the receive buffer of its all-gather is its value.
pub(crate) fn tiles(numel: i64, group: i64) -> bool {
    numel > 0 && numel % group == 0
}

/// Checks that the `units` (name, parameter indices) a wrap policy chose
/// put each of `names` in exactly one unit; the message names the
/// parameter and the unit(s).
pub(crate) fn check_units(names: &[String], units: &[(String, Vec<usize>)]) -> Result<(), String> {
    let mut owner: Vec<Option<usize>> = vec![None; names.len()];
    for (u, (unit, idx)) in units.iter().enumerate() {
        for &i in idx {
            let Some(slot) = owner.get_mut(i) else {
                return Err(format!(
                    "wrap policy put parameter {i} in unit `{unit}`; the model has {}",
                    names.len()
                ));
            };
            if let Some(prev) = slot.replace(u) {
                return Err(format!(
                    "wrap policy put `{}` in units `{}` and `{unit}`",
                    names[i], units[prev].0
                ));
            }
        }
    }
    match owner.iter().position(Option::is_none) {
        Some(i) => Err(format!("wrap policy left `{}` out of every unit", names[i])),
        None => Ok(()),
    }
}

/// One gradient's term of the `norm_type`-norm, in f64: `max |g|` for the
/// inf-norm, else `sum |g|^p`.
pub(crate) fn norm_term(g: &Tensor, norm_type: f64) -> f64 {
    let g = g.to_kind(Kind::Double).abs();
    if norm_type.is_infinite() {
        g.max().double_value(&[])
    } else {
        g.pow_tensor_scalar(norm_type)
            .sum(Kind::Double)
            .double_value(&[])
    }
}

/// How terms combine, across tensors and across ranks: max for the
/// inf-norm, else a sum.
pub(crate) fn combine_terms(norm_type: f64, a: f64, b: f64) -> f64 {
    if norm_type.is_infinite() {
        a.max(b)
    } else {
        a + b
    }
}

/// The global norm from the terms combined over every rank, where each
/// chunk is held by `replicas` ranks (hybrid sharding: once per machine).
pub(crate) fn global_norm(reduced: f64, replicas: f64, norm_type: f64) -> f64 {
    if norm_type.is_infinite() {
        reduced
    } else {
        (reduced / replicas).powf(1.0 / norm_type)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("p{i}")).collect()
    }

    fn unit(name: &str, idx: &[usize]) -> (String, Vec<usize>) {
        (name.to_owned(), idx.to_vec())
    }

    #[test]
    fn chunks_pad_to_the_group_and_spans_cover_each_element_once() {
        for (numel, group, chunk) in [(10, 4, 3), (8, 4, 2), (1, 4, 1), (5, 1, 5), (0, 2, 0)] {
            assert_eq!(chunk_len(numel, group), chunk, "{numel} over {group}");
            let spans: Vec<(i64, i64)> = (0..group).map(|r| chunk_span(numel, chunk, r)).collect();
            let mut next = 0;
            for &(start, len) in &spans {
                assert_eq!(start, next.min(numel), "{numel} over {group}: {spans:?}");
                assert!((0..=chunk).contains(&len), "{spans:?}");
                next = start + len;
            }
            assert_eq!(next, numel, "{numel} over {group}: {spans:?}");
        }
        // A parameter smaller than the group: the last ranks hold padding only.
        assert_eq!(chunk_span(1, 1, 3), (1, 0));
        assert_eq!(chunk_span(10, 3, 3), (9, 1));
    }

    #[test]
    fn units_must_hold_every_parameter_exactly_once() {
        let n = names(3);
        assert_eq!(
            check_units(&n, &[unit("a", &[0, 2]), unit("", &[1])]),
            Ok(())
        );
        for (units, message) in [
            (
                vec![unit("a", &[0, 1]), unit("", &[1, 2])],
                "wrap policy put `p1` in units `a` and ``",
            ),
            (
                vec![unit("a", &[0]), unit("", &[2])],
                "wrap policy left `p1` out of every unit",
            ),
            (
                vec![unit("", &[0, 1, 2, 3])],
                "wrap policy put parameter 3 in unit ``; the model has 3",
            ),
        ] {
            assert_eq!(check_units(&n, &units), Err(message.to_owned()));
        }
    }

    #[test]
    fn norms_combine_as_torch_clip_grad_norm() {
        let a = Tensor::from_slice(&[3.0f32, -4.0]);
        let b = Tensor::from_slice(&[12.0f32]);
        // 2-norm: sqrt(9 + 16 + 144) = 13.
        let two = combine_terms(2.0, norm_term(&a, 2.0), norm_term(&b, 2.0));
        assert_eq!(two, 169.0);
        assert_eq!(global_norm(two, 1.0, 2.0), 13.0);
        // Each chunk counted twice (two machines holding the same chunks).
        assert_eq!(global_norm(2.0 * two, 2.0, 2.0), 13.0);
        // inf-norm: the largest magnitude, however often it is counted.
        let inf = f64::INFINITY;
        let max = combine_terms(inf, norm_term(&a, inf), norm_term(&b, inf));
        assert_eq!(max, 12.0);
        assert_eq!(global_norm(max, 2.0, inf), 12.0);
        // 1-norm.
        let one = combine_terms(1.0, norm_term(&a, 1.0), norm_term(&b, 1.0));
        assert_eq!(global_norm(one, 1.0, 1.0), 19.0);
    }
}
