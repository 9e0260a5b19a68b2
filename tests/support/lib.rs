//! Helpers shared by the integration tests: building workspace artifacts
//! (the `accel` binary, plugin libraries, example programs) with cargo and
//! running them.

pub mod gpt2;

pub use accel_test_kit::Rng;

use serde_json::Value;
use std::{
    fs::File,
    io::Read,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Output, Stdio},
    thread,
    time::{Duration, Instant},
};

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// A `cargo` command without the variables cargo set for this test binary
/// (`OUT_DIR`, `CARGO_MANIFEST_DIR`, `CARGO_PKG_*`, ...): they are not a
/// build's environment, and a build script that watches one (ring's watches
/// both) would run again, with all that depends on it,
/// each time a test's build and a plain `cargo build` take turns.
pub fn cargo() -> Command {
    let mut cmd = Command::new(env!("CARGO"));
    for (name, _) in std::env::vars_os() {
        let Some(name) = name.to_str() else { continue };
        let set_for_the_test = matches!(
            name,
            "OUT_DIR"
                | "CARGO_MANIFEST_DIR"
                | "CARGO_MANIFEST_PATH"
                | "CARGO_MANIFEST_LINKS"
                | "CARGO_CRATE_NAME"
                | "CARGO_BIN_NAME"
                | "CARGO_TARGET_TMPDIR"
                | "CARGO_PRIMARY_PACKAGE"
        ) || name.starts_with("CARGO_PKG_")
            || name.starts_with("CARGO_BIN_EXE_");
        if set_for_the_test {
            cmd.env_remove(name);
        }
    }
    cmd
}

/// Builds `args` (e.g. `["-p", "accel-csv-tracker"]`) with extra `env`, under
/// a lock shared by every test process (builds that change the environment
/// rewrite the same output files), then runs `with_artifacts` on the built
/// files — still under the lock, so it can copy them out before anyone
/// rebuilds them.
pub fn build_locked<T>(
    args: &[&str],
    env: &[(&str, &str)],
    with_artifacts: impl FnOnce(&[PathBuf]) -> T,
) -> T {
    cargo_locked("build", args, env, with_artifacts)
}

/// [`build_locked`] with another cargo command that builds (`rustc`).
fn cargo_locked<T>(
    command: &str,
    args: &[&str],
    env: &[(&str, &str)],
    with_artifacts: impl FnOnce(&[PathBuf]) -> T,
) -> T {
    let lock = File::create(std::env::temp_dir().join("accel-tests-cargo.lock")).unwrap();
    lock.lock().unwrap();
    let mut cmd = cargo();
    cmd.current_dir(workspace_root())
        .args([command, "--message-format=json-render-diagnostics"])
        .args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("cargo runs");
    assert!(
        out.status.success(),
        "cargo {command} {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let artifacts: Vec<PathBuf> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact")
        .flat_map(|m| {
            let mut files: Vec<PathBuf> = m["filenames"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|f| f.as_str().map(PathBuf::from))
                .collect();
            if let Some(exe) = m["executable"].as_str() {
                files.push(PathBuf::from(exe));
            }
            files
        })
        .collect();
    let result = with_artifacts(&artifacts);
    drop(lock);
    result
}

/// The test-only plugins (`tests/fixtures/`): plain libraries in a
/// workspace build, built as plugins only for the tests that load them, in
/// [`fixture_target_dir`].
pub const FIXTURE_PLUGINS: &[&str] = &["accel-test-faulty", "accel-test-plain-tracker"];

/// Where the fixture plugins (and their test-only variants) are built: a
/// target directory of their own, never searched for plugins — not by
/// `target/debug/accel` (its executable directory), nor by the tests that
/// run an Accelerator in their own process (`target/debug/deps`), which
/// would otherwise pick up a variant another test has just built (one that
/// claims `fp16`, say).
pub fn fixture_target_dir() -> PathBuf {
    workspace_root().join("target/fixture-builds")
}

