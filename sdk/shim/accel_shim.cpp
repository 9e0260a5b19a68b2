// The C++ shim: what tch does not expose, called from `accel_sdk::shim`.
//
// Every function takes `at::Tensor*` (tch's `C_tensor`), never throws across
// the boundary, and returns NULL on success or a heap-allocated message
// (freed with `accel_shim_free`).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/DeviceAccelerator.h>
#include <torch/version.h>
#include <ATen/SequenceNumber.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

namespace {

char* dup_message(const char* what) {
  size_t n = std::strlen(what);
  char* out = static_cast<char*>(std::malloc(n + 1));
  if (out != nullptr) std::memcpy(out, what, n + 1);
  return out;
}

template <typename F>
char* guarded(F&& f) {
  try {
    f();
    return nullptr;
  } catch (const c10::Error& e) {
    return dup_message(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return dup_message(e.what());
  } catch (...) {
    return dup_message("unknown C++ exception");
  }
}

std::vector<at::Tensor> list(at::Tensor* const* ts, size_t n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) out.push_back(*ts[i]);
  return out;
}

at::DeviceType device_type(int device) {
  return device == 1 ? at::kCUDA : at::kCPU;
}

// A Rust closure: `call(ctx, buf, cap)` runs it and returns false with a
// message in `buf` on failure; `drop(ctx)` frees it. Owned by the hook that
// holds it, so the closure lives exactly as long as the hook can fire.
struct RustCallback {
  bool (*call)(void*, char*, size_t);
  void (*drop)(void*);
  void* ctx;
  RustCallback(bool (*c)(void*, char*, size_t), void (*d)(void*), void* x)
      : call(c), drop(d), ctx(x) {}
  RustCallback(const RustCallback&) = delete;
  RustCallback& operator=(const RustCallback&) = delete;
  ~RustCallback() { drop(ctx); }
  // Runs the closure; a failure becomes a C++ exception, which the autograd
  // engine carries out of backward() as an error.
  void operator()() const {
    char buf[2048] = {0};
    if (!call(ctx, buf, sizeof(buf) - 1)) throw std::runtime_error(buf);
  }
};

// Runs a callback after a node executed: on a leaf's gradient accumulator,
// once it wrote `.grad` (PyTorch's Reducer uses the same post hook: the
// gradient is final for this backward).
template <typename Callback>
struct AfterNodeHook : torch::autograd::FunctionPostHook {
  std::shared_ptr<Callback> callback;
  explicit AfterNodeHook(std::shared_ptr<Callback> cb) : callback(std::move(cb)) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    (*callback)();
    return outputs;
  }
};

// One Rust closure shared by the hooks of several autograd nodes, called
// one at a time.
struct SharedCallback {
  RustCallback callback;
  std::mutex lock;
  SharedCallback(bool (*c)(void*, char*, size_t), void (*d)(void*), void* x) : callback(c, d, x) {}
  void operator()() {
    std::lock_guard<std::mutex> guard(lock);
    callback();
  }
};

// Runs the closure before a node executes (every gradient into it is in).
struct BeforeNodeHook : torch::autograd::FunctionPreHook {
  std::shared_ptr<SharedCallback> shared;
  explicit BeforeNodeHook(std::shared_ptr<SharedCallback> s) : shared(std::move(s)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    (*shared)();
    return grads;
  }
};

// Keeps a leaf's gradient accumulator (and so the hook on it) alive: the
// variable itself holds it only weakly.
struct GradAccumulatorHandle {
  c10::intrusive_ptr<torch::autograd::Node> accumulator;
};

// A Rust layer run by activation checkpointing: `call(ctx, inputs, n, out,
// buf, cap)` runs it on `n` inputs, hands every output to
// `accel_tensor_list_push(out, t)`, and returns false with a message in
// `buf` on failure; `drop(ctx)` frees it when the autograd node goes.
struct RustLayer : torch::CustomClassHolder {
  bool (*call)(void*, at::Tensor* const*, size_t, void*, char*, size_t);
  void (*drop)(void*);
  void* ctx;
  RustLayer(bool (*c)(void*, at::Tensor* const*, size_t, void*, char*, size_t), void (*d)(void*),
            void* x)
      : call(c), drop(d), ctx(x) {}
  RustLayer(const RustLayer&) = delete;
  RustLayer& operator=(const RustLayer&) = delete;
  ~RustLayer() override { drop(ctx); }
  std::vector<at::Tensor> operator()(std::vector<at::Tensor>& inputs) const {
    std::vector<at::Tensor*> ptrs;
    ptrs.reserve(inputs.size());
    for (auto& t : inputs) ptrs.push_back(&t);
    std::vector<at::Tensor> out;
    char buf[4096] = {0};
    if (!call(ctx, ptrs.data(), ptrs.size(), &out, buf, sizeof(buf) - 1))
      throw std::runtime_error(buf);
    return out;
  }
};

