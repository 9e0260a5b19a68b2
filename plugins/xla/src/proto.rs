//! The few fields of `xla.CompileOptionsProto` this plugin sets, as
//! hand-written prost messages (no protoc, no prost-build).
//!
//! Field numbers are OpenXLA's:
//!
//! * `xla/pjrt/proto/compile_options.proto` — `CompileOptionsProto`
//!   (`executable_build_options = 3`) and `ExecutableBuildOptionsProto`
//!   (`device_ordinal = 1`, `num_replicas = 4`, `num_partitions = 5`,
//!   `use_spmd_partitioning = 6`, `device_assignment = 9`);
//! * `xla/xla_data.proto` — `DeviceAssignmentProto` (`replica_count = 1`,
//!   `computation_count = 2`, `computation_devices = 3`, each a
//!   `ComputationDevice` with `replica_device_ids = 1`).
//!
//! PJRT plugins need a real serialized `CompileOptionsProto`: an empty blob
//! aborts the CPU plugin (it reads `num_replicas = 0`).

use prost::Message;

/// `xla.DeviceAssignmentProto.ComputationDevice`.
#[derive(Clone, PartialEq, Message)]
pub struct ComputationDevice {
    /// The device of each replica.
    #[prost(int64, repeated, tag = "1")]
    pub replica_device_ids: Vec<i64>,
}

/// `xla.DeviceAssignmentProto`.
#[derive(Clone, PartialEq, Message)]
pub struct DeviceAssignmentProto {
    /// Replicas per computation.
    #[prost(int32, tag = "1")]
    pub replica_count: i32,
    /// Computations (partitions).
    #[prost(int32, tag = "2")]
    pub computation_count: i32,
    /// One entry per computation.
    #[prost(message, repeated, tag = "3")]
    pub computation_devices: Vec<ComputationDevice>,
}

/// `xla.ExecutableBuildOptionsProto` (the fields used here).
#[derive(Clone, PartialEq, Message)]
pub struct ExecutableBuildOptionsProto {
    /// -1: not set (the executable runs on the assigned devices).
    #[prost(int64, tag = "1")]
    pub device_ordinal: i64,
    /// Replicas of the computation.
    #[prost(int64, tag = "4")]
    pub num_replicas: i64,
    /// Partitions of the computation.
    #[prost(int64, tag = "5")]
    pub num_partitions: i64,
    /// SPMD partitioning (false here: the modules are written per replica).
    #[prost(bool, tag = "6")]
    pub use_spmd_partitioning: bool,
    /// Which global device runs which replica.
    #[prost(message, optional, tag = "9")]
    pub device_assignment: Option<DeviceAssignmentProto>,
}

/// `xla.CompileOptionsProto` (the fields used here).
#[derive(Clone, PartialEq, Message)]
pub struct CompileOptionsProto {
    /// The build options.
    #[prost(message, optional, tag = "3")]
    pub executable_build_options: Option<ExecutableBuildOptionsProto>,
}

/// The serialized options for a replicated computation: `device_ids[i]`
/// (global PJRT device ids) runs replica `i`, one partition.
pub fn replicated_compile_options(device_ids: &[i64]) -> Vec<u8> {
    let n = device_ids.len() as i64;
    CompileOptionsProto {
        executable_build_options: Some(ExecutableBuildOptionsProto {
            device_ordinal: -1,
            num_replicas: n,
            num_partitions: 1,
            use_spmd_partitioning: false,
            device_assignment: Some(DeviceAssignmentProto {
                replica_count: n as i32,
                computation_count: 1,
                computation_devices: vec![ComputationDevice {
                    replica_device_ids: device_ids.to_vec(),
                }],
            }),
        }),
    }
    .encode_to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_encode_the_replica_count_and_assignment() {
        let bytes = replicated_compile_options(&[0, 1, 2, 3]);
        // field 3, wire type 2 (a message) comes first.
        assert_eq!(bytes[0], (3 << 3) | 2);
        let back = CompileOptionsProto::decode(bytes.as_slice()).unwrap();
        let b = back.executable_build_options.unwrap();
        assert_eq!((b.num_replicas, b.num_partitions), (4, 1));
        let da = b.device_assignment.unwrap();
        assert_eq!((da.replica_count, da.computation_count), (4, 1));
        assert_eq!(da.computation_devices[0].replica_device_ids, [0, 1, 2, 3]);
        // num_replicas = 4 is field 4, varint: 0x20 0x04 inside the message.
        let inner = &bytes[2..];
        assert!(inner.windows(2).any(|w| w == [4 << 3, 4]), "{bytes:?}");
    }
}