/// The cargo command and arguments that build `package`'s cdylib: a
/// fixture's with `cargo rustc --crate-type cdylib`, a test-only `variant`
/// of any other with `cargo build -p`, both into [`fixture_target_dir`];
/// the workspace's own plugin with `cargo build --workspace`, as
/// [`build_bin`] builds.
pub fn plugin_build_args(package: &str, variant: bool) -> (&'static str, Vec<String>) {
    let fixture = FIXTURE_PLUGINS.contains(&package);
    if !fixture && !variant {
        return ("build", vec!["--workspace".to_owned()]);
    }
    let mut args: Vec<String> = ["-p", package].map(str::to_owned).to_vec();
    if fixture {
        args.extend(["--lib", "--crate-type", "cdylib"].map(str::to_owned));
    }
    args.push("--target-dir".to_owned());
    args.push(fixture_target_dir().to_string_lossy().into_owned());
    (if fixture { "rustc" } else { "build" }, args)
}

/// The file name of `package`'s cdylib: `libaccel_ddp.so` for `accel-ddp`.
pub fn plugin_file_name(package: &str) -> String {
    format!("lib{}.so", package.replace('-', "_"))
}

/// Builds the cdylib of `package` (with extra `env`: a test-only variant,
/// built apart from the workspace's own output) and runs `with_so` on it,
/// under the build lock.
fn build_plugin(package: &str, env: &[(&str, &str)], with_so: impl FnOnce(&Path)) {
    let lib_name = plugin_file_name(package);
    let (command, args) = plugin_build_args(package, !env.is_empty());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    cargo_locked(command, &args, env, |files| {
        let so = files
            .iter()
            .find(|f| f.file_name().is_some_and(|n| n == lib_name.as_str()))
            .unwrap_or_else(|| panic!("no {lib_name} among {files:?}"));
        with_so(so);
    });
}

/// Builds the cdylib of `package` (with extra `env`) and copies it to `dest`.
pub fn build_plugin_into(package: &str, env: &[(&str, &str)], dest: &Path) {
    build_plugin(package, env, |so| {
        std::fs::copy(so, dest).unwrap();
    });
}

/// A new temporary directory holding `package`'s cdylib (as
/// [`plugin_file_name`]), for `--plugin-dir`.
pub fn plugin_dir(package: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    build_plugin_into(package, &[], &dir.path().join(plugin_file_name(package)));
    dir
}

/// Builds `package` with extra `env` (a test-only variant) in
/// [`fixture_target_dir`] and copies its cdylib to `dest`: the workspace's
/// own output stays the ordinary plugin throughout, for the tests running
/// beside this one.
pub fn build_plugin_variant_into(package: &str, env: &[(&str, &str)], dest: &Path) {
    assert!(!env.is_empty(), "a variant is built with extra env");
    build_plugin_into(package, env, dest);
}

/// The plugins accel ships, linked beside every test binary as an install
/// would put them.
const SHIPPED_PLUGINS: &[&str] = &[
    "accel-ddp",
    "accel-zero",
    "accel-fsdp",
    "accel-tensorboard",
    "accel-wandb",
    "accel-mlflow",
];

/// Builds the workspace (`cargo build --workspace`: the build bootstrap
/// made, so a no-op when it is fresh; building one package with `-p`
/// would resolve its dependencies' features apart and build tch and much
/// else again) and returns the path of a link to its binary `bin` in a
/// directory of its own (`target/test-bins/<test binary>/`), beside the
/// plugins accel ships, so that the program's "executable directory"
/// plugin search sees no test fixtures that other tests built into
/// `target/debug`.
pub fn build_bin(bin: &str) -> PathBuf {
    build_locked(&["--workspace"], &[], |files| {
        let built = |name: &str| {
            files
                .iter()
                .find(|f| f.file_name().is_some_and(|n| n == name))
                .unwrap_or_else(|| panic!("no {name} among {files:?}"))
        };
        let test_exe = std::env::current_exe().unwrap();
        let stem = test_exe.file_stem().unwrap().to_string_lossy().into_owned();
        let dir = built(bin).parent().unwrap().join("../test-bins").join(stem);
        std::fs::create_dir_all(&dir).unwrap();
        let place = |from: &Path| {
            let link = dir.join(from.file_name().unwrap());
            // Replaced only when cargo rebuilt it: another test of this
            // binary may be running the current one.
            use std::os::unix::fs::MetadataExt;
            let same = |a: &Path, b: &Path| match (std::fs::metadata(a), std::fs::metadata(b)) {
                (Ok(a), Ok(b)) => a.ino() == b.ino() && a.dev() == b.dev(),
                _ => false,
            };
            if same(from, &link) {
                return link;
            }
            let _ = std::fs::remove_file(&link);
            if std::fs::hard_link(from, &link).is_err() {
                std::fs::copy(from, &link).unwrap();
            }
            link
        };
        for p in SHIPPED_PLUGINS {
            place(built(&plugin_file_name(p)));
        }
        place(built(bin))
    })
}

