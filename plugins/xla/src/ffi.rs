//! The parts of the PJRT C API (`xla/pjrt/c/pjrt_c_api.h`, version 0.81,
//! the header the `xla-cpu-pjrt` wheel ships) this plugin calls, written by
//! hand as `#[repr(C)]` structs.
//!
//! Names are the header's own, so the layout test (`tests::layouts_match_the_header`)
//! can compare every `STRUCT_SIZE` and every `PJRT_Api` field offset with a
//! C program compiled against the real header. `STRUCT_SIZE` is computed as
//! the header's `PJRT_STRUCT_SIZE` macro does: the offset of the last field
//! plus its size (no trailing padding).
//!
//! Only the functions this plugin calls are typed in [`PJRT_Api`]; the other
//! slots are [`Unused`] pointers, kept so the offsets stay right.

#![allow(non_camel_case_types, non_snake_case, dead_code)]

use std::ffi::{c_char, c_int, c_void};

/// The major version of the header this plugin was written against.
pub const PJRT_API_MAJOR: c_int = 0;
/// The minor version of the header this plugin was written against.
pub const PJRT_API_MINOR: c_int = 81;

macro_rules! opaque {
    ($($name:ident),* $(,)?) => {
        $(
            /// An opaque PJRT object, only ever behind a pointer.
            #[repr(C)]
            pub struct $name {
                _private: [u8; 0],
            }
        )*
    };
}

opaque!(
    PJRT_Error,
    PJRT_Client,
    PJRT_Device,
    PJRT_DeviceDescription,
    PJRT_Memory,
    PJRT_Executable,
    PJRT_LoadedExecutable,
    PJRT_Buffer,
    PJRT_Event,
    PJRT_ExecuteContext,
    PJRT_Buffer_MemoryLayout,
    PJRT_SendCallbackInfo,
    PJRT_RecvCallbackInfo,
);

/// `PJRT_Extension_Base`.
#[repr(C)]
pub struct PJRT_Extension_Base {
    pub struct_size: usize,
    pub type_: c_int,
    pub next: *mut PJRT_Extension_Base,
}

/// A `PJRT_*` function taking its args struct.
pub type PjrtFn<A> = Option<unsafe extern "C" fn(args: *mut A) -> *mut PJRT_Error>;
/// A `PJRT_*` function returning nothing (the two error functions).
pub type PjrtVoidFn<A> = Option<unsafe extern "C" fn(args: *mut A)>;
/// A slot of [`PJRT_Api`] this plugin never calls.
pub type Unused = Option<unsafe extern "C" fn()>;

/// `PJRT_CallbackError`: how a key-value callback makes a `PJRT_Error`.
pub type PJRT_CallbackError = Option<
    unsafe extern "C" fn(
        code: c_int,
        message: *const c_char,
        message_size: usize,
    ) -> *mut PJRT_Error,
>;

/// Defines an args struct: `struct_size`, `extension_start`, then the
/// fields; `STRUCT_SIZE` is the offset of the last field plus its size, as
/// `PJRT_DEFINE_STRUCT_TRAITS` computes it.
macro_rules! args {
    ($name:ident { $($field:ident : $ty:ty,)* } last $lf:ident : $lt:ty) => {
        #[repr(C)]
        pub struct $name {
            pub struct_size: usize,
            pub extension_start: *mut PJRT_Extension_Base,
            $(pub $field: $ty,)*
            pub $lf: $lt,
        }

        impl $name {
            /// `<name>_STRUCT_SIZE` of the header.
            pub const STRUCT_SIZE: usize =
                std::mem::offset_of!($name, $lf) + std::mem::size_of::<$lt>();

            /// All fields zero (null pointers, 0, false, `None`) and
            /// `struct_size` set.
            pub fn new() -> Self {
                // SAFETY: every field is a raw pointer, an integer, a bool
                // or an `Option` of a function pointer, for which all-zero
                // bytes are a valid value.
                let mut s: Self = unsafe { std::mem::zeroed() };
                s.struct_size = Self::STRUCT_SIZE;
                s
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }
    };
}

// Every args struct this plugin uses, with `(name, STRUCT_SIZE)` for the
// layout test.
macro_rules! all_args {
    ($($name:ident { $($field:ident : $ty:ty,)* } last $lf:ident : $lt:ty;)*) => {
        $(args!($name { $($field : $ty,)* } last $lf : $lt);)*

        /// `(struct name, STRUCT_SIZE)` of every args struct defined here.
        pub const STRUCT_SIZES: &[(&str, usize)] = &[$((stringify!($name), $name::STRUCT_SIZE),)*];
    };
}

/// `PJRT_NamedValue_Type`.
pub mod named_value_type {
    use std::ffi::c_int;
    pub const STRING: c_int = 0;
    pub const INT64: c_int = 1;
    pub const INT64_LIST: c_int = 2;
    pub const FLOAT: c_int = 3;
    pub const BOOL: c_int = 4;
}

/// The anonymous union of `PJRT_NamedValue`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union PJRT_NamedValue_Value {
    pub string_value: *const c_char,
    pub int64_value: i64,
    pub int64_array_value: *const i64,
    pub float_value: f32,
    pub bool_value: bool,
}

