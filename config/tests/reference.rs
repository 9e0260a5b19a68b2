//! `config/README.md`'s key reference is the output of
//! `accel_config::reference::reference_markdown()`, byte for byte: a key
//! added, renamed or re-documented in the schema table fails this test until
//! the README is regenerated (the failure prints the text to paste).

use accel_config::reference::{reference_markdown, BEGIN, END};

#[test]
fn the_readme_reference_is_generated_from_the_key_table() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/README.md");
    let readme = std::fs::read_to_string(path).expect("config/README.md");
    let generated = reference_markdown();
    let start = readme.find(BEGIN).unwrap_or_else(|| {
        panic!("config/README.md lacks the marker line {BEGIN}; paste this:\n{generated}")
    });
    let end = readme[start..]
        .find(END)
        .map(|i| start + i + END.len() + 1)
        .unwrap_or_else(|| panic!("config/README.md lacks the marker line {END}"));
    assert!(
        readme[start..end] == generated,
        "config/README.md's reference differs from the key table; replace the block between the markers with:\n{generated}"
    );
}

#[test]
fn every_key_is_documented_and_every_env_var_and_flag_is_unique() {
    let mut envs = std::collections::HashSet::new();
    let mut flags = std::collections::HashSet::new();
    for (path, spec) in accel_config::schema::key_paths() {
        assert!(!spec.doc.is_empty(), "{path} has no doc");
        if let Some(var) = spec.env {
            assert!(envs.insert(var), "{var} sets two keys");
        }
        if let Some(flag) = spec.flag {
            assert!(flags.insert(flag), "--{flag} sets two keys");
        }
    }
}
