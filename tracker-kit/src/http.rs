//! The HTTP client side of a tracker that talks to a service (W&B, an
//! MLflow tracking server).

use crate::settings::HttpTiming;
use std::time::Duration;

/// An agent that gives up on a request after `timing.request_timeout`,
/// hands every HTTP status back as an answer (not an error), and introduces
/// itself as `user_agent`.
pub fn agent(user_agent: &str, timing: &HttpTiming) -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(timing.request_timeout))
        .http_status_as_error(false)
        .user_agent(user_agent)
        .build()
        .into()
}

/// The start of an answer's body for an error message: trimmed, at most 300
/// characters, `…` where it was cut.
pub fn snippet(text: &str) -> String {
    let t = text.trim();
    match t.char_indices().nth(300) {
        Some((i, _)) => format!("{}…", &t[..i]),
        None => t.to_owned(),
    }
}

/// Percent-encodes one URL path segment (all but `A-Za-z0-9-_.~`).
pub fn path_segment(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Whether an HTTP status is worth retrying: a timeout, too many requests,
/// or a server error.
pub fn is_transient(status: u16) -> bool {
    matches!(status, 408 | 429 | 500..=599)
}

/// Exponential backoff: `retry_backoff`, doubling, capped at `max_backoff`.
#[derive(Debug, Clone)]
pub struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    /// Starts at `timing.retry_backoff`, capped at `timing.max_backoff`.
    pub fn new(timing: &HttpTiming) -> Backoff {
        Backoff {
            next: timing.retry_backoff,
            max: timing.max_backoff.max(timing.retry_backoff),
        }
    }

    /// The delay before the next try.
    pub fn delay(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snippets_are_trimmed_and_cut_at_300_characters() {
        assert_eq!(snippet("  short \n"), "short");
        let long = "é".repeat(400);
        let s = snippet(&long);
        assert_eq!(s.chars().count(), 301);
        assert!(s.ends_with('…'));
    }

    #[test]
    fn path_segments_are_percent_encoded() {
        assert_eq!(path_segment("my-proj_1.x~"), "my-proj_1.x~");
        assert_eq!(path_segment("a b/c"), "a%20b%2Fc");
        assert_eq!(path_segment("é"), "%C3%A9");
    }

    #[test]
    fn transient_statuses() {
        for s in [408, 429, 500, 503, 599] {
            assert!(is_transient(s), "{s}");
        }
        for s in [200, 400, 401, 404, 600] {
            assert!(!is_transient(s), "{s}");
        }
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let timing = HttpTiming {
            retry_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(350),
            ..HttpTiming::default()
        };
        let mut b = Backoff::new(&timing);
        let got: Vec<u128> = (0..5).map(|_| b.delay().as_millis()).collect();
        assert_eq!(got, [100, 200, 350, 350, 350]);
    }
}
