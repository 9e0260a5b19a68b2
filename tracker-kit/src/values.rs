//! The JSON forms of the richer log values (ABI 4.2) that several trackers
//! write: histograms as W&B's `{"_type": "histogram", "values", "bins"}`,
//! tables as `{"columns": [...], "data": [[...]]}` (the form of both W&B's
//! `table-file` and MLflow's `log_table`).

use accel_sdk::{
    serde_json::{json, Value},
    LogHistogram, LogTable, TableCell,
};

/// A number as JSON; NaN and infinities (which JSON lacks) as `null`.
fn number(x: f64) -> Value {
    accel_sdk::serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number)
}

/// W&B's histogram: `{"_type": "histogram", "values": counts, "bins": edges}`.
pub fn histogram_json(h: &LogHistogram) -> Value {
    json!({
        "_type": "histogram",
        "values": h.counts.as_slice(),
        "bins": h.edges.iter().copied().map(number).collect::<Vec<_>>(),
    })
}

/// [`histogram_json`] with the summary statistics added: `min`, `max`,
/// `num`, `sum`, `sum_squares`.
pub fn histogram_with_stats_json(h: &LogHistogram) -> Value {
    let mut v = histogram_json(h);
    if let Some(o) = v.as_object_mut() {
        o.insert("min".into(), number(h.min));
        o.insert("max".into(), number(h.max));
        o.insert("num".into(), h.num.into());
        o.insert("sum".into(), number(h.sum));
        o.insert("sum_squares".into(), number(h.sum_squares));
    }
    v
}

/// One cell: a number or a string.
pub fn cell_json(c: &TableCell) -> Value {
    match c {
        TableCell::Scalar(x) => number(*x),
        TableCell::Text(t) => Value::from(t.as_str()),
    }
}

/// A table as `{"columns": [...], "data": [[...], ...]}`.
pub fn table_json(t: &LogTable) -> Value {
    json!({
        "columns": t.columns.iter().map(|c| c.as_str()).collect::<Vec<_>>(),
        "data": t.rows.iter()
            .map(|r| r.iter().map(cell_json).collect::<Vec<_>>())
            .collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_and_tables_as_json() {
        let h = LogHistogram::from_values(&[1.0, 2.0, 2.0, 3.0, 3.0, 3.0], 4).unwrap();
        assert_eq!(
            histogram_json(&h),
            json!({"_type": "histogram", "values": [1, 0, 2, 3], "bins": [1.0, 1.5, 2.0, 2.5, 3.0]})
        );
        let s = histogram_with_stats_json(&h);
        assert_eq!(
            (s["num"].as_u64(), s["sum"].as_f64()),
            (Some(6), Some(14.0))
        );
        let t = LogTable {
            columns: vec!["a".into(), "b".into()].into(),
            rows: vec![
                vec![TableCell::Scalar(1.0), "x".into()].into(),
                vec![2.5.into(), TableCell::Scalar(f64::NAN)].into(),
            ]
            .into(),
        };
        assert_eq!(
            table_json(&t),
            json!({"columns": ["a", "b"], "data": [[1.0, "x"], [2.5, null]]})
        );
    }
}