// The autocast state of the CPU and CUDA, as a checkpointed forward saw it.
struct AutocastState {
  bool cpu_enabled, cuda_enabled;
  at::ScalarType cpu_dtype, cuda_dtype;
  static AutocastState now() {
    return {at::autocast::is_autocast_enabled(at::kCPU),
            at::autocast::is_autocast_enabled(at::kCUDA),
            at::autocast::get_autocast_dtype(at::kCPU), at::autocast::get_autocast_dtype(at::kCUDA)};
  }
  void apply() const {
    at::autocast::set_autocast_enabled(at::kCPU, cpu_enabled);
    at::autocast::set_autocast_enabled(at::kCUDA, cuda_enabled);
    at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
    at::autocast::set_autocast_dtype(at::kCUDA, cuda_dtype);
  }
};

// Puts a forward's autocast state back for a recomputation, as an autocast
// region of its own (its cast cache cleared when the outermost one ends),
// and the state before it afterwards, also when the recomputation throws.
struct AutocastRestore {
  AutocastState before;
  explicit AutocastRestore(const AutocastState& saved) : before(AutocastState::now()) {
    saved.apply();
    at::autocast::increment_nesting();
  }
  ~AutocastRestore() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    before.apply();
  }
};

// Sets the default generators of the CPU and the given CUDA devices to
// `states` and puts their current states back when it goes (torch's
// fork_rng): the recomputation draws the forward's random numbers (dropout
// masks) and the rest of the program its own.
struct RngFork {
  std::vector<std::pair<at::Generator, at::Tensor>> before;
  RngFork(const std::vector<at::Generator>& gens, const std::vector<at::Tensor>& states) {
    for (size_t i = 0; i < gens.size(); ++i) {
      auto gen = gens[i];
      std::lock_guard<std::mutex> lock(gen.mutex());
      before.emplace_back(gen, gen.get_state());
      gen.set_state(states[i]);
    }
  }
  ~RngFork() {
    for (auto& [gen, state] : before) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  }
};

// The generators a layer on `inputs` may draw from: the CPU's and those of
// the CUDA devices among the inputs.
std::vector<at::Generator> generators_of(const std::vector<at::Tensor>& inputs) {
  std::vector<at::Generator> gens{at::detail::getDefaultCPUGenerator()};
  std::vector<c10::DeviceIndex> seen;
  for (const auto& t : inputs) {
    if (!t.defined() || !t.is_cuda()) continue;
    auto index = t.device().index();
    if (std::find(seen.begin(), seen.end(), index) != seen.end()) continue;
    seen.push_back(index);
    gens.push_back(at::globalContext().defaultGenerator(t.device()));
  }
  return gens;
}

