//! MLflow's REST API (`<server>/api/2.0/mlflow/...`), the calls the tracker
//! makes, and retries with exponential backoff.

use crate::settings::HttpSettings;
use accel_sdk::serde_json::{self, json, Value};
use accel_tracker_kit::http::{self, snippet, Backoff};

/// Why one request failed.
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    /// Worth another try: no connection, a timeout, 408, 429 or 5xx.
    Transient(String),
    /// Not: the server refused the request (MLflow's `error_code` and
    /// message).
    Fatal {
        /// MLflow's `error_code`, e.g. `INVALID_PARAMETER_VALUE` (or
        /// `HTTP_<status>` when the answer carries none).
        code: String,
        /// What the server said.
        message: String,
    },
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Transient(m) => write!(f, "{m}"),
            Failure::Fatal { code, message } => write!(f, "{code}: {message}"),
        }
    }
}

/// A run as the server describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct RunInfo {
    /// Run id.
    pub run_id: String,
    /// Its experiment.
    pub experiment_id: String,
    /// Where its artifacts go (`mlflow-artifacts:/…`, `file:…`, `s3://…`).
    pub artifact_uri: String,
}

/// An HTTP client for one tracking server.
pub struct Client {
    agent: ureq::Agent,
    base: String,
    auth: Option<String>,
}

impl Client {
    /// A client for the server at `base` (no trailing `/`), sending `auth`
    /// as the `Authorization` header when given.
    pub fn new(base: &str, auth: Option<String>, timing: &HttpSettings) -> Client {
        Client {
            agent: http::agent(concat!("accel-mlflow/", env!("CARGO_PKG_VERSION")), timing),
            base: base.to_owned(),
            auth,
        }
    }

    /// The server's base URL.
    pub fn base(&self) -> &str {
        &self.base
    }

    fn answer(
        &self,
        what: &str,
        result: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ) -> Result<Value, Failure> {
        let mut response = match result {
            Ok(r) => r,
            Err(e) => return Err(Failure::Transient(format!("{what}: {e}"))),
        };
        let status = response.status().as_u16();
        let text = response.body_mut().read_to_string().unwrap_or_default();
        let body: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        match status {
            200..=299 => Ok(body),
            s if http::is_transient(s) => Err(Failure::Transient(format!(
                "{what}: HTTP {status} {}",
                snippet(&text)
            ))),
            _ => Err(Failure::Fatal {
                code: body["error_code"]
                    .as_str()
                    .map(str::to_owned)
                    .unwrap_or_else(|| format!("HTTP_{status}")),
                message: body["message"]
                    .as_str()
                    .map(str::to_owned)
                    .unwrap_or_else(|| format!("{what}: HTTP {status} {}", snippet(&text))),
            }),
        }
    }

    fn post(&self, endpoint: &str, body: &Value) -> Result<Value, Failure> {
        let url = format!("{}/api/2.0/mlflow/{endpoint}", self.base);
        let mut req = self
            .agent
            .post(&url)
            .header("Content-Type", "application/json");
        if let Some(a) = &self.auth {
            req = req.header("Authorization", a);
        }
        self.answer(&format!("POST {url}"), req.send(body.to_string()))
    }

    fn get(&self, endpoint: &str, query: &[(&str, &str)]) -> Result<Value, Failure> {
        let url = format!("{}/api/2.0/mlflow/{endpoint}", self.base);
        let mut req = self.agent.get(&url);
        for (k, v) in query {
            req = req.query(*k, *v);
        }
        if let Some(a) = &self.auth {
            req = req.header("Authorization", a);
        }
        self.answer(&format!("GET {url}"), req.call())
    }

