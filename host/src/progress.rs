//! Progress bars for training loops, checkpoints and the launcher (the
//! tqdm habit of Accelerate users), drawn with
//! [indicatif](https://docs.rs/indicatif) on stderr.
//!
//! A bar draws only on the **local main process** (one bar per machine,
//! as Accelerate's `tqdm(disable=not accelerator.is_local_main_process)`),
//! and only when stderr reaches a **terminal**: the process's own stderr is
//! one, or `accel launch` — whose own stderr is a terminal — passes the
//! rank's stderr on unchanged (no `--tee` of stderr, no `--log_dir`) and
//! says so with `ACCEL_PROGRESS_TERMINAL=1` (ranks started through
//! `mpirun` or `srun` write to a pipe that ends on that terminal). Output
//! redirected to a file or a pipe therefore never holds a bar.
//!
//! `ACCEL_DISABLE_PROGRESS_BAR=1` (or `true`) hides every bar, as
//! `HF_HUB_DISABLE_PROGRESS_BARS` does in the Hugging Face libraries.
//!
//! ```
//! use accel::progress::ProgressBar;
//! // Not the local main process: hidden whatever stderr is.
//! let bar = ProgressBar::steps(100, "train", false);
//! assert!(!bar.is_drawing());
//! bar.inc(1);
//! bar.finish();
//! ```

use indicatif::{ProgressDrawTarget, ProgressStyle};
use std::{borrow::Cow, io::IsTerminal, path::PathBuf, time::Duration};

/// `1`/`true` hides every progress bar.
pub const DISABLE_ENV: &str = "ACCEL_DISABLE_PROGRESS_BAR";

/// Set to `1` by `accel launch` for its ranks when its own stderr is a
/// terminal and reaches the ranks' stderr unchanged.
pub const TERMINAL_ENV: &str = "ACCEL_PROGRESS_TERMINAL";

/// Test-only: a directory; a bar that would draw on a terminal draws into
/// `<dir>/progress_rank<RANK>.txt` instead (whatever stderr is), so a test
/// can see which rank drew.
pub const TEST_DRAW_DIR_ENV: &str = "ACCEL_TEST_PROGRESS_DIR";

/// Checkpoints whose model holds at least this many bytes of tensors show a
/// bar while they are saved or loaded: 100 MB.
pub const LARGE_CHECKPOINT_BYTES: u64 = 100_000_000;

/// The bytes `tensors` hold.
pub fn tensor_bytes<'a>(tensors: impl IntoIterator<Item = &'a tch::Tensor>) -> u64 {
    tensors
        .into_iter()
        .map(|t| t.numel() as u64 * t.kind().elt_size_in_bytes() as u64)
        .sum()
}

fn env_on(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| matches!(v.trim(), "1" | "true" | "TRUE" | "True"))
}

/// Whether a bar draws: on the local main process, not disabled, and with
/// stderr on a terminal (its own, or the launcher's).
pub fn should_draw(
    local_main: bool,
    stderr_is_terminal: bool,
    launcher_terminal: bool,
    disabled: bool,
) -> bool {
    local_main && !disabled && (stderr_is_terminal || launcher_terminal)
}

/// A progress bar (hidden where it must not draw; every method still works).
pub struct ProgressBar {
    bar: indicatif::ProgressBar,
}

impl ProgressBar {
    /// A bar over `len` steps: `message [#####>    ] 12/100 steps (3.4/s, eta 26s)`.
    /// `local_main`: whether this is the local main process.
    pub fn steps(len: u64, message: impl Into<Cow<'static, str>>, local_main: bool) -> Self {
        Self::with_template(
            len,
            message,
            local_main,
            "{msg} [{bar:30.cyan/blue}] {pos}/{len} steps ({per_sec}, eta {eta})",
        )
    }

    /// A bar over `len` bytes: `message [#####>    ] 1.2 GiB/3.0 GiB (250 MiB/s, eta 7s)`.
    pub fn bytes(len: u64, message: impl Into<Cow<'static, str>>, local_main: bool) -> Self {
        Self::with_template(
            len,
            message,
            local_main,
            "{msg} [{bar:30.cyan/blue}] {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})",
        )
    }