// Activation checkpointing (torch.utils.checkpoint's reentrant variant): the
// forward runs the layer without grad, keeping only its inputs, the random
// generators' states and the autocast state; backward runs it again with
// grad on detached inputs under the same generator and autocast states,
// backpropagates the incoming gradients through it (parameters accumulate
// their gradients as usual) and returns the inputs' gradients.
struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList input_list,
                                                const at::Tensor& /*anchor*/,
                                                c10::intrusive_ptr<RustLayer> layer) {
    std::vector<at::Tensor> inputs = input_list.vec();
    auto gens = generators_of(inputs);
    c10::List<at::Tensor> states;
    for (auto& gen : gens) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      states.push_back(gen.get_state());
    }
    auto autocast = AutocastState::now();
    ctx->saved_data["layer"] = c10::IValue::make_capsule(layer);
    ctx->saved_data["rng"] = states;
    ctx->saved_data["autocast"] = c10::List<int64_t>(
        {autocast.cpu_enabled, autocast.cuda_enabled, static_cast<int64_t>(autocast.cpu_dtype),
         static_cast<int64_t>(autocast.cuda_dtype)});
    ctx->save_for_backward(inputs);
    // Casts made here have no history: keep them out of autocast's cache,
    // where a later use of the same weight with grad would find them.
    bool cache = at::autocast::is_autocast_cache_enabled();
    at::autocast::set_autocast_cache_enabled(false);
    std::vector<at::Tensor> outputs;
    try {
      outputs = (*layer)(inputs);
    } catch (...) {
      at::autocast::set_autocast_cache_enabled(cache);
      throw;
    }
    at::autocast::set_autocast_cache_enabled(cache);
    TORCH_CHECK(!outputs.empty(), "a checkpointed layer returned no tensor");
    for (const auto& t : outputs)
      TORCH_CHECK(t.defined(), "a checkpointed layer returned an undefined tensor");
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto layer = ctx->saved_data["layer"].toCapsule();
    auto* run = static_cast<RustLayer*>(layer.get());
    std::vector<at::Tensor> states;
    states = ctx->saved_data["rng"].toTensorVector();
    auto a = ctx->saved_data["autocast"].toIntList();
    AutocastState autocast{a.get(0) != 0, a.get(1) != 0, static_cast<at::ScalarType>(a.get(2)),
                           static_cast<at::ScalarType>(a.get(3))};
    std::vector<at::Tensor> detached;
    detached.reserve(saved.size());
    for (const auto& t : saved) {
      auto d = t.detach();
      if (t.requires_grad()) d.set_requires_grad(true);
      detached.push_back(d);
    }
    std::vector<at::Tensor> outputs;
    {
      RngFork fork(generators_of(saved), states);
      AutocastRestore restore(autocast);
      at::AutoGradMode grad(true);
      outputs = (*run)(detached);
    }
    TORCH_CHECK(outputs.size() == grads.size(), "a checkpointed layer returned ", outputs.size(),
                " tensor(s) when recomputed, ", grads.size(), " in its forward");
    torch::autograd::variable_list roots, root_grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].requires_grad() && grads[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grads[i]);
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, root_grads);
    torch::autograd::variable_list result;
    for (const auto& d : detached) result.push_back(d.requires_grad() ? d.grad() : at::Tensor());
    result.emplace_back();  // the anchor
    result.emplace_back();  // the layer
    return result;
  }
};

}  // namespace

// Exported by libtorch (torch/csrc/profiler/kineto_shim.h, whose Kineto
// headers are not installed with it).
namespace torch::autograd::profiler {
TORCH_API void addMetadataJson(const std::string& key, const std::string& value);
}

