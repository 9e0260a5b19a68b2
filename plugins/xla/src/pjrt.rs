//! A safe client over the PJRT C API: load a plugin (`GetPjrtApi`), check
//! its API version, create a client (with key-value callbacks for
//! multi-process jobs), list devices, move buffers between host and device,
//! compile StableHLO and execute it across devices.
//!
//! Every `PJRT_Error*` becomes an [`XlaError`] carrying the plugin's message
//! (`PJRT_Error_Message`) and is destroyed (`PJRT_Error_Destroy`). Ownership
//! follows the C API: buffers and executables keep their client alive
//! (`Arc`), so they are always destroyed before it; events are awaited and
//! destroyed where they are returned. Plugin libraries are loaded once per
//! path and never unloaded (PJRT plugins start threads and register atexit
//! handlers).

use crate::ffi::*;
use std::{
    collections::HashMap,
    ffi::{c_char, c_int, c_void},
    fmt,
    path::{Path, PathBuf},
    ptr::{null, null_mut},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

/// An error from the PJRT plugin or from talking to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XlaError(pub String);

impl fmt::Display for XlaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for XlaError {}

/// Shorthand.
pub type Result<T> = std::result::Result<T, XlaError>;

fn err<T>(message: impl Into<String>) -> Result<T> {
    Err(XlaError(message.into()))
}

/// Calls an entry point of the PJRT function table of `$api` (an [`Api`])
/// and checks the returned error, which is reported under the entry
/// point's own name:
/// - `call!(api, PJRT_Client_Compile, &mut args)` passes `args`;
/// - `call!(api => PJRT_Client_ProcessIndex { client: self.inner.raw })` passes a fresh
///   args struct with these fields set and evaluates to it after the call.
macro_rules! call {
    ($api:expr, $f:ident, $args:expr) => {
        $api.call($api.table().$f, stringify!($f), $args)
    };
    ($api:expr => $f:ident { $($field:ident: $value:expr),* $(,)? }) => {
        $api.query($api.table().$f, stringify!($f), |a| {
            $(a.$field = $value;)*
        })
    };
}

/// Copies `len` bytes at `p` into a `String` (lossy UTF-8); empty for null.
///
/// # Safety
/// `p` must be null or point to `len` readable bytes.
unsafe fn string(p: *const c_char, len: usize) -> String {
    if p.is_null() || len == 0 {
        return String::new();
    }
    String::from_utf8_lossy(std::slice::from_raw_parts(p.cast::<u8>(), len)).into_owned()
}

/// A loaded PJRT plugin: its library and its `PJRT_Api` table.
pub struct Api {
    raw: *const PJRT_Api,
    path: PathBuf,
    major: i32,
    minor: i32,
    _lib: libloading::Library,
}

// SAFETY: the `PJRT_Api` table is immutable and its functions are
// thread-safe, as the C API requires of plugins.
unsafe impl Send for Api {}
// SAFETY: as above.
unsafe impl Sync for Api {}

static LOADED: Mutex<Option<HashMap<PathBuf, Arc<Api>>>> = Mutex::new(None);

impl fmt::Debug for Api {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Api({}, {}.{})",
            self.path.display(),
            self.major,
            self.minor
        )
    }
}

