//! The `accel config` questionnaire: Accelerate's questions, read line by
//! line from any `BufRead`, so a terminal user and a test answer it alike.
//! An empty answer takes the default shown in brackets; the end of input
//! takes the defaults of every remaining question (and fails only where a
//! question has no default).

use std::io::{self, BufRead, Write};

use serde_json::{Map, Value};

use crate::error::ConfigError;
use crate::load::{load_str, LoadOptions};
use crate::parse::Format;
use crate::schema::{
    Config, KeySpec, Kind, DEEPSPEED_KEYS, DISTRIBUTED_TYPES, DYNAMO_BACKENDS, DYNAMO_KEYS,
    FSDP_KEYS, FSDP_SHARDING_STRATEGIES, MEGATRON_KEYS, MIXED_PRECISIONS,
    SAGEMAKER_DISTRIBUTED_TYPES,
};
use crate::write::to_yaml;

/// A failed questionnaire.
#[derive(Debug, thiserror::Error)]
pub enum QuestionnaireError {
    /// Reading or writing the terminal failed.
    #[error("i/o error: {0}")]
    Io(#[from] io::Error),
    /// Input ended at a question that has no default.
    #[error("input ended before the question {0:?} was answered (it has no default)")]
    Eof(String),
    /// The answers did not make a valid config (should not happen: answers are checked).
    #[error("the answers do not make a valid config:\n{0}")]
    Invalid(#[from] ConfigError),
}

struct Prompter<'a> {
    input: &'a mut dyn BufRead,
    out: &'a mut dyn Write,
}

impl Prompter<'_> {
    /// One answer; `None` at end of input.
    fn read(
        &mut self,
        question: &str,
        default: Option<&str>,
    ) -> Result<Option<String>, QuestionnaireError> {
        match default {
            Some(d) if !d.is_empty() => write!(self.out, "{question} [{d}]: ")?,
            _ => write!(self.out, "{question}: ")?,
        }
        self.out.flush()?;
        let mut line = String::new();
        // Read bytes so that invalid UTF-8 on stdin is an answer to re-ask, not a crash.
        let mut buf = Vec::new();
        let n = self.input.read_until(b'\n', &mut buf)?;
        if n == 0 {
            writeln!(self.out)?;
            return Ok(None);
        }
        line.push_str(&String::from_utf8_lossy(&buf));
        Ok(Some(line.trim().to_string()))
    }

    fn text(
        &mut self,
        question: &str,
        default: Option<&str>,
    ) -> Result<String, QuestionnaireError> {
        loop {
            match self.read(question, default)? {
                None => {
                    return default
                        .map(str::to_string)
                        .ok_or_else(|| QuestionnaireError::Eof(question.into()))
                }
                Some(a) if a.is_empty() => match default {
                    Some(d) => return Ok(d.to_string()),
                    None => writeln!(self.out, "  Please enter a value.")?,
                },
                Some(a) => return Ok(a),
            }
        }
    }

    fn yes_no(&mut self, question: &str, default: bool) -> Result<bool, QuestionnaireError> {
        let d = if default { "yes" } else { "no" };
        loop {
            let a = self.text(&format!("{question} (yes/no)"), Some(d))?;
            match crate::validate::str_to_bool(&a) {
                Some(b) => return Ok(b),
                None => writeln!(self.out, "  Please answer yes or no.")?,
            }
        }
    }

    fn int(
        &mut self,
        question: &str,
        default: i64,
        min: i64,
        max: i64,
    ) -> Result<i64, QuestionnaireError> {
        loop {
            let a = self.text(question, Some(&default.to_string()))?;
            match a.parse::<i64>() {
                Ok(i) if i >= min && i <= max => return Ok(i),
                _ if max == i64::MAX => {
                    writeln!(self.out, "  Please enter a whole number of at least {min}.")?
                }
                _ => writeln!(
                    self.out,
                    "  Please enter a whole number from {min} to {max}."
                )?,
            }
        }
    }