extern "C" {

void accel_shim_free(char* message) { std::free(message); }

// Enters an autocast region for `device` (0 CPU, 1 CUDA), `enabled` casting
// to `dtype` (a c10::ScalarType code; below 0 the current one), or not, as
// `torch.autocast(device_type, dtype, enabled)`; writes the previous state
// to `prev_enabled` and `prev_dtype` for `accel_autocast_exit`.
char* accel_autocast_enter(int device, bool enabled, int dtype, bool* prev_enabled,
                           int* prev_dtype) {
  return guarded([&] {
    auto dt = device_type(device);
    *prev_enabled = at::autocast::is_autocast_enabled(dt);
    *prev_dtype = static_cast<int>(at::autocast::get_autocast_dtype(dt));
    at::autocast::set_autocast_enabled(dt, enabled);
    if (dtype >= 0) at::autocast::set_autocast_dtype(dt, static_cast<at::ScalarType>(dtype));
    at::autocast::increment_nesting();
  });
}

// Leaves the region `accel_autocast_enter` opened, restoring its state and
// clearing the cast cache when the outermost region closes.
char* accel_autocast_exit(int device, bool prev_enabled, int prev_dtype) {
  return guarded([&] {
    auto dt = device_type(device);
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(dt, prev_enabled);
    at::autocast::set_autocast_dtype(dt, static_cast<at::ScalarType>(prev_dtype));
  });
}

// Whether autocast is on for `device`.
bool accel_autocast_enabled(int device) {
  try {
    return at::autocast::is_autocast_enabled(device_type(device));
  } catch (...) {
    return false;
  }
}

// Releases the unused memory the accelerator's caching allocator (CUDA's)
// holds, as `torch.accelerator.empty_cache()`: nothing without an
// accelerator or before its allocator is initialised. Writes whether a
// cache was emptied.
char* accel_empty_device_cache(bool* emptied) {
  return guarded([&] {
    *emptied = false;
    // The device-generic allocator API (torch.accelerator.empty_cache)
    // is libtorch 2.9's; before it, nothing is emptied.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 9)
    auto device = at::accelerator::getAccelerator(false);
    if (!device) return;
    auto* allocator = at::getDeviceAllocator(*device);
    if (allocator == nullptr || !allocator->initialized()) return;
    allocator->emptyCache();
    *emptied = true;
#endif
  });
}

// Makes `grad` the gradient of `param` (undefined `grad` clears it), so a
// strategy can point gradients into its own buffers (DDP's
// gradient_as_bucket_view): backward then accumulates into them in place.
char* accel_set_grad(at::Tensor* param, const at::Tensor* grad) {
  return guarded([&] { param->mutable_grad() = *grad; });
}

// The default generator of `device` (0 CPU, 1 CUDA device `index`).
at::Generator default_generator(int device, int index) {
  return device == 1 ? at::globalContext().defaultGenerator(at::Device(at::kCUDA, index))
                     : at::detail::getDefaultCPUGenerator();
}

// Copies the state of a default generator into `out` (a uint8 tensor), as
// torch.get_rng_state / torch.cuda.get_rng_state.
char* accel_rng_get_state(int device, int index, at::Tensor* out) {
  return guarded([&] {
    auto gen = default_generator(device, index);
    std::lock_guard<std::mutex> lock(gen.mutex());
    *out = gen.get_state();
  });
}

// Restores a state `accel_rng_get_state` returned.
char* accel_rng_set_state(int device, int index, const at::Tensor* state) {
  return guarded([&] {
    auto gen = default_generator(device, index);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(*state);
  });
}

// `torch.randperm(n, generator=g)` with `g` a fresh CPU generator seeded
// with `seed` (`torch.Generator().manual_seed(seed)`): the order Accelerate's
// SeedableRandomSampler draws, leaving the default generator alone.
char* accel_randperm(int64_t n, uint64_t seed, at::Tensor* out) {
  return guarded([&] {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    *out = at::randperm(n, gen, at::TensorOptions().dtype(at::kLong));
  });
}

// GradScaler's unscale: multiplies every gradient by `inv_scale` and sets
// `found_inf` to 1 when any holds inf or NaN.
char* accel_amp_unscale(at::Tensor* const* grads, size_t n, at::Tensor* found_inf,
                        const at::Tensor* inv_scale) {
  return guarded([&] {
    auto gs = list(grads, n);
    at::_amp_foreach_non_finite_check_and_unscale_(gs, *found_inf, *inv_scale);
  });
}

// torch.optim.SGD's single-tensor step for one parameter. `buf` is the
// momentum buffer: undefined before the first step, set here.
char* accel_sgd_step(at::Tensor* param, const at::Tensor* grad_in, at::Tensor* buf, double lr,
                     double momentum, double dampening, double weight_decay, bool nesterov,
                     bool maximize) {
  return guarded([&] {
    at::NoGradGuard no_grad;
    at::Tensor grad = maximize ? grad_in->neg() : *grad_in;
    if (weight_decay != 0) grad = grad.add(*param, weight_decay);
    if (momentum != 0) {
      if (!buf->defined()) {
        *buf = grad.clone().detach();
      } else {
        buf->mul_(momentum).add_(grad, 1 - dampening);
      }
      grad = nesterov ? grad.add(*buf, momentum) : *buf;
    }
    param->add_(grad, -lr);
  });
}

// The hyper-parameters of one Adam/AdamW update (torch.optim's names), laid
// out as the Rust side's `AdamHyper`.
struct AccelAdamHyper {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad, decoupled, maximize;
};

// torch.optim.Adam / AdamW's single-tensor step for one parameter (`step`
// already counts this step). `max_exp_avg_sq` is used with `amsgrad` only.
char* accel_adam_step(at::Tensor* param, const at::Tensor* grad_in, at::Tensor* exp_avg,
                      at::Tensor* exp_avg_sq, at::Tensor* max_exp_avg_sq, double step,
                      const AccelAdamHyper* hyper) {
  const AccelAdamHyper& h = *hyper;
  return guarded([&] {
    at::NoGradGuard no_grad;
    at::Tensor grad = h.maximize ? grad_in->neg() : *grad_in;
    if (h.weight_decay != 0) {
      if (h.decoupled) {
        param->mul_(1 - h.lr * h.weight_decay);
      } else {
        grad = grad.add(*param, h.weight_decay);
      }
    }
    exp_avg->lerp_(grad, 1 - h.beta1);
    exp_avg_sq->mul_(h.beta2).addcmul_(grad, grad, 1 - h.beta2);
    double bias_correction1 = 1 - std::pow(h.beta1, step);
    double bias_correction2 = 1 - std::pow(h.beta2, step);
    double step_size = h.lr / bias_correction1;
    double bias_correction2_sqrt = std::sqrt(bias_correction2);
    at::Tensor denom;
    if (h.amsgrad) {
      at::maximum_out(*max_exp_avg_sq, *max_exp_avg_sq, *exp_avg_sq);
      denom = (max_exp_avg_sq->sqrt() / bias_correction2_sqrt).add_(h.eps);
    } else {
      denom = (exp_avg_sq->sqrt() / bias_correction2_sqrt).add_(h.eps);
    }
    param->addcdiv_(*exp_avg, denom, -step_size);
  });
}

// ATen's fused Adam/AdamW (`decoupled`) over `n` parameters at once;
// `steps` are float scalar tensors, incremented by the kernel's caller
// (torch.optim increments them before the call, and so do we).
char* accel_fused_adam(at::Tensor* const* params, at::Tensor* const* grads,
                       at::Tensor* const* exp_avgs, at::Tensor* const* exp_avg_sqs,
                       at::Tensor* const* max_exp_avg_sqs, at::Tensor* const* steps, size_t n,
                       const AccelAdamHyper* hyper) {
  const AccelAdamHyper& h = *hyper;
  return guarded([&] {
    at::NoGradGuard no_grad;
    auto p = list(params, n), g = list(grads, n), m = list(exp_avgs, n),
         v = list(exp_avg_sqs, n), s = list(steps, n);
    auto vmax = h.amsgrad ? list(max_exp_avg_sqs, n) : std::vector<at::Tensor>{};
    if (h.decoupled) {
      at::_fused_adamw_(p, g, m, v, vmax, s, h.lr, h.beta1, h.beta2, h.weight_decay, h.eps,
                        h.amsgrad, h.maximize);
    } else {
      at::_fused_adam_(p, g, m, v, vmax, s, h.lr, h.beta1, h.beta2, h.weight_decay, h.eps,
                       h.amsgrad, h.maximize);
    }
  });
}

// Calls `call(ctx, ...)` each time backward has accumulated `param`'s
// gradient (a leaf that requires grad); `drop(ctx)` runs when the hook is
// destroyed. `*handle` keeps the accumulator alive until
// `accel_grad_ready_release`.
char* accel_grad_ready_hook(at::Tensor* param, bool (*call)(void*, char*, size_t),
                            void (*drop)(void*), void* ctx, void** handle) {
  auto callback = std::make_shared<RustCallback>(call, drop, ctx);
  return guarded([&] {
    TORCH_CHECK(param->is_leaf() && param->requires_grad(),
                "a gradient-ready hook needs a leaf tensor that requires grad");
    auto acc = torch::autograd::impl::grad_accumulator(*param);
    TORCH_CHECK(acc != nullptr, "the tensor has no gradient accumulator");
    acc->add_post_hook(std::make_unique<AfterNodeHook<RustCallback>>(callback));
    *handle = new GradAccumulatorHandle{acc};
  });
}

// Releases what `accel_grad_ready_hook` kept alive.
void accel_grad_ready_release(void* handle) {
  delete static_cast<GradAccumulatorHandle*>(handle);
}

// Calls `call(ctx, ...)` when backward has computed the gradient with
// respect to `output` (a non-leaf that requires grad), before the ops that
// produced it run their backward: FSDP's pre-backward point.
char* accel_grad_hook(at::Tensor* output, bool (*call)(void*, char*, size_t),
                      void (*drop)(void*), void* ctx) {
  auto callback = std::make_shared<RustCallback>(call, drop, ctx);
  return guarded([&] {
    TORCH_CHECK(output->requires_grad(), "the tensor does not require grad");
    output->register_hook([callback](const at::TensorBase&) { (*callback)(); });
  });
}

// The sequence number the next autograd node made on this thread gets:
// nodes made after this call have one at least as large.
uint64_t accel_sequence_peek() { return at::sequence_number::peek(); }

// The graph a scope made: the nodes reached from the `outputs`' through
// nodes made since sequence number `since`. Hooks its boundary, each
// running `call(ctx, ...)`: before each first node made before `since`
// (what the scope read) executes, and after each node of the scope that
// hands a leaf its gradient (a parameter's, a leaf input's accumulator) or
// hands nothing on (activation checkpointing's node when no input needs a
// gradient: the parameters' gradients come from inside it) executed; sets
// `*count` to their number. Once every one has run, no node
// of the scope is left in backward (each lies upstream of one of them,
// and a node runs only after every node upstream of it). The hooks are on
// nodes of this graph only, never on a leaf's accumulator, which may
// outlive it. Nodes numbered UINT64_MAX (made outside any sequence) are
// walked through; an output that is a leaf has no node and adds nothing.
char* accel_scope_boundary_hooks(at::Tensor* const* outputs, size_t n, uint64_t since,
                                 bool (*call)(void*, char*, size_t), void (*drop)(void*),
                                 void* ctx, size_t* count) {
  auto shared = std::make_shared<SharedCallback>(call, drop, ctx);
  return guarded([&] {
    using torch::autograd::Node;
    using NodePtr = decltype(torch::autograd::Edge::function);  // shared or intrusive
    auto is_leaf = [](const NodePtr& node) {
      return dynamic_cast<torch::autograd::AccumulateGrad*>(node.get()) != nullptr;
    };
    std::vector<NodePtr> todo, before, after;
    std::unordered_set<Node*> seen;
    auto visit = [&](const NodePtr& node) {
      if (node && !is_leaf(node) && seen.insert(node.get()).second) todo.push_back(node);
    };
    for (size_t i = 0; i < n; ++i) {
      if (outputs[i]->requires_grad()) visit(outputs[i]->grad_fn());
    }
    while (!todo.empty()) {
      NodePtr node = std::move(todo.back());
      todo.pop_back();
      uint64_t seq = node->sequence_nr();
      if (seq < since && seq != UINT64_MAX) {
        before.push_back(std::move(node));
        continue;
      }
      bool feeds_leaf = false, sink = true;
      for (const auto& edge : node->next_edges()) {
        feeds_leaf |= edge.function && is_leaf(edge.function);
        sink &= !edge.function;
        visit(edge.function);
      }
      if (feeds_leaf || sink) after.push_back(std::move(node));
    }
    for (auto& node : before) {
      node->add_pre_hook(std::make_unique<BeforeNodeHook>(shared));
    }
    for (auto& node : after) {
      node->add_post_hook(std::make_unique<AfterNodeHook<SharedCallback>>(shared));
    }
    *count = before.size() + after.size();
  });
}

// Frees the memory behind `t` (and every tensor sharing its storage): the
// tensor keeps its shape but holds 0 bytes until `accel_storage_fill`. The
// version counter is untouched, so autograd's saved references stay valid
// for when the data comes back (how FSDP reshards).
char* accel_storage_free(at::Tensor* t) {
  return guarded([&] {
    auto* impl = t->storage().unsafeGetStorageImpl();
    impl->set_data_ptr_noswap(at::DataPtr(nullptr, t->device()));
    impl->set_nbytes(0);
  });
}

// Gives the contiguous `t` memory again when it has none (sized for `t`), and
// returns a tensor on its storage with its shape and strides but a version
// counter of its own: writing into it does not bump `t`'s.
static at::Tensor refilled_alias(const at::Tensor& t, const char* who) {
  TORCH_CHECK(t.is_contiguous(), who, " needs a contiguous tensor");
  auto storage = t.storage();
  size_t need = static_cast<size_t>(t.storage_offset() + t.numel()) * t.element_size();
  if (storage.nbytes() < need) {
    auto* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->allocator() != nullptr, "the tensor's storage has no allocator");
    impl->set_data_ptr_noswap(impl->allocator()->allocate(need));
    impl->set_nbytes(need);
  }
  at::Tensor alias = at::empty({0}, t.options());
  alias.set_(storage, t.storage_offset(), t.sizes(), t.strides());
  return alias;
}