impl Api {
    /// Loads the PJRT plugin at `path` (once per process; later calls
    /// return the same table), checks that it speaks the API major version
    /// this plugin was written for, and runs `PJRT_Plugin_Initialize`.
    pub fn load(path: &Path) -> Result<Arc<Api>> {
        let key = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
        let mut loaded = LOADED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(api) = loaded.get_or_insert_with(HashMap::new).get(&key) {
            return Ok(Arc::clone(api));
        }
        if path.components().count() > 1 && !path.exists() {
            return err(format!(
                "PJRT plugin {} does not exist (set accel.plugins.accel-xla.pjrt_plugin or ACCEL_PJRT_PLUGIN to the plugin library, e.g. libtpu.so or xla_cpu_pjrt.so)",
                path.display()
            ));
        }
        // SAFETY: loading runs the library's initialisers; a PJRT plugin is
        // meant to be loaded this way.
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| XlaError(format!("cannot load PJRT plugin {}: {e}", path.display())))?;
        // SAFETY: `GetPjrtApi` has this signature in every PJRT plugin.
        let get: libloading::Symbol<'_, unsafe extern "C" fn() -> *const PJRT_Api> =
            unsafe { lib.get(b"GetPjrtApi\0") }.map_err(|e| {
                XlaError(format!(
                    "{} is not a PJRT plugin: it exports no `GetPjrtApi` ({e})",
                    path.display()
                ))
            })?;
        // SAFETY: calling the plugin's entry point, which takes nothing.
        let raw = unsafe { get() };
        if raw.is_null() {
            return err(format!(
                "PJRT plugin {}: GetPjrtApi returned null",
                path.display()
            ));
        }
        // SAFETY: `raw` points to the plugin's static table; only the
        // leading `struct_size` and version are read before they are checked.
        let (size, major, minor) = unsafe {
            let size = (*raw).struct_size;
            let version_end =
                std::mem::offset_of!(PJRT_Api, pjrt_api_version) + PJRT_API_VERSION_STRUCT_SIZE;
            if size < version_end {
                return err(format!(
                    "PJRT plugin {}: its PJRT_Api table is {size} bytes, too small to hold a version",
                    path.display()
                ));
            }
            (
                size,
                (*raw).pjrt_api_version.major_version,
                (*raw).pjrt_api_version.minor_version,
            )
        };
        if major != PJRT_API_MAJOR {
            return err(format!(
                "PJRT plugin {} speaks PJRT C API {major}.{minor}, but accel-xla was built for {PJRT_API_MAJOR}.{PJRT_API_MINOR}: major versions must match (use a plugin built for PJRT {PJRT_API_MAJOR}.x)",
                path.display()
            ));
        }
        if size < REQUIRED_API_SIZE {
            return err(format!(
                "PJRT plugin {} (PJRT C API {major}.{minor}) has a {size}-byte function table that lacks functions accel-xla calls ({REQUIRED_API_SIZE} bytes needed): use a newer plugin",
                path.display()
            ));
        }
        let api = Api {
            raw,
            path: path.to_path_buf(),
            major,
            minor,
            _lib: lib,
        };
        let mut init = PJRT_Plugin_Initialize_Args::new();
        call!(api, PJRT_Plugin_Initialize, &mut init)?;
        let api = Arc::new(api);
        loaded
            .get_or_insert_with(HashMap::new)
            .insert(key, Arc::clone(&api));
        Ok(api)
    }

    fn table(&self) -> &PJRT_Api {
        // SAFETY: checked non-null and large enough at load; static in the plugin.
        unsafe { &*self.raw }
    }

    /// The plugin library's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The PJRT C API version the plugin reports (`major`, `minor`).
    pub fn version(&self) -> (i32, i32) {
        (self.major, self.minor)
    }

    /// Turns a returned `PJRT_Error*` into `Err(message)` and destroys it.
    fn check(&self, error: *mut PJRT_Error, what: &str) -> Result<()> {
        if error.is_null() {
            return Ok(());
        }
        let t = self.table();
        let mut message = format!("{what} failed");
        if let Some(f) = t.PJRT_Error_Message {
            let mut m = PJRT_Error_Message_Args::new();
            m.error = error;
            // SAFETY: `error` is the live error the plugin returned.
            unsafe { f(&mut m) };
            // SAFETY: the message lives as long as `error`, destroyed below.
            let text = unsafe { string(m.message, m.message_size) };
            message = format!("{what}: {text}");
        }
        if let Some(f) = t.PJRT_Error_Destroy {
            let mut d = PJRT_Error_Destroy_Args::new();
            d.error = error;
            // SAFETY: destroys the error once; it is not used afterwards.
            unsafe { f(&mut d) };
        }
        err(message)
    }

    /// Calls `f(args)` and checks the returned error.
    fn call<A>(&self, f: PjrtFn<A>, name: &str, args: &mut A) -> Result<()> {
        let Some(f) = f else {
            return err(format!(
                "PJRT plugin {} does not implement {name}",
                self.path.display()
            ));
        };
        // SAFETY: `args` is a properly initialised args struct of the type
        // `f` takes (with `struct_size` set by its `new`).
        let e = unsafe { f(args) };
        self.check(e, name)
    }

    /// Calls `f` with a fresh args struct that `init` fills in and returns
    /// the struct, with the plugin's answers, after the call.
    fn query<A: Default>(&self, f: PjrtFn<A>, name: &str, init: impl FnOnce(&mut A)) -> Result<A> {
        let mut args = A::default();
        init(&mut args);
        self.call(f, name, &mut args)?;
        Ok(args)
    }

    /// Waits for `event` (if any) and destroys it.
    fn await_event(&self, event: *mut PJRT_Event, what: &str) -> Result<()> {
        if event.is_null() {
            return Ok(());
        }
        let mut a = PJRT_Event_Await_Args::new();
        a.event = event;
        let waited = self.call(self.table().PJRT_Event_Await, what, &mut a);
        let mut d = PJRT_Event_Destroy_Args::new();
        d.event = event;
        let destroyed = call!(self, PJRT_Event_Destroy, &mut d);
        waited.and(destroyed)
    }

    /// The plugin's attributes (`xla_version`, `stablehlo_current_version`, ...).
    pub fn attributes(&self) -> Result<Vec<(String, String)>> {
        let mut a = PJRT_Plugin_Attributes_Args::new();
        call!(self, PJRT_Plugin_Attributes, &mut a)?;
        let mut out = Vec::new();
        for i in 0..a.num_attributes {
            // SAFETY: the plugin returned `num_attributes` values that live
            // as long as the process.
            let v = unsafe { &*a.attributes.add(i) };
            // SAFETY: as above; each union member is read per its `type_`.
            let (name, value) = unsafe {
                let name = string(v.name, v.name_size);
                let value = match v.type_ {
                    named_value_type::STRING => string(v.value.string_value, v.value_size),
                    named_value_type::INT64 => v.value.int64_value.to_string(),
                    named_value_type::INT64_LIST => format!(
                        "{:?}",
                        std::slice::from_raw_parts(v.value.int64_array_value, v.value_size)
                    ),
                    named_value_type::FLOAT => v.value.float_value.to_string(),
                    named_value_type::BOOL => v.value.bool_value.to_string(),
                    _ => "?".into(),
                };
                (name, value)
            };
            out.push((name, value));
        }
        Ok(out)
    }
}

