//! Unit tests against the real PJRT CPU plugin of PyPI's `xla-cpu-pjrt`
//! (installed into `.venv` by `scripts/bootstrap.sh`).

use super::*;
use crate::{
    engine::{Engine, RankInfo},
    ffi::layout_facts,
    hlo::all_reduce_module,
    pjrt::KvStore,
    pjrt::{Api, Client, OptionValue},
    proto::replicated_compile_options,
};
use std::{path::Path, process::Command};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

/// The wheel's `xla_cpu_pjrt.so`; a clear failure when it is missing.
fn cpu_plugin() -> PathBuf {
    let root = workspace_root();
    cpu_plugin_under(&root).unwrap_or_else(|| {
        panic!(
            "the PJRT CPU plugin is missing: expected {}/.venv/lib/python3*/site-packages/xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so; run scripts/bootstrap.sh (it installs xla-cpu-pjrt==0.0.1 from scripts/requirements.txt)",
            root.display()
        )
    })
}

fn cpu_client(devices: i64) -> Client {
    let api = Api::load(&cpu_plugin()).unwrap();
    Client::create(
        &api,
        &[("cpu_device_count".into(), OptionValue::Int(devices))],
        None,
    )
    .unwrap()
}

/// An engine for a job of `ranks` ranks that all run in this process, one
/// CPU device each, shared by the rank threads of a test.
fn one_process_engine(ranks: u32) -> Arc<Engine> {
    let info = RankInfo {
        rank: 0,
        world_size: ranks,
        local_rank: 0,
    };
    let client = cpu_client(i64::from(ranks));
    Arc::new(Engine::new(client, info, ranks, Duration::from_secs(60)).unwrap())
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn layouts_match_the_header() {
    let plugin = cpu_plugin();
    let header_dir = plugin.parent().unwrap().join("include");
    assert!(
        header_dir.join("pjrt_c_api.h").is_file(),
        "the wheel's pjrt_c_api.h is missing under {}",
        header_dir.display()
    );
    let dir = std::env::temp_dir().join(format!("accel-xla-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let facts = layout_facts();
    let mut c = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include \"pjrt_c_api.h\"\nint main(void) {\n",
    );
    for (name, _) in &facts {
        c.push_str(&format!(
            "  printf(\"%s %zu\\n\", \"{name}\", (size_t)({name}));\n"
        ));
    }
    c.push_str(
        "  printf(\"major %d minor %d\\n\", PJRT_API_MAJOR, PJRT_API_MINOR);\n  return 0;\n}\n",
    );
    let src = dir.join("layout.c");
    let exe = dir.join("layout");
    std::fs::write(&src, c).unwrap();
    let out = Command::new("cc")
        .arg("-I")
        .arg(&header_dir)
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("cc runs");
    assert!(
        out.status.success(),
        "compiling against pjrt_c_api.h failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(&exe).output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let mut checked = 0;
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("major ") {
            assert_eq!(
                v,
                format!("{} minor {}", ffi::PJRT_API_MAJOR, ffi::PJRT_API_MINOR)
            );
            continue;
        }
        let (name, value) = line.rsplit_once(' ').unwrap();
        let expected = facts.iter().find(|(n, _)| n == name).unwrap().1;
        assert_eq!(value.parse::<usize>().unwrap(), expected, "{name}");
        checked += 1;
    }
    assert_eq!(checked, facts.len());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_cpu_plugin_lists_its_devices() {
    let api = Api::load(&cpu_plugin()).unwrap();
    assert_eq!(api.version(), (0, 81));
    let attrs = api.attributes().unwrap();
    assert!(attrs.iter().any(|(k, _)| k == "xla_version"), "{attrs:?}");
    let client = cpu_client(4);
    assert_eq!(client.platform_name().unwrap(), "cpu");
    assert_eq!(client.process_index().unwrap(), 0);
    let devices = client.addressable_devices().unwrap();
    assert_eq!(devices.len(), 4);
    assert_eq!(client.devices().unwrap().len(), 4);
    let infos: Vec<_> = devices
        .iter()
        .map(|d| client.device_info(*d).unwrap())
        .collect();
    assert_eq!(infos.iter().map(|i| i.id).collect::<Vec<_>>(), [0, 1, 2, 3]);
    assert!(infos
        .iter()
        .all(|i| i.process_index == 0 && i.kind == "cpu"));
    assert!(infos[2].name.contains("id=2"), "{infos:?}");
    let env = env_rows(&format!(
        r#"{{"settings": {{"pjrt_plugin": {:?}, "create_options": {{"cpu_device_count": 3}}}}}}"#,
        cpu_plugin()
    ));
    assert!(env[2].1.starts_with("3 addressable of 3"), "{env:?}");
}

#[test]
fn a_compiled_all_reduce_over_4_cpu_devices_is_the_elementwise_sum() {
    let client = cpu_client(4);
    let n = 5;
    let exe = client
        .compile(
            &all_reduce_module(n, Elem::F32, 4, Reduce::Sum),
            &replicated_compile_options(&[0, 1, 2, 3]),
        )
        .unwrap();
    assert_eq!(exe.addressable_devices().len(), 4);
    let inputs: Vec<Vec<f32>> = (0..4)
        .map(|d| (0..n).map(|i| (d * 10 + i) as f32 + 0.25).collect())
        .collect();
    let buffers: Vec<_> = exe
        .addressable_devices()
        .iter()
        .zip(&inputs)
        .map(|(dev, v)| {
            client
                .buffer_from_host(&f32_bytes(v), Elem::F32.pjrt(), &[n], *dev)
                .unwrap()
        })
        .collect();
    let args: Vec<Vec<_>> = buffers.iter().map(|b| vec![b]).collect();
    let outputs = exe.execute(&args).unwrap();
    let expected: Vec<f32> = (0..n as usize)
        .map(|i| inputs.iter().map(|v| v[i]).sum())
        .collect();
    assert_eq!(outputs.len(), 4);
    for out in &outputs {
        let mut host = vec![0u8; n as usize * 4];
        out[0].to_host(&mut host).unwrap();
        assert_eq!(f32s(&host), expected);
    }
}

#[test]
fn ranks_sharing_a_process_average_through_the_engine() {
    let engine = one_process_engine(4);
    assert_eq!(engine.devices_of(2), [2]);
    let handles: Vec<_> = (0..4)
        .map(|r| {
            let e = Arc::clone(&engine);
            std::thread::spawn(move || {
                let v: Vec<f32> = vec![r as f32, 2.0 * r as f32, -1.0];
                let mean = e
                    .all_reduce(r, 3, Elem::F32, Reduce::Mean(4), Some(f32_bytes(&v)))
                    .unwrap();
                // Only rank 1 contributes: a broadcast from rank 1.
                let b = e
                    .all_reduce(
                        r,
                        3,
                        Elem::F32,
                        Reduce::Sum,
                        (r == 1).then(|| f32_bytes(&v)),
                    )
                    .unwrap();
                (f32s(&mean), f32s(&b))
            })
        })
        .collect();
    for h in handles {
        let (mean, b) = h.join().unwrap();
        assert_eq!(mean, [1.5, 3.0, -1.0]);
        assert_eq!(b, [1.0, 2.0, -1.0]);
    }
    assert_eq!(engine.compiled(), 2, "one program per (length, type, op)");
}

#[test]
fn a_single_process_client_refuses_a_multi_process_job() {
    let client = cpu_client(2);
    let ranks = RankInfo {
        rank: 1,
        world_size: 2,
        local_rank: 0,
    };
    let e = Engine::new(client, ranks, 1, Duration::from_secs(5))
        .err()
        .unwrap();
    assert!(
        e.0.contains("cannot run collectives across processes"),
        "{e}"
    );
}

fn cc_shared(dir: &Path, name: &str, code: &str) -> PathBuf {
    let src = dir.join(format!("{name}.c"));
    let so = dir.join(format!("lib{name}.so"));
    std::fs::write(&src, code).unwrap();
    let st = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&so)
        .arg(&src)
        .status()
        .expect("cc runs");
    assert!(st.success());
    so
}

#[test]
fn bad_plugins_are_clear_errors() {
    let missing = Api::load(Path::new("/nonexistent/libtpu.so")).unwrap_err();
    assert!(missing.0.contains("does not exist"), "{missing}");
    let dir = std::env::temp_dir().join(format!("accel-xla-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let plain = cc_shared(&dir, "plain", "int plain_answer(void) { return 42; }\n");
    let e = Api::load(&plain).unwrap_err();
    assert!(e.0.contains("exports no `GetPjrtApi`"), "{e}");
    let future = cc_shared(
        &dir,
        "future",
        "#include <stddef.h>\nstruct V { size_t s; void* e; int major; int minor; };\nstruct A { size_t s; void* e; struct V v; void* fns[200]; };\nstatic struct A api = { sizeof(struct A), 0, { sizeof(struct V), 0, 1, 3 } };\nconst struct A* GetPjrtApi(void) { return &api; }\n",
    );
    let e = Api::load(&future).unwrap_err();
    assert!(
        e.0.contains("speaks PJRT C API 1.3") && e.0.contains("major versions must match"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn settings_are_read_and_checked() {
    let s = parse_settings(
        r#"{"section": null, "settings": {"pjrt_plugin": "/p.so", "create_options": {"cpu_device_count": 4, "x": [1, 2], "y": true}, "ranks_per_process": 2, "downcast_bf16": "yes"}}"#,
    )
    .unwrap();
    assert_eq!(s.pjrt_plugin.as_deref(), Some(Path::new("/p.so")));
    assert_eq!(
        s.create_options,
        [
            ("cpu_device_count".to_owned(), OptionValue::Int(4)),
            ("x".to_owned(), OptionValue::Ints(vec![1, 2])),
            ("y".to_owned(), OptionValue::Bool(true)),
        ]
    );
    assert_eq!(s.ranks_per_process, 2);
    assert_eq!(s.downcast_bf16, Some(true));
    assert_eq!(parse_settings("{}").unwrap().ranks_per_process, 1);
    let e = parse_settings(r#"{"settings": {"pjrt_plugn": "/p.so"}}"#).unwrap_err();
    assert!(
        e.message.contains("unknown setting") && e.message.contains("pjrt_plugin"),
        "{e}"
    );
    assert!(parse_settings(r#"{"settings": {"ranks_per_process": 0}}"#).is_err());
}

#[test]
fn bf16_rules_follow_torch_xla() {
    assert_eq!(wire_kind(Kind::Float, false, false), Kind::Float);
    assert_eq!(wire_kind(Kind::Float, true, false), Kind::BFloat16);
    assert_eq!(wire_kind(Kind::Double, true, false), Kind::BFloat16);
    assert_eq!(wire_kind(Kind::Float, true, true), Kind::BFloat16);
    assert_eq!(wire_kind(Kind::Double, true, true), Kind::Float);
    let host =
        r#"{"section": null, "settings": {}, "mixed_precision": "bf16", "downcast_bf16": true}"#;
    let s = parse_settings(host).unwrap();
    assert_eq!(precision(&s, host).unwrap(), (true, true));
    let host = r#"{"section": null, "settings": null, "mixed_precision": "bf16"}"#;
    assert_eq!(precision(&s, host).unwrap(), (true, false));
    let own = r#"{"settings": {"mixed_precision": "no"}, "mixed_precision": "bf16"}"#;
    assert_eq!(
        precision(&parse_settings(own).unwrap(), own).unwrap(),
        (false, false)
    );
    assert_eq!(precision(&s, "{}").unwrap(), (false, false));
}

/// The evidence that xla-cpu-pjrt 0.0.1 cannot run collectives across
/// processes: two clients created as nodes 0 and 1 of a 2-node job, with the
/// key-value store, never call the store, both say process 0 and own the same
/// device ids; a program naming devices beyond a client's own does not compile.
#[test]
fn the_cpu_plugin_makes_only_single_process_clients() {
    let api = Api::load(&cpu_plugin()).unwrap();
    let server = accel_rendezvous::Server::bind("127.0.0.1:0").unwrap();
    let addr = server.local_addr().to_string();
    let nodes: Vec<_> = (0..2i64)
        .map(|node| {
            let kv = KvStore::connect(&addr, "probe/", Duration::from_secs(5)).unwrap();
            let c = Client::create(
                &api,
                &[
                    ("num_nodes".into(), OptionValue::Int(2)),
                    ("node_id".into(), OptionValue::Int(node)),
                    ("cpu_device_count".into(), OptionValue::Int(2)),
                ],
                Some(kv),
            )
            .unwrap();
            let ids: Vec<i32> = c
                .devices()
                .unwrap()
                .iter()
                .map(|d| c.device_info(*d).unwrap().id)
                .collect();
            (c, ids)
        })
        .collect();
    for (c, ids) in &nodes {
        assert_eq!(c.process_index().unwrap(), 0);
        assert_eq!(ids, &[0, 1]);
        assert_eq!(c.addressable_devices().unwrap().len(), 2);
        assert_eq!(c.kv_calls(), 0, "the plugin used the key-value store");
    }
    let e = nodes[0]
        .0
        .compile(
            &all_reduce_module(4, Elem::F32, 4, Reduce::Sum),
            &replicated_compile_options(&[0, 1, 2, 3]),
        )
        .err()
        .unwrap();
    assert!(
        e.0.contains("No matching device found for device_id 2"),
        "{e}"
    );
}

#[test]
fn bf16_and_f64_payloads_reduce_on_the_devices() {
    let engine = one_process_engine(2);
    let bytes_of = |t: &Tensor| {
        let mut b = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
        t.copy_data_u8(&mut b, t.numel());
        b
    };
    let handles: Vec<_> = (0..2usize)
        .map(|r| {
            let e = Arc::clone(&engine);
            let v = Tensor::from_slice(&[1.0f64 + r as f64, 0.3, -2.5 * r as f64]);
            let (bf, f64b) = (bytes_of(&v.to_kind(Kind::BFloat16)), bytes_of(&v));
            std::thread::spawn(move || {
                let bf = e
                    .all_reduce(r, 3, Elem::Bf16, Reduce::Mean(2), Some(bf))
                    .unwrap();
                let f = e
                    .all_reduce(r, 3, Elem::F64, Reduce::Mean(2), Some(f64b))
                    .unwrap();
                (
                    Tensor::from_data_size(&bf, &[3], Kind::BFloat16).to_kind(Kind::Double),
                    Tensor::from_data_size(&f, &[3], Kind::Double),
                )
            })
        })
        .collect();
    for h in handles {
        let (bf, f) = h.join().unwrap();
        let want = Tensor::from_slice(&[1.5f64, 0.3, -1.25]);
        assert_eq!((&f - &want).abs().max().double_value(&[]), 0.0);
        // bf16 keeps 8 bits of mantissa: 0.3 comes back as 0.30078125.
        assert!((&bf - &want).abs().max().double_value(&[]) < 4e-3);
        assert_eq!(bf.double_value(&[1]), 0.30078125);
    }
}

static SENTINEL: u8 = 0;

unsafe extern "C" fn record_error(
    code: std::ffi::c_int,
    _message: *const std::ffi::c_char,
    _len: usize,
) -> *mut ffi::PJRT_Error {
    // No assertion here: a panic must not unwind out of an `extern "C"` fn.
    let _ = code;
    (&SENTINEL as *const u8).cast_mut().cast()
}

/// The key-value callbacks a multi-process plugin would call, driven by
/// hand: put, get, try-get (found and not), and a get that times out.
#[test]
fn key_value_callbacks_go_through_the_rendezvous_store() {
    use crate::pjrt::{kv_get, kv_put, kv_try_get};
    let server = accel_rendezvous::Server::bind("127.0.0.1:0").unwrap();
    let store = KvStore::connect(
        &server.local_addr().to_string(),
        "accel/pjrt/0/",
        Duration::from_secs(5),
    )
    .unwrap();
    let user = (&store as *const KvStore)
        .cast_mut()
        .cast::<std::ffi::c_void>();
    let mut on_error: ffi::PJRT_CallbackError = Some(record_error);
    let key = "cpu:local_topology/0 x"; // a space: encoded for the store
    let value = b"\x00topology\xff";
    let mut put = ffi::PJRT_KeyValuePutCallback_Args::new();
    put.key = key.as_ptr().cast();
    put.key_size = key.len();
    put.value = value.as_ptr().cast();
    put.value_size = value.len();
    put.callback_error = &mut on_error;
    put.user_arg = user;
    // SAFETY: a properly filled args struct.
    assert!(unsafe { kv_put(&mut put) }.is_null());

    let mut get = ffi::PJRT_KeyValueGetCallback_Args::new();
    get.key = key.as_ptr().cast();
    get.key_size = key.len();
    get.timeout_in_ms = 1000;
    get.callback_error = &mut on_error;
    get.user_arg = user;
    // SAFETY: as above; the value is freed through its deleter.
    unsafe {
        assert!(kv_get(&mut get).is_null());
        let got = std::slice::from_raw_parts(get.value.cast::<u8>(), get.value_size);
        assert_eq!(got, value);
        (get.value_deleter_callback.unwrap())(get.value);
    }

    let mut try_get = ffi::PJRT_KeyValueTryGetCallback_Args::new();
    let absent = "absent";
    try_get.key = absent.as_ptr().cast();
    try_get.key_size = absent.len();
    try_get.callback_error = &mut on_error;
    try_get.user_arg = user;
    // SAFETY: as above.
    let e = unsafe { kv_try_get(&mut try_get) };
    assert_eq!(e.cast::<u8>().cast_const(), &SENTINEL as *const u8);

    get.key = absent.as_ptr().cast();
    get.key_size = absent.len();
    get.timeout_in_ms = 50;
    // SAFETY: as above.
    let e = unsafe { kv_get(&mut get) };
    assert_eq!(e.cast::<u8>().cast_const(), &SENTINEL as *const u8);
    assert_eq!(store.calls(), 4);
    // The store holds it under the prefix, with the space encoded.
    let mut c =
        accel_rendezvous::Client::connect(&server.local_addr().to_string(), Duration::from_secs(5))
            .unwrap();
    assert_eq!(
        c.try_get("accel/pjrt/0/cpu:local_topology/0%20x")
            .unwrap()
            .unwrap(),
        value
    );
}
