//! The plugin host end to end: the template plugin built, copied to a
//! temporary `--plugin-dir`, listed, called; bad files rejected one line
//! each without stopping the others; conflicts; panics that stay errors.

use accel::plugins::{DirOrigin, PluginSet, SearchDir};
use accel_integration_tests::{
    accel_bin, build_locked, build_plain_c_library, build_plugin_into, build_plugin_variant_into,
    describe, plugin_dir, plugin_file_name, plugins_list_json, run, run_quickstart,
    FIXTURE_PLUGINS,
};
use accel_sdk::{abi_stable::std_types::ROption, ErrorKind, LogEntry, PluginKind};
use serde_json::Value;
use std::{
    path::{Path, PathBuf},
    process::Output,
};

const TEMPLATE: &str = "libaccel_csv_tracker.so";

fn template_into(dir: &Path) -> PathBuf {
    let dest = dir.join(TEMPLATE);
    build_plugin_into("accel-csv-tracker", &[], &dest);
    dest.canonicalize().unwrap()
}

fn entry<'a>(list: &'a Value, path: &Path) -> &'a Value {
    list["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["path"].as_str() == path.to_str())
        .unwrap_or_else(|| panic!("{} not listed in {list:#}", path.display()))
}

/// `accel plugins select tracker csv EXTRA --plugin-dir DIR`.
fn select_csv(accel: &Path, dir: &str, extra: &[&str]) -> Output {
    let args = [
        &["plugins", "select", "tracker", "csv"][..],
        extra,
        &["--plugin-dir", dir],
    ];
    run(accel, &args.concat())
}

#[test]
fn template_plugin_is_listed_ok_from_a_plugin_dir() {
    let dir = tempfile::tempdir().unwrap();
    let so = template_into(dir.path());
    let list = plugins_list_json(dir.path());
    let template = entry(&list, &so);
    assert_eq!(template["status"], "ok");
    assert_eq!(template["name"], "accel-csv-tracker");
    assert_eq!(template["kinds"], serde_json::json!(["tracker"]));
    assert_eq!(
        template["provides"][0]["selectors"],
        serde_json::json!(["csv"])
    );
    assert_eq!(template["abi_version"], accel_sdk::ABI_VERSION);
    // The template needs accel-abi alone (tests/abi_contract.rs: no tch in
    // its tree), but in a workspace build accel-abi is built once, with the
    // `tch` feature accel-sdk turns on, and so reports the workspace's libtorch.
    assert_eq!(template["libtorch_version"], accel_sdk::LIBTORCH_VERSION);
    assert_eq!(list["search_path"][0]["origin"], "flag");
}

/// `accel plugins list | head -1`: a reader that leaves early is no error
/// (no "Broken pipe" message, status 0), as with ripgrep or ls.
#[test]
fn a_listing_whose_reader_went_away_ends_quietly() {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = std::process::Command::new(accel_bin())
        .args(["plugins", "list"])
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", describe(&out));
    assert_eq!(String::from_utf8_lossy(&out.stderr), "");
}

