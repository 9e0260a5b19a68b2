//! The XLA strategy (`plugins/xla`) on PyPI's PJRT CPU plugin
//! (`xla-cpu-pjrt`, installed into `.venv` by `scripts/bootstrap.sh`):
//! gradients synced through compiled XLA collectives equal the MPI path's,
//! `mlp` with `distributed_type: XLA` trains like DDP, what happens on two
//! processes, bad PJRT plugins fail cleanly, and `accel env` lists the
//! PJRT platform and devices.

use accel::plugins::PluginSet;
use accel_integration_tests::{
    accel_bin, assert_stdout_contains, build_bin, build_plain_c_library, build_plugin_into,
    describe, file_in, launch_mlp, max_abs_diff, mlp, no_hf_home, output_of, read_weights, run_ok,
    workspace_root,
};
use accel_sdk::{
    abi_stable::{
        sabi_trait::TD_Opaque,
        std_types::{RArc, RErr, RStr},
    },
    context::HostContext_TO,
    tensor::{NamedTensorMut, TensorMut, TensorRef},
    DeviceSpec, HostContext, HostContextBox, LogLevel, PluginError, PluginKind, PluginResult,
    ReduceOp,
};
use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};
use tch::{Device, Kind, Tensor};

/// The wheel's `xla_cpu_pjrt.so`; a clear failure when it is missing.
fn cpu_plugin() -> PathBuf {
    let lib = workspace_root().join(".venv/lib");
    std::fs::read_dir(&lib)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| {
            e.path()
                .join("site-packages/xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so")
        })
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "the PJRT CPU plugin is missing: expected {}/python3*/site-packages/xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so; run scripts/bootstrap.sh (it installs xla-cpu-pjrt==0.0.1 from scripts/requirements.txt)",
                lib.display()
            )
        })
}

/// A directory holding only `libaccel_xla.so`.
fn xla_plugin_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    build_plugin_into("accel-xla", &[], &dir.path().join("libaccel_xla.so"));
    dir
}

/// A rank that is a thread of this process; the host's own collectives are
/// not there (the XLA strategy must not need them).
#[derive(Clone)]
struct ThreadRank {
    rank: u32,
    world: u32,
}

fn no_host_collectives() -> PluginResult<()> {
    RErr(PluginError::other(
        "test",
        "host collectives are not available to thread ranks",
    ))
}

impl HostContext for ThreadRank {
    fn rank(&self) -> u32 {
        self.rank
    }
    fn world_size(&self) -> u32 {
        self.world
    }
    // Every rank is a thread of this one process.
    fn local_rank(&self) -> u32 {
        self.rank()
    }
    fn local_world_size(&self) -> u32 {
        self.world_size()
    }
    fn device(&self) -> DeviceSpec {
        DeviceSpec::CPU
    }
    fn all_reduce(&self, _: TensorMut<'_>, _: ReduceOp) -> PluginResult<()> {
        no_host_collectives()
    }
    fn broadcast(&self, _: TensorMut<'_>, _: u32) -> PluginResult<()> {
        no_host_collectives()
    }
    fn all_gather(&self, _: TensorRef<'_>, _: TensorMut<'_>) -> PluginResult<()> {
        no_host_collectives()
    }
    fn reduce_scatter(&self, _: TensorRef<'_>, _: TensorMut<'_>, _: ReduceOp) -> PluginResult<()> {
        no_host_collectives()
    }
    fn barrier(&self) -> PluginResult<()> {
        no_host_collectives()
    }
    fn log(&self, _: LogLevel, _: RStr<'_>, _: RStr<'_>) {}
}

const NAMES: [&str; 4] = ["w1", "b1", "w2", "b2"];

/// The model `grad-probe` runs: `tanh(x W1ᵀ + b1) W2ᵀ + b2`.
fn forward(p: &[Tensor], x: &Tensor) -> Tensor {
    (x.matmul(&p[0].tr()) + &p[1]).tanh().matmul(&p[2].tr()) + &p[3]
}

fn get(inputs: &[(String, Tensor)], name: &str) -> Tensor {
    inputs
        .iter()
        .find(|(n, _)| n == name)
        .unwrap()
        .1
        .shallow_clone()
}

