//! Test helpers shared by the test suites of accel's crates (`accel-config`,
//! `accel-data` and the integration tests), so that each does not keep its
//! own copy: proptest's case counts under `ACCEL_FUZZ_SCALE`, a small
//! seeded random stream, per-case scratch files and directories, and the
//! conformance corpus beside the repository.

pub mod safetensors;

use proptest::test_runner::Config as ProptestConfig;
use std::{
    ops::Range,
    path::{Path, PathBuf},
    sync::atomic::{AtomicUsize, Ordering},
};

/// proptest's settings for `n` cases, times `ACCEL_FUZZ_SCALE` (a
/// multiplier, 1 when unset) to fuzz longer; failures are not persisted.
pub fn cases(n: u32) -> ProptestConfig {
    let scale = std::env::var("ACCEL_FUZZ_SCALE")
        .ok()
        .and_then(|s| s.parse::<u32>().ok())
        .unwrap_or(1)
        .max(1);
    ProptestConfig {
        failure_persistence: None,
        ..ProptestConfig::with_cases(n.saturating_mul(scale))
    }
}

/// A YAML "billion laughs" document: a list of ten scalars under `a`, then
/// `levels` anchored lists of ten aliases of the one before, so expanding
/// the last would make 10^(levels+1) scalars. A parser must refuse it, not
/// expand it.
pub fn yaml_alias_bomb(levels: usize) -> String {
    let mut text = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
    for i in 0..levels {
        let prev = match i {
            0 => "a".to_string(),
            _ => format!("l{}", i - 1),
        };
        let aliases = vec![format!("*{prev}"); 10].join(", ");
        text.push_str(&format!("l{i}: &l{i} [{aliases}]\n"));
    }
    text
}

/// A small deterministic random stream (splitmix64) from a seed. Fuzz tests
/// let proptest draw the seed and draw the rest from here: proptest's
/// composed strategies cost milliseconds a case in a debug build, this costs
/// microseconds, so a suite runs tens of thousands of cases.
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number below `n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// A number in `r` (`r.start` when it is empty).
    pub fn range(&mut self, r: Range<usize>) -> usize {
        r.start + self.below(r.end - r.start)
    }

    /// True once in `in_n` draws.
    pub fn chance(&mut self, in_n: usize) -> bool {
        self.below(in_n) == 0
    }

    /// One element of `from` (not empty).
    pub fn pick<T: Clone>(&mut self, from: &[T]) -> T {
        from[self.below(from.len())].clone()
    }

    /// The index of one of `weights`, drawn in proportion to its weight.
    pub fn weighted(&mut self, weights: &[usize]) -> usize {
        let mut r = self.below(weights.iter().sum());
        for (i, &w) in weights.iter().enumerate() {
            if r < w {
                return i;
            }
            r -= w;
        }
        weights.len() - 1
    }

    /// A string of a length in `len`, each character drawn by `pick` from
    /// the next random bits.
    pub fn string(&mut self, len: Range<usize>, pick: fn(u64) -> char) -> String {
        let n = self.range(len);
        (0..n).map(|_| pick(self.next_u64())).collect()
    }

    /// `n` random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

/// A new path, `{n}-{name}` with `n` never used before, in a directory
/// shared by the cases of a test thread (a directory per case costs a
/// millisecond on some disks, more than the case itself), in memory where
/// there is a tmpfs.
fn scratch_path(name: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static DIR: tempfile::TempDir = tempfile::tempdir_in("/dev/shm")
            .or_else(|_| tempfile::tempdir())
            .expect("a temporary directory");
    }
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    DIR.with(|d| d.path().join(format!("{n}-{name}")))
}

/// A file for one case (not created), removed when dropped.
pub struct CaseFile(PathBuf);

impl CaseFile {
    /// A new case file whose name ends with `name` (its extension counts).
    pub fn new(name: &str) -> Self {
        CaseFile(scratch_path(name))
    }

    /// Where the file is.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for CaseFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// An empty scratch directory for one case, removed with what it holds
/// when dropped.
pub struct CaseDir(PathBuf);

impl CaseDir {
    /// A new, empty case directory.
    pub fn new() -> Self {
        let dir = scratch_path("case");
        std::fs::create_dir(&dir).unwrap();
        CaseDir(dir)
    }

    /// Where the directory is.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl std::ops::Deref for CaseDir {
    type Target = Path;

    /// Where the directory is (so `dir.join(..)` and `&dir` work as on a
    /// path).
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Default for CaseDir {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for CaseDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The conformance corpus (Accelerate's files, gathered beside the
/// repository: `../shared/conformance`, as in CI; `ACCEL_CONFORMANCE_DIR`
/// names another place), or `None`, said on stderr, when there is none,
/// unless `ACCEL_REQUIRE_CONFORMANCE` is set: then its absence fails.
pub fn conformance_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("ACCEL_CONFORMANCE_DIR").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/conformance"),
        PathBuf::from,
    );
    if !dir.is_dir() {
        let why = format!(
            "no corpus at {} (it sits beside the repository in CI; \
             ACCEL_CONFORMANCE_DIR names another place)",
            dir.display()
        );
        assert!(
            std::env::var_os("ACCEL_REQUIRE_CONFORMANCE").is_none(),
            "conformance: {why}, and ACCEL_REQUIRE_CONFORMANCE is set"
        );
        eprintln!("conformance: skipped: {why}");
        return None;
    }
    Some(dir.canonicalize().unwrap_or(dir))
}

/// `accelerate-configs/` of the conformance corpus (Accelerate's own
/// config files), or `None` as [`conformance_dir`] says; a corpus without
/// it fails.
pub fn accelerate_configs_dir() -> Option<PathBuf> {
    let dir = conformance_dir()?;
    let root = dir.join("accelerate-configs");
    assert!(
        root.is_dir(),
        "{} exists but has no accelerate-configs/",
        dir.display()
    );
    Some(root)
}

/// Every `.yaml`/`.yml` file under `dir` (recursively), sorted.
///
/// ```
/// let dir = tempfile::tempdir().unwrap();
/// std::fs::create_dir(dir.path().join("sub")).unwrap();
/// for f in ["b.yaml", "sub/a.yml", "c.json"] {
///     std::fs::write(dir.path().join(f), "").unwrap();
/// }
/// let names: Vec<_> = accel_test_kit::yaml_files(dir.path())
///     .iter()
///     .map(|p| p.strip_prefix(dir.path()).unwrap().to_owned())
///     .collect();
/// assert_eq!(names, ["b.yaml", "sub/a.yml"].map(std::path::PathBuf::from));
/// ```
pub fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let entries =
            std::fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()));
        for p in entries.map(|e| e.unwrap().path()) {
            if p.is_dir() {
                walk(&p, out);
            } else if matches!(p.extension().and_then(|e| e.to_str()), Some("yaml" | "yml")) {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(dir, &mut files);
    files.sort();
    files
}