/// `PJRT_HostBufferSemantics_kImmutableOnlyDuringCall`: the data is copied
/// before `PJRT_Client_BufferFromHostBuffer` returns.
pub const HOST_BUFFER_IMMUTABLE_ONLY_DURING_CALL: c_int = 0;

/// `PJRT_Error_Code` (the ones accel's key-value callbacks return).
pub mod error_code {
    use std::ffi::c_int;
    pub const DEADLINE_EXCEEDED: c_int = 4;
    pub const NOT_FOUND: c_int = 5;
    pub const INTERNAL: c_int = 13;
    pub const UNAVAILABLE: c_int = 14;
}

/// `PJRT_Api_Version`.
#[repr(C)]
pub struct PJRT_Api_Version {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub major_version: c_int,
    pub minor_version: c_int,
}

/// `PJRT_Plugin_Initialize_Args` (its last field is `extension_start`).
#[repr(C)]
pub struct PJRT_Plugin_Initialize_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
}

impl PJRT_Plugin_Initialize_Args {
    /// `PJRT_Plugin_Initialize_Args_STRUCT_SIZE`.
    pub const STRUCT_SIZE: usize =
        std::mem::offset_of!(PJRT_Plugin_Initialize_Args, extension_start)
            + std::mem::size_of::<*mut PJRT_Extension_Base>();

    /// With `struct_size` set.
    pub fn new() -> Self {
        Self {
            struct_size: Self::STRUCT_SIZE,
            extension_start: std::ptr::null_mut(),
        }
    }
}

impl Default for PJRT_Plugin_Initialize_Args {
    fn default() -> Self {
        Self::new()
    }
}

/// `PJRT_KeyValueGetCallback_ValueDeleter` (and the try-get one).
pub type ValueDeleter = Option<unsafe extern "C" fn(value: *mut c_char)>;

