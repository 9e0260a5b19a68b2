//! Components compiled into accel, registered with `inventory` like a
//! plugin's: the single-device strategy (`distributed_type: NO`), the `no`
//! precision policy, the `fp16` and `bf16` policies (with DeepSpeed's loss
//! scaler for `fp16` under DEEPSPEED), and the JSONL tracker.

mod deepspeed_loss_scale;
mod jsonl;
mod mixed_precision;
mod no_precision;
mod single_device;

use accel_sdk::PluginError;
use serde_json::Value;

/// Parses a component's settings, where empty text means "no settings".
fn parse_settings(component: &str, json: &str) -> Result<Value, PluginError> {
    if json.trim().is_empty() {
        return Ok(Value::Null);
    }
    serde_json::from_str(json).map_err(|e| {
        PluginError::config("accel", format!("{component}: settings are not JSON: {e}"))
    })
}
