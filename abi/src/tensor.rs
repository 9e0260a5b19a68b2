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
mod with_tch;
#[cfg(feature = "tch")]
pub use with_tch::{TensorView, TensorViewMut};

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

/// A named, exclusively borrowed tensor: a model parameter handed to a strategy.
#[repr(C)]
#[derive(StableAbi)]
pub struct NamedTensorMut<'a> {
    /// The parameter's path in the model (tch `VarStore` naming, `a.b.weight`).
    pub name: RStr<'a>,
    /// The parameter itself.
    pub tensor: TensorMut<'a>,
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
