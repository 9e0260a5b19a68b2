//! The StableHLO programs the strategy compiles: one `stablehlo.all_reduce`
//! over a flat vector, across one replica group holding every replica.

use accel_sdk::tch::Kind;
use std::ffi::c_int;

/// An element type that can cross to a PJRT device; its discriminant is
/// its `PJRT_Buffer_Type`.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Elem {
    /// `f32` (`PJRT_Buffer_Type_F32`).
    F32 = 11,
    /// `f64`.
    F64 = 12,
    /// `f16`.
    F16 = 10,
    /// `bf16`.
    Bf16 = 13,
    /// `i32` (`PJRT_Buffer_Type_S32`).
    I32 = 4,
    /// `i64`.
    I64 = 5,
    /// `i16`.
    I16 = 3,
    /// `i8`.
    I8 = 2,
    /// `ui8`.
    U8 = 6,
}

impl Elem {
    /// The element type of tch kind `k`, if PJRT buffers can hold it here.
    pub fn of(k: Kind) -> Option<Elem> {
        Some(match k {
            Kind::Float => Elem::F32,
            Kind::Double => Elem::F64,
            Kind::Half => Elem::F16,
            Kind::BFloat16 => Elem::Bf16,
            Kind::Int => Elem::I32,
            Kind::Int64 => Elem::I64,
            Kind::Int16 => Elem::I16,
            Kind::Int8 => Elem::I8,
            Kind::Uint8 => Elem::U8,
            _ => return None,
        })
    }

    /// The tch kind.
    pub fn kind(self) -> Kind {
        match self {
            Elem::F32 => Kind::Float,
            Elem::F64 => Kind::Double,
            Elem::F16 => Kind::Half,
            Elem::Bf16 => Kind::BFloat16,
            Elem::I32 => Kind::Int,
            Elem::I64 => Kind::Int64,
            Elem::I16 => Kind::Int16,
            Elem::I8 => Kind::Int8,
            Elem::U8 => Kind::Uint8,
        }
    }

    /// `PJRT_Buffer_Type`.
    pub fn pjrt(self) -> c_int {
        self as c_int
    }

    /// The MLIR element type.
    pub fn mlir(self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::F64 => "f64",
            Elem::F16 => "f16",
            Elem::Bf16 => "bf16",
            Elem::I32 => "i32",
            Elem::I64 => "i64",
            Elem::I16 => "i16",
            Elem::I8 => "i8",
            Elem::U8 => "ui8",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Elem::F64 | Elem::I64 => 8,
            Elem::F32 | Elem::I32 => 4,
            Elem::F16 | Elem::Bf16 | Elem::I16 => 2,
            Elem::I8 | Elem::U8 => 1,
        }
    }

    /// Whether it is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, Elem::F32 | Elem::F64 | Elem::F16 | Elem::Bf16)
    }
}

/// The reduction of an all-reduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reduce {
    /// Elementwise sum.
    Sum,
    /// Sum divided by the given count (the number of ranks).
    Mean(u32),
    /// Elementwise maximum.
    Max,
    /// Elementwise minimum.
    Min,
    /// Elementwise product.
    Product,
}

/// A StableHLO module: `main(x: tensor<n x T>)` all-reduces `x` over one
/// replica group of `replicas` replicas (cross-replica mode: no channel)
/// and, for [`Reduce::Mean`], divides by the count.
pub fn all_reduce_module(n: i64, elem: Elem, replicas: usize, op: Reduce) -> String {
    let t = elem.mlir();
    let vec = format!("tensor<{n}x{t}>");
    let scalar = format!("tensor<{t}>");
    let combine = match op {
        Reduce::Sum | Reduce::Mean(_) => "stablehlo.add",
        Reduce::Max => "stablehlo.maximum",
        Reduce::Min => "stablehlo.minimum",
        Reduce::Product => "stablehlo.multiply",
    };
    let group: Vec<String> = (0..replicas).map(|r| r.to_string()).collect();
    let mut body = format!(
        r#"    %0 = "stablehlo.all_reduce"(%arg0) ({{
    ^bb0(%a: {scalar}, %b: {scalar}):
      %r = {combine} %a, %b : {scalar}
      stablehlo.return %r : {scalar}
    }}) {{replica_groups = dense<[[{}]]> : tensor<1x{replicas}xi64>}} : ({vec}) -> {vec}
"#,
        group.join(", ")
    );
    let result = match op {
        Reduce::Mean(count) => {
            body.push_str(&format!(
                "    %c = stablehlo.constant dense<{count}.0> : {vec}\n    %1 = stablehlo.divide %0, %c : {vec}\n"
            ));
            "%1"
        }
        _ => "%0",
    };
    format!(
        r#"module @accel_all_reduce attributes {{mhlo.num_partitions = 1 : i32, mhlo.num_replicas = {replicas} : i32}} {{
  func.func public @main(%arg0: {vec}) -> {vec} {{
{body}    return {result} : {vec}
  }}
}}
"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mean_module_names_every_replica_and_divides() {
        let m = all_reduce_module(8, Elem::Bf16, 4, Reduce::Mean(2));
        assert!(m.contains("dense<[[0, 1, 2, 3]]> : tensor<1x4xi64>"), "{m}");
        assert!(m.contains("stablehlo.add %a, %b : tensor<bf16>"), "{m}");
        assert!(m.contains("dense<2.0> : tensor<8xbf16>"), "{m}");
        assert!(m.contains("return %1 : tensor<8xbf16>"), "{m}");
        let s = all_reduce_module(3, Elem::I64, 2, Reduce::Max);
        assert!(
            s.contains("stablehlo.maximum") && s.contains("return %0"),
            "{s}"
        );
    }
}
