//! `FERROTEXT_FAULT`: a failure injected into a run to check how it is reported —
//! `device_panic:N` (device `N` panics) or `engine_misuse` (an `update` with nothing
//! accumulated). A test hook: compiled only with the `fault-injection` feature (the test
//! command's build); a release binary has no hook and never reads the variable.

use anyhow::Result;
use ferrotext_train::RunOptions;

#[cfg(feature = "fault-injection")]
use crate::common::UsageError;

/// The failure the environment asks to inject (none without the `fault-injection` feature).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct InjectedFault {
    #[cfg(feature = "fault-injection")]
    fault: Option<ferrotext_train::Fault>,
}

impl InjectedFault {
    /// `FERROTEXT_FAULT`'s request, checked before anything runs.
    ///
    /// # Errors
    /// A usage error for a value that names no fault.
    #[cfg(feature = "fault-injection")]
    pub(super) fn from_env() -> Result<InjectedFault> {
        use ferrotext_train::Fault;
        let Ok(text) = std::env::var("FERROTEXT_FAULT") else {
            return Ok(InjectedFault::default());
        };
        let fault = match text.split_once(':') {
            None if text == "engine_misuse" => Fault::EngineMisuse,
            Some(("device_panic", n)) => match n.parse() {
                Ok(device) => Fault::DevicePanic { device },
                Err(_) => {
                    let message = format!("FERROTEXT_FAULT `{text}`: `{n}` is not a device");
                    return Err(UsageError(message).into());
                }
            },
            _ => {
                let message =
                    format!("FERROTEXT_FAULT `{text}` is not `device_panic:N` or `engine_misuse`");
                return Err(UsageError(message).into());
            }
        };
        Ok(InjectedFault { fault: Some(fault) })
    }

    /// No fault: this build has no hook.
    ///
    /// # Errors
    /// None.
    #[cfg(not(feature = "fault-injection"))]
    pub(super) fn from_env() -> Result<InjectedFault> {
        Ok(InjectedFault::default())
    }

    /// `options` with the fault to inject.
    pub(super) fn apply(self, options: RunOptions<'_>) -> RunOptions<'_> {
        #[cfg(feature = "fault-injection")]
        let options = RunOptions {
            fault: self.fault,
            ..options
        };
        options
    }
}