/// A value of a `PJRT_Client_Create` option.
#[derive(Debug, Clone, PartialEq)]
pub enum OptionValue {
    /// `kString`.
    Str(String),
    /// `kInt64`.
    Int(i64),
    /// `kInt64List`.
    Ints(Vec<i64>),
    /// `kFloat`.
    Float(f32),
    /// `kBool`.
    Bool(bool),
}

/// The launcher's rendezvous store, serving PJRT's key-value callbacks
/// (multi-process clients exchange their topology through it).
pub struct KvStore {
    client: Mutex<accel_rendezvous::Client>,
    prefix: String,
    calls: AtomicUsize,
}

impl KvStore {
    /// Connects to the store at `addr`; every PJRT key is stored under `prefix`.
    pub fn connect(addr: &str, prefix: &str, wait: Duration) -> Result<KvStore> {
        let client = accel_rendezvous::Client::connect(addr, wait)
            .map_err(|e| XlaError(format!("PJRT key-value store: {e}")))?;
        Ok(KvStore {
            client: Mutex::new(client),
            prefix: prefix.to_owned(),
            calls: AtomicUsize::new(0),
        })
    }

    /// How many times the plugin called the key-value callbacks.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::Relaxed)
    }

    /// The store key for PJRT key `key`: the prefix, then the key with
    /// whitespace, `%` and non-printable bytes percent-encoded (store keys
    /// contain no whitespace).
    fn store_key(&self, key: &[u8]) -> String {
        let mut k = self.prefix.clone();
        for &b in key {
            if b.is_ascii_graphic() && b != b'%' {
                k.push(b as char);
            } else {
                k.push_str(&format!("%{b:02X}"));
            }
        }
        k
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, accel_rendezvous::Client> {
        self.client.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Makes a `PJRT_Error` through the plugin's `callback_error`.
///
/// # Safety
/// `callback_error` must be null or point to the plugin's callback.
unsafe fn callback_error(
    callback_error: *mut PJRT_CallbackError,
    code: c_int,
    message: &str,
) -> *mut PJRT_Error {
    if callback_error.is_null() {
        return null_mut();
    }
    match *callback_error {
        Some(f) => f(code, message.as_ptr().cast(), message.len()),
        None => null_mut(),
    }
}

unsafe extern "C" fn free_value(value: *mut c_char) {
    libc::free(value.cast());
}

/// Hands the value a key-value getter `got` to the plugin (a `malloc`ed
/// copy it frees through `free_value`, in `value`, `value_size` and
/// `deleter`), or passes on the getter's error.
fn hand_over(
    got: std::result::Result<Vec<u8>, *mut PJRT_Error>,
    value: &mut *mut c_char,
    value_size: &mut usize,
    deleter: &mut ValueDeleter,
) -> *mut PJRT_Error {
    let v = match got {
        Ok(v) => v,
        Err(e) => return e,
    };
    // SAFETY: allocating at least one byte and copying `v.len()` into it.
    unsafe {
        let p = libc::malloc(v.len().max(1)).cast::<u8>();
        if !p.is_null() {
            std::ptr::copy_nonoverlapping(v.as_ptr(), p, v.len());
        }
        *value = p.cast();
    }
    *value_size = v.len();
    *deleter = Some(free_value);
    null_mut()
}

/// A failed store operation as a PJRT error: `(error code, message)`.
type KvFailure = (c_int, String);

/// A store error the plugin may retry later (`UNAVAILABLE`).
fn unavailable(e: accel_rendezvous::StoreError) -> KvFailure {
    (error_code::UNAVAILABLE, e.to_string())
}

/// What every key-value callback does around its store operation: counts
/// the call, maps the plugin's key to its store key and runs `op` on the
/// store. A failure, or a panic (`INTERNAL`, "key-value `what` panicked"),
/// becomes a `PJRT_Error` made through `errors`.
///
/// # Safety
/// `user_arg` must be the [`KvStore`] given to `PJRT_Client_Create`, `key`
/// must point to `key_size` readable bytes, and `errors` must be null or
/// point to the plugin's callback.
unsafe fn serve_kv<T>(
    user_arg: *mut c_void,
    key: *const c_char,
    key_size: usize,
    errors: *mut PJRT_CallbackError,
    what: &str,
    op: impl FnOnce(&KvStore, &str) -> std::result::Result<T, KvFailure>,
) -> std::result::Result<T, *mut PJRT_Error> {
    let store = &*(user_arg as *const KvStore);
    store.calls.fetch_add(1, Ordering::Relaxed);
    let key = store.store_key(std::slice::from_raw_parts(key.cast::<u8>(), key_size));
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| op(store, &key))) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err((code, message))) => Err(callback_error(errors, code, &message)),
        Err(_) => Err(callback_error(
            errors,
            error_code::INTERNAL,
            &format!("key-value {what} panicked"),
        )),
    }
}