// Gives `t` memory again when it has none (sized for `t`, which must be
// contiguous) and copies `src` into it, without bumping the version counter.
char* accel_storage_fill(at::Tensor* t, const at::Tensor* src) {
  return guarded([&] {
    at::NoGradGuard no_grad;
    refilled_alias(*t, "accel_storage_fill").copy_(src->reshape(t->sizes()));
  });
}

// Gives `t` memory again when it has none (sized for `t`, which must be
// contiguous) and puts a flat tensor on that memory into `out`, left unwritten:
// what a collective then fills, straight into `t`. Writing through `out` does
// not bump `t`'s version counter.
char* accel_storage_refill(at::Tensor* t, at::Tensor* out) {
  return guarded([&] {
    *out = refilled_alias(*t, "accel_storage_refill").view({t->numel()});
  });
}

// As accel_storage_fill, from `rows`, a 2-D block of any strides whose first
// `t.numel()` elements in row-major order are the value: a parameter's chunks
// as an all-gather left them (a column block of the receive buffer). One copy,
// where reshaping the block first would make two.
char* accel_storage_fill_rows(at::Tensor* t, const at::Tensor* rows) {
  return guarded([&] {
    at::NoGradGuard no_grad;
    TORCH_CHECK(rows->dim() == 2, "accel_storage_fill_rows needs a 2-D block, not ", rows->dim(), "-D");
    int64_t n = t->numel();
    int64_t c = rows->size(1);
    TORCH_CHECK(rows->numel() >= n, "accel_storage_fill_rows: a block of ", rows->numel(),
                " elements for a tensor of ", n);
    at::Tensor flat = refilled_alias(*t, "accel_storage_fill_rows").view({n});
    if (n == 0) {
      return;
    }
    TORCH_CHECK(c > 0, "accel_storage_fill_rows: a block of empty rows for a tensor of ", n);
    int64_t full = n / c;
    int64_t rest = n % c;
    if (full > 0) {
      flat.narrow(0, 0, full * c).view({full, c}).copy_(rows->narrow(0, 0, full));
    }
    if (rest > 0) {
      flat.narrow(0, full * c, rest).copy_(rows->select(0, full).narrow(0, 0, rest));
    }
  });
}