#[test]
fn template_plugin_is_called_through_the_plugin_dir_and_writes_csv() {
    let dir = tempfile::tempdir().unwrap();
    template_into(dir.path());
    let project = tempfile::tempdir().unwrap();
    run_quickstart(dir.path(), project.path(), "50", &["csv", "jsonl"]);

    let csv = std::fs::read_to_string(project.path().join("quickstart/metrics.csv")).unwrap();
    let mut lines = csv.lines();
    assert_eq!(lines.next(), Some("step,key,value"));
    let losses: Vec<(u64, f64)> = lines
        .filter_map(|l| {
            let cols: Vec<&str> = l.split(',').collect();
            (cols[1] == "loss").then(|| (cols[0].parse().unwrap(), cols[2].parse().unwrap()))
        })
        .collect();
    let steps: Vec<u64> = losses.iter().map(|(s, _)| *s).collect();
    assert_eq!(steps, [0, 10, 20, 30, 40, 49]);
    assert!(
        losses.last().unwrap().1 < losses[0].1 / 10.0,
        "loss did not fall: {losses:?}"
    );

    // The built-in JSONL tracker saw exactly the same values.
    let jsonl = std::fs::read_to_string(project.path().join("quickstart/metrics.jsonl")).unwrap();
    let from_jsonl: Vec<(u64, f64)> = jsonl
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .map(|v| (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap()))
        .collect();
    assert_eq!(from_jsonl, losses);
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(project.path().join("quickstart/config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(config["steps"], 50);
}

#[test]
fn bad_files_are_rejected_one_line_each_and_the_rest_still_load() {
    let dir = tempfile::tempdir().unwrap();
    let template = template_into(dir.path());
    let junk = dir.path().join("junk.so");
    std::fs::write(&junk, "not a library").unwrap();
    let plain = dir.path().join("libplain.so");
    build_plain_c_library(&plain);
    let abi = dir.path().join("libaccel_csv_tracker_abi999.so");
    build_plugin_variant_into(
        "accel-csv-tracker",
        &[("ACCEL_SDK_TEST_ABI_VERSION", "999")],
        &abi,
    );

    let list = plugins_list_json(dir.path());
    assert_eq!(entry(&list, &template)["status"], "ok");
    let error_of = |p: &Path| {
        let e = entry(&list, &p.canonicalize().unwrap());
        assert_eq!(e["status"], "rejected");
        let msg = e["error"].as_str().unwrap().to_owned();
        assert!(!msg.contains('\n'), "not one line: {msg}");
        assert!(
            msg.starts_with(&format!("{}: ", p.canonicalize().unwrap().display())),
            "{msg}"
        );
        msg
    };
    assert!(error_of(&junk).contains("not an accel plugin"));
    let plain_msg = error_of(&plain);
    assert!(
        plain_msg.contains("not an accel plugin (no `accel_plugin_abi_version` symbol)"),
        "{plain_msg}"
    );
    let abi_msg = error_of(&abi);
    assert!(
        abi_msg.contains(&format!(
            "SDK ABI mismatch: plugin built for accel-sdk ABI 999, this accel speaks ABI {}",
            accel_sdk::ABI_VERSION
        )),
        "{abi_msg}"
    );

    let d = dir.path().to_str().unwrap();
    let accel = accel_bin();
    // Asking for a rejected plugin by name fails, with the same line.
    let show = run(
        &accel,
        &[
            "plugins",
            "show",
            "accel_csv_tracker_abi999",
            "--plugin-dir",
            d,
        ],
    );
    assert_eq!(show.status.code(), Some(1), "{}", describe(&show));
    assert!(
        String::from_utf8_lossy(&show.stderr).contains(&abi_msg),
        "{}",
        describe(&show)
    );
    let pick = select_csv(&accel, d, &["--use-plugin", "junk"]);
    assert_eq!(pick.status.code(), Some(1), "{}", describe(&pick));
    assert!(String::from_utf8_lossy(&pick.stderr).contains("not an accel plugin"));
    // The good plugin beside them still answers.
    let ok = select_csv(&accel, d, &[]);
    assert!(ok.status.success(), "{}", describe(&ok));
    assert!(String::from_utf8_lossy(&ok.stdout).contains(template.to_str().unwrap()));
}

#[test]
fn two_plugins_claiming_one_selector_is_an_error_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    let template = template_into(dir.path());
    let faulty = dir.path().join("libaccel_test_faulty.so");
    build_plugin_variant_into(
        "accel-test-faulty",
        &[("ACCEL_TEST_FAULTY_CLAIMS_CSV", "1")],
        &faulty,
    );
    let faulty = faulty.canonicalize().unwrap();
    let d = dir.path().to_str().unwrap();
    let accel = accel_bin();

    let out = select_csv(&accel, d, &[]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(template.to_str().unwrap()) && err.contains(faulty.to_str().unwrap()),
        "{err}"
    );

    let picked = select_csv(&accel, d, &["--use-plugin", "accel-csv-tracker"]);
    assert!(picked.status.success(), "{}", describe(&picked));
}

#[test]
fn a_panicking_plugin_call_is_an_error_and_the_host_survives() {
    let dir = plugin_dir("accel-test-faulty");
    let set = PluginSet::discover(&[SearchDir {
        path: dir.path().to_owned(),
        origin: DirOrigin::Flag,
    }]);
    assert!(set.rejected().is_empty(), "{:?}", set.rejected());

    let mut tracker = set
        .select(PluginKind::Tracker, "panicky", None)
        .unwrap()
        .new_tracker("{}")
        .unwrap();
    tracker.start("p".into(), "{}".into()).unwrap();
    let err = tracker
        .log(
            [LogEntry::scalar("x", 1.0)].as_slice().into(),
            ROption::RNone,
        )
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::Panic);
    assert_eq!(err.plugin.as_str(), "accel-test-faulty");
    assert!(
        err.message.contains("Tracker::log") && err.message.contains("deliberate panic in log"),
        "{err}"
    );
    // The same object still answers afterwards.
    tracker.flush().unwrap();

    let err = set
        .select(PluginKind::Tracker, "exploding", None)
        .unwrap()
        .new_tracker("{}")
        .err()
        .unwrap();
    assert_eq!(err.kind, ErrorKind::Panic);
    assert!(
        err.message.contains("creating tracker `exploding`"),
        "{err}"
    );
}

/// A workspace build (what `cargo test --workspace` builds too) leaves no
/// test fixture plugin beside `target/debug/accel`, so the plugins a
/// contributor's `accel plugins list` shows there are the ones accel ships.
#[test]
fn a_workspace_build_leaves_no_fixture_plugin_beside_accel() {
    let fixtures: Vec<String> = FIXTURE_PLUGINS
        .iter()
        .map(|p| plugin_file_name(p))
        .collect();
    build_locked(&["--workspace"], &[], |files| {
        let name = |f: &PathBuf| f.file_name().and_then(|n| n.to_str()).map(str::to_owned);
        let libraries: Vec<String> = files
            .iter()
            .filter_map(name)
            .filter(|n| n.ends_with(".so"))
            .collect();
        for fixture in &fixtures {
            assert!(
                !libraries.contains(fixture),
                "{fixture} built: {libraries:?}"
            );
        }
        let accel = files
            .iter()
            .find(|f| name(f).as_deref() == Some("accel"))
            .expect("target/debug/accel built");
        let out = run(accel, &["plugins", "list", "--json"]);
        assert!(out.status.success(), "{}", describe(&out));
        let list: Value = serde_json::from_slice(&out.stdout).unwrap();
        let names: Vec<&str> = list["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|p| p["name"].as_str())
            .collect();
        assert!(names.contains(&"accel-ddp"), "{names:?}");
        for fixture in FIXTURE_PLUGINS {
            assert!(!names.contains(fixture), "{fixture} listed: {names:?}");
        }
    });
}