/// The `accel` binary.
pub fn accel_bin() -> PathBuf {
    build_bin("accel")
}

/// An `HF_HOME` with nothing in it, so that no user's Accelerate config
/// (its default config file) leaks into a test.
pub fn no_hf_home() -> PathBuf {
    std::env::temp_dir().join("accel-tests-no-hf-home")
}

/// Runs `program` with `args`, with `ACCEL_PLUGIN_DIR` cleared so only the
/// directories a test names are searched explicitly.
pub fn run(program: &Path, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .env_remove("ACCEL_PLUGIN_DIR")
        .output()
        .expect("program starts")
}

/// The `mlp` driver (drivers/mlp.rs).
pub fn mlp() -> PathBuf {
    build_bin("mlp")
}

/// What `accel plugins list --plugin-dir <dir> --json` prints, asserting it
/// succeeded.
pub fn plugins_list_json(dir: &Path) -> Value {
    let out = run(
        &accel_bin(),
        &[
            "plugins",
            "list",
            "--plugin-dir",
            dir.to_str().unwrap(),
            "--json",
        ],
    );
    assert!(out.status.success(), "{}", describe(&out));
    serde_json::from_slice(&out.stdout).expect("plugins list --json is JSON")
}

/// Runs the `quickstart` example for `steps` steps with the plugins of
/// `plugin_dir` and the trackers `log_with`, into `project` (its files land
/// in `<project>/quickstart`), and asserts it succeeded.
pub fn run_quickstart(plugin_dir: &Path, project: &Path, steps: &str, log_with: &[&str]) {
    let mut args = vec!["--plugin-dir", plugin_dir.to_str().unwrap()];
    for tracker in log_with {
        args.extend(["--log-with", tracker]);
    }
    args.extend(["--project-dir", project.to_str().unwrap(), "--steps", steps]);
    let out = run(&build_bin("quickstart"), &args);
    assert!(out.status.success(), "{}", describe(&out));
}

/// Runs `cmd` with no `ACCEL_PLUGIN_DIR` and no Hugging Face cache, whether
/// it succeeds or not.
pub fn output_of(cmd: &mut Command) -> Output {
    cmd.env_remove("ACCEL_PLUGIN_DIR")
        .env("HF_HOME", no_hf_home())
        .output()
        .expect("starts")
}

/// Runs `cmd` (no `ACCEL_PLUGIN_DIR`, no Hugging Face cache) and asserts it
/// succeeded.
pub fn run_ok(cmd: &mut Command) -> Output {
    let out = output_of(cmd);
    assert!(out.status.success(), "{:?}: {}", cmd, describe(&out));
    out
}

/// `accel launch --cpu --num_processes n mlp <args>`.
pub fn launch_mlp(n: u32, args: &[&str]) -> Output {
    let mlp = mlp();
    run_ok(
        Command::new(accel_bin())
            .args(["launch", "-q", "--cpu", "--num_processes", &n.to_string()])
            .arg(&mlp)
            .args(args),
    )
}

