//! The key/value cache generation fills: preallocated for the whole
//! generation, written in place, so a new token costs one forward of one
//! position and no concatenation.

use tch::Tensor;

/// Keys and values of every layer, `[B, kv_heads, capacity, head_dim]`
/// each, the first [`KvCache::len`] positions filled.
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    len: i64,
    capacity: i64,
}

impl KvCache {
    /// An empty cache of `layers` layers for up to `capacity` positions;
    /// each layer's tensors are allocated at its first update, in the
    /// keys' dtype and device.
    pub fn new(layers: usize, capacity: i64) -> Self {
        Self {
            layers: (0..layers).map(|_| None).collect(),
            len: 0,
            capacity,
        }
    }

    /// Positions cached so far.
    pub fn len(&self) -> i64 {
        self.len
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the cache holds at most.
    pub fn capacity(&self) -> i64 {
        self.capacity
    }

    /// Writes the new `keys`/`values` `[B, H, T, D]` of `layer` after the
    /// cached positions and returns all of them (`[B, H, len + T, D]`,
    /// views of the cache). [`KvCache::advance`] moves past them once every
    /// layer has written.
    ///
    /// # Panics
    /// When the cache would exceed its capacity (the caller sizes it for
    /// the prompt and the new tokens).
    pub fn update(&mut self, layer: usize, keys: &Tensor, values: &Tensor) -> (Tensor, Tensor) {
        let t = keys.size()[2];
        assert!(
            self.len + t <= self.capacity,
            "the KV cache holds {} positions; {} cached and {t} more asked for",
            self.capacity,
            self.len
        );
        let capacity = self.capacity;
        let (k, v) = self.layers[layer].get_or_insert_with(|| {
            let mut shape = keys.size();
            shape[2] = capacity;
            let alloc =
                |like: &Tensor| Tensor::zeros(shape.as_slice(), (like.kind(), like.device()));
            (alloc(keys), alloc(values))
        });
        k.narrow(2, self.len, t).copy_(keys);
        v.narrow(2, self.len, t).copy_(values);
        (k.narrow(2, 0, self.len + t), v.narrow(2, 0, self.len + t))
    }

    /// Counts `t` more positions as cached (after a forward of `t` tokens).
    pub fn advance(&mut self, t: i64) {
        self.len += t;
    }
}
