//! Tensors cross the plugin boundary as opaque handles to libtorch tensors
//! (tch's `C_tensor` pointers). Host and plugins link the same libtorch, so a
//! handle made on one side is a valid tensor on the other.
//!
//! * [`TensorRef`] / [`TensorMut`] borrow a tensor for the length of a call;
//!   [`TensorRef::get`] and [`TensorMut::get_mut`] give back a `tch::Tensor`
//!   view that never frees it.
//! * [`OwnedTensor`] moves ownership across: whoever holds it frees it,
//!   through the deleter the side that made it put beside the pointer (so
//!   the contract itself needs no libtorch).
//!
//! The `tch::Tensor` views and constructors come with feature `tch` (on in
//! `accel-sdk`, which re-exports this module as `accel_sdk::tensor`):
//!
//! ```
//! # #[cfg(feature = "tch")] {
//! use accel_abi::tensor::{OwnedTensor, TensorMut, TensorRef};
//! let mut t = tch::Tensor::from_slice(&[1.0f32, 2.0]);
//! let r = TensorRef::new(&t);
//! assert_eq!(r.get().size(), vec![2]);
//! let mut m = TensorMut::new(&mut t);
//! let _ = m.get_mut().g_mul_scalar_(2.0);
//! assert_eq!(Vec::<f32>::try_from(&t).unwrap(), vec![2.0, 4.0]);
//! let owned = OwnedTensor::new(t.shallow_clone());
//! assert_eq!(owned.into_tensor().size(), vec![2]);
//! # }
//! ```

use abi_stable::{
    std_types::{RStr, RString},
    StableAbi,
};
use std::{ffi::c_void, marker::PhantomData};
#[cfg(feature = "tch")]
use std::{
    mem::ManuallyDrop,
    ops::{Deref, DerefMut},
};
#[cfg(feature = "tch")]
use tch::Tensor;

/// A shared borrow of a libtorch tensor, valid for `'a`.
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy)]
pub struct TensorRef<'a> {
    ptr: *mut c_void,
    _borrow: PhantomData<&'a ()>,
}

/// An exclusive borrow of a libtorch tensor, valid for `'a`; in-place
/// operations through it are seen by the owner.
#[repr(transparent)]
#[derive(StableAbi)]
pub struct TensorMut<'a> {
    ptr: *mut c_void,
    _borrow: PhantomData<&'a mut ()>,
}

/// A tensor whose ownership moved across the boundary; dropping it frees it
/// with the deleter of the side that made it.
#[repr(C)]
#[derive(StableAbi)]
pub struct OwnedTensor {
    ptr: *mut c_void,
    free: unsafe extern "C" fn(*mut c_void),
}

// SAFETY: a libtorch tensor handle may be moved between threads (tch's
// `Tensor` is `Send`); the borrow types only add lifetimes.
unsafe impl Send for TensorRef<'_> {}
unsafe impl Send for TensorMut<'_> {}
unsafe impl Send for OwnedTensor {}

/// A `tch::Tensor` view over a borrowed handle. It never frees the tensor.
#[cfg(feature = "tch")]
pub struct TensorView<'a> {
    tensor: ManuallyDrop<Tensor>,
    _borrow: PhantomData<&'a ()>,
}

#[cfg(feature = "tch")]
impl Deref for TensorView<'_> {
    type Target = Tensor;
    fn deref(&self) -> &Tensor {
        &self.tensor
    }
}

/// A mutable `tch::Tensor` view over an exclusively borrowed handle.
#[cfg(feature = "tch")]
pub struct TensorViewMut<'a> {
    tensor: ManuallyDrop<Tensor>,
    _borrow: PhantomData<&'a mut ()>,
}

#[cfg(feature = "tch")]
impl Deref for TensorViewMut<'_> {
    type Target = Tensor;
    fn deref(&self) -> &Tensor {
        &self.tensor
    }
}

#[cfg(feature = "tch")]
impl DerefMut for TensorViewMut<'_> {
    fn deref_mut(&mut self) -> &mut Tensor {
        &mut self.tensor
    }
}

#[cfg(feature = "tch")]
fn raw(t: &Tensor) -> *mut c_void {
    t.as_ptr() as *mut c_void
}

#[cfg(feature = "tch")]
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

#[cfg(feature = "tch")]
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

impl TensorMut<'_> {
    /// Reborrows as a shared handle.
    pub fn as_tensor_ref(&self) -> TensorRef<'_> {
        TensorRef {
            ptr: self.ptr,
            _borrow: PhantomData,
        }
    }

    /// Reborrows for a shorter call.
    pub fn reborrow(&mut self) -> TensorMut<'_> {
        TensorMut {
            ptr: self.ptr,
            _borrow: PhantomData,
        }
    }
}

/// Frees a handle made by [`OwnedTensor::new`].
#[cfg(feature = "tch")]
unsafe extern "C" fn free_tch_tensor(ptr: *mut c_void) {
    // SAFETY: `ptr` is a tch tensor handle this deleter was paired with.
    drop(unsafe { Tensor::from_ptr(ptr as *mut _) });
}

#[cfg(feature = "tch")]
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

impl OwnedTensor {
    /// A shared borrow of the owned tensor.
    pub fn as_tensor_ref(&self) -> TensorRef<'_> {
        TensorRef {
            ptr: self.ptr,
            _borrow: PhantomData,
        }
    }

    /// An exclusive borrow of the owned tensor.
    pub fn as_tensor_mut(&mut self) -> TensorMut<'_> {
        TensorMut {
            ptr: self.ptr,
            _borrow: PhantomData,
        }
    }
}

impl Drop for OwnedTensor {
    fn drop(&mut self) {
        // SAFETY: this handle owns the tensor; its own deleter frees it once.
        unsafe { (self.free)(self.ptr) }
    }
}

#[cfg(feature = "tch")]
impl From<Tensor> for OwnedTensor {
    fn from(t: Tensor) -> Self {
        Self::new(t)
    }
}

/// A named, exclusively borrowed tensor: a model parameter handed to a strategy.
#[repr(C)]
#[derive(StableAbi)]
pub struct NamedTensorMut<'a> {
    /// The parameter's path in the model (tch `VarStore` naming, `a.b.weight`).
    pub name: RStr<'a>,
    /// The parameter itself.
    pub tensor: TensorMut<'a>,
}

#[cfg(feature = "tch")]
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

/// A named, shared borrow of a tensor (e.g. an entry of a state dict to load).
#[repr(C)]
#[derive(StableAbi)]
pub struct NamedTensorRef<'a> {
    /// Entry name.
    pub name: RStr<'a>,
    /// The tensor.
    pub tensor: TensorRef<'a>,
}

/// A named tensor whose ownership crosses the boundary (e.g. a state dict entry).
#[repr(C)]
#[derive(StableAbi)]
pub struct NamedOwnedTensor {
    /// Entry name.
    pub name: RString,
    /// The tensor.
    pub tensor: OwnedTensor,
}

#[cfg(feature = "tch")]
impl NamedOwnedTensor {
    /// Names and owns `tensor`.
    pub fn new(name: impl Into<String>, tensor: Tensor) -> Self {
        Self {
            name: name.into().into(),
            tensor: OwnedTensor::new(tensor),
        }
    }
}
