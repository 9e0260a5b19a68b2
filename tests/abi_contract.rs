//! The plugin contract (`accel-abi`) and the toolkit (`accel-sdk`): a
//! tracker built on the contract alone needs no libtorch; a plugin built
//! for an older ABI minor still loads (and a tracker built before a kind of
//! log value was added skips it); the README's strategy skeleton
//! builds out of tree and trains 2 ranks.

use accel_integration_tests::{
    accel_bin, assert_failed_with, assert_stdout_contains, cargo, describe, fixture_target_dir,
    loss_log, max_abs_diff, mlp, plugin_build_args, plugin_file_name, plugins_list_json,
    read_weights, run, run_quickstart, workspace_root, write_config,
};
use serde_json::Value;
use std::{
    fs::File,
    path::{Path, PathBuf},
    process::Command,
};

const PLAIN: &str = "accel-test-plain-tracker";

/// Builds the fixture tracker (`tests/fixtures/plain-tracker`, on
/// `accel-abi` alone) with extra `env` and nothing of libtorch in the
/// environment, in a target directory of its own, and copies its cdylib
/// into a new temporary directory.
fn plain_tracker_dir(env: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let lock = File::create(std::env::temp_dir().join("accel-tests-cargo.lock")).unwrap();
    lock.lock().unwrap();
    let root = workspace_root();
    let path: Vec<PathBuf> = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .filter(|p| !p.to_string_lossy().contains(".venv"))
        .collect();
    let (command, args) = plugin_build_args(PLAIN, false);
    let mut cmd = cargo();
    cmd.current_dir(&root)
        .arg(command)
        .args(args)
        .env("PATH", std::env::join_paths(path).unwrap());
    for var in [
        "LIBTORCH",
        "LIBTORCH_USE_PYTORCH",
        "LIBTORCH_LIB",
        "LIBTORCH_INCLUDE",
        "ACCEL_ABI_TEST_MINOR",
    ] {
        cmd.env_remove(var);
    }
    cmd.envs(env.iter().copied());
    let out = cmd.output().expect("cargo runs");
    assert!(out.status.success(), "{}", describe(&out));
    let name = plugin_file_name(PLAIN);
    std::fs::copy(
        fixture_target_dir().join("debug").join(&name),
        dir.path().join(&name),
    )
    .unwrap();
    drop(lock);
    dir
}