all_args! {
    PJRT_Error_Destroy_Args {} last error: *mut PJRT_Error;
    PJRT_Error_Message_Args {
        error: *const PJRT_Error,
        message: *const c_char,
    } last message_size: usize;
    PJRT_Error_GetCode_Args { error: *const PJRT_Error, } last code: c_int;
    PJRT_NamedValue {
        name: *const c_char,
        name_size: usize,
        type_: c_int,
        value: PJRT_NamedValue_Value,
    } last value_size: usize;
    PJRT_Plugin_Attributes_Args {
        attributes: *const PJRT_NamedValue,
    } last num_attributes: usize;
    PJRT_Event_Destroy_Args {} last event: *mut PJRT_Event;
    PJRT_Event_Await_Args {} last event: *mut PJRT_Event;
    PJRT_KeyValueGetCallback_Args {
        key: *const c_char,
        key_size: usize,
        timeout_in_ms: c_int,
        callback_error: *mut PJRT_CallbackError,
        user_arg: *mut c_void,
        value: *mut c_char,
        value_size: usize,
    } last value_deleter_callback: ValueDeleter;
    PJRT_KeyValueTryGetCallback_Args {
        key: *const c_char,
        key_size: usize,
        callback_error: *mut PJRT_CallbackError,
        user_arg: *mut c_void,
        value: *mut c_char,
        value_size: usize,
    } last value_deleter_callback: ValueDeleter;
    PJRT_KeyValuePutCallback_Args {
        key: *const c_char,
        key_size: usize,
        value: *const c_char,
        value_size: usize,
        callback_error: *mut PJRT_CallbackError,
    } last user_arg: *mut c_void;
    PJRT_Client_Create_Args {
        create_options: *const PJRT_NamedValue,
        num_options: usize,
        kv_get_callback: KvGetCallback,
        kv_get_user_arg: *mut c_void,
        kv_put_callback: KvPutCallback,
        kv_put_user_arg: *mut c_void,
        client: *mut PJRT_Client,
        kv_try_get_callback: KvTryGetCallback,
    } last kv_try_get_user_arg: *mut c_void;
    PJRT_Client_Destroy_Args {} last client: *mut PJRT_Client;
    PJRT_Client_PlatformName_Args {
        client: *mut PJRT_Client,
        platform_name: *const c_char,
    } last platform_name_size: usize;
    PJRT_Client_ProcessIndex_Args { client: *mut PJRT_Client, } last process_index: c_int;
    PJRT_Client_PlatformVersion_Args {
        client: *mut PJRT_Client,
        platform_version: *const c_char,
    } last platform_version_size: usize;
    PJRT_Client_Devices_Args {
        client: *mut PJRT_Client,
        devices: *const *mut PJRT_Device,
    } last num_devices: usize;
    PJRT_Client_AddressableDevices_Args {
        client: *mut PJRT_Client,
        addressable_devices: *const *mut PJRT_Device,
    } last num_addressable_devices: usize;
    PJRT_Program {
        code: *mut c_char,
        code_size: usize,
        format: *const c_char,
    } last format_size: usize;
    PJRT_Client_Compile_Args {
        client: *mut PJRT_Client,
        program: *const PJRT_Program,
        compile_options: *const c_char,
        compile_options_size: usize,
    } last executable: *mut PJRT_LoadedExecutable;
    PJRT_Client_BufferFromHostBuffer_Args {
        client: *mut PJRT_Client,
        data: *const c_void,
        type_: c_int,
        dims: *const i64,
        num_dims: usize,
        byte_strides: *const i64,
        num_byte_strides: usize,
        host_buffer_semantics: c_int,
        device: *mut PJRT_Device,
        memory: *mut PJRT_Memory,
        device_layout: *mut PJRT_Buffer_MemoryLayout,
        done_with_host_buffer: *mut PJRT_Event,
    } last buffer: *mut PJRT_Buffer;
    PJRT_DeviceDescription_Id_Args {
        device_description: *mut PJRT_DeviceDescription,
    } last id: c_int;
    PJRT_DeviceDescription_ProcessIndex_Args {
        device_description: *mut PJRT_DeviceDescription,
    } last process_index: c_int;
    PJRT_DeviceDescription_Kind_Args {
        device_description: *mut PJRT_DeviceDescription,
        device_kind: *const c_char,
    } last device_kind_size: usize;
    PJRT_DeviceDescription_ToString_Args {
        device_description: *mut PJRT_DeviceDescription,
        to_string: *const c_char,
    } last to_string_size: usize;
    PJRT_Device_GetDescription_Args {
        device: *mut PJRT_Device,
    } last device_description: *mut PJRT_DeviceDescription;
    PJRT_Device_IsAddressable_Args { device: *mut PJRT_Device, } last is_addressable: bool;
    PJRT_Device_LocalHardwareId_Args {
        device: *mut PJRT_Device,
    } last local_hardware_id: c_int;
    PJRT_Executable_Destroy_Args {} last executable: *mut PJRT_Executable;
    PJRT_Executable_NumOutputs_Args {
        executable: *mut PJRT_Executable,
    } last num_outputs: usize;
    PJRT_LoadedExecutable_Destroy_Args {} last executable: *mut PJRT_LoadedExecutable;
    PJRT_LoadedExecutable_GetExecutable_Args {
        loaded_executable: *mut PJRT_LoadedExecutable,
    } last executable: *mut PJRT_Executable;
    PJRT_LoadedExecutable_AddressableDevices_Args {
        executable: *mut PJRT_LoadedExecutable,
        addressable_devices: *const *mut PJRT_Device,
    } last num_addressable_devices: usize;
    PJRT_ExecuteOptions {
        send_callbacks: *mut *mut PJRT_SendCallbackInfo,
        recv_callbacks: *mut *mut PJRT_RecvCallbackInfo,
        num_send_ops: usize,
        num_recv_ops: usize,
        launch_id: c_int,
        non_donatable_input_indices: *const i64,
        num_non_donatable_input_indices: usize,
        context: *mut PJRT_ExecuteContext,
        call_location: *const c_char,
        num_tasks: usize,
        task_ids: *mut c_int,
    } last incarnation_ids: *mut i64;
    PJRT_LoadedExecutable_Execute_Args {
        executable: *mut PJRT_LoadedExecutable,
        options: *mut PJRT_ExecuteOptions,
        argument_lists: *const *const *mut PJRT_Buffer,
        num_devices: usize,
        num_args: usize,
        output_lists: *const *mut *mut PJRT_Buffer,
        device_complete_events: *mut *mut PJRT_Event,
    } last execute_device: *mut PJRT_Device;
    PJRT_Buffer_Destroy_Args {} last buffer: *mut PJRT_Buffer;
    PJRT_Buffer_ToHostBuffer_Args {
        src: *mut PJRT_Buffer,
        host_layout: *mut PJRT_Buffer_MemoryLayout,
        dst: *mut c_void,
        dst_size: usize,
    } last event: *mut PJRT_Event;
}