pub(crate) unsafe extern "C" fn kv_get(
    args: *mut PJRT_KeyValueGetCallback_Args,
) -> *mut PJRT_Error {
    let a = &mut *args;
    let timeout_ms = a.timeout_in_ms;
    let timeout = Duration::from_millis(timeout_ms.max(0) as u64);
    let got = serve_kv(
        a.user_arg,
        a.key,
        a.key_size,
        a.callback_error,
        "get",
        |store, key| {
            store.lock().get(key, timeout).map_err(|e| match e {
                accel_rendezvous::StoreError::Timeout(_) => (
                    error_code::DEADLINE_EXCEEDED,
                    format!("key `{key}` not set within {timeout_ms} ms"),
                ),
                e => unavailable(e),
            })
        },
    );
    hand_over(
        got,
        &mut a.value,
        &mut a.value_size,
        &mut a.value_deleter_callback,
    )
}

pub(crate) unsafe extern "C" fn kv_try_get(
    args: *mut PJRT_KeyValueTryGetCallback_Args,
) -> *mut PJRT_Error {
    let a = &mut *args;
    let got = serve_kv(
        a.user_arg,
        a.key,
        a.key_size,
        a.callback_error,
        "try-get",
        |store, key| {
            let value = store.lock().try_get(key).map_err(unavailable)?;
            value.ok_or_else(|| (error_code::NOT_FOUND, format!("key `{key}` not found")))
        },
    );
    hand_over(
        got,
        &mut a.value,
        &mut a.value_size,
        &mut a.value_deleter_callback,
    )
}

