//! `accel env`: what a bug report needs — versions, devices, communication
//! libraries, the plugins found, and the default config.

use crate::plugins::{default_search_path, LoadedLibrary, PluginSet, Source};
use accel_config::{default_config_file_from_env, load_file, to_yaml, LoadOptions};
use std::{io::Write, path::PathBuf, process::Command};

fn mpi_version() -> String {
    match Command::new("mpirun").arg("--version").output() {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout)
            .lines()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("unknown version")
            .trim()
            .to_owned(),
        Ok(out) => format!("mpirun --version failed ({})", out.status),
        Err(_) => "not found (mpirun is not on PATH)".to_owned(),
    }
}

fn nccl() -> String {
    // SAFETY: loading NCCL runs only its initialisers; nothing is called.
    match unsafe { libloading::Library::new("libnccl.so.2") } {
        Ok(lib) => {
            std::mem::forget(lib);
            "libnccl.so.2 found by the dynamic loader".to_owned()
        }
        Err(_) => "libnccl.so.2 not found by the dynamic loader".to_owned(),
    }
}

fn memory() -> String {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            let kb: f64 = m
                .lines()
                .find(|l| l.starts_with("MemTotal:"))?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            Some(format!("{:.1} GiB", kb / 1024.0 / 1024.0))
        })
        .unwrap_or_else(|| "unknown".to_owned())
}

fn platform() -> String {
    Command::new("uname")
        .arg("-srm")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| format!("{} {}", std::env::consts::OS, std::env::consts::ARCH))
}

/// The rows a plugin library adds to `accel env` through its root module
/// (`env_report`, ABI minor 1: accel-xla's PJRT platform and devices),
/// given the settings its strategy would get. A plugin built for minor 0
/// has none; a failing report is one row saying why.
fn plugin_report(lib: &LoadedLibrary, settings: &str) -> Vec<(String, String)> {
    let Some(report) = lib.module.env_report() else {
        return Vec::new();
    };
    match report(settings.into()).into_result() {
        Ok(rows) => rows
            .into_iter()
            .map(|r| (r.0.into_string(), r.1.into_string()))
            .collect(),
        Err(e) => vec![("plugin report:".to_owned(), e.to_string())],
    }
}

/// What started this process and how a training program started the same
/// way would join its job ([`crate::launch::detect`]).
fn launcher_rows(out: &mut dyn Write, cuda: bool) -> anyhow::Result<()> {
    let row = |out: &mut dyn Write, k: &str, v: &str| writeln!(out, "- {k:<22} {v}");
    match crate::launch::detect::detect_here() {
        Ok(d) => {
            row(out, "launcher:", &d.starter.to_string())?;
            row(
                out,
                "rank:",
                &format!(
                    "{} of {} (local {} of {}; from {})",
                    d.rank, d.world_size, d.local_rank, d.local_world_size, d.rank_source
                ),
            )?;
            row(
                out,
                "MPI process manager:",
                d.mpi.unwrap_or("none (MPI cannot join ranks)"),
            )?;
            let device = if cuda { "CUDA" } else { "CPU" };
            // The distributed type this process would train with: what
            // `accel launch` handed it, else none.
            let distributed = accel_config::resolve_training(&[], &|k| std::env::var(k).ok(), &[])
                .is_ok_and(|c| {
                    !matches!(
                        c.config.distributed_type,
                        None | Some(accel_config::DistributedType::No)
                    )
                });
            let join = match d.join(cuda, distributed) {
                Ok(j @ crate::launch::detect::Join::Single) => j.to_string(),
                Ok(j) => format!("{device} ranks join through {j}"),
                Err(e) => format!("refused: {e}"),
            };
            row(out, "joins:", &join)?;
            row(
                out,
                "intra-op threads:",
                &crate::accelerator::connector::CpuThreads::for_ranks(d.local_world_size)
                    .to_string(),
            )?;
            row(
                out,
                "CPU ranks' malloc:",
                &crate::accelerator::cpu_malloc::CpuMalloc::here()
                    .map_or_else(|e| format!("refused: {e}"), |m| m.to_string()),
            )?;
        }
        Err(e) => row(out, "launcher:", &format!("invalid environment: {e}"))?,
    }
    Ok(())
}

/// Runs `accel env`.
pub fn run(plugin_dirs: &[PathBuf], out: &mut dyn Write) -> anyhow::Result<i32> {
    let row = |out: &mut dyn Write, k: &str, v: &str| writeln!(out, "- {k:<22} {v}");
    writeln!(out, "Copy-and-paste the text below in your GitHub issue\n")?;
    row(out, "accel version:", env!("CARGO_PKG_VERSION"))?;
    row(
        out,
        "accel-sdk ABI:",
        &format!("{}.{}", accel_sdk::ABI_VERSION, accel_sdk::ABI_MINOR),
    )?;
    row(out, "platform:", &platform())?;
    row(out, "libtorch version:", accel_sdk::LIBTORCH_VERSION)?;
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    row(out, "CPU cores:", &cores.to_string())?;
    row(out, "memory:", &memory())?;
    let cuda = tch::Cuda::is_available();
    row(
        out,
        "CUDA available:",
        &format!(
            "{cuda} ({} device(s), cuDNN: {})",
            tch::Cuda::device_count(),
            tch::Cuda::cudnn_is_available()
        ),
    )?;
    row(out, "MPI:", &mpi_version())?;
    row(out, "NCCL:", &nccl())?;
    launcher_rows(out, cuda)?;

    let dirs = default_search_path(plugin_dirs);
    let search: Vec<String> = dirs.iter().map(|d| d.path.display().to_string()).collect();
    row(out, "plugin search path:", &search.join(":"))?;
    let set = PluginSet::discover(&dirs);
    let opts = LoadOptions::with_extra_distributed_types(
        &crate::plugins::config_check::claimed_distributed_types(&set),
    );
    let default_config = default_config_file_from_env()
        .filter(|p| p.exists())
        .and_then(|p| load_file(&p, &opts).ok());
    for p in set.plugins() {
        let provides: Vec<String> = p
            .provides
            .iter()
            .map(|c| format!("{} {}", c.kind, c.name))
            .collect();
        row(
            out,
            "plugin:",
            &format!(
                "{} {} [{}] ({})",
                p.name,
                p.version,
                provides.join(", "),
                p.location()
            ),
        )?;
        if let Source::Library(lib) = &p.source {
            let settings = default_config.as_ref().map_or_else(
                || "{}".to_owned(),
                |c| crate::plugins::config_check::strategy_settings(&c.config, &p.name).to_string(),
            );
            for (k, v) in plugin_report(lib, &settings) {
                row(out, &k, &v)?;
            }
        }
    }
    for e in set.rejected() {
        row(out, "rejected plugin:", &e.to_string())?;
    }

    match default_config_file_from_env() {
        None => row(out, "default config:", "no location (HOME is unset)")?,
        Some(path) if !path.exists() => row(
            out,
            "default config:",
            &format!("{} (not found)", path.display()),
        )?,
        Some(path) => {
            row(out, "default config:", &path.display().to_string())?;
            match load_file(&path, &opts) {
                Ok(loaded) => {
                    for line in to_yaml(&loaded.config).lines() {
                        writeln!(out, "        {line}")?;
                    }
                }
                Err(e) => writeln!(out, "        (invalid: {e})")?,
            }
        }
    }
    Ok(0)
}