/// The lines of an `mlp --loss-log` file.
pub fn loss_records(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The number `key` of every line of an `mlp --loss-log` file.
pub fn log_values(path: impl AsRef<Path>, key: &str) -> Vec<f64> {
    loss_records(path.as_ref())
        .iter()
        .map(|v| v[key].as_f64().unwrap())
        .collect()
}

/// `(step, loss)` of every line of an `mlp --loss-log` file.
pub fn loss_log(path: &Path) -> Vec<(u64, f64)> {
    loss_records(path)
        .iter()
        .map(|v| (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap()))
        .collect()
}

/// accel launch's last message in `stderr` (from its last `accel launch: `
/// to the end of that line; empty if there is none). The ranks write to the
/// same stream, so a rank's message cut before its newline may come first on
/// the same line.
pub fn launch_summary(stderr: &str) -> &str {
    stderr
        .rfind("accel launch: ")
        .map_or("", |at| stderr[at..].lines().next().unwrap_or_default())
}

/// Stdout and stderr of `out`, for assertion messages.
pub fn describe(out: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Asserts that `text` contains every one of `parts`, showing `text` if not.
pub fn assert_contains(text: &str, parts: &[&str]) {
    for part in parts {
        assert!(text.contains(part), "no `{part}` in:\n{text}");
    }
}

/// Asserts that the standard output of `out` contains `part`, showing the
/// whole output if not.
pub fn assert_stdout_contains(out: &Output, part: &str) {
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(part),
        "{}",
        describe(out)
    );
}

/// `name` in `dir`, as a string (for command-line arguments): the paths of
/// a test's scratch directory are `let p = file_in(dir.path());` `p("x")`.
pub fn file_in(dir: &Path) -> impl Fn(&str) -> String + '_ {
    move |name| dir.join(name).to_str().unwrap().to_owned()
}

/// Asserts that `out` failed and that its output (stdout and stderr)
/// contains every one of `parts`; returns that output.
pub fn assert_failed_with(out: &Output, parts: &[&str]) -> String {
    let text = describe(out);
    assert!(!out.status.success(), "{text}");
    assert_contains(&text, parts);
    text
}

/// Compiles a plain C shared library that is not an accel plugin.
pub fn build_plain_c_library(dest: &Path) {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("plain.c");
    std::fs::write(&src, "int plain_answer(void) { return 42; }\n").unwrap();
    let status = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(dest)
        .arg(&src)
        .status()
        .expect("cc runs");
    assert!(status.success(), "cc failed");
}

/// The project venv's Python (made by `scripts/bootstrap.sh`), for the
/// Python peers (`safetensors`, `accelerate`, `torchrun`).
pub fn venv_bin(name: &str) -> PathBuf {
    let path = workspace_root().join(".venv/bin").join(name);
    assert!(
        path.exists(),
        "{} is missing: run scripts/bootstrap.sh",
        path.display()
    );
    path
}

