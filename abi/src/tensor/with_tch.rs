//! The `tch::Tensor` side of the handles (feature `tch`): views over a
//! borrowed handle and the constructors from `tch::Tensor`s.

use super::{NamedOwnedTensor, NamedTensorMut, OwnedTensor, TensorMut, TensorRef};
use std::{
    ffi::c_void,
    marker::PhantomData,
    mem::ManuallyDrop,
    ops::{Deref, DerefMut},
};
use tch::Tensor;

/// A `tch::Tensor` view over a borrowed handle. It never frees the tensor.
pub struct TensorView<'a> {
    tensor: ManuallyDrop<Tensor>,
    _borrow: PhantomData<&'a ()>,
}

impl Deref for TensorView<'_> {
    type Target = Tensor;
    fn deref(&self) -> &Tensor {
        &self.tensor
    }
}

/// A mutable `tch::Tensor` view over an exclusively borrowed handle.
pub struct TensorViewMut<'a> {
    tensor: ManuallyDrop<Tensor>,
    _borrow: PhantomData<&'a mut ()>,
}

impl Deref for TensorViewMut<'_> {
    type Target = Tensor;
    fn deref(&self) -> &Tensor {
        &self.tensor
    }
}

impl DerefMut for TensorViewMut<'_> {
    fn deref_mut(&mut self) -> &mut Tensor {
        &mut self.tensor
    }
}

fn raw(t: &Tensor) -> *mut c_void {
    t.as_ptr() as *mut c_void
}

impl<'a> TensorRef<'a> {
    /// Borrows `t` for the lifetime of the reference.
    pub fn new(t: &'a Tensor) -> Self {
        Self {
            ptr: raw(t),
            _borrow: PhantomData,
        }
    }

    /// A `tch::Tensor` view of the borrowed tensor.
    pub fn get(&self) -> TensorView<'a> {
        // SAFETY: `ptr` came from a live `&'a Tensor`; the view is never dropped
        // as a Tensor (ManuallyDrop), so the owner keeps ownership.
        TensorView {
            tensor: ManuallyDrop::new(unsafe { Tensor::from_ptr(self.ptr as *mut _) }),
            _borrow: PhantomData,
        }
    }
}

impl<'a> TensorMut<'a> {
    /// Borrows `t` exclusively for the lifetime of the reference.
    pub fn new(t: &'a mut Tensor) -> Self {
        Self {
            ptr: raw(t),
            _borrow: PhantomData,
        }
    }

    /// A shared view of the borrowed tensor.
    pub fn get(&self) -> TensorView<'_> {
        TensorRef {
            ptr: self.ptr,
            _borrow: PhantomData,
        }
        .get()
    }

    /// A mutable `tch::Tensor` view of the borrowed tensor.
    pub fn get_mut(&mut self) -> TensorViewMut<'_> {
        // SAFETY: as in `TensorRef::get`, plus exclusivity from `&mut self`.
        TensorViewMut {
            tensor: ManuallyDrop::new(unsafe { Tensor::from_ptr(self.ptr as *mut _) }),
            _borrow: PhantomData,
        }
    }
}

/// Frees a handle made by [`OwnedTensor::new`].
unsafe extern "C" fn free_tch_tensor(ptr: *mut c_void) {
    // SAFETY: `ptr` is a tch tensor handle this deleter was paired with.
    drop(unsafe { Tensor::from_ptr(ptr as *mut _) });
}

impl OwnedTensor {
    /// Takes ownership of `t` so it can be handed across the boundary.
    pub fn new(t: Tensor) -> Self {
        let t = ManuallyDrop::new(t);
        Self {
            ptr: raw(&t),
            free: free_tch_tensor,
        }
    }

    /// Gives the tensor back as a `tch::Tensor` that frees it when dropped.
    /// (Every handle is a tch tensor of the one libtorch host and plugins
    /// link — the host checks — so tch's deleter is the handle's own.)
    pub fn into_tensor(self) -> Tensor {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `ptr` was owned by this handle; ownership moves to the Tensor.
        unsafe { Tensor::from_ptr(this.ptr as *mut _) }
    }
}

impl From<Tensor> for OwnedTensor {
    fn from(t: Tensor) -> Self {
        Self::new(t)
    }
}

impl<'a> NamedTensorMut<'a> {
    /// Handles over named tensors, e.g. a model's `(name, parameter)` list,
    /// ready for [`crate::DistributedStrategy::prepare_model`].
    pub fn all(named: &'a mut [(String, Tensor)]) -> Vec<NamedTensorMut<'a>> {
        named
            .iter_mut()
            .map(|(n, t)| NamedTensorMut {
                name: n.as_str().into(),
                tensor: TensorMut::new(t),
            })
            .collect()
    }
}

impl NamedOwnedTensor {
    /// Names and owns `tensor`.
    pub fn new(name: impl Into<String>, tensor: Tensor) -> Self {
        Self {
            name: name.into().into(),
            tensor: OwnedTensor::new(tensor),
        }
    }
}