    /// A spinner with a message (no length).
    pub fn spinner(message: impl Into<Cow<'static, str>>, local_main: bool) -> Self {
        let bar = Self::with_template(0, message, local_main, "{spinner} {msg} ({elapsed})");
        bar.bar.set_length(0);
        bar.bar.enable_steady_tick(Duration::from_millis(100));
        bar
    }

    fn with_template(
        len: u64,
        message: impl Into<Cow<'static, str>>,
        local_main: bool,
        template: &str,
    ) -> Self {
        let target = draw_target(local_main);
        let style = ProgressStyle::with_template(template)
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("#>-");
        let bar = indicatif::ProgressBar::with_draw_target(Some(len), target)
            .with_style(style)
            .with_message(message);
        Self { bar }
    }

    /// Whether the bar draws anywhere.
    pub fn is_drawing(&self) -> bool {
        !self.bar.is_hidden()
    }

    /// Advances by `n`.
    pub fn inc(&self, n: u64) {
        self.bar.inc(n);
    }

    /// Makes the bar `n` longer (more work found on the way).
    pub fn inc_length(&self, n: u64) {
        self.bar.inc_length(n);
    }

    /// Sets the position.
    pub fn set_position(&self, pos: u64) {
        self.bar.set_position(pos);
    }

    /// Replaces the message.
    pub fn set_message(&self, message: impl Into<Cow<'static, str>>) {
        self.bar.set_message(message);
    }

    /// Draws the final state and leaves it on the terminal.
    pub fn finish(&self) {
        self.bar.finish();
    }

    /// Removes the bar from the terminal.
    pub fn finish_and_clear(&self) {
        self.bar.finish_and_clear();
    }
}

/// Where this process's bars draw.
fn draw_target(local_main: bool) -> ProgressDrawTarget {
    let test_dir = std::env::var_os(TEST_DRAW_DIR_ENV).map(PathBuf::from);
    let stderr_term = std::io::stderr().is_terminal();
    if !should_draw(
        local_main,
        stderr_term || test_dir.is_some(),
        env_on(TERMINAL_ENV),
        env_on(DISABLE_ENV),
    ) {
        return ProgressDrawTarget::hidden();
    }
    if let Some(dir) = test_dir {
        let rank = std::env::var("RANK").unwrap_or_else(|_| "0".into());
        let path = dir.join(format!("progress_rank{rank}.txt"));
        let files = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|f| Ok((f.try_clone()?, f)));
        return match files {
            Ok((read, write)) => {
                ProgressDrawTarget::term_like(Box::new(console::Term::read_write_pair(read, write)))
            }
            Err(e) => {
                tracing::warn!("{TEST_DRAW_DIR_ENV}: cannot create {}: {e}", path.display());
                ProgressDrawTarget::hidden()
            }
        };
    }
    if stderr_term {
        ProgressDrawTarget::stderr()
    } else {
        // The launcher's terminal, through a pipe: indicatif's own stderr
        // target would hide itself, seeing no terminal.
        ProgressDrawTarget::term_like(Box::new(console::Term::stderr()))
    }
}

impl crate::accelerator::Accelerator {
    /// A bar over `len` steps that draws on the local main process only,
    /// and only on a terminal (see [`crate::progress`]):
    ///
    /// ```no_run
    /// # fn f(acc: &accel::accelerator::Accelerator) {
    /// let bar = acc.progress_bar(100, "train");
    /// for _step in 0..100 {
    ///     // ... one optimizer step ...
    ///     bar.inc(1);
    /// }
    /// bar.finish();
    /// # }
    /// ```
    pub fn progress_bar(&self, len: u64, message: impl Into<Cow<'static, str>>) -> ProgressBar {
        ProgressBar::steps(len, message, self.is_local_main_process())
    }
}

#[cfg(test)]
mod tests {
    use super::should_draw;

    #[test]
    fn only_the_local_main_process_on_a_terminal_draws() {
        assert!(should_draw(true, true, false, false));
        assert!(should_draw(true, false, true, false));
        assert!(!should_draw(false, true, true, false));
        assert!(!should_draw(true, false, false, false));
        assert!(!should_draw(true, true, true, true));
    }
}