/// Reads the tensors of a safetensors file, by name.
pub fn read_weights(path: &Path) -> Vec<(String, tch::Tensor)> {
    let mut t = tch::Tensor::read_safetensors(path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    t.sort_by(|a, b| a.0.cmp(&b.0));
    t
}

/// Copies of the variables of `vs` (detached, their own memory), by name.
pub fn snapshot(vs: &tch::nn::VarStore) -> Vec<(String, tch::Tensor)> {
    let mut v: Vec<(String, tch::Tensor)> = vs
        .variables()
        .into_iter()
        .map(|(n, t)| (n, t.detach().copy()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// The tensor `name` of `tensors` (a safetensors file's, read by a probe),
/// or an error naming it and `file`.
pub fn tensor_named(
    tensors: &[(String, tch::Tensor)],
    name: &str,
    file: &str,
) -> Result<tch::Tensor, String> {
    tensors
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, t)| t.shallow_clone())
        .ok_or(format!("{file} holds no `{name}`"))
}

/// A PNG file decoded: width, height, channels, and every channel of every
/// pixel, row by row.
pub fn decode_png(bytes: &[u8]) -> (u32, u32, usize, Vec<u8>) {
    let mut reader = png::Decoder::new(std::io::Cursor::new(bytes))
        .read_info()
        .unwrap_or_else(|e| panic!("not a PNG ({} bytes): {e}", bytes.len()));
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    buf.truncate(info.buffer_size());
    (info.width, info.height, info.color_type.samples(), buf)
}

/// The images `mlp --log-media` logs, as `(key, width, height, channels,
/// pixels)`: `samples/rgb` (5 x 6 RGB, pixel (y, x) = (10y + x,
/// 100 + 10y + x, 200 + x)) and `samples/gray` (2 x 2 grayscale from the
/// floats 0, 0.5, 1, 0.25).
pub fn mlp_media_images() -> Vec<(&'static str, u32, u32, usize, Vec<u8>)> {
    let rgb: Vec<u8> = (0..5u8)
        .flat_map(|y| (0..6u8).flat_map(move |x| [10 * y + x, 100 + 10 * y + x, 200 + x]))
        .collect();
    vec![
        ("samples/rgb", 6, 5, 3, rgb),
        ("samples/gray", 2, 2, 1, vec![0, 127, 255, 63]),
    ]
}

/// The histogram `mlp --log-media` logs as `weights/l1`, made from the
/// `l1.weight` of the weights it saved (`--save`), binned as the host bins
/// it (64 bins).
pub fn mlp_l1_histogram(saved: &Path) -> accel_sdk::LogHistogram {
    let (_, w) = read_weights(saved)
        .into_iter()
        .find(|(n, _)| n == "l1.weight")
        .expect("l1.weight saved");
    let values = Vec::<f64>::try_from(&w.flatten(0, -1)).unwrap();
    accel_sdk::LogHistogram::from_values(&values, 64).unwrap()
}

/// The largest absolute difference between two sets of weights with the
/// same names and shapes (NaN when either holds NaN).
pub fn max_abs_diff(a: &[(String, tch::Tensor)], b: &[(String, tch::Tensor)]) -> f64 {
    assert_eq!(
        a.iter().map(|(n, _)| n).collect::<Vec<_>>(),
        b.iter().map(|(n, _)| n).collect::<Vec<_>>()
    );
    a.iter()
        .zip(b)
        .map(|((_, x), (_, y))| (x - y).abs().max().double_value(&[]))
        // NaN anywhere (diverged weights) must not read as "no difference".
        .fold(0.0, |acc: f64, d| {
            if acc.is_nan() || d.is_nan() {
                f64::NAN
            } else {
                acc.max(d)
            }
        })
}

/// Writes an Accelerate config file `name` in `dir`: CPU ranks, `ranks`
/// processes, `distributed_type` and the YAML lines `rest` after them.
pub fn write_config(
    dir: &Path,
    name: &str,
    distributed_type: &str,
    ranks: u32,
    rest: &str,
) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(
        &path,
        format!(
            "distributed_type: {distributed_type}\nnum_processes: {ranks}\nuse_cpu: true\n{rest}"
        ),
    )
    .unwrap();
    path
}

/// A 2-rank DEEPSPEED config `name` in `dir` at ZeRO stage `stage`.
pub fn write_zero_config(dir: &Path, name: &str, stage: u32) -> PathBuf {
    write_config(
        dir,
        name,
        "DEEPSPEED",
        2,
        &format!("deepspeed_config:\n  zero_stage: {stage}\n"),
    )
}

/// A `deepspeed_config` section whose `deepspeed_config_file` is
/// `<dir>/<name>.json`, written with `json`.
pub fn deepspeed_file_section(dir: &Path, name: &str, json: &str) -> String {
    let file = dir.join(format!("{name}.json"));
    std::fs::write(&file, json).unwrap();
    format!(
        "deepspeed_config:\n  deepspeed_config_file: {}\n",
        file.display()
    )
}

/// A `deepspeed_config` section for ZeRO-3 with every parameter sharded
/// (`stage3_param_persistence_threshold: 0`; DeepSpeed's default keeps a
/// test model's small parameters whole), its file `<dir>/<name>.json`.
pub fn zero3_shard_everything(dir: &Path, name: &str) -> String {
    deepspeed_file_section(
        dir,
        name,
        r#"{"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}"#,
    )
}

/// A 2-rank DEEPSPEED config `<dir>/<name>.yaml` whose
/// `deepspeed_config_file` is `<dir>/<name>.json`, written with `json`.
pub fn write_deepspeed_config(dir: &Path, name: &str, json: &str) -> PathBuf {
    let section = deepspeed_file_section(dir, name, json);
    write_config(dir, &format!("{name}.yaml"), "DEEPSPEED", 2, &section)
}

/// `accel launch -q --config_file <config> <probe>` of the test fixture
/// binary `probe` (built), with no plugin directory from the environment
/// and no Hugging Face cache; not yet run.
pub fn launch_probe(config: &Path, probe: &str) -> Command {
    let mut cmd = Command::new(accel_bin());
    cmd.args(["launch", "-q", "--config_file"])
        .arg(config)
        .arg(build_bin(probe))
        .env_remove("ACCEL_PLUGIN_DIR")
        .env("HF_HOME", no_hf_home());
    cmd
}

/// `accel launch -q --config_file <config> mlp <args>`, not yet run.
pub fn launch_with_config(config: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(accel_bin());
    cmd.args(["launch", "-q", "--config_file"])
        .arg(config)
        .arg(mlp())
        .args(args);
    cmd
}

/// The `mlp-memory` line (`mlp --print-memory`) of each of `ranks` ranks,
/// by rank.
pub fn memory_lines(out: &Output, ranks: usize) -> Vec<Value> {
    let mut lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("mlp-memory "))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    lines.sort_by_key(|v| v["rank"].as_u64());
    assert_eq!(lines.len(), ranks, "{}", describe(out));
    lines
}