    /// A choice by number or by name (any case).
    fn choice(
        &mut self,
        question: &str,
        choices: &[(&str, &str)],
        default: usize,
    ) -> Result<String, QuestionnaireError> {
        writeln!(self.out, "{question}")?;
        for (i, (name, help)) in choices.iter().enumerate() {
            if help.is_empty() {
                writeln!(self.out, "  [{i}] {name}")?;
            } else {
                writeln!(self.out, "  [{i}] {name}: {help}")?;
            }
        }
        loop {
            let a = self.text("Your choice (number or name)", Some(choices[default].0))?;
            if let Ok(i) = a.parse::<usize>() {
                if i < choices.len() {
                    return Ok(choices[i].0.to_string());
                }
            }
            if let Some((name, _)) = choices.iter().find(|(n, _)| n.eq_ignore_ascii_case(&a)) {
                return Ok(name.to_string());
            }
            writeln!(
                self.out,
                "  Please pick a number from 0 to {} or one of the names.",
                choices.len() - 1
            )?;
        }
    }
    /// Asks for a section key as the key table describes it: its doc is
    /// the question, its type decides the answer and what is allowed, so
    /// the questions cannot drift from what the validator accepts.
    fn key(
        &mut self,
        keys: &[KeySpec],
        name: &str,
        default: Value,
    ) -> Result<Value, QuestionnaireError> {
        let spec = keys
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| unreachable!("`{name}` is asked but is not in the key table"));
        let mut doc = spec.doc.to_owned();
        if let Some(first) = doc.get_mut(..1) {
            first.make_ascii_uppercase();
        }
        let question = format!("{doc} ({name})");
        let pick = |values: &[&str]| {
            values
                .iter()
                .position(|v| Some(*v) == default.as_str())
                .unwrap_or(0)
        };
        Ok(match spec.kind {
            Kind::Bool => self
                .yes_no(&question, default.as_bool().unwrap_or(false))?
                .into(),
            Kind::Int { min, max } => self
                .int(&question, default.as_i64().unwrap_or(min), min, max)?
                .into(),
            Kind::Enum { values, .. } => {
                self.choice(&question, &plain(values), pick(values))?.into()
            }
            Kind::ShardingStrategy => self
                .choice(
                    &question,
                    &plain(FSDP_SHARDING_STRATEGIES),
                    pick(FSDP_SHARDING_STRATEGIES),
                )?
                .into(),
            _ => self.text(&question, default.as_str())?.into(),
        })
    }
}

fn plain(names: &[&'static str]) -> Vec<(&'static str, &'static str)> {
    names.iter().map(|n| (*n, "")).collect()
}

fn describe(dt: &str) -> &'static str {
    match dt {
        "NO" => "one process (CPU or one accelerator)",
        "MULTI_CPU" => "data parallel over CPU processes (DDP plugin; MPI)",
        "MULTI_GPU" => "data parallel over GPUs (DDP plugin; NCCL)",
        "DEEPSPEED" => "ZeRO sharded optimizer/gradients/parameters (zero plugin)",
        "FSDP" => "fully sharded data parallel (fsdp plugin)",
        "XLA" => "XLA devices through PJRT (xla plugin)",
        "MEGATRON_LM" => "Megatron-LM tensor/pipeline parallel",
        _ => "",
    }
}