// Makes `t`'s storage use `nbytes` at `data`, memory the caller owns (a file
// mapping): `release(ctx)` runs once libtorch lets go of it (the storage freed
// by `accel_storage_free`, or its last tensor dropped); it owns `ctx` from
// this call on, also when the call fails. The storage keeps its allocator, so
// `accel_storage_fill` can give it fresh memory later.
char* accel_storage_adopt(at::Tensor* t, void* data, size_t nbytes, void* ctx,
                          void (*release)(void*)) {
  at::DataPtr owned(data, ctx, release, at::Device(at::kCPU));
  return guarded([&] {
    TORCH_CHECK(t->device().is_cpu(), "accel_storage_adopt needs a CPU tensor");
    TORCH_CHECK(t->is_contiguous(), "accel_storage_adopt needs a contiguous tensor");
    size_t need = static_cast<size_t>(t->storage_offset() + t->numel()) * t->element_size();
    TORCH_CHECK(nbytes >= need, "accel_storage_adopt: ", nbytes, " bytes for a tensor of ", need);
    auto* impl = t->storage().unsafeGetStorageImpl();
    impl->set_data_ptr_noswap(std::move(owned));
    impl->set_nbytes(nbytes);
  });
}

// Bytes of memory behind `t` now (0 after `accel_storage_free`).
size_t accel_storage_nbytes(const at::Tensor* t) {
  try {
    return t->defined() ? t->storage().nbytes() : 0;
  } catch (...) {
    return 0;
  }
}