/// Runs `config` expecting a refusal: a non-zero exit, every `expect` in the
/// output, and no panic.
pub fn refused(config: &Path, expect: &[&str]) {
    let out = output_of(&mut launch_with_config(config, &["--steps", "1"]));
    assert!(!out.status.success(), "{}", describe(&out));
    let text = describe(&out);
    for e in expect {
        assert!(text.contains(e), "no `{e}` in {text}");
    }
    assert!(!text.contains("panicked"), "{text}");
}

/// [`max_abs_diff`] between the weights of two safetensors files.
pub fn file_weights_diff(a: impl AsRef<Path>, b: impl AsRef<Path>) -> f64 {
    max_abs_diff(&read_weights(a.as_ref()), &read_weights(b.as_ref()))
}

/// Asserts that the weights of safetensors files `a` and `b` differ by at
/// most 1e-5; `what` says what was compared.
pub fn assert_weights_close(a: impl AsRef<Path>, b: impl AsRef<Path>, what: &str) {
    let diff = file_weights_diff(a, b);
    assert!(diff <= 1e-5, "{what}: the weights differ by {diff}");
}

/// One step of the fp16 loss-scaling tests on `out`, a half-precision
/// output whose squared mean is the loss: at step 2 the loss is made
/// infinite, and the optimizer step must be skipped then and only then,
/// leaving the weights (`before` the step, `after` it) as they were, while
/// every other step changes them. Returns the loss scale after the step.
pub fn fp16_step_with_inf_at_2(
    acc: &mut accel::accelerator::Accelerator,
    opt: &mut accel_sdk::optim::Optimizer,
    (out, step): (&tch::Tensor, usize),
    before: &[(String, tch::Tensor)],
    after: impl FnOnce(&accel::accelerator::Accelerator) -> Vec<(String, tch::Tensor)>,
) -> f64 {
    use tch::Kind;
    assert_eq!(out.kind(), Kind::Half, "fp16 computes in half precision");
    let mut loss = out.to_kind(Kind::Float).square().mean(Kind::Float);
    if step == 2 {
        loss *= f64::INFINITY;
    }
    acc.backward(&loss).unwrap();
    let stepped = acc.step(opt).unwrap();
    acc.zero_grad(opt);
    assert_eq!(stepped, step != 2, "step {step}");
    assert_eq!(acc.optimizer_step_was_skipped(), step == 2);
    let moved = max_abs_diff(before, &after(acc));
    if step == 2 {
        assert_eq!(moved, 0.0, "the skipped step changed the weights");
    } else {
        assert!(moved > 0.0, "step {step} did not update");
    }
    acc.loss_scale().unwrap()
}

/// The mlp flags of an AdamW run (`--steps STEPS --optimizer adamw --lr
/// 0.01`), followed by `extra`.
pub fn adamw_args<'a>(steps: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let base = ["--steps", steps, "--optimizer", "adamw", "--lr", "0.01"];
    base.into_iter().chain(extra.iter().copied()).collect()
}

