//! The engine on one process, whose collectives are copies: gathering and
//! resharding, the gradients' way into the chunks, clipping, state dicts
//! and the checks of `prepare_model`.

use super::Sharded;
use crate::plan::{Dtypes, Persistence, Plan, WrapPolicy};
use accel_sdk::abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{RArc, RSlice, RSliceMut, RStr},
};
use accel_sdk::context::HostContext_TO;
use accel_sdk::tch::{Kind, Tensor};
use accel_sdk::{
    abi_stable::sabi_types::RMut,
    shim,
    strategy::{OptimizerStep, OptimizerStep_TO},
    tensor::{NamedOwnedTensor, NamedTensorMut, NamedTensorRef, TensorMut, TensorRef},
    DeviceSpec, DistributedStrategy, HostContext, LogLevel, PluginResult, ReduceOp, StateDictKind,
};

/// The only process of a one-process job: every collective leaves the
/// tensors as they are (gathers and scatters copy).
#[derive(Clone)]
struct Solo;

impl HostContext for Solo {
    fn rank(&self) -> u32 {
        0
    }
    fn world_size(&self) -> u32 {
        1
    }
    fn local_rank(&self) -> u32 {
        0
    }
    fn local_world_size(&self) -> u32 {
        1
    }
    fn device(&self) -> DeviceSpec {
        DeviceSpec::CPU
    }
    fn all_reduce(&self, _: TensorMut<'_>, _: ReduceOp) -> PluginResult<()> {
        PluginResult::ROk(())
    }
    fn broadcast(&self, _: TensorMut<'_>, _: u32) -> PluginResult<()> {
        PluginResult::ROk(())
    }
    fn all_gather(&self, i: TensorRef, o: TensorMut) -> PluginResult<()> {
        copied(i, o)
    }
    fn reduce_scatter(&self, i: TensorRef, o: TensorMut, _: ReduceOp) -> PluginResult<()> {
        copied(i, o)
    }
    fn barrier(&self) -> PluginResult<()> {
        PluginResult::ROk(())
    }
    fn log(&self, _: LogLevel, _: RStr<'_>, _: RStr<'_>) {}
}

/// One process's gather or scatter: `output` becomes `input`.
fn copied(input: TensorRef<'_>, mut output: TensorMut<'_>) -> PluginResult<()> {
    output.get_mut().copy_(&input.get());
    PluginResult::ROk(())
}

/// FULL_SHARD / ZeRO-3: everything sharded.
fn full_shard() -> Plan {
    Plan::full_shard("test")
}

/// Unit `a` holds `a.w`, the root unit `b.w`.
fn two_units() -> WrapPolicy {
    Box::new(|_, _| Ok(vec![("a".to_owned(), vec![0]), (String::new(), vec![1])]))
}

/// A model of two trainable parameters, `a.w` `[2, 3]` and `b.w` `[5]`.
fn model() -> Vec<(String, Tensor)> {
    vec![
        (
            "a.w".to_owned(),
            Tensor::arange(6, (Kind::Float, accel_sdk::tch::Device::Cpu))
                .view([2, 3])
                .set_requires_grad(true),
        ),
        (
            "b.w".to_owned(),
            Tensor::from_slice(&[1.0f32, -2.0, 3.0, -4.0, 5.0]).set_requires_grad(true),
        ),
    ]
}

/// An engine running `plan` prepared over `params`.
fn prepared(plan: Plan, wrap: WrapPolicy, params: &mut [(String, Tensor)]) -> Sharded {
    let ctx = HostContext_TO::from_ptr(RArc::new(Solo), TD_Opaque);
    let mut engine = Sharded::new(ctx, plan, wrap);
    let mut handles = NamedTensorMut::all(params);
    engine
        .prepare_model(RSliceMut::from(&mut handles[..]))
        .into_result()
        .expect("prepare_model");
    engine
}

/// The sum of `p^2 / 2` over the parameters, whose gradient with respect
/// to each is its value.
fn half_square_sum(params: &[(String, Tensor)]) -> Tensor {
    params
        .iter()
        .map(|(_, p)| p.square().sum(Kind::Float) / 2.0)
        .reduce(|a, b| a + b)
        .unwrap()
}

/// Compute in bf16 over fp32 masters, reduce in bf16.
const BF16_COMPUTE: Dtypes = Dtypes {
    param: Some(Kind::BFloat16),
    reduce: None,
};