pub(crate) unsafe extern "C" fn kv_put(
    args: *mut PJRT_KeyValuePutCallback_Args,
) -> *mut PJRT_Error {
    let a = &mut *args;
    let value: &[u8] = if a.value.is_null() {
        &[]
    } else {
        std::slice::from_raw_parts(a.value.cast::<u8>(), a.value_size)
    };
    let put = serve_kv(
        a.user_arg,
        a.key,
        a.key_size,
        a.callback_error,
        "put",
        |store, key| store.lock().set(key, value).map_err(unavailable),
    );
    put.err().unwrap_or(null_mut())
}

struct ClientInner {
    api: Arc<Api>,
    raw: *mut PJRT_Client,
    kv: Option<Box<KvStore>>,
}

// SAFETY: PJRT clients are thread-safe (the C API's contract).
unsafe impl Send for ClientInner {}
// SAFETY: as above.
unsafe impl Sync for ClientInner {}

impl Drop for ClientInner {
    fn drop(&mut self) {
        let mut a = PJRT_Client_Destroy_Args::new();
        a.client = self.raw;
        // An error while shutting down has nowhere to go but the log.
        if let Err(e) = call!(self.api, PJRT_Client_Destroy, &mut a) {
            eprintln!("accel-xla: {e}");
        }
        // `kv` (the callbacks' user_arg) is dropped after the client is gone.
    }
}

/// A PJRT client (`PJRT_Client*`).
#[derive(Clone)]
pub struct Client {
    inner: Arc<ClientInner>,
}

/// A device of a client (owned by the client).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Device {
    raw: *mut PJRT_Device,
}

// SAFETY: a device handle is an immutable pointer owned by the client.
unsafe impl Send for Device {}
// SAFETY: as above.
unsafe impl Sync for Device {}

/// What a device says about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Global id (unique across processes).
    pub id: i32,
    /// The process that can address it.
    pub process_index: i32,
    /// Vendor kind, e.g. `cpu` or `TPU v4`.
    pub kind: String,
    /// Terse description, e.g. `CpuDevice(id=0)`.
    pub name: String,
    /// Hardware id on its host (-1 if undefined).
    pub local_hardware_id: i32,
}

impl Client {
    /// `PJRT_Client_Create` with `options` (plugin-specific named values)
    /// and, for multi-process jobs, the key-value store `kv`.
    pub fn create(
        api: &Arc<Api>,
        options: &[(String, OptionValue)],
        kv: Option<KvStore>,
    ) -> Result<Client> {
        // Keep the option payloads alive through the call.
        let mut named = Vec::with_capacity(options.len());
        for (name, value) in options {
            let mut v = PJRT_NamedValue::new();
            v.name = name.as_ptr().cast();
            v.name_size = name.len();
            use named_value_type::*;
            use OptionValue as O;
            use PJRT_NamedValue_Value as Value;
            (v.type_, v.value, v.value_size) = match value {
                O::Str(s) => (
                    STRING,
                    Value {
                        string_value: s.as_ptr().cast(),
                    },
                    s.len(),
                ),
                O::Int(i) => (INT64, Value { int64_value: *i }, 1),
                O::Ints(l) => (
                    INT64_LIST,
                    Value {
                        int64_array_value: l.as_ptr(),
                    },
                    l.len(),
                ),
                O::Float(f) => (FLOAT, Value { float_value: *f }, 1),
                O::Bool(b) => (BOOL, Value { bool_value: *b }, 1),
            };
            named.push(v);
        }
        let kv = kv.map(Box::new);
        let mut a = PJRT_Client_Create_Args::new();
        a.create_options = if named.is_empty() {
            null()
        } else {
            named.as_ptr()
        };
        a.num_options = named.len();
        if let Some(store) = &kv {
            let user = (&**store as *const KvStore).cast_mut().cast::<c_void>();
            a.kv_get_callback = Some(kv_get);
            a.kv_get_user_arg = user;
            a.kv_put_callback = Some(kv_put);
            a.kv_put_user_arg = user;
            a.kv_try_get_callback = Some(kv_try_get);
            a.kv_try_get_user_arg = user;
        }
        call!(api, PJRT_Client_Create, &mut a)?;
        if a.client.is_null() {
            return err("PJRT_Client_Create returned no client");
        }
        Ok(Client {
            inner: Arc::new(ClientInner {
                api: Arc::clone(api),
                raw: a.client,
                kv,
            }),
        })
    }