/// Asks the questions on `out`, reads answers from `input`, and gives the
/// resulting config (already validated). `extra_distributed_types` are
/// offered besides Accelerate's own.
pub fn ask(
    input: &mut dyn BufRead,
    out: &mut dyn Write,
    extra_distributed_types: &[String],
) -> Result<Config, QuestionnaireError> {
    let mut p = Prompter { input, out };
    let mut c = Map::new();
    let set = |c: &mut Map<String, Value>, k: &str, v: Value| {
        c.insert(k.to_string(), v);
    };

    let env = p.choice(
        "In which compute environment are you running?",
        &[
            (
                "LOCAL_MACHINE",
                "this machine, or machines you reach directly",
            ),
            ("AMAZON_SAGEMAKER", "an Amazon SageMaker job"),
        ],
        0,
    )?;
    set(&mut c, "compute_environment", env.clone().into());
    set(&mut c, "debug", false.into());

    if env == "AMAZON_SAGEMAKER" {
        let dt = p.choice(
            "Which type of SageMaker training?",
            &plain(SAGEMAKER_DISTRIBUTED_TYPES),
            0,
        )?;
        set(&mut c, "distributed_type", dt.into());
        set(
            &mut c,
            "ec2_instance_type",
            p.text("Which EC2 instance type?", Some("ml.p3.2xlarge"))?
                .into(),
        );
        set(
            &mut c,
            "iam_role_name",
            p.text("Name of the IAM role SageMaker runs as", None)?
                .into(),
        );
        set(
            &mut c,
            "region",
            p.text("Which AWS region?", Some("us-east-1"))?.into(),
        );
        set(
            &mut c,
            "num_machines",
            p.int("How many machines (instances)?", 1, 1, i64::MAX)?
                .into(),
        );
    } else {
        let mut names: Vec<String> = DISTRIBUTED_TYPES.iter().map(|s| s.to_string()).collect();
        names.extend(
            extra_distributed_types
                .iter()
                .filter(|e| !DISTRIBUTED_TYPES.contains(&e.as_str()))
                .cloned(),
        );
        let choices: Vec<(&str, &str)> = names
            .iter()
            .map(|n| {
                (
                    n.as_str(),
                    if DISTRIBUTED_TYPES.contains(&n.as_str()) {
                        describe(n)
                    } else {
                        "provided by a plugin"
                    },
                )
            })
            .collect();
        let dt = p.choice("Which type of distributed training?", &choices, 0)?;
        set(&mut c, "distributed_type", dt.clone().into());
        let multi = dt != "NO";
        let mut machines = 1;
        if multi {
            machines = p.int("How many machines (nodes) will you use?", 1, 1, i64::MAX)?;
        }
        set(&mut c, "num_machines", machines.into());
        if machines > 1 {
            set(
                &mut c,
                "machine_rank",
                p.int("What is the rank of this machine?", 0, 0, machines - 1)?
                    .into(),
            );
            set(
                &mut c,
                "main_process_ip",
                p.text("What is the IP address of the machine of rank 0?", None)?
                    .into(),
            );
            set(
                &mut c,
                "main_process_port",
                p.int("Which port should rank 0 listen on?", 29500, 0, 65535)?
                    .into(),
            );
            set(
                &mut c,
                "same_network",
                p.yes_no("Are all the machines on the same local network?", true)?
                    .into(),
            );
            let rdzv = p.choice(
                "Which rendezvous backend?",
                &[("static", ""), ("c10d", ""), ("etcd", ""), ("etcd-v2", "")],
                0,
            )?;
            set(&mut c, "rdzv_backend", rdzv.into());
        } else {
            set(&mut c, "machine_rank", 0.into());
            set(&mut c, "rdzv_backend", "static".into());
            set(&mut c, "same_network", true.into());
        }

        let use_cpu = match dt.as_str() {
            "NO" => p.yes_no(
                "Run the training on CPU only, even if an accelerator is there?",
                false,
            )?,
            "MULTI_CPU" => true,
            _ => false,
        };
        set(&mut c, "use_cpu", use_cpu.into());

        if dt == "MULTI_CPU"
            && p.yes_no(
                "Start the processes with mpirun (needed to span machines)?",
                machines > 1,
            )?
        {
            let hostfile = p.text("Path of the MPI hostfile", Some("hostfile"))?;
            let mut m = Map::new();
            m.insert("mpirun_hostfile".into(), hostfile.into());
            set(&mut c, "mpirun_config", Value::Object(m));
        }

        if dt == "DEEPSPEED" {
            let mut ds = Map::new();
            let file = p.text(
                "Path of a DeepSpeed JSON config file (empty: answer the questions here)",
                Some(""),
            )?;
            if !file.is_empty() {
                ds.insert("deepspeed_config_file".into(), file.into());
            } else {
                let mut ask = |ds: &mut Map<String, Value>, name: &str, default: Value| {
                    p.key(DEEPSPEED_KEYS, name, default)
                        .map(|v| ds.insert(name.into(), v))
                };
                ask(&mut ds, "zero_stage", 2.into())?;
                ask(&mut ds, "offload_optimizer_device", "none".into())?;
                if ds.get("zero_stage").and_then(Value::as_i64) == Some(3) {
                    ask(&mut ds, "offload_param_device", "none".into())?;
                    ask(&mut ds, "zero3_init_flag", false.into())?;
                    ask(&mut ds, "zero3_save_16bit_model", false.into())?;
                }
                ask(&mut ds, "gradient_accumulation_steps", 1.into())?;
            }
            set(&mut c, "deepspeed_config", Value::Object(ds));
        }

        if dt == "FSDP" {
            let mut f = Map::new();
            let mut ask = |f: &mut Map<String, Value>, name: &str, default: Value| {
                p.key(FSDP_KEYS, name, default)
                    .map(|v| f.insert(name.into(), v))
            };
            ask(&mut f, "fsdp_version", 2.into())?;
            if f.get("fsdp_version").and_then(Value::as_i64) == Some(2) {
                ask(&mut f, "fsdp_reshard_after_forward", true.into())?;
            } else {
                ask(&mut f, "fsdp_sharding_strategy", "FULL_SHARD".into())?;
            }
            ask(&mut f, "fsdp_offload_params", false.into())?;
            ask(
                &mut f,
                "fsdp_auto_wrap_policy",
                "TRANSFORMER_BASED_WRAP".into(),
            )?;
            match f.get("fsdp_auto_wrap_policy").and_then(Value::as_str) {
                Some("TRANSFORMER_BASED_WRAP") => {
                    ask(&mut f, "fsdp_transformer_layer_cls_to_wrap", "".into())?;
                    // Empty: the model decides.
                    if f.get("fsdp_transformer_layer_cls_to_wrap") == Some(&Value::from("")) {
                        f.remove("fsdp_transformer_layer_cls_to_wrap");
                    }
                }
                Some("SIZE_BASED_WRAP") => {
                    ask(&mut f, "fsdp_min_num_params", 100_000_000.into())?;
                }
                _ => {}
            }
            ask(&mut f, "fsdp_state_dict_type", "SHARDED_STATE_DICT".into())?;
            ask(&mut f, "fsdp_cpu_ram_efficient_loading", true.into())?;
            f.insert("fsdp_sync_module_states".into(), true.into());
            ask(&mut f, "fsdp_activation_checkpointing", false.into())?;
            set(&mut c, "fsdp_config", Value::Object(f));
        }

        if dt == "MEGATRON_LM" {
            let mut m = Map::new();
            for name in ["megatron_lm_tp_degree", "megatron_lm_pp_degree"] {
                m.insert(name.into(), p.key(MEGATRON_KEYS, name, 1.into())?);
            }
            set(&mut c, "megatron_lm_config", Value::Object(m));
        }

        let procs = if multi {
            let default = (2 * machines).max(2);
            p.int(
                "How many processes in total (all machines together)?",
                default,
                1,
                i64::MAX,
            )?
        } else {
            1
        };
        set(&mut c, "num_processes", procs.into());

        if !use_cpu && matches!(dt.as_str(), "MULTI_GPU" | "FSDP" | "DEEPSPEED" | "NO") {
            let ids = p.text(
                "Which GPUs (by id) on this machine, comma-separated, or all?",
                Some("all"),
            )?;
            set(&mut c, "gpu_ids", ids.into());
        }

        if p.yes_no("Compile the model with torch dynamo?", false)? {
            let backends: Vec<&str> = DYNAMO_BACKENDS
                .iter()
                .copied()
                .filter(|b| *b != "NO")
                .collect();
            let default = backends.iter().position(|b| *b == "INDUCTOR").unwrap_or(0);
            let mut d = Map::new();
            d.insert(
                "dynamo_backend".into(),
                p.choice("Which dynamo backend?", &plain(&backends), default)?
                    .into(),
            );
            d.insert(
                "dynamo_mode".into(),
                p.key(DYNAMO_KEYS, "dynamo_mode", "default".into())?,
            );
            for name in ["dynamo_use_fullgraph", "dynamo_use_dynamic"] {
                d.insert(name.into(), p.key(DYNAMO_KEYS, name, false.into())?);
            }
            set(&mut c, "dynamo_config", Value::Object(d));
        }
        set(&mut c, "main_training_function", "main".into());
        set(&mut c, "enable_cpu_affinity", false.into());
        set(&mut c, "tpu_use_cluster", false.into());
        set(&mut c, "tpu_use_sudo", false.into());
        set(&mut c, "tpu_env", Value::Array(Vec::new()));
    }

    let mp = p.choice("Which mixed precision?", &plain(MIXED_PRECISIONS), 0)?;
    let bf16 = mp == "bf16";
    set(&mut c, "mixed_precision", mp.into());
    if env != "AMAZON_SAGEMAKER" {
        let downcast = c.get("distributed_type").and_then(Value::as_str) == Some("XLA")
            && bf16
            && p.yes_no(
                "Downcast float64 to bfloat16 as well on XLA (downcast_bf16)?",
                false,
            )?;
        set(&mut c, "downcast_bf16", downcast.into());
    }

    // Write the answers through the same loader the files go through.
    let config = Config::from_json(c)
        .map_err(|e| QuestionnaireError::Io(io::Error::other(e.to_string())))?;
    let text = to_yaml(&config);
    let loaded = load_str(
        &text,
        "questionnaire answers",
        Format::Yaml,
        &LoadOptions::with_extra_distributed_types(extra_distributed_types),
    )?;
    Ok(loaded.config)
}