/// Parameters of at most `elements` elements stay whole, however many.
fn up_to(elements: u64) -> Persistence {
    Persistence {
        param_elements: elements,
        model_elements: u64::MAX,
    }
}

/// Every parameter's values, in order.
fn all_values(params: &[(String, Tensor)]) -> Vec<Vec<f32>> {
    params.iter().map(|(_, t)| values(t)).collect()
}

/// The tensors the engine hands the optimizer (this rank's chunks).
fn optimizer_chunks(engine: &mut Sharded) -> Vec<Tensor> {
    engine
        .prepare_optimizer()
        .into_result()
        .unwrap()
        .iter()
        .map(|t| t.tensor.as_tensor_ref().get().shallow_clone())
        .collect()
}

fn values(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.to_kind(Kind::Float).reshape([-1])).expect("f32 values")
}

fn by_name(state: &[NamedOwnedTensor], name: &str) -> Vec<f32> {
    let entry = state
        .iter()
        .find(|t| t.name.as_str() == name)
        .unwrap_or_else(|| panic!("no `{name}` in the state dict"));
    values(&entry.tensor.as_tensor_ref().get())
}

#[test]
fn units_are_freed_outside_compute_and_gathered_for_it() {
    let mut params = model();
    let originals = all_values(&params);
    let mut engine = prepared(full_shard(), two_units(), &mut params);
    for (_, p) in &params {
        assert_eq!(shim::storage_bytes(p), 0, "resharded after prepare_model");
    }
    engine.pre_forward(0).into_result().unwrap();
    assert_eq!(values(&params[0].1), originals[0]);
    assert_eq!(params[0].1.size(), [2, 3]);
    assert_eq!(shim::storage_bytes(&params[1].1), 0, "only unit 0 gathered");
    engine.post_forward(0).into_result().unwrap();
    assert_eq!(
        shim::storage_bytes(&params[0].1),
        0,
        "freed after its forward"
    );
    // The root unit stays gathered from its forward until its backward ends.
    engine.pre_forward(1).into_result().unwrap();
    engine.post_forward(1).into_result().unwrap();
    assert_eq!(values(&params[1].1), originals[1]);
    assert!(engine.pre_forward(2).into_result().is_err(), "no unit 2");
}