/// The mlp flags the sharding tests train with (8 AdamW steps, hidden 24,
/// `layers` extra layers), followed by `extra`.
pub fn adamw_mlp_args<'a>(layers: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let sized = ["--hidden", "24", "--layers", layers];
    adamw_args("8", &[&sized[..], extra].concat())
}

/// A run stopped after step 4 with a checkpoint there, then resumed from
/// it: the second half must say it resumed at step 4 and end with the same
/// weights as a straight run.
pub struct StopResume<'a> {
    /// The project directory (`--project-dir`) of both halves.
    pub project: &'a str,
    /// The weights of the straight run.
    pub straight: &'a str,
    /// Where the resumed run saves its weights.
    pub resumed: &'a str,
    /// The loss logs (`--loss-log`) of the first and second half, if any.
    pub loss_logs: Option<(&'a str, &'a str)>,
    /// What is run, for assertion messages.
    pub what: &'a str,
}

impl<'a> StopResume<'a> {
    /// Runs both halves with `train` (given the flags), calling `between`
    /// with the checkpoint directory after the first.
    pub fn run(&self, train: impl Fn(&[&str]) -> Output, between: impl FnOnce(&Path)) {
        let stop = ["--stop-at", "4", "--checkpoint-every", "4"];
        let project = ["--project-dir", self.project];
        let (first, second) = self.loss_logs.unzip();
        let log = |file: Option<&'a str>| file.map_or(vec![], |f| vec!["--loss-log", f]);
        train(&[&stop[..], &project, &log(first)].concat());
        between(&Path::new(self.project).join("checkpoints/checkpoint_0"));
        let resume = ["--resume", "--save", self.resumed];
        let out = train(&[&resume[..], &project, &log(second)].concat());
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("at step 4"),
            "{}: {}",
            self.what,
            describe(&out)
        );
        assert!(
            std::fs::read(self.straight).unwrap() == std::fs::read(self.resumed).unwrap(),
            "{}: the resumed run's weights differ from the straight run's",
            self.what
        );
    }
}

/// Asserts that the loss log `whole` is `first` followed by `second`.
pub fn assert_logs_join(whole: &str, first: &str, second: &str) {
    let read = |f: &str| std::fs::read_to_string(f).unwrap();
    assert_eq!(read(whole), read(first) + &read(second));
}

/// Live processes whose command line mentions `marker` (zombies, whose
/// command line is empty, are gone once reaped).
pub fn processes_mentioning(marker: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let pid = entry.file_name().to_string_lossy().into_owned();
        if !pid.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        if let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) {
            let text = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            if text.contains(marker) {
                found.push(format!("{pid}: {text}"));
            }
        }
    }
    found
}

/// Waits up to 10 s for every process mentioning `marker` to be gone, and
/// fails naming those left.
pub fn assert_no_leftovers(marker: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let left = processes_mentioning(marker);
        if left.is_empty() {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "leftover processes: {left:#?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// A TCP port free on this machine now (for torchrun's `--master_port`).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Far longer than a torn-down job takes (about 2 s): reaching it means the
/// job hung.
pub const LIMIT: Duration = Duration::from_secs(60);

/// `accel launch --cpu --num_processes 2 --launcher mpi`, to which the
/// flags, program and arguments are added.
pub fn launch_mpi() -> Command {
    let mut cmd = Command::new(accel_bin());
    cmd.args([
        "launch",
        "--cpu",
        "--num_processes",
        "2",
        "--launcher",
        "mpi",
    ]);
    cmd
}

/// [`launch_mpi`] `FLAGS PROGRAM ARGS`, with `watch` called with accel's
/// pid once the job runs, and the job killed if it runs past [`LIMIT`]
/// (then this panics: the job hung).
pub fn launch_mpi_with(
    flags: &[&str],
    program: &PathBuf,
    args: &[&str],
    watch: impl FnOnce(u32),
) -> Output {
    let mut child = launch_mpi()
        .args(flags)
        .arg(program)
        .args(args)
        .env_remove("ACCEL_PLUGIN_DIR")
        .env("HF_HOME", no_hf_home())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("accel starts");
    // Read while waiting, so a full pipe cannot stall the job.
    let drain = |mut from: Box<dyn Read + Send>| {
        thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = from.read_to_end(&mut buf);
            buf
        })
    };
    let mut streams = Some((
        drain(Box::new(child.stdout.take().unwrap())),
        drain(Box::new(child.stderr.take().unwrap())),
    ));
    watch(child.id());
    // accel's death takes mpirun (PR_SET_PDEATHSIG) and so the ranks.
    let status = wait_limited(&mut child, || {
        let (stdout, stderr) = streams.take().unwrap();
        format!(
            "still running after {LIMIT:?}, killed\n--- stdout\n{}\n--- stderr\n{}",
            String::from_utf8_lossy(&stdout.join().unwrap()),
            String::from_utf8_lossy(&stderr.join().unwrap())
        )
    });
    let (stdout, stderr) = streams.unwrap();
    Output {
        status,
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    }
}

