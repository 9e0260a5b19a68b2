//! [`RunTracker`]: a tracker written with Rust's own types (`&str`,
//! slices, `Option`, `Result`); [`into_tracker`] erases it for the host,
//! converting at the ABI boundary.

use accel_sdk::{
    abi_stable::std_types::{ROption, RSlice, RStr},
    LogEntry, PluginError, PluginResult, Tracker, TrackerBox,
};

/// An experiment tracker with Rust's own types: the calls of
/// [`accel_sdk::Tracker`], one to one.
pub trait RunTracker: Send + 'static {
    /// Starts a run of `project`, recording the run's `config_json`.
    fn start(&mut self, project: &str, config_json: &str) -> Result<(), PluginError>;

    /// Logs `values` at `step` (or at the tracker's own counter when `None`).
    fn log(&mut self, values: &[LogEntry], step: Option<u64>) -> Result<(), PluginError>;

    /// Makes everything logged so far durable.
    fn flush(&mut self) -> Result<(), PluginError>;

    /// Ends the run; nothing is logged after this.
    fn finish(&mut self) -> Result<(), PluginError>;
}

/// A [`RunTracker`] seen as a [`Tracker`].
struct Adapter<T>(T);

impl<T: RunTracker> Tracker for Adapter<T> {
    fn start(&mut self, project: RStr<'_>, config_json: RStr<'_>) -> PluginResult<()> {
        self.0.start(project.as_str(), config_json.as_str()).into()
    }

    fn log(&mut self, values: RSlice<'_, LogEntry>, step: ROption<u64>) -> PluginResult<()> {
        self.0.log(values.as_slice(), step.into_option()).into()
    }

    fn flush(&mut self) -> PluginResult<()> {
        self.0.flush().into()
    }

    fn finish(&mut self) -> PluginResult<()> {
        self.0.finish().into()
    }
}

/// Erases `tracker` for the host (panics in it become errors, as with
/// [`accel_sdk::into_tracker`]).
pub fn into_tracker(tracker: impl RunTracker) -> TrackerBox {
    accel_sdk::into_tracker(Adapter(tracker))
}

/// The error of `call` on a tracker with no run: `<call> called twice` when
/// a run was started (and finished), `<call> called before start` when none
/// was.
pub fn not_running(plugin: &str, call: &str, was_started: bool) -> PluginError {
    PluginError::other(
        plugin,
        if was_started {
            format!("{call} called twice")
        } else {
            format!("{call} called before start")
        },
    )
}

/// `step` as the signed 64-bit step `service`'s records hold (TensorBoard's
/// events, MLflow's metrics); an error naming both when it does not fit.
pub fn signed_step(plugin: &str, service: &str, step: u64) -> Result<i64, PluginError> {
    i64::try_from(step).map_err(|_| {
        PluginError::other(
            plugin,
            format!("step {step} is beyond {service}'s int64 steps"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use accel_sdk::abi_stable::std_types::RNone;

    /// Records the calls it gets.
    #[derive(Default)]
    struct Calls(Vec<String>);

    struct Recorder(std::sync::Arc<std::sync::Mutex<Calls>>);

    impl RunTracker for Recorder {
        fn start(&mut self, project: &str, config_json: &str) -> Result<(), PluginError> {
            self.0
                .lock()
                .unwrap()
                .0
                .push(format!("start {project} {config_json}"));
            Ok(())
        }
        fn log(&mut self, values: &[LogEntry], step: Option<u64>) -> Result<(), PluginError> {
            self.0
                .lock()
                .unwrap()
                .0
                .push(format!("log {} {step:?}", values.len()));
            Ok(())
        }
        fn flush(&mut self) -> Result<(), PluginError> {
            Err(PluginError::other("rec", "flush refused"))
        }
        fn finish(&mut self) -> Result<(), PluginError> {
            self.0.lock().unwrap().0.push("finish".into());
            Ok(())
        }
    }

    #[test]
    fn calls_cross_the_boundary_one_to_one() {
        let calls = std::sync::Arc::new(std::sync::Mutex::new(Calls::default()));
        let mut t = into_tracker(Recorder(calls.clone()));
        t.start("proj".into(), "{}".into()).unwrap();
        let values = [LogEntry::scalar("loss", 1.0)];
        t.log(values.as_slice().into(), ROption::RSome(3)).unwrap();
        t.log(values[..0].into(), RNone).unwrap();
        let err = t.flush().unwrap_err();
        assert_eq!(err.message.as_str(), "flush refused");
        t.finish().unwrap();
        assert_eq!(
            calls.lock().unwrap().0,
            ["start proj {}", "log 1 Some(3)", "log 0 None", "finish"]
        );
    }

    #[test]
    fn steps_beyond_i64_are_refused_naming_the_service() {
        assert_eq!(signed_step("p", "MLflow", 7).unwrap(), 7);
        assert_eq!(
            signed_step("p", "MLflow", i64::MAX as u64).unwrap(),
            i64::MAX
        );
        let err = signed_step("p", "TensorBoard", u64::MAX).unwrap_err();
        assert!(
            err.to_string()
                .contains("step 18446744073709551615 is beyond TensorBoard's int64 steps"),
            "{err}"
        );
    }

    #[test]
    fn misuse_names_the_call() {
        let e = not_running("p", "finish", true);
        assert_eq!(
            (e.plugin.as_str(), e.message.as_str()),
            ("p", "finish called twice")
        );
        let e = not_running("p", "finish", false);
        assert_eq!(e.message.as_str(), "finish called before start");
    }
}