// Hands one output of a checkpointed layer to the shim (`list` is the
// vector `RustLayer` passed to the layer).
char* accel_tensor_list_push(void* list, const at::Tensor* t) {
  return guarded([&] { static_cast<std::vector<at::Tensor>*>(list)->push_back(*t); });
}

// Runs the layer `call(ctx, ...)` on `inputs` with activation checkpointing
// (see CheckpointFunction) and calls `emit(out, t)` with each output;
// `drop(ctx)` frees the layer when the autograd graph no longer needs it
// (at once when grad is off, or on failure). With grad on, the outputs
// require grad even when no input does, so the layer's parameters get
// their gradients.
char* accel_checkpoint(at::Tensor* const* inputs, size_t n,
                       bool (*call)(void*, at::Tensor* const*, size_t, void*, char*, size_t),
                       void (*drop)(void*), void* ctx, void (*emit)(void*, const at::Tensor*),
                       void* out) {
  auto layer = c10::make_intrusive<RustLayer>(call, drop, ctx);
  return guarded([&] {
    // An input that requires grad, so the layer's parameters get their
    // gradients even when none of its inputs requires grad (frozen
    // embeddings before the first block): reentrant checkpointing's pitfall.
    at::Tensor anchor = at::empty({0}, at::TensorOptions().dtype(at::kFloat));
    anchor.set_requires_grad(true);
    auto in = list(inputs, n);
    auto outputs = CheckpointFunction::apply(at::TensorList(in), anchor, std::move(layer));
    for (const auto& t : outputs) emit(out, &t);
  });
}