    fn api(&self) -> &Api {
        &self.inner.api
    }

    /// How many times the plugin used the key-value store (0 without one).
    pub fn kv_calls(&self) -> usize {
        self.inner.kv.as_ref().map_or(0, |k| k.calls())
    }

    /// `PJRT_Client_PlatformName`, e.g. `cpu` or `tpu`.
    pub fn platform_name(&self) -> Result<String> {
        let a = call!(self.api() => PJRT_Client_PlatformName { client: self.inner.raw })?;
        // SAFETY: owned by the client, alive while `self` is.
        Ok(unsafe { string(a.platform_name, a.platform_name_size) })
    }

    /// `PJRT_Client_PlatformVersion`.
    pub fn platform_version(&self) -> Result<String> {
        let a = call!(self.api() => PJRT_Client_PlatformVersion { client: self.inner.raw })?;
        // SAFETY: owned by the client, alive while `self` is.
        Ok(unsafe { string(a.platform_version, a.platform_version_size) })
    }

    /// `PJRT_Client_ProcessIndex`: this process's index (0 in one process).
    pub fn process_index(&self) -> Result<i32> {
        Ok(call!(self.api() => PJRT_Client_ProcessIndex { client: self.inner.raw })?.process_index)
    }

    /// Every device of the job (`PJRT_Client_Devices`).
    pub fn devices(&self) -> Result<Vec<Device>> {
        let a = call!(self.api() => PJRT_Client_Devices { client: self.inner.raw })?;
        // SAFETY: `num_devices` pointers owned by the client.
        Ok(unsafe { device_list(a.devices, a.num_devices) })
    }

    /// The devices this process drives (`PJRT_Client_AddressableDevices`).
    pub fn addressable_devices(&self) -> Result<Vec<Device>> {
        let a = call!(self.api() => PJRT_Client_AddressableDevices { client: self.inner.raw })?;
        // SAFETY: `num_addressable_devices` pointers owned by the client.
        Ok(unsafe { device_list(a.addressable_devices, a.num_addressable_devices) })
    }

    /// Id, process, kind and name of `device`.
    pub fn device_info(&self, device: Device) -> Result<DeviceInfo> {
        let api = self.api();
        let dev = device.raw;
        let d = call!(api => PJRT_Device_GetDescription { device: dev })?.device_description;
        let id = call!(api => PJRT_DeviceDescription_Id { device_description: d })?;
        let pi = call!(api => PJRT_DeviceDescription_ProcessIndex { device_description: d })?;
        let kind = call!(api => PJRT_DeviceDescription_Kind { device_description: d })?;
        let name = call!(api => PJRT_DeviceDescription_ToString { device_description: d })?;
        let hw = call!(api => PJRT_Device_LocalHardwareId { device: dev })?;
        Ok(DeviceInfo {
            id: id.id,
            process_index: pi.process_index,
            // SAFETY: the strings live as long as the device.
            kind: unsafe { string(kind.device_kind, kind.device_kind_size) },
            // SAFETY: as above.
            name: unsafe { string(name.to_string, name.to_string_size) },
            local_hardware_id: hw.local_hardware_id,
        })
    }