#[test]
fn xla_gradient_sync_equals_the_mpi_path() {
    const RANKS: u32 = 4;
    let dir = tempfile::tempdir().unwrap();
    tch::manual_seed(7);
    let opts = (Kind::Float, Device::Cpu);
    let mut inputs: Vec<(String, Tensor)> = vec![
        ("w1".into(), Tensor::randn([8, 5], opts)),
        ("b1".into(), Tensor::randn([8], opts)),
        ("w2".into(), Tensor::randn([3, 8], opts)),
        ("b2".into(), Tensor::randn([3], opts)),
    ];
    for r in 0..RANKS {
        inputs.push((format!("x{r}"), Tensor::randn([6, 5], opts)));
        inputs.push((format!("y{r}"), Tensor::randn([6, 3], opts)));
    }
    Tensor::write_safetensors(&inputs, dir.path().join("inputs.safetensors")).unwrap();

    // The MPI path: DDP over MPI, 4 processes.
    let probe = build_bin("grad-probe");
    run_ok(
        Command::new(accel_bin())
            .args([
                "launch",
                "-q",
                "--cpu",
                "--num_processes",
                &RANKS.to_string(),
            ])
            .arg(&probe)
            .arg(dir.path()),
    );
    let mpi = read_weights(&dir.path().join("grads0.safetensors"));

    // The XLA path: 4 ranks as threads of this process, each driving one of
    // the CPU plugin's 4 devices; every collective is a compiled
    // stablehlo.all_reduce over the 4 devices.
    let plugins = xla_plugin_dir();
    let mut set = PluginSet::builtins();
    set.add_file(&plugins.path().join("libaccel_xla.so"));
    let choice = set
        .select(PluginKind::Strategy, "XLA", None)
        .unwrap_or_else(|e| panic!("{e}; rejected: {:?}", set.rejected()));
    let settings = serde_json::json!({
        "section": null,
        "settings": {
            "pjrt_plugin": cpu_plugin(),
            "create_options": {"cpu_device_count": RANKS},
            "ranks_per_process": RANKS,
            "timeout_s": 120,
        }
    })
    .to_string();
    let strategies: Vec<_> = (0..RANKS)
        .map(|rank| {
            let ctx: HostContextBox =
                HostContext_TO::from_ptr(RArc::new(ThreadRank { rank, world: RANKS }), TD_Opaque);
            choice.new_strategy(ctx, &settings).unwrap()
        })
        .collect();
    let threads: Vec<_> = strategies
        .into_iter()
        .enumerate()
        .map(|(r, mut strategy)| {
            let inputs: Vec<(String, Tensor)> =
                inputs.iter().map(|(n, t)| (n.clone(), t.copy())).collect();
            std::thread::spawn(move || {
                // Every rank but 0 starts elsewhere: prepare_model must
                // broadcast rank 0's parameters.
                let mut params: Vec<(String, Tensor)> = NAMES
                    .iter()
                    .map(|n| {
                        let t = (get(&inputs, n) + r as f64).set_requires_grad(true);
                        (n.to_string(), t)
                    })
                    .collect();
                let mut handles = NamedTensorMut::all(&mut params);
                strategy
                    .prepare_model(handles.as_mut_slice().into())
                    .into_result()
                    .unwrap();
                drop(handles);
                for (n, p) in &params {
                    assert_eq!(
                        (p - get(&inputs, n)).abs().max().double_value(&[]),
                        0.0,
                        "rank {r}: `{n}` was not broadcast from rank 0"
                    );
                }
                let ps: Vec<Tensor> = params.iter().map(|(_, p)| p.shallow_clone()).collect();
                let loss = forward(&ps, &get(&inputs, &format!("x{r}")))
                    .mse_loss(&get(&inputs, &format!("y{r}")), tch::Reduction::Mean);
                loss.backward();
                strategy.post_backward(true).into_result().unwrap();
                params
                    .iter()
                    .map(|(n, p)| (n.clone(), p.grad().copy()))
                    .collect::<Vec<(String, Tensor)>>()
            })
        })
        .collect();
    let by_name = |mut g: Vec<(String, Tensor)>| {
        g.sort_by(|a, b| a.0.cmp(&b.0));
        g
    };
    let xla: Vec<Vec<(String, Tensor)>> = threads
        .into_iter()
        .map(|t| by_name(t.join().unwrap()))
        .collect();

    // A third reference: the plain mean of the 4 local gradients.
    let mut mean: Vec<(String, Tensor)> = NAMES
        .iter()
        .map(|n| (n.to_string(), Tensor::zeros_like(&get(&inputs, n))))
        .collect();
    for r in 0..RANKS {
        let ps: Vec<Tensor> = NAMES
            .iter()
            .map(|n| get(&inputs, n).copy().set_requires_grad(true))
            .collect();
        forward(&ps, &get(&inputs, &format!("x{r}")))
            .mse_loss(&get(&inputs, &format!("y{r}")), tch::Reduction::Mean)
            .backward();
        for ((_, m), p) in mean.iter_mut().zip(&ps) {
            *m += p.grad() / f64::from(RANKS);
        }
    }
    let mean = by_name(mean);
    // Both paths against the plain mean first, so that a failure below
    // says which of them is off.
    let mpi_off = max_abs_diff(&mpi, &mean);
    println!("max |MPI grad - mean| = {mpi_off:e}");
    for (r, g) in xla.iter().enumerate() {
        let (d, to_mean) = (max_abs_diff(g, &mpi), max_abs_diff(g, &mean));
        println!("rank {r}: max |XLA grad - MPI grad| = {d:e}, |XLA grad - mean| = {to_mean:e}");
        assert!(
            d <= 1e-6,
            "rank {r}: XLA gradients differ from MPI's by {d} (MPI's from the mean by {mpi_off})"
        );
        assert!(
            to_mean <= 1e-6,
            "rank {r}: XLA gradients differ from the mean by {to_mean}"
        );
        assert_eq!(
            max_abs_diff(g, &xla[0]),
            0.0,
            "rank {r} differs from rank 0"
        );
    }
    for r in 1..RANKS {
        let other = read_weights(&dir.path().join(format!("grads{r}.safetensors")));
        assert_eq!(max_abs_diff(&other, &mpi), 0.0, "MPI rank {r}");
    }
}