/// Waits for `child` at most [`LIMIT`]; past it, kills it and panics: "the
/// job hung: " and what `hung` says.
pub fn wait_limited(child: &mut Child, hung: impl FnOnce() -> String) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the job hung: {}", hung());
        }
        thread::sleep(Duration::from_millis(50));
    }
}

/// The processes of `accel_pid`'s job (its descendants) that run `name`,
/// with their `RANK` and their state (`/proc/PID/stat`).
pub fn job_ranks(accel_pid: u32, name: &str) -> Vec<(u32, i32, char)> {
    let stat = |pid: i32| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok();
    let field = |text: &str, i: usize| -> Option<String> {
        let rest = &text[text.rfind(')')? + 1..];
        rest.split_whitespace().nth(i).map(str::to_owned)
    };
    let mut parents = std::collections::HashMap::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() {
            if let Some(pp) = stat(pid).and_then(|t| field(&t, 1)?.parse::<i32>().ok()) {
                parents.insert(pid, pp);
            }
        }
    }
    let below = |mut pid: i32| {
        while let Some(pp) = parents.get(&pid) {
            if *pp == accel_pid as i32 {
                return true;
            }
            pid = *pp;
        }
        false
    };
    let mut found = Vec::new();
    for (&pid, _) in parents.iter().filter(|(p, _)| below(**p)) {
        let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        if !String::from_utf8_lossy(&cmd)
            .split('\0')
            .next()
            .unwrap_or("")
            .ends_with(name)
        {
            continue;
        }
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        let rank = env
            .split(|b| *b == 0)
            .find_map(|kv| {
                kv.strip_prefix(b"RANK=")
                    .map(|v| String::from_utf8_lossy(v).parse().ok())
            })
            .flatten();
        let state = stat(pid).and_then(|t| field(&t, 0)?.chars().next());
        if let (Some(rank), Some(state)) = (rank, state) {
            found.push((rank, pid, state));
        }
    }
    found
}

/// Writes `dir/init.safetensors` for the `freeze-probe` fixture: its
/// two-block network (`block0.w`, `block0.b`, `block1.w`, `block1.b`,
/// `head.w`) and data (`x` [40, 6], `y` [40, 2]), seeded.
pub fn write_freeze_probe_init(dir: &Path) {
    use tch::{Kind, Tensor};
    tch::manual_seed(3);
    let t = |shape: &[i64]| Tensor::randn(shape, (Kind::Float, tch::Device::Cpu)) * 0.5;
    let x = t(&[40, 6]);
    let y = t(&[40, 2]);
    let tensors = [
        ("block0.w", t(&[6, 8])),
        ("block0.b", t(&[8])),
        ("block1.w", t(&[8, 8])),
        ("block1.b", t(&[8])),
        ("head.w", t(&[8, 2])),
        ("x", x),
        ("y", y),
    ];
    let refs: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
    Tensor::write_safetensors(&refs, dir.join("init.safetensors")).unwrap();
}

/// Seed 001's Accelerate config file (the YAML block of
/// shared/seeds/001_d2920c91cb52855b.txt, verbatim; `tests/seed_config.rs`
/// compares it with the seed when the seeds are beside the repository).
pub const SEED_001_CONFIG: &str = "compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_reshard_after_forward: true
  fsdp_cpu_offload: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_activation_checkpointing: false
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
mixed_precision: bf16
num_machines: 1
num_processes: 4
";