    /// Compiles a StableHLO module (MLIR text) with serialized
    /// `xla.CompileOptionsProto` `options`.
    pub fn compile(&self, mlir: &str, options: &[u8]) -> Result<LoadedExecutable> {
        let api = self.api();
        let format = "mlir";
        let mut program = PJRT_Program::new();
        program.code = mlir.as_ptr().cast_mut().cast();
        program.code_size = mlir.len();
        program.format = format.as_ptr().cast();
        program.format_size = format.len();
        let mut a = PJRT_Client_Compile_Args::new();
        a.client = self.inner.raw;
        a.program = &program;
        a.compile_options = options.as_ptr().cast();
        a.compile_options_size = options.len();
        call!(api, PJRT_Client_Compile, &mut a)?;
        let exe = LoadedExecutable {
            client: Arc::clone(&self.inner),
            raw: a.executable,
            num_outputs: 0,
            devices: Vec::new(),
        };
        exe.finish()
    }

    /// Copies `data` (dense, row-major, element type `ty`, shape `dims`) to
    /// `device`.
    pub fn buffer_from_host(
        &self,
        data: &[u8],
        ty: c_int,
        dims: &[i64],
        device: Device,
    ) -> Result<Buffer> {
        let api = self.api();
        let mut a = PJRT_Client_BufferFromHostBuffer_Args::new();
        a.client = self.inner.raw;
        a.data = data.as_ptr().cast();
        a.type_ = ty;
        a.dims = dims.as_ptr();
        a.num_dims = dims.len();
        a.host_buffer_semantics = HOST_BUFFER_IMMUTABLE_ONLY_DURING_CALL;
        a.device = device.raw;
        call!(api, PJRT_Client_BufferFromHostBuffer, &mut a)?;
        let buffer = Buffer {
            client: Arc::clone(&self.inner),
            raw: a.buffer,
        };
        api.await_event(a.done_with_host_buffer, "host-to-device copy")?;
        Ok(buffer)
    }
}

/// # Safety
/// `p` must point to `n` device pointers (or be null with `n == 0`).
unsafe fn device_list(p: *const *mut PJRT_Device, n: usize) -> Vec<Device> {
    if p.is_null() {
        return Vec::new();
    }
    std::slice::from_raw_parts(p, n)
        .iter()
        .map(|&raw| Device { raw })
        .collect()
}

/// A device buffer (`PJRT_Buffer*`), destroyed on drop.
pub struct Buffer {
    client: Arc<ClientInner>,
    raw: *mut PJRT_Buffer,
}

// SAFETY: PJRT buffers may be used from any thread.
unsafe impl Send for Buffer {}

impl Buffer {
    /// Copies the whole buffer into `dst` (which must be its exact size in
    /// the dense row-major layout) and waits for the copy.
    pub fn to_host(&self, dst: &mut [u8]) -> Result<()> {
        let api = &self.client.api;
        let mut a = PJRT_Buffer_ToHostBuffer_Args::new();
        a.src = self.raw;
        a.dst = dst.as_mut_ptr().cast();
        a.dst_size = dst.len();
        call!(api, PJRT_Buffer_ToHostBuffer, &mut a)?;
        api.await_event(a.event, "device-to-host copy")
    }
}

/// `impl Drop` for a handle `raw` of `client` (a [`Buffer`] or a
/// [`LoadedExecutable`]): unless null, it is destroyed through the entry
/// point `$f`, whose args struct `$args` takes it as `$field`. An error
/// while tearing down has nowhere to go but the log.
macro_rules! destroy_on_drop {
    ($ty:ty, $f:ident, $args:ident.$field:ident) => {
        impl Drop for $ty {
            fn drop(&mut self) {
                if self.raw.is_null() {
                    return;
                }
                let api = &self.client.api;
                let mut a = $args::new();
                a.$field = self.raw;
                if let Err(e) = call!(api, $f, &mut a) {
                    eprintln!("accel-xla: {e}");
                }
            }
        }
    };
}

destroy_on_drop!(Buffer, PJRT_Buffer_Destroy, PJRT_Buffer_Destroy_Args.buffer);

/// A compiled program loaded on its devices (`PJRT_LoadedExecutable*`),
/// destroyed on drop.
pub struct LoadedExecutable {
    client: Arc<ClientInner>,
    raw: *mut PJRT_LoadedExecutable,
    num_outputs: usize,
    devices: Vec<Device>,
}

// SAFETY: PJRT executables may be executed from any thread.
unsafe impl Send for LoadedExecutable {}
// SAFETY: as above.
unsafe impl Sync for LoadedExecutable {}