/// A config for `processes` processes of `devices` CPU devices each, with
/// `distributed_type` `dt` (XLA, or its old name TPU).
fn xla_config(dir: &Path, dt: &str, processes: u32, devices: u32) -> PathBuf {
    let cfg = dir.join(format!("xla_{processes}x{devices}.yaml"));
    std::fs::write(
        &cfg,
        format!(
            "distributed_type: {dt}\nnum_processes: {processes}\nuse_cpu: true\naccel:\n  plugins:\n    accel-xla:\n      pjrt_plugin: {}\n      create_options:\n        cpu_device_count: {devices}\n",
            cpu_plugin().display()
        ),
    )
    .unwrap();
    cfg
}

fn launch(plugin_dir: &Path, cfg: &Path, mlp_args: &[&str]) -> Output {
    output_of(
        Command::new(accel_bin())
            .args(["launch", "--plugin-dir", plugin_dir.to_str().unwrap()])
            .args(["--config_file", cfg.to_str().unwrap()])
            .arg(mlp())
            .args(mlp_args),
    )
}

#[test]
fn mlp_with_xla_on_two_ranks() {
    let plugins = xla_plugin_dir();
    let dir = tempfile::tempdir().unwrap();
    let p = file_in(dir.path());
    let common = ["--steps", "15", "--optimizer", "sgd", "--lr", "0.01"];

    // Two processes: the CPU plugin makes a single-process client in each
    // (process_index 0, its own devices, no key-value traffic), so the
    // strategy refuses with that evidence rather than faking the job.
    let two = launch(
        plugins.path(),
        &xla_config(dir.path(), "XLA", 2, 2),
        &[&common[..], &["--batch-size", "16"]].concat(),
    );
    let text = describe(&two);
    assert!(!two.status.success(), "{text}");
    assert!(
        text.contains("cannot run collectives across processes")
            && text.contains("made a single-process client (process_index 0, 2 device(s)")
            && text.contains("key-value store 0 time(s)"),
        "{text}"
    );
    println!("two processes on the CPU PJRT plugin:\n{text}");

    // One process driving two devices: every step's gradients go through
    // the compiled all-reduce over both, and it reaches DDP's weights. (The
    // config says TPU, the old name the config reads as XLA.)
    let one = launch(
        plugins.path(),
        &xla_config(dir.path(), "TPU", 1, 2),
        &[
            &common[..],
            &["--batch-size", "32", "--save", &p("xla.safetensors")],
        ]
        .concat(),
    );
    assert!(one.status.success(), "{}", describe(&one));
    assert_stdout_contains(&one, "strategy xla (accel-xla)");
    launch_mlp(
        2,
        &[
            &common[..],
            &["--batch-size", "16", "--save", &p("ddp_{rank}.safetensors")],
        ]
        .concat(),
    );
    let xla = read_weights(&dir.path().join("xla.safetensors"));
    let ddp = read_weights(&dir.path().join("ddp_0.safetensors"));
    let diff = max_abs_diff(&xla, &ddp);
    println!("mlp: XLA (1 process, 2 devices) vs DDP (2 ranks): max |Δw| = {diff:e}");
    assert!(
        diff <= 1e-5,
        "XLA (1 process, 2 devices) differs from DDP (2 ranks) by {diff}"
    );
}