#[test]
fn gradients_reach_the_chunks_and_clipping_scales_them_to_the_norm() {
    let mut params = model();
    let mut engine = prepared(full_shard(), two_units(), &mut params);
    for u in 0..2 {
        engine.pre_forward(u).into_result().unwrap();
    }
    let loss = half_square_sum(&params);
    loss.backward();
    for u in 0..2 {
        engine.post_unit_backward(u).into_result().unwrap();
    }
    engine.post_backward(true).into_result().unwrap();
    for (_, p) in &params {
        assert!(!p.grad().defined(), "whole gradients freed");
        assert_eq!(shim::storage_bytes(p), 0, "resharded after backward");
    }
    let chunks = engine.prepare_optimizer().into_result().unwrap();
    let grad = |i: usize| values(&chunks[i].tensor.as_tensor_ref().get().grad());
    assert_eq!(grad(0), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    assert_eq!(grad(1), [1.0, -2.0, 3.0, -4.0, 5.0]);
    // |g|_2 = sqrt(55 + 55) and |g|_inf = 5, as torch computes them.
    let norm = engine.clip_grad_norm(f64::MAX, 2.0).into_result().unwrap();
    assert!((norm - 110f64.sqrt()).abs() < 1e-9, "{norm}");
    let norm = engine
        .clip_grad_norm(1.0, f64::INFINITY)
        .into_result()
        .unwrap();
    assert_eq!(norm, 5.0);
    assert!(
        (grad(1)[4] - 1.0).abs() < 1e-6,
        "scaled by 1/5: {:?}",
        grad(1)
    );
    assert!(
        (grad(0)[1] - 0.2).abs() < 1e-6,
        "scaled by 1/5: {:?}",
        grad(0)
    );
}

#[test]
fn a_unit_with_a_frozen_parameter_stays_gathered_until_its_backward_is_done() {
    // Unit `a` holds `a.w` (frozen) and `b.w` (trained); the root unit
    // holds nothing: `a.w` is still needed for the input's gradient once
    // `b.w`'s is in.
    let mut params = model();
    params[0].1 = params[0].1.detach().set_requires_grad(false);
    let one_unit: WrapPolicy = Box::new(|_, _| Ok(vec![("a".to_owned(), vec![0, 1])]));
    let mut engine = prepared(full_shard(), one_unit, &mut params);
    engine.pre_forward(0).into_result().unwrap();
    let loss = half_square_sum(&params);
    loss.backward();
    engine.post_unit_backward(0).into_result().unwrap();
    assert!(
        shim::storage_bytes(&params[0].1) > 0,
        "resharded while its backward may still read the frozen weight"
    );
    engine.unit_backward_done(0).into_result().unwrap();
    for (n, p) in &params {
        assert_eq!(
            shim::storage_bytes(p),
            0,
            "`{n}` gathered after its backward"
        );
    }
    engine.post_backward(true).into_result().unwrap();
    let chunks = optimizer_chunks(&mut engine);
    assert_eq!(chunks.len(), 1, "only `b.w` is trained");
    assert_eq!(
        values(&chunks[0].grad()),
        [1.0, -2.0, 3.0, -4.0, 5.0],
        "its gradient reached its chunk"
    );
}

#[test]
fn state_dicts_hold_the_masters_and_load_back() {
    let mut params = model();
    let originals = all_values(&params);
    let plan = Plan {
        dtypes: BF16_COMPUTE,
        ..full_shard()
    };
    let mut engine = prepared(plan, two_units(), &mut params);
    let full = engine
        .state_dict(StateDictKind::Full)
        .into_result()
        .unwrap();
    assert_eq!(by_name(&full, "a.w"), originals[0]);
    assert_eq!(by_name(&full, "b.w"), originals[1]);
    assert!(full
        .iter()
        .all(|t| t.tensor.as_tensor_ref().get().kind() == Kind::Float));
    // The model computes with a bf16 copy.
    engine.pre_forward(0).into_result().unwrap();
    assert_eq!(params[0].1.kind(), Kind::BFloat16);
    engine.post_forward(0).into_result().unwrap();

    let doubled: Vec<Tensor> = params
        .iter()
        .map(|(n, _)| {
            let t = full.iter().find(|t| t.name.as_str() == n).unwrap();
            &*t.tensor.as_tensor_ref().get() * 2.0
        })
        .collect();
    let refs: Vec<NamedTensorRef<'_>> = params
        .iter()
        .zip(&doubled)
        .map(|((n, _), t)| NamedTensorRef {
            name: n.as_str().into(),
            tensor: TensorRef::new(t),
        })
        .collect();
    engine
        .load_state_dict(StateDictKind::Full, RSlice::from(&refs[..]))
        .into_result()
        .unwrap();
    let sharded = engine
        .state_dict(StateDictKind::Sharded)
        .into_result()
        .unwrap();
    let twice = |v: &[f32]| v.iter().map(|x| x * 2.0).collect::<Vec<_>>();
    assert_eq!(by_name(&sharded, "a.w"), twice(&originals[0]));
    assert_eq!(by_name(&sharded, "b.w"), twice(&originals[1]));

    // A SHARDED state dict of another layout is refused, naming the problem.
    let wrong = Tensor::zeros([7], (Kind::Float, accel_sdk::tch::Device::Cpu));
    let refs = [NamedTensorRef {
        name: "a.w".into(),
        tensor: TensorRef::new(&wrong),
    }];
    let err = engine
        .load_state_dict(StateDictKind::Sharded, RSlice::from(&refs[..]))
        .into_result()
        .unwrap_err();
    assert!(err.to_string().contains("does not fit"), "{err}");
}

/// Plain SGD with a learning rate of 1 over the tensors the engine hands
/// the optimizer.
struct Sgd(Vec<Tensor>);

impl OptimizerStep for Sgd {
    fn step(&mut self) -> PluginResult<()> {
        accel_sdk::tch::no_grad(|| {
            for t in &self.0 {
                let g = t.grad();
                if g.defined() {
                    let _ = t.shallow_clone().g_sub_(&g);
                }
            }
        });
        PluginResult::ROk(())
    }
}

#[test]
fn small_parameters_stay_whole_and_follow_each_step_and_load() {
    let mut params = model();
    let originals = all_values(&params);
    // `b.w` (5 elements) persists, `a.w` (6) is sharded; each is a unit.
    let plan = Plan {
        persistence: up_to(5),
        dtypes: BF16_COMPUTE,
        ..full_shard()
    };
    let units: WrapPolicy = Box::new(|_, _| {
        Ok(vec![
            ("a".to_owned(), vec![0]),
            ("b".to_owned(), vec![1]),
            (String::new(), vec![]),
        ])
    });
    let mut engine = prepared(plan, units, &mut params);
    let whole = |params: &[(String, Tensor)]| {
        assert_eq!(params[1].1.kind(), Kind::BFloat16);
        values(&params[1].1)
    };
    assert_eq!(shim::storage_bytes(&params[0].1), 0, "a.w sharded");
    assert_eq!(whole(&params), originals[1], "b.w whole, in bf16");
    for u in 0..3 {
        engine.pre_forward(u).into_result().unwrap();
    }
    let loss = half_square_sum(&params);
    for u in 0..3 {
        engine.post_forward(u).into_result().unwrap();
    }
    assert_eq!(shim::storage_bytes(&params[0].1), 0, "freed after forward");
    assert_eq!(whole(&params), originals[1], "kept after forward");
    for u in (0..3).rev() {
        engine.pre_backward(u).into_result().unwrap();
    }
    loss.backward();
    for u in (0..3).rev() {
        engine.post_unit_backward(u).into_result().unwrap();
    }
    engine.post_backward(true).into_result().unwrap();
    assert_eq!(whole(&params), originals[1], "kept after backward");
    assert!(!params[1].1.grad().defined(), "its whole gradient is freed");
    let chunks = optimizer_chunks(&mut engine);
    assert_eq!(values(&chunks[1].grad()), originals[1], "reduced as others");
    // p - 1 * p: the step zeroes the masters, and the whole copy follows.
    let mut sgd = Sgd(chunks);
    engine
        .optimizer_step(OptimizerStep_TO::from_ptr(RMut::new(&mut sgd), TD_Opaque))
        .into_result()
        .unwrap();
    assert_eq!(whole(&params), [0.0; 5], "re-gathered after the step");
    assert_eq!(shim::storage_bytes(&params[0].1), 0);
    // Loading a state dict refills it too.
    let refs: Vec<NamedTensorRef<'_>> = params
        .iter()
        .map(|(n, _)| n.as_str())
        .zip(&sgd.0)
        .map(|(name, chunk)| NamedTensorRef {
            name: name.into(),
            tensor: TensorRef::new(chunk),
        })
        .collect();
    tch_fill(&sgd.0[1], 7.0);
    engine
        .load_state_dict(StateDictKind::Sharded, RSlice::from(&refs[..]))
        .into_result()
        .unwrap();
    assert_eq!(whole(&params), [7.0; 5], "refilled by a load");
}

#[test]
fn persistent_parameters_let_go_of_the_memory_the_program_gave_them() {
    use std::sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    };
    /// The memory a checkpoint mapping would be: says when it is dropped.
    struct Mapping {
        _memory: Box<[f32]>,
        released: Arc<AtomicBool>,
    }
    impl Drop for Mapping {
        fn drop(&mut self) {
            self.released.store(true, Ordering::SeqCst);
        }
    }
    let mut params = model();
    let originals = all_values(&params);
    let released = Arc::new(AtomicBool::new(false));
    let bytes: Box<[f32]> = originals[1].clone().into_boxed_slice();
    let data = bytes.as_ptr() as *mut u8;
    // SAFETY: the mapping (moved into the owner) holds the 20 bytes at
    // `data`, used only through `b.w`.
    unsafe {
        shim::adopt_storage(
            &params[1].1,
            data,
            20,
            Box::new(Mapping {
                _memory: bytes,
                released: released.clone(),
            }),
        )
    }
    .unwrap();
    let plan = Plan {
        persistence: up_to(5),
        ..full_shard()
    };
    let _engine = prepared(plan, two_units(), &mut params);
    assert!(
        released.load(Ordering::SeqCst),
        "b.w still holds the memory it was given"
    );
    assert_eq!(values(&params[1].1), originals[1], "and keeps its value");
}

