//! Gradient helpers every strategy needs, numerically identical to PyTorch.

use tch::{Kind, Tensor};

/// The `norm_type` norm of all elements of `t`, in f64.
fn vector_norm(t: &Tensor, norm_type: f64) -> Tensor {
    t.flatten(0, -1)
        .linalg_norm(norm_type, None::<&[i64]>, false, Kind::Double)
}

/// The total `norm_type` norm of `grads` (inf for the max norm), as
/// `torch.nn.utils.clip_grad_norm_` computes it: the norm of the per-tensor norms.
pub fn total_norm(grads: &[Tensor], norm_type: f64) -> f64 {
    if grads.is_empty() {
        return 0.0;
    }
    let norms: Vec<Tensor> = grads.iter().map(|g| vector_norm(g, norm_type)).collect();
    vector_norm(&Tensor::stack(&norms, 0), norm_type).double_value(&[])
}

/// Scales `grads` in place by `min(1, max_norm / (total + 1e-6))`, as
/// `torch.nn.utils.clip_grad_norm_` does for a total norm `total`.
pub fn scale_to_norm(grads: &mut [Tensor], total: f64, max_norm: f64) {
    let coef = (max_norm / (total + 1e-6)).min(1.0);
    tch::no_grad(|| {
        for g in grads.iter_mut() {
            let _ = g.g_mul_scalar_(coef);
        }
    });
}

/// `torch.nn.utils.clip_grad_norm_` over the gradients of one process:
/// returns the total norm and scales the gradients in place.
///
/// ```
/// use tch::Tensor;
/// // grads [3, 4] and [12]: total 2-norm 13; clipped to 6.5, they are halved.
/// let mut grads = vec![Tensor::from_slice(&[3.0f32, 4.0]), Tensor::from_slice(&[12.0f32])];
/// let total = accel_sdk::grad::clip_grad_norm(&mut grads, 6.5, 2.0);
/// assert!((total - 13.0).abs() < 1e-9);
/// let a = Vec::<f32>::try_from(&grads[0]).unwrap();
/// assert!((a[0] - 1.5).abs() < 1e-5 && (a[1] - 2.0).abs() < 1e-5);
/// let mut inf = vec![Tensor::from_slice(&[-7.0f32, 2.0])];
/// assert_eq!(accel_sdk::grad::clip_grad_norm(&mut inf, 100.0, f64::INFINITY), 7.0);
/// ```
pub fn clip_grad_norm(grads: &mut [Tensor], max_norm: f64, norm_type: f64) -> f64 {
    let total = total_norm(grads, norm_type);
    scale_to_norm(grads, total, max_norm);
    total
}