/// Runs `mlp` alone (no launcher) with `distributed_type: XLA` and
/// `pjrt_plugin` as given.
fn mlp_with_pjrt(plugin_dir: &Path, pjrt: &Path) -> Output {
    let config = serde_json::json!({
        "distributed_type": "XLA",
        "use_cpu": true,
        "accel": {"plugins": {"accel-xla": {"pjrt_plugin": pjrt}}},
    });
    Command::new(mlp())
        .args(["--steps", "1"])
        .env("ACCEL_PLUGIN_DIR", plugin_dir)
        .env("ACCEL_RESOLVED_CONFIG", config.to_string())
        .env("HF_HOME", no_hf_home())
        .output()
        .expect("mlp starts")
}

#[test]
fn bad_pjrt_plugins_fail_with_a_message_not_an_abort() {
    let plugins = xla_plugin_dir();
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("libplain.so");
    build_plain_c_library(&plain);
    let src = dir.path().join("future.c");
    std::fs::write(
        &src,
        "#include <stddef.h>\nstruct V { size_t s; void* e; int major; int minor; };\nstruct A { size_t s; void* e; struct V v; void* fns[200]; };\nstatic struct A api = { sizeof(struct A), 0, { sizeof(struct V), 0, 1, 0 } };\nconst struct A* GetPjrtApi(void) { return &api; }\n",
    )
    .unwrap();
    let future = dir.path().join("libfuture_pjrt.so");
    let cc = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&future)
        .arg(&src)
        .status()
        .unwrap();
    assert!(cc.success());
    for (pjrt, expected) in [
        (
            dir.path().join("missing/libtpu.so"),
            "missing/libtpu.so does not exist".to_owned(),
        ),
        (
            plain.clone(),
            "is not a PJRT plugin: it exports no `GetPjrtApi`".to_owned(),
        ),
        (
            future.clone(),
            "speaks PJRT C API 1.0, but accel-xla was built for 0.81: major versions must match"
                .to_owned(),
        ),
    ] {
        let out = mlp_with_pjrt(plugins.path(), &pjrt);
        let text = describe(&out);
        // A code, not a signal: the process exited by itself.
        assert!(
            matches!(out.status.code(), Some(c) if c != 0),
            "{}: {text}",
            pjrt.display()
        );
        assert!(text.contains(&expected), "{}: {text}", pjrt.display());
    }
}

#[test]
fn accel_env_lists_the_pjrt_platform_and_devices() {
    let plugins = xla_plugin_dir();
    let out = run_ok(
        Command::new(accel_bin())
            .args(["env", "--plugin-dir", plugins.path().to_str().unwrap()])
            .env("ACCEL_PJRT_PLUGIN", cpu_plugin()),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let line = |label: &str| {
        text.lines()
            .find(|l| l.contains(label))
            .unwrap_or_else(|| panic!("no `{label}` in:\n{text}"))
            .to_owned()
    };
    assert!(
        line("PJRT plugin:").contains("xla_cpu_pjrt.so (PJRT C API 0.81)"),
        "{text}"
    );
    assert!(line("PJRT platform:").contains("cpu"), "{text}");
    let devices = line("PJRT devices:");
    assert!(devices.contains("4 addressable of 4"), "{text}");
    assert!(devices.contains("CpuDevice(id=3)"), "{text}");
}
