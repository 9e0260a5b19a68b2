//! `accel config` through the `accel` binary: the questionnaire answered on
//! stdin, `validate` of Accelerate's own files, and a plugin that checks
//! its own config section. The files of Accelerate's repository come from
//! the conformance corpus beside this repository when it is there (CI);
//! without it that test says it skipped.

use accel_integration_tests::{accel_bin, assert_contains, describe, plugin_dir, run};
use accel_test_kit::conformance_dir;
use std::{
    io::Write,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
};

/// A file of the conformance corpus beside the repository (CI has it, a
/// plain clone does not: then `None`, said on stderr, unless
/// `ACCEL_REQUIRE_CONFORMANCE` is set). `ACCEL_CONFORMANCE_DIR` names
/// another place.
fn conformance(rel: &str) -> Option<PathBuf> {
    let dir = conformance_dir()?;
    let file = dir.join("accelerate-configs").join(rel);
    assert!(
        file.is_file(),
        "{} is missing from the corpus",
        file.display()
    );
    Some(file)
}

#[test]
fn questionnaire_on_stdin_writes_a_file_validate_accepts() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("answers.yaml");
    let mut child = Command::new(accel_bin())
        .args(["config", "--config_file", target.to_str().unwrap()])
        .env_remove("ACCEL_PLUGIN_DIR")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // LOCAL_MACHINE, MULTI_CPU, 1 machine, no cpu affinity?, 4 processes, no, bf16
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"0\nMULTI_CPU\n1\nno\n4\nno\nbf16\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", describe(&out));
    let text = std::fs::read_to_string(&target).unwrap();
    assert!(text.contains("distributed_type: MULTI_CPU"), "{text}");
    assert!(text.contains("num_processes: 4"), "{text}");
    let v = run(
        &accel_bin(),
        &["config", "validate", target.to_str().unwrap()],
    );
    assert!(v.status.success(), "{}", describe(&v));
}