/// `PJRT_KeyValueGetCallback`.
pub type KvGetCallback =
    Option<unsafe extern "C" fn(args: *mut PJRT_KeyValueGetCallback_Args) -> *mut PJRT_Error>;
/// `PJRT_KeyValueTryGetCallback`.
pub type KvTryGetCallback =
    Option<unsafe extern "C" fn(args: *mut PJRT_KeyValueTryGetCallback_Args) -> *mut PJRT_Error>;
/// `PJRT_KeyValuePutCallback`.
pub type KvPutCallback =
    Option<unsafe extern "C" fn(args: *mut PJRT_KeyValuePutCallback_Args) -> *mut PJRT_Error>;

/// Defines `PJRT_Api` from its field list, with `API_FIELD_OFFSETS` (every
/// field's name and offset) for the layout test.
macro_rules! api {
    ($($field:ident : $ty:ty,)*) => {
        /// `PJRT_Api`: the version, then one function pointer per entry point.
        #[repr(C)]
        pub struct PJRT_Api {
            pub struct_size: usize,
            pub extension_start: *mut PJRT_Extension_Base,
            pub pjrt_api_version: PJRT_Api_Version,
            $(pub $field: $ty,)*
        }

        /// `(field name, offset)` of every function pointer of [`PJRT_Api`].
        pub const API_FIELD_OFFSETS: &[(&str, usize)] =
            &[$((stringify!($field), std::mem::offset_of!(PJRT_Api, $field)),)*];
    };
}