/// Sets every element of `t` to `v` outside autograd.
fn tch_fill(t: &Tensor, v: f64) {
    accel_sdk::tch::no_grad(|| {
        let _ = t.shallow_clone().fill_(v);
    });
}

#[test]
fn prepare_model_refuses_what_the_engine_cannot_run() {
    let cases: Vec<(Plan, WrapPolicy, &str)> = vec![
        (
            full_shard(),
            Box::new(|_, _| Ok(vec![("a".to_owned(), vec![0]), (String::new(), vec![0])])),
            "wrap policy put `a.w` in units `a` and ``",
        ),
        (
            Plan {
                shard_optimizer: false,
                shard_grads: false,
                shard_params: false,
                dtypes: Dtypes {
                    param: None,
                    reduce: Some(Kind::Float),
                },
                ..full_shard()
            },
            two_units(),
            "a compute or reduce dtype (fp32) needs the optimizer to step on master chunks",
        ),
    ];
    for (plan, wrap, message) in cases {
        let ctx = HostContext_TO::from_ptr(RArc::new(Solo), TD_Opaque);
        let mut engine = Sharded::new(ctx, plan, wrap);
        let mut params = model();
        let mut handles = NamedTensorMut::all(&mut params);
        let err = engine
            .prepare_model(RSliceMut::from(&mut handles[..]))
            .into_result()
            .unwrap_err();
        assert!(err.to_string().contains(message), "{err}");
    }
}