/// `accel config validate` on a file of Accelerate's: accepted, or refused
/// naming both of `invalid_key` and `another_invalid_key`.
fn validate_names_invalid_keys(good: &Path, bad: &Path) {
    let out = run(
        &accel_bin(),
        &["config", "validate", good.to_str().unwrap()],
    );
    assert!(out.status.success(), "{}", describe(&out));
    let out = run(&accel_bin(), &["config", "validate", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("`invalid_key`") && err.contains("`another_invalid_key`"),
        "{err}"
    );
}

#[test]
fn conformance_validate_accepts_accelerates_files_and_names_invalid_keys() {
    let Some(good) = conformance("tests/test_configs/latest.yaml") else {
        return;
    };
    let bad = conformance("tests/test_configs/invalid_keys.yaml").unwrap();
    validate_names_invalid_keys(&good, &bad);
    eprintln!(
        "conformance: `accel config validate` accepts {} and refuses {}",
        good.display(),
        bad.display()
    );
}

#[test]
fn validate_names_every_invalid_key_and_accepts_the_repositorys_configs() {
    // The corpus's invalid_keys.yaml, as Accelerate's tests have it.
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.yaml");
    let text = "compute_environment: LOCAL_MACHINE\ndeepspeed_config: {}\n\
                distributed_type: 'NO'\ndowncast_bf16: 'no'\nfsdp_config: {}\n\
                machine_rank: 0\nmain_process_ip: null\nmain_process_port: null\n\
                main_training_function: main\nmixed_precision: 'no'\nnum_machines: 1\n\
                num_processes: 1\nuse_cpu: false\n";
    std::fs::write(&good, text).unwrap();
    let bad = dir.path().join("invalid_keys.yaml");
    std::fs::write(
        &bad,
        format!(
            "{text}invalid_key: \"invalid_value\"\nanother_invalid_key: \"another_invalid_value\"\n"
        ),
    )
    .unwrap();
    validate_names_invalid_keys(&good, &bad);
    let configs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
    for f in std::fs::read_dir(configs).unwrap() {
        let f = f.unwrap().path();
        let out = run(&accel_bin(), &["config", "validate", f.to_str().unwrap()]);
        assert!(out.status.success(), "{}: {}", f.display(), describe(&out));
    }
}

#[test]
fn a_strategy_plugin_checks_its_own_section() {
    let plugins = plugin_dir("accel-test-faulty");
    let d = plugins.path().to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, mb: &str| {
        let path = dir.path().join(name);
        std::fs::write(
            &path,
            format!(
                "distributed_type: TEST_CHECKED\nnum_processes: 2\naccel:\n  plugins:\n    accel-test-faulty:\n      bucket_mb: {mb}\n"
            ),
        )
        .unwrap();
        path.to_str().unwrap().to_owned()
    };
    let bad = write("bad.yaml", "-1");
    let good = write("good.yaml", "25");

    let out = run(
        &accel_bin(),
        &["config", "validate", "--plugin-dir", d, &bad],
    );
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    // At the value of the key the plugin names: line 6, column 18.
    assert!(
        err.contains(&format!(
            "{bad}:6:18: error: plugin `accel-test-faulty`: \
             accel.plugins.accel-test-faulty.bucket_mb must be a positive number, got -1"
        )),
        "{err}"
    );
    let out = run(
        &accel_bin(),
        &["config", "validate", "--plugin-dir", d, &good],
    );
    assert!(out.status.success(), "{}", describe(&out));

    // Without the plugin, TEST_CHECKED is not a distributed_type at all.
    let out = run(&accel_bin(), &["config", "validate", &good]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("TEST_CHECKED") && err.contains("MULTI_GPU"),
        "{err}"
    );
}

/// A config file in a directory of its own, checked by `accel config
/// validate` and run by `accel launch` (`touch` of a marker file, so a test
/// sees whether a rank started).
struct ConfigRun {
    accel: PathBuf,
    config: PathBuf,
    marker: PathBuf,
    _dir: tempfile::TempDir,
}

impl ConfigRun {
    /// `yaml` written as `name`.
    fn new(name: &str, yaml: &str) -> ConfigRun {
        let dir = tempfile::tempdir().unwrap();
        let run = ConfigRun {
            accel: accel_bin(),
            config: dir.path().join(name),
            marker: dir.path().join("a-rank-ran"),
            _dir: dir,
        };
        run.write(yaml);
        run
    }

    /// Replaces the file with `yaml`.
    fn write(&self, yaml: &str) {
        std::fs::write(&self.config, yaml).unwrap();
    }

    /// `{file}:{line_col}`, where a message points in the file.
    fn place(&self, line_col: &str) -> String {
        format!("{}:{line_col}", self.config.display())
    }

    /// `accel config validate FILE`, asserted to exit with `code` saying
    /// `said` on stderr.
    fn validate(&self, code: i32, said: &str) {
        let out = run(
            &self.accel,
            &["config", "validate", self.config.to_str().unwrap()],
        );
        assert_exit(&out, code, said);
    }

    /// [`ConfigRun::validate`] and [`ConfigRun::launch`], both exiting with
    /// `code` and reporting `said` as a `severity` at `line_col` (validate:
    /// `FILE:LINE:COL: SEVERITY: SAID`; launch: `accel launch: SEVERITY:
    /// FILE:LINE:COL: SAID`).
    fn both_say(&self, code: i32, severity: &str, line_col: &str, said: &str) {
        let place = self.place(line_col);
        self.validate(code, &format!("{place}: {severity}: {said}"));
        self.launch(code, &format!("accel launch: {severity}: {place}: {said}"));
    }

    /// `accel launch --config_file FILE touch MARKER` (no ACCEL_PLUGIN_DIR),
    /// asserted to exit with `code` saying `said` on stderr, a rank having
    /// run exactly when it succeeded; returns all it wrote.
    fn launch(&self, code: i32, said: &str) -> String {
        let out = Command::new(&self.accel)
            .args(["launch", "--config_file"])
            .arg(&self.config)
            .arg("touch")
            .arg(&self.marker)
            .env_remove("ACCEL_PLUGIN_DIR")
            .output()
            .unwrap();
        let text = assert_exit(&out, code, said);
        assert_eq!(self.marker.exists(), code == 0, "a rank ran: {text}");
        let _ = std::fs::remove_file(&self.marker);
        text
    }
}

/// A 2-process CPU FSDP config whose `fsdp_config` is `section`.
fn on_fsdp(section: &str) -> String {
    format!("distributed_type: FSDP\nnum_processes: 2\nuse_cpu: true\nfsdp_config:\n{section}")
}

/// Asserts that `out` exited with `code` and its stderr contains `said`;
/// returns all it wrote.
fn assert_exit(out: &Output, code: i32, said: &str) -> String {
    let text = describe(out);
    assert_eq!(out.status.code(), Some(code), "{text}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(said),
        "no `{said}` in {text}"
    );
    text
}

#[test]
fn launch_refuses_what_accel_fsdp_cannot_run_before_any_rank_starts() {
    // Accelerate's value, well-formed (so the file validates), but not
    // implemented by accel-fsdp: launch refuses it, pointing at it.
    let c = ConfigRun::new(
        "fsdp.yaml",
        &on_fsdp("  fsdp_state_dict_type: LOCAL_STATE_DICT\n"),
    );
    c.validate(0, "");
    let text = c.launch(
        1,
        &format!(
            "accel launch: error: {}: plugin `accel-fsdp`: fsdp_config.fsdp_state_dict_type: \
             LOCAL_STATE_DICT is not supported by accel-fsdp",
            c.place("5:25")
        ),
    );
    assert!(!text.contains("process(es) on machine"), "{text}");

    // A setting the plugin's validator refuses outright: the same, in
    // `config validate` too, at the key's line and column.
    c.write(&on_fsdp("  fsdp_sync_module_states: false\n"));
    let said = "plugin `accel-fsdp`: fsdp_config.fsdp_sync_module_states is false";
    c.both_say(1, "error", "5:28", said);
}

#[test]
fn a_section_for_a_plugin_not_installed_is_a_warning_naming_the_close_ones() {
    let c = ConfigRun::new(
        "typo.yaml",
        "distributed_type: NO\nnum_processes: 1\nuse_cpu: true\naccel:\n  plugins:\n    accel-fsdq:\n      bucket_mb: 25\n",
    );
    let said = "accel.plugins.accel-fsdq: no installed plugin is named `accel-fsdq`, \
                so nothing reads these settings; did you mean `accel-fsdp`?";
    // At launch too: the same warning, and the job runs.
    c.both_say(0, "warning", "6:5", said);
}

#[test]
fn launch_checks_the_strategys_settings_before_any_rank_starts() {
    // `fsdp_offload_param` is one letter short of a real key: an error with
    // the suggestion; an unknown key is only a warning.
    let c = ConfigRun::new(
        "fsdp.yaml",
        &on_fsdp("  fsdp_offload_param: true\n  fsdp_shiny_new_knob: 1\n"),
    );
    assert_contains(&c.launch(1, ""), &["did you mean `fsdp_offload_params`"]);
    // Without the near miss, the unknown key is a warning and the job runs.
    c.write(&on_fsdp("  fsdp_shiny_new_knob: 1\n"));
    assert_contains(&c.launch(0, ""), &["fsdp_shiny_new_knob"]);
}