/// The `plain` tracker's entry in `accel plugins list --json` over `dir`,
/// asserting its status is ok.
fn plugins_list(dir: &Path) -> Value {
    let list = plugins_list_json(dir);
    let plain = list["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == PLAIN)
        .unwrap_or_else(|| panic!("{PLAIN} not listed: {list:#}"))
        .clone();
    assert_eq!(plain["status"], "ok", "{plain:#}");
    plain
}

/// `quickstart --log-with plain` through `dir`: the tracker's log lines.
fn trains_with_plain(dir: &Path) -> String {
    let project = tempfile::tempdir().unwrap();
    run_quickstart(dir, project.path(), "20", &["plain"]);
    std::fs::read_to_string(project.path().join("quickstart/plain.log")).unwrap()
}

fn accel_env(dir: &Path) -> String {
    let out = run(
        &accel_bin(),
        &["env", "--plugin-dir", dir.to_str().unwrap()],
    );
    assert!(out.status.success(), "{}", describe(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_tracker_on_the_contract_alone_builds_without_libtorch_and_runs() {
    // This fixture and the tracker template authors copy.
    for package in [PLAIN, "accel-csv-tracker"] {
        let tree = cargo()
            .current_dir(workspace_root())
            .args([
                "tree",
                "-p",
                package,
                "-e",
                "normal,build",
                "--prefix",
                "none",
            ])
            .output()
            .unwrap();
        assert!(tree.status.success(), "{}", describe(&tree));
        let tree = String::from_utf8_lossy(&tree.stdout);
        assert!(tree.lines().any(|l| l.starts_with("accel-abi ")), "{tree}");
        for torch in ["tch ", "torch-sys ", "accel-sdk "] {
            assert!(
                !tree.lines().any(|l| l.starts_with(torch)),
                "{package}: {torch}in {tree}"
            );
        }
    }

    let dir = plain_tracker_dir(&[]);
    let plain = plugins_list(dir.path());
    assert_eq!(plain["libtorch_version"], "", "{plain:#}");
    // Its name is longer than the listing's usual NAME column: the columns
    // still line up.
    let out = run(
        &accel_bin(),
        &[
            "plugins",
            "list",
            "--plugin-dir",
            dir.path().to_str().unwrap(),
        ],
    );
    let table = String::from_utf8_lossy(&out.stdout);
    let version_at = |line: &str| line.find(" VERSION ").or_else(|| line.find(" 0.1.0 "));
    let header = table.lines().next().unwrap();
    let row = table
        .lines()
        .find(|l| l.starts_with(PLAIN))
        .expect("listed");
    assert_eq!(version_at(header), version_at(row), "{table}");
    assert_eq!(plain["abi_version"], accel_sdk::ABI_VERSION);
    assert_eq!(plain["abi_minor"], accel_sdk::ABI_MINOR);
    let log = trains_with_plain(dir.path());
    assert!(log.lines().any(|l| l.starts_with("0 loss ")), "{log}");
    // Its `EnvReport`, through the root module.
    let env = accel_env(dir.path());
    assert!(
        env.lines()
            .any(|l| l.contains("plain tracker:") && l.ends_with(" built without libtorch")),
        "{env}"
    );
}

/// The fixture tracker built as ABI minor `minor` was: it loads, reports
/// that minor, and a training run logs through it; returns `accel env`.
fn built_for_an_older_minor_loads_and_runs(minor: u32) -> String {
    let dir = plain_tracker_dir(&[("ACCEL_ABI_TEST_MINOR", &minor.to_string())]);
    let plain = plugins_list(dir.path());
    assert_eq!(plain["abi_version"], accel_sdk::ABI_VERSION);
    assert_eq!(plain["abi_minor"], minor, "{plain:#}");
    assert!(accel_sdk::ABI_MINOR > minor);
    let log = trains_with_plain(dir.path());
    assert!(log.lines().any(|l| l.starts_with("0 loss ")), "{log}");
    accel_env(dir.path())
}

#[test]
fn a_plugin_built_for_abi_minor_0_still_loads_and_runs() {
    // The contract as ABI 4.0 was: the root module without `env_report`.
    let env = built_for_an_older_minor_loads_and_runs(0);
    // What it predates reads as absent: no rows, no error.
    assert!(env.contains(PLAIN), "{env}");
    assert!(
        !env.contains("plain tracker:") && !env.contains("plugin report:"),
        "{env}"
    );
}

#[test]
fn a_tracker_built_for_abi_minor_1_gets_scalars_and_skips_the_values_it_does_not_know() {
    // The contract as ABI 4.1 was: `LogValue` without Image, Histogram and
    // Table. abi_stable alone would refuse it (a host enum with more
    // variants than the library's); the host checks it against 4.1's layout.
    let dir = plain_tracker_dir(&[("ACCEL_ABI_TEST_MINOR", "1")]);
    let plain = plugins_list(dir.path());
    assert_eq!(plain["abi_version"], accel_sdk::ABI_VERSION);
    assert_eq!(plain["abi_minor"], 1, "{plain:#}");
    const { assert!(accel_sdk::ABI_MINOR > 1) };
    // mlp logs loss and lr every step, then images, a histogram and a table
    // (`--log-media`): the tracker writes the scalars, skips the rest, and
    // the run ends without an error.
    let project = tempfile::tempdir().unwrap();
    let out = run(
        &mlp(),
        &[
            "--plugin-dir",
            dir.path().to_str().unwrap(),
            "--log-with",
            "plain",
            "--project-dir",
            project.path().to_str().unwrap(),
            "--steps",
            "3",
            "--log-media",
        ],
    );
    assert!(out.status.success(), "{}", describe(&out));
    let log = std::fs::read_to_string(project.path().join("mlp/plain.log")).unwrap();
    for step in 1..=3 {
        for key in ["loss", "lr"] {
            assert!(
                log.lines()
                    .any(|l| l.starts_with(&format!("{step} {key} "))),
                "no {key} at step {step}: {log}"
            );
        }
    }
    assert_eq!(log.lines().count(), 6, "{log}");
    // What 4.1 added still works: its `EnvReport`.
    let env = accel_env(dir.path());
    assert!(env.contains("plain tracker:"), "{env}");
}

#[test]
fn plugins_built_for_abi_minors_1_and_2_still_load_and_run() {
    // The contract as ABI 4.1 was: the host context without 4.2's methods;
    // as 4.2 was: the strategy without 4.3's `unit_backward_done`. Both
    // vtables, shorter than the host's, are in the root module's layout
    // (through `new_strategy`, also in a library without a strategy).
    for minor in [1, 2] {
        let env = built_for_an_older_minor_loads_and_runs(minor);
        assert!(
            env.lines()
                .any(|l| l.contains("plain tracker:") && l.ends_with(" built without libtorch")),
            "minor {minor}: {env}"
        );
    }
}

/// The code block after `<!-- skeleton: NAME -->` in the README.
fn readme_block(readme: &str, name: &str) -> String {
    let marker = format!("<!-- skeleton: {name} -->");
    let after = readme
        .split_once(&marker)
        .unwrap_or_else(|| panic!("README.md has no `{marker}`"))
        .1;
    let body = after.split_once("```").unwrap().1;
    let body = body.split_once('\n').unwrap().1;
    body.split_once("```").unwrap().0.to_owned()
}

#[test]
fn readme_strategy_skeleton_trains_two_ranks() {
    let root = workspace_root();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let lib = readme_block(&readme, "src/lib.rs");
    assert!(lib.lines().count() <= 60, "{} lines", lib.lines().count());
    let manifest = readme_block(&readme, "Cargo.toml").replace(
        "accel-sdk = \"0.1\"",
        &format!("accel-sdk = {{ path = {:?} }}", root.join("sdk")),
    );

    // Out of tree: a crate of its own, the workspace's versions pinned.
    let krate = tempfile::tempdir().unwrap();
    std::fs::create_dir(krate.path().join("src")).unwrap();
    std::fs::write(krate.path().join("Cargo.toml"), manifest).unwrap();
    std::fs::write(krate.path().join("src/lib.rs"), &lib).unwrap();
    std::fs::copy(root.join("Cargo.lock"), krate.path().join("Cargo.lock")).unwrap();
    let plugins = tempfile::tempdir().unwrap();
    let so = plugin_file_name("avg-grads");
    {
        let lock = File::create(std::env::temp_dir().join("accel-tests-cargo.lock")).unwrap();
        lock.lock().unwrap();
        // The workspace's target directory and profile, so that tch and
        // libtorch's bindings are not built again; the plugin is not left
        // beside `target/debug/accel`, whose plugin search would list it.
        let target = root.join("target");
        let out = cargo()
            .current_dir(krate.path())
            .args([
                "build",
                "--config",
                "profile.dev.debug=\"line-tables-only\"",
            ])
            .args(["--config", "profile.dev.package.\"*\".debug=false"])
            .env("CARGO_TARGET_DIR", &target)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", describe(&out));
        let built = target.join("debug").join(&so);
        std::fs::copy(&built, plugins.path().join(&so)).unwrap();
        std::fs::remove_file(built).unwrap();
    }

    let dir = tempfile::tempdir().unwrap();
    let plugin_dir = plugins.path().to_str().unwrap();
    let cfg = write_config(
        dir.path(),
        "avg_grads.yaml",
        "AVG_GRADS",
        2,
        "accel:\n  plugins:\n    avg-grads:\n      sum: false\n",
    );
    let save = dir.path().join("w_{rank}.safetensors");
    let log = dir.path().join("loss.jsonl");
    let out = launch(
        Command::new(accel_bin())
            .args(["launch", "--plugin-dir", plugin_dir, "--config_file"])
            .arg(&cfg)
            .arg(mlp())
            .args(["--steps", "6", "--save", save.to_str().unwrap()])
            .args(["--loss-log", log.to_str().unwrap()]),
    );
    assert!(out.status.success(), "{}", describe(&out));
    assert_stdout_contains(&out, "strategy avg-grads (avg-grads)");
    // Averaged gradients from identical starts: the ranks stay identical.
    let w = |r: u32| read_weights(&dir.path().join(format!("w_{r}.safetensors")));
    assert_eq!(max_abs_diff(&w(0), &w(1)), 0.0);
    let losses = loss_log(&log);
    assert!(losses[5].1 < losses[0].1, "{losses:?}");

    // Typed settings: a key the plugin does not know stops the launch,
    // naming its section.
    let bad = write_config(
        dir.path(),
        "bad.yaml",
        "AVG_GRADS",
        2,
        "accel:\n  plugins:\n    avg-grads:\n      bogus: 1\n",
    );
    let out = launch(
        Command::new(accel_bin())
            .args(["launch", "--plugin-dir", plugin_dir, "--config_file"])
            .arg(&bad)
            .arg(mlp())
            .args(["--steps", "1"]),
    );
    assert_failed_with(&out, &["accel.plugins.avg-grads", "unknown field `bogus`"]);
}

/// Runs `cmd` (an `accel launch`) with no `ACCEL_PLUGIN_DIR` or `ACCEL_LOG`.
fn launch(cmd: &mut Command) -> std::process::Output {
    cmd.env_remove("ACCEL_PLUGIN_DIR")
        .env_remove("ACCEL_LOG")
        .output()
        .expect("starts")
}
