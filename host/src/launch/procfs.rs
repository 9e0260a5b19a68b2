//! What the supervisor reads of other processes in Linux's `/proc`: state,
//! CPU time, parent, exit status of a zombie, the rank variables, and a
//! pidfd to wait on a process that is not accel's child.

use std::{
    collections::HashMap,
    fs,
    os::fd::{FromRawFd, OwnedFd},
};

/// A process as `/proc/PID/stat` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    /// `R`, `S`, `D`, `T` (stopped), `t` (traced), `Z` (zombie), ...
    pub state: char,
    /// The parent.
    pub ppid: i32,
    /// User + system CPU time, in clock ticks.
    pub cpu_ticks: u64,
    /// For a zombie, its status as `waitpid` reports it.
    pub exit_status: i32,
}

/// Parses the text of `/proc/PID/stat`.
pub fn parse_stat(text: &str) -> Option<Stat> {
    // The command name (field 2) is in parentheses and may hold anything:
    // the other fields follow its last `)`.
    let rest = &text[text.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // f[0] is field 3 (state): field N is f[N - 3].
    let num = |i: usize| f.get(i)?.parse::<i64>().ok();
    Some(Stat {
        state: f.first()?.chars().next()?,
        ppid: num(1)? as i32,
        cpu_ticks: (num(11)? + num(12)?) as u64,
        exit_status: num(49).unwrap_or(0) as i32,
    })
}

/// `/proc/PID/stat` of `pid`; `None` once it is gone (reaped).
pub fn stat(pid: i32) -> Option<Stat> {
    parse_stat(&fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Every process's parent.
pub fn parents() -> HashMap<i32, i32> {
    let Ok(dir) = fs::read_dir("/proc") else {
        return HashMap::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| Some((pid, stat(pid)?.ppid)))
        .collect()
}

/// The processes below `root` (children, their children, ...), parents
/// before their children.
pub fn descendants(root: i32, parents: &HashMap<i32, i32>) -> Vec<i32> {
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    for (child, parent) in parents {
        children.entry(*parent).or_default().push(*child);
    }
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        if let Some(kids) = children.get_mut(&found[i]) {
            kids.sort_unstable();
            found.extend(kids.iter().copied());
        }
        i += 1;
    }
    found.remove(0);
    found
}

/// The variables `pid` started with (`/proc/PID/environ`).
pub fn environ(pid: i32) -> Option<HashMap<String, String>> {
    let raw = fs::read(format!("/proc/{pid}/environ")).ok()?;
    Some(
        raw.split(|b| *b == 0)
            .filter_map(|kv| {
                let kv = String::from_utf8_lossy(kv);
                let (k, v) = kv.split_once('=')?;
                Some((k.to_owned(), v.to_owned()))
            })
            .collect(),
    )
}

/// The global rank of `pid` when a process manager started it as a rank
/// (`OMPI_COMM_WORLD_RANK`, `PMI_RANK`, `SLURM_PROCID`).
pub fn rank_of(pid: i32) -> Option<u32> {
    let env = environ(pid)?;
    let vars = super::env::rank_env_from_process_manager(&|k| env.get(k).cloned())?;
    vars.iter()
        .find(|(k, _)| k == "RANK")
        .and_then(|(_, v)| v.parse().ok())
}

/// A pidfd of `pid` (readable once it ends), where the kernel has them.
pub fn pidfd(pid: i32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    // SAFETY: a non-negative result is a new fd that nothing else owns.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_follow_the_last_parenthesis() {
        let mut fields = vec!["0"; 50];
        fields[0] = "T";
        fields[1] = "41";
        fields[11] = "7";
        fields[12] = "5";
        fields[49] = "768";
        let text = format!("42 (a) b) c) {}", fields.join(" "));
        let s = parse_stat(&text).unwrap();
        assert_eq!(
            s,
            Stat {
                state: 'T',
                ppid: 41,
                cpu_ticks: 12,
                exit_status: 768
            }
        );
    }

    #[test]
    fn this_process_is_seen() {
        let me = std::process::id() as i32;
        let s = stat(me).unwrap();
        assert!(matches!(s.state, 'R' | 'S'), "{s:?}");
        let parents = parents();
        assert!(descendants(s.ppid, &parents).contains(&me));
        assert!(environ(me).unwrap().contains_key("PATH"));
        assert!(pidfd(me).is_some());
    }
}