api! {
    PJRT_Error_Destroy: PjrtVoidFn<PJRT_Error_Destroy_Args>,
    PJRT_Error_Message: PjrtVoidFn<PJRT_Error_Message_Args>,
    PJRT_Error_GetCode: PjrtFn<PJRT_Error_GetCode_Args>,

    PJRT_Plugin_Initialize: PjrtFn<PJRT_Plugin_Initialize_Args>,
    PJRT_Plugin_Attributes: PjrtFn<PJRT_Plugin_Attributes_Args>,

    PJRT_Event_Destroy: PjrtFn<PJRT_Event_Destroy_Args>,
    PJRT_Event_IsReady: Unused,
    PJRT_Event_Error: Unused,
    PJRT_Event_Await: PjrtFn<PJRT_Event_Await_Args>,
    PJRT_Event_OnReady: Unused,

    PJRT_Client_Create: PjrtFn<PJRT_Client_Create_Args>,
    PJRT_Client_Destroy: PjrtFn<PJRT_Client_Destroy_Args>,
    PJRT_Client_PlatformName: PjrtFn<PJRT_Client_PlatformName_Args>,
    PJRT_Client_ProcessIndex: PjrtFn<PJRT_Client_ProcessIndex_Args>,
    PJRT_Client_PlatformVersion: PjrtFn<PJRT_Client_PlatformVersion_Args>,
    PJRT_Client_Devices: PjrtFn<PJRT_Client_Devices_Args>,
    PJRT_Client_AddressableDevices: PjrtFn<PJRT_Client_AddressableDevices_Args>,
    PJRT_Client_LookupDevice: Unused,
    PJRT_Client_LookupAddressableDevice: Unused,
    PJRT_Client_AddressableMemories: Unused,
    PJRT_Client_Compile: PjrtFn<PJRT_Client_Compile_Args>,
    PJRT_Client_DefaultDeviceAssignment: Unused,
    PJRT_Client_BufferFromHostBuffer: PjrtFn<PJRT_Client_BufferFromHostBuffer_Args>,

    PJRT_DeviceDescription_Id: PjrtFn<PJRT_DeviceDescription_Id_Args>,
    PJRT_DeviceDescription_ProcessIndex: PjrtFn<PJRT_DeviceDescription_ProcessIndex_Args>,
    PJRT_DeviceDescription_Attributes: Unused,
    PJRT_DeviceDescription_Kind: PjrtFn<PJRT_DeviceDescription_Kind_Args>,
    PJRT_DeviceDescription_DebugString: Unused,
    PJRT_DeviceDescription_ToString: PjrtFn<PJRT_DeviceDescription_ToString_Args>,

    PJRT_Device_GetDescription: PjrtFn<PJRT_Device_GetDescription_Args>,
    PJRT_Device_IsAddressable: PjrtFn<PJRT_Device_IsAddressable_Args>,
    PJRT_Device_LocalHardwareId: PjrtFn<PJRT_Device_LocalHardwareId_Args>,
    PJRT_Device_AddressableMemories: Unused,
    PJRT_Device_DefaultMemory: Unused,
    PJRT_Device_MemoryStats: Unused,

    PJRT_Memory_Id: Unused,
    PJRT_Memory_Kind: Unused,
    PJRT_Memory_DebugString: Unused,
    PJRT_Memory_ToString: Unused,
    PJRT_Memory_AddressableByDevices: Unused,

    PJRT_Executable_Destroy: PjrtFn<PJRT_Executable_Destroy_Args>,
    PJRT_Executable_Name: Unused,
    PJRT_Executable_NumReplicas: Unused,
    PJRT_Executable_NumPartitions: Unused,
    PJRT_Executable_NumOutputs: PjrtFn<PJRT_Executable_NumOutputs_Args>,
    PJRT_Executable_SizeOfGeneratedCodeInBytes: Unused,
    PJRT_Executable_GetCostAnalysis: Unused,
    PJRT_Executable_OutputMemoryKinds: Unused,
    PJRT_Executable_OptimizedProgram: Unused,
    PJRT_Executable_Serialize: Unused,

    PJRT_LoadedExecutable_Destroy: PjrtFn<PJRT_LoadedExecutable_Destroy_Args>,
    PJRT_LoadedExecutable_GetExecutable: PjrtFn<PJRT_LoadedExecutable_GetExecutable_Args>,
    PJRT_LoadedExecutable_AddressableDevices: PjrtFn<PJRT_LoadedExecutable_AddressableDevices_Args>,
    PJRT_LoadedExecutable_Delete: Unused,
    PJRT_LoadedExecutable_IsDeleted: Unused,
    PJRT_LoadedExecutable_Execute: PjrtFn<PJRT_LoadedExecutable_Execute_Args>,
    PJRT_Executable_DeserializeAndLoad: Unused,
    PJRT_LoadedExecutable_Fingerprint: Unused,

    PJRT_Buffer_Destroy: PjrtFn<PJRT_Buffer_Destroy_Args>,
    PJRT_Buffer_ElementType: Unused,
    PJRT_Buffer_Dimensions: Unused,
    PJRT_Buffer_UnpaddedDimensions: Unused,
    PJRT_Buffer_DynamicDimensionIndices: Unused,
    PJRT_Buffer_GetMemoryLayout: Unused,
    PJRT_Buffer_OnDeviceSizeInBytes: Unused,
    PJRT_Buffer_Device: Unused,
    PJRT_Buffer_Memory: Unused,
    PJRT_Buffer_Delete: Unused,
    PJRT_Buffer_IsDeleted: Unused,
    PJRT_Buffer_CopyToDevice: Unused,
    PJRT_Buffer_ToHostBuffer: PjrtFn<PJRT_Buffer_ToHostBuffer_Args>,
    PJRT_Buffer_IsOnCpu: Unused,
    PJRT_Buffer_ReadyEvent: Unused,
    PJRT_Buffer_UnsafePointer: Unused,
    PJRT_Buffer_IncreaseExternalReferenceCount: Unused,
    PJRT_Buffer_DecreaseExternalReferenceCount: Unused,
    PJRT_Buffer_OpaqueDeviceMemoryDataPointer: Unused,

    PJRT_CopyToDeviceStream_Destroy: Unused,
    PJRT_CopyToDeviceStream_AddChunk: Unused,
    PJRT_CopyToDeviceStream_TotalBytes: Unused,
    PJRT_CopyToDeviceStream_GranuleSize: Unused,
    PJRT_CopyToDeviceStream_CurrentBytes: Unused,

    PJRT_TopologyDescription_Create: Unused,
    PJRT_TopologyDescription_Destroy: Unused,
    PJRT_TopologyDescription_PlatformName: Unused,
    PJRT_TopologyDescription_PlatformVersion: Unused,
    PJRT_TopologyDescription_GetDeviceDescriptions: Unused,
    PJRT_TopologyDescription_Serialize: Unused,
    PJRT_TopologyDescription_Attributes: Unused,

    PJRT_Compile: Unused,

    PJRT_Executable_OutputElementTypes: Unused,
    PJRT_Executable_OutputDimensions: Unused,
    PJRT_Buffer_CopyToMemory: Unused,
    PJRT_Client_CreateViewOfDeviceBuffer: Unused,
    PJRT_Executable_Fingerprint: Unused,
    PJRT_Client_TopologyDescription: Unused,
    PJRT_Executable_GetCompiledMemoryStats: Unused,
    PJRT_Memory_Kind_Id: Unused,
    PJRT_ExecuteContext_Create: Unused,
    PJRT_ExecuteContext_Destroy: Unused,
    PJRT_Buffer_CopyRawToHost: Unused,
    PJRT_AsyncHostToDeviceTransferManager_Destroy: Unused,
    PJRT_AsyncHostToDeviceTransferManager_TransferData: Unused,
    PJRT_Client_CreateBuffersForAsyncHostToDevice: Unused,
    PJRT_AsyncHostToDeviceTransferManager_RetrieveBuffer: Unused,
    PJRT_AsyncHostToDeviceTransferManager_Device: Unused,
    PJRT_AsyncHostToDeviceTransferManager_BufferCount: Unused,
    PJRT_AsyncHostToDeviceTransferManager_BufferSize: Unused,
    PJRT_AsyncHostToDeviceTransferManager_SetBufferError: Unused,
    PJRT_AsyncHostToDeviceTransferManager_AddMetadata: Unused,
    PJRT_Client_DmaMap: Unused,
    PJRT_Client_DmaUnmap: Unused,
    PJRT_Client_CreateUninitializedBuffer: Unused,
    PJRT_Client_UpdateGlobalProcessInfo: Unused,
    PJRT_TopologyDescription_Deserialize: Unused,
    PJRT_Client_CreateAliasBuffer: Unused,
    PJRT_Client_FulfillAliasBuffer: Unused,
    PJRT_LoadedExecutable_GetDeviceAssignment: Unused,
}