// Starts libtorch's Kineto profiler (torch.profiler's engine) on this thread
// and the threads autograd hands its work to: CPU operators, and CUDA kernels
// when `cuda`; input shapes, allocations and FLOPs on request.
char* accel_profiler_start(bool cuda, bool record_shapes, bool profile_memory, bool with_flops) {
  return guarded([&] {
    namespace impl = torch::profiler::impl;
    TORCH_CHECK(!impl::profilerEnabled(), "a profiler is already running on this thread");
    impl::ProfilerConfig config(impl::ProfilerState::KINETO, record_shapes, profile_memory,
                                /*with_stack=*/false, with_flops, /*with_modules=*/false);
    std::set<impl::ActivityType> activities{impl::ActivityType::CPU};
    if (cuda) activities.insert(impl::ActivityType::CUDA);
    torch::autograd::profiler::prepareProfiler(config, activities);
    torch::autograd::profiler::enableProfiler(config, activities);
  });
}

// Stops the profiler started on this thread: hands each recorded event to
// `emit(ctx, name, device, thread or stream, start_ns, duration_ns, flops)` (device 0
// CPU, 1 CUDA, 2 other) and, when `path` is not NULL, writes the Chrome trace
// there.
char* accel_profiler_stop(const char* path,
                          void (*emit)(void*, const char*, int, uint64_t, uint64_t, uint64_t,
                                       uint64_t),
                          void* ctx) {
  return guarded([&] {
    TORCH_CHECK(torch::profiler::impl::profilerEnabled(), "no profiler is running on this thread");
    auto result = torch::autograd::profiler::disableProfiler();
    TORCH_CHECK(result != nullptr, "no profiler is running on this thread");
    for (const auto& e : result->events()) {
      if (e.isHiddenEvent()) continue;
      auto type = e.deviceType();
      int device = type == c10::DeviceType::CPU ? 0 : type == c10::DeviceType::CUDA ? 1 : 2;
      std::string name = e.name();
      // A kernel's "thread" is its stream.
      uint64_t lane = device == 0 ? e.startThreadId() : static_cast<uint64_t>(e.deviceResourceId());
      emit(ctx, name.c_str(), device, lane, e.startNs(), e.durationNs(), e.flops());
    }
    if (path != nullptr) result->save(path);
  });
}

// Adds `key: json` to the top level of the running profiler's trace (as
// torch.profiler's `add_metadata_json`, which writes `distributedInfo`).
char* accel_profiler_metadata(const char* key, const char* json) {
  return guarded([&] { torch::autograd::profiler::addMetadataJson(key, json); });
}

// Opens a named range (a `torch.profiler.record_function`) that the running
// profiler records; NULL (and nothing recorded) when no profiler listens.
void* accel_range_enter(const char* name, size_t len) {
  auto callbacks = at::getStepCallbacksUnlessEmpty(at::RecordScope::USER_SCOPE);
  if (!callbacks) return nullptr;
  try {
    auto* range = new at::RecordFunction(std::move(*callbacks));
    range->before(std::string_view(name, len));
    return range;
  } catch (...) {
    return nullptr;
  }
}

// Closes a range `accel_range_enter` opened, on the thread that opened it.
void accel_range_exit(void* range) { delete static_cast<at::RecordFunction*>(range); }

// Reads a file `torch.save` wrote (its zip format, torch 1.6 on) holding a
// dict of tensors by name, a state dict such as transformers'
// `pytorch_model.bin`, with torch's restricted unpickler
// (`torch::jit::pickle_load`: tensors, containers and plain values; a Python
// class or call is refused, never run). Checks every entry, then calls
// `emit(ctx, name, tensor)` for each, in the file's order.
char* accel_load_state_dict(const char* path, void* ctx,
                            void (*emit)(void*, const char*, const at::Tensor*)) {
  return guarded([&] {
    c10::IValue value;
    {
      std::ifstream file(path, std::ios::binary);
      if (!file) throw std::runtime_error("cannot open it");
      std::vector<char> data((std::istreambuf_iterator<char>(file)),
                             std::istreambuf_iterator<char>());
      value = torch::jit::pickle_load(data);
    }
    if (!value.isGenericDict()) {
      throw std::runtime_error(std::string("it holds a ") + value.tagKind() +
                               ", not a dict of tensors by name (a state dict)");
    }
    auto dict = value.toGenericDict();
    for (const auto& entry : dict) {
      if (!entry.key().isString()) {
        throw std::runtime_error(std::string("a key is a ") + entry.key().tagKind() +
                                 ", not a tensor name");
      }
      if (!entry.value().isTensor()) {
        throw std::runtime_error("`" + entry.key().toStringRef() + "` is a " +
                                 entry.value().tagKind() + ", not a tensor");
      }
    }
    for (const auto& entry : dict) {
      const at::Tensor& t = entry.value().toTensor();
      emit(ctx, entry.key().toStringRef().c_str(), &t);
    }
  });
}

}  // extern "C"