    /// `experiments/get-by-name`: the id, or `None` if there is none.
    pub fn experiment_by_name(&self, name: &str) -> Result<Option<String>, Failure> {
        match self.get("experiments/get-by-name", &[("experiment_name", name)]) {
            Ok(v) => Ok(v["experiment"]["experiment_id"].as_str().map(str::to_owned)),
            Err(Failure::Fatal { code, .. }) if code == "RESOURCE_DOES_NOT_EXIST" => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// `experiments/get`: checks that experiment `id` exists.
    pub fn experiment_exists(&self, id: &str) -> Result<(), Failure> {
        self.get("experiments/get", &[("experiment_id", id)])
            .map(|_| ())
    }

    /// The experiment called `name`, created (with `tags`) if missing.
    pub fn get_or_create_experiment(
        &self,
        name: &str,
        tags: &[(String, String)],
    ) -> Result<String, Failure> {
        if let Some(id) = self.experiment_by_name(name)? {
            return Ok(id);
        }
        let tags: Vec<Value> = tags
            .iter()
            .map(|(k, v)| json!({"key": k, "value": v}))
            .collect();
        match self.post("experiments/create", &json!({"name": name, "tags": tags})) {
            Ok(v) => v["experiment_id"]
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| Failure::Fatal {
                    code: "BAD_ANSWER".into(),
                    message: format!("experiments/create answered without an id: {v}"),
                }),
            // Created by someone else in between.
            Err(Failure::Fatal { code, .. }) if code == "RESOURCE_ALREADY_EXISTS" => self
                .experiment_by_name(name)?
                .ok_or_else(|| Failure::Transient(format!("experiment {name:?} vanished"))),
            Err(e) => Err(e),
        }
    }

    fn run_info(v: &Value) -> Result<RunInfo, Failure> {
        let info = &v["run"]["info"];
        let s = |k: &str| info[k].as_str().map(str::to_owned);
        match (s("run_id").or_else(|| s("run_uuid")), s("experiment_id")) {
            (Some(run_id), Some(experiment_id)) => Ok(RunInfo {
                run_id,
                experiment_id,
                artifact_uri: s("artifact_uri").unwrap_or_default(),
            }),
            _ => Err(Failure::Fatal {
                code: "BAD_ANSWER".into(),
                message: format!("the server described a run without its id: {v}"),
            }),
        }
    }

    /// `runs/create`.
    pub fn create_run(
        &self,
        experiment_id: &str,
        user: &str,
        run_name: Option<&str>,
        start_time: i64,
        tags: &[(String, String)],
    ) -> Result<RunInfo, Failure> {
        let tags: Vec<Value> = tags
            .iter()
            .map(|(k, v)| json!({"key": k, "value": v}))
            .collect();
        let mut body = json!({
            "experiment_id": experiment_id,
            "user_id": user,
            "start_time": start_time,
            "tags": tags,
        });
        if let Some(name) = run_name {
            body["run_name"] = Value::from(name);
        }
        Self::run_info(&self.post("runs/create", &body)?)
    }

    /// `runs/get`.
    pub fn get_run(&self, run_id: &str) -> Result<RunInfo, Failure> {
        Self::run_info(&self.get("runs/get", &[("run_id", run_id)])?)
    }

    /// `runs/update`: the run's status, and its end time when it ends.
    pub fn update_run(
        &self,
        run_id: &str,
        status: &str,
        end_time: Option<i64>,
    ) -> Result<(), Failure> {
        let mut body = json!({"run_id": run_id, "status": status});
        if let Some(t) = end_time {
            body["end_time"] = Value::from(t);
        }
        self.post("runs/update", &body).map(|_| ())
    }

    /// `runs/log-batch` with a body made by [`crate::record::Work::batch_body`].
    pub fn log_batch(&self, body: &Value) -> Result<(), Failure> {
        self.post("runs/log-batch", body).map(|_| ())
    }

    /// Uploads `bytes` to `path` through the server's artifact proxy
    /// (`PUT /api/2.0/mlflow-artifacts/artifacts/<path>`), where `path` is
    /// what follows `mlflow-artifacts:/` in the run's artifact URI, as
    /// `content_type`.
    pub fn put_artifact(
        &self,
        path: &str,
        bytes: &[u8],
        content_type: &str,
    ) -> Result<(), Failure> {
        let encoded: Vec<String> = path.split('/').map(http::path_segment).collect();
        let url = format!(
            "{}/api/2.0/mlflow-artifacts/artifacts/{}",
            self.base,
            encoded.join("/")
        );
        let mut req = self.agent.put(&url).header("Content-Type", content_type);
        if let Some(a) = &self.auth {
            req = req.header("Authorization", a);
        }
        self.answer(&format!("PUT {url}"), req.send(bytes))
            .map(|_| ())
    }
}

/// Runs `f` until it succeeds, fails for good, or has failed transiently
/// `http.max_retries + 1` times.
pub fn retry<T>(
    http: &HttpSettings,
    mut f: impl FnMut() -> Result<T, Failure>,
) -> Result<T, Failure> {
    let mut backoff = Backoff::new(http);
    let mut tries = 0;
    loop {
        tries += 1;
        match f() {
            Err(Failure::Transient(e)) if tries <= http.max_retries => {
                let _ = e;
                std::thread::sleep(backoff.delay());
            }
            Err(Failure::Transient(e)) => {
                return Err(Failure::Transient(format!(
                    "{e} (gave up after {tries} tries)"
                )))
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::DEFAULT_HTTP;
    use std::time::Duration;

    #[test]
    fn retry_stops_on_success_on_fatal_and_after_the_retries() {
        let http = HttpSettings {
            max_retries: 2,
            retry_backoff: Duration::from_millis(1),
            ..DEFAULT_HTTP
        };
        let mut n = 0;
        let r = retry(&http, || {
            n += 1;
            if n < 3 {
                Err(Failure::Transient("down".into()))
            } else {
                Ok(n)
            }
        });
        assert_eq!(r, Ok(3));
        let mut n = 0;
        let r: Result<(), _> = retry(&http, || {
            n += 1;
            Err(Failure::Transient("down".into()))
        });
        assert_eq!(n, 3);
        assert_eq!(
            r,
            Err(Failure::Transient("down (gave up after 3 tries)".into()))
        );
        let mut n = 0;
        let r: Result<(), _> = retry(&http, || {
            n += 1;
            Err(Failure::Fatal {
                code: "INVALID_PARAMETER_VALUE".into(),
                message: "no".into(),
            })
        });
        assert_eq!(n, 1, "a refusal is not retried");
        assert!(matches!(r, Err(Failure::Fatal { .. })));
    }

    #[test]
    fn a_server_that_is_not_there_is_transient() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let c = Client::new(&format!("http://127.0.0.1:{port}"), None, &DEFAULT_HTTP);
        assert!(matches!(
            c.experiment_by_name("x"),
            Err(Failure::Transient(_))
        ));
    }
}