/// `PJRT_Api_STRUCT_SIZE` of the 0.81 header.
pub const PJRT_API_STRUCT_SIZE: usize =
    std::mem::offset_of!(PJRT_Api, PJRT_LoadedExecutable_GetDeviceAssignment)
        + std::mem::size_of::<Unused>();

/// The smallest `PJRT_Api::struct_size` that holds every function this
/// plugin calls (the last of them is `PJRT_Buffer_ToHostBuffer`). A plugin
/// built for an older minor version with a shorter table is refused.
pub const REQUIRED_API_SIZE: usize =
    std::mem::offset_of!(PJRT_Api, PJRT_Buffer_ToHostBuffer) + std::mem::size_of::<Unused>();

/// `PJRT_Api_Version_STRUCT_SIZE`.
pub const PJRT_API_VERSION_STRUCT_SIZE: usize =
    std::mem::offset_of!(PJRT_Api_Version, minor_version) + std::mem::size_of::<c_int>();

/// What the layout test compares with the header: the structs, their sizes,
/// and where `PJRT_Api` keeps each function.
pub fn layout_facts() -> Vec<(String, usize)> {
    let mut facts: Vec<(String, usize)> = STRUCT_SIZES
        .iter()
        .map(|(n, s)| (format!("{n}_STRUCT_SIZE"), *s))
        .collect();
    facts.push((
        "PJRT_Plugin_Initialize_Args_STRUCT_SIZE".into(),
        PJRT_Plugin_Initialize_Args::STRUCT_SIZE,
    ));
    facts.push((
        "PJRT_Api_Version_STRUCT_SIZE".into(),
        PJRT_API_VERSION_STRUCT_SIZE,
    ));
    facts.push(("PJRT_Api_STRUCT_SIZE".into(), PJRT_API_STRUCT_SIZE));
    facts.push((
        "offsetof(PJRT_Api, pjrt_api_version)".into(),
        std::mem::offset_of!(PJRT_Api, pjrt_api_version),
    ));
    for (name, offset) in API_FIELD_OFFSETS {
        facts.push((format!("offsetof(PJRT_Api, {name})"), *offset));
    }
    facts
}