impl LoadedExecutable {
    /// Reads the output count and the addressable devices once.
    fn finish(mut self) -> Result<Self> {
        let api = Arc::clone(&self.client.api);
        let mut g = PJRT_LoadedExecutable_GetExecutable_Args::new();
        g.loaded_executable = self.raw;
        call!(api, PJRT_LoadedExecutable_GetExecutable, &mut g)?;
        let mut n = PJRT_Executable_NumOutputs_Args::new();
        n.executable = g.executable;
        let counted = call!(api, PJRT_Executable_NumOutputs, &mut n);
        let mut d = PJRT_Executable_Destroy_Args::new();
        d.executable = g.executable;
        call!(api, PJRT_Executable_Destroy, &mut d)?;
        counted?;
        self.num_outputs = n.num_outputs;
        let mut a = PJRT_LoadedExecutable_AddressableDevices_Args::new();
        a.executable = self.raw;
        call!(api, PJRT_LoadedExecutable_AddressableDevices, &mut a)?;
        // SAFETY: `num_addressable_devices` pointers owned by the client.
        self.devices = unsafe { device_list(a.addressable_devices, a.num_addressable_devices) };
        Ok(self)
    }

    /// The devices it runs on in this process, in the order `execute`
    /// takes their arguments.
    pub fn addressable_devices(&self) -> &[Device] {
        &self.devices
    }

    /// Outputs per device.
    pub fn num_outputs(&self) -> usize {
        self.num_outputs
    }

    /// Runs on every addressable device at once: `args[d]` are the
    /// arguments on device `d` (of [`Self::addressable_devices`]); returns
    /// the outputs per device, after every device finished.
    pub fn execute(&self, args: &[Vec<&Buffer>]) -> Result<Vec<Vec<Buffer>>> {
        let api = Arc::clone(&self.client.api);
        if args.len() != self.devices.len() {
            return err(format!(
                "execute: {} argument lists for {} devices",
                args.len(),
                self.devices.len()
            ));
        }
        let num_args = args.first().map_or(0, Vec::len);
        if args.iter().any(|a| a.len() != num_args) {
            return err("execute: every device needs the same number of arguments");
        }
        let arg_ptrs: Vec<Vec<*mut PJRT_Buffer>> = args
            .iter()
            .map(|l| l.iter().map(|b| b.raw).collect())
            .collect();
        let arg_lists: Vec<*const *mut PJRT_Buffer> = arg_ptrs.iter().map(|v| v.as_ptr()).collect();
        let mut out_ptrs: Vec<Vec<*mut PJRT_Buffer>> =
            vec![vec![null_mut(); self.num_outputs]; args.len()];
        let out_lists: Vec<*mut *mut PJRT_Buffer> =
            out_ptrs.iter_mut().map(|v| v.as_mut_ptr()).collect();
        let mut events: Vec<*mut PJRT_Event> = vec![null_mut(); args.len()];
        let mut options = PJRT_ExecuteOptions::new();
        let mut a = PJRT_LoadedExecutable_Execute_Args::new();
        a.executable = self.raw;
        a.options = &mut options;
        a.argument_lists = arg_lists.as_ptr();
        a.num_devices = args.len();
        a.num_args = num_args;
        a.output_lists = out_lists.as_ptr();
        a.device_complete_events = events.as_mut_ptr();
        call!(api, PJRT_LoadedExecutable_Execute, &mut a)?;
        // Own the outputs first, so they are destroyed whatever happens next.
        let outputs: Vec<Vec<Buffer>> = out_ptrs
            .into_iter()
            .map(|l| {
                l.into_iter()
                    .map(|raw| Buffer {
                        client: Arc::clone(&self.client),
                        raw,
                    })
                    .collect()
            })
            .collect();
        let mut first_error = None;
        for e in events {
            if let Err(e) = api.await_event(e, "execution") {
                first_error.get_or_insert(e);
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(outputs),
        }
    }
}

destroy_on_drop!(
    LoadedExecutable,
    PJRT_LoadedExecutable_Destroy,
    PJRT_LoadedExecutable_Destroy_Args.executable
);