/// An optimizer step whose every chunk has a gradient of ones (SGD at
/// rate 1: every element minus one).
fn step_every_chunk_by_minus_one(engine: &mut Sharded) {
    let chunks = optimizer_chunks(engine);
    for c in &chunks {
        shim::set_grad(c, &c.ones_like()).unwrap();
    }
    let mut sgd = Sgd(chunks);
    engine
        .optimizer_step(OptimizerStep_TO::from_ptr(RMut::new(&mut sgd), TD_Opaque))
        .into_result()
        .unwrap();
}

#[test]
fn a_unit_left_gathered_by_a_forward_without_backward_follows_the_next_step() {
    let mut params = model();
    let originals = all_values(&params);
    // The root unit (b.w) is not freed after its forward.
    let mut engine = prepared(full_shard(), two_units(), &mut params);
    let root = 1;
    engine.pre_forward(root).into_result().unwrap();
    engine.post_forward(root).into_result().unwrap();
    assert_eq!(
        values(&params[1].1),
        originals[1],
        "gathered by the forward"
    );
    // A step with no backward before it: every chunk minus one.
    step_every_chunk_by_minus_one(&mut engine);
    engine.pre_forward(root).into_result().unwrap();
    let stepped: Vec<f32> = originals[1].iter().map(|x| x - 1.0).collect();
    assert_eq!(
        values(&params[1].1),
        stepped,
        "the next forward sees the step"
    );
}

#[test]
fn a_prefetch_dropped_before_a_step_frees_the_storage_it_gathered_into() {
    let mut params = model();
    let originals = all_values(&params);
    let mut plan = full_shard();
    plan.overlap.forward_prefetch = true;
    let mut engine = prepared(plan, two_units(), &mut params);
    let root = 1;
    // The first step records the order: unit 0's forward, then the root's.
    for u in [0, root] {
        engine.pre_forward(u).into_result().unwrap();
        engine.post_forward(u).into_result().unwrap();
    }
    for u in [root, 0] {
        engine.pre_backward(u).into_result().unwrap();
        engine.post_unit_backward(u).into_result().unwrap();
    }
    engine.post_backward(true).into_result().unwrap();
    assert_eq!(shim::storage_bytes(&params[1].1), 0, "the root resharded");
    // Unit 0's forward prefetches the root, gathering `b.w` straight into
    // its storage; the root's forward never comes before the step.
    engine.pre_forward(0).into_result().unwrap();
    assert_eq!(shim::storage_bytes(&params[1].1), 20, "prefetched");
    engine.post_forward(0).into_result().unwrap();
    step_every_chunk_by_minus_one(&mut engine);
    assert_eq!(
        shim::storage_bytes(&params[1].1),
        0,
        "the dropped prefetch let go of `b.w`"
    );
    engine.pre_forward(root).into_result().unwrap();
    let stepped: Vec<f32> = originals[1].iter().map(|x| x - 1.0).collect();
    assert_eq!(values(&params[1].1), stepped, "gathered again, stepped");
}
