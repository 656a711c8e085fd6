/*!
The `train` layer of ferrotext: the config (MaxText's keys), the run plan, data, optimizers,
the deferral gate, the engine, and the training loop that runs gradient accumulation with the
data-parallel reduction deferred to the step. It must not know about the command line.

# Map

One step, from the config to the optimizer, in the order a run meets it:

| file | what it owns |
|---|---|
| `config/` | [`TrainConfig`]: every key, its default (`mod.rs`), loading (`load.rs`), the checks on values alone (`validate.rs`), derived quantities and memory (`derived.rs`, `memory.rs`) |
| `plan/` | [`RunPlan`]: the config checked once → decoder, mesh, [`Deferral`], [`Zero1`], each parameter's [`ParamLayout`]; `plan/memory.rs` the memory estimate |
| `gate.rs` | the two gates' answers, whole: `Open { .. }` or `Closed(`[`ClosedReason`]`)` |
| `run.rs` | [`train`]: one device program per device, and the training loop |
| `trainer.rs` | [`Trainer`]: a step's two moves, `micro_batch` and `update`; [`plan_step`] (abstract mode) |
| `engine/` | [`Engine`]: `fwd_bwd` per micro-batch, `update` per step |
| `gradients.rs` | [`PartialGradients`] (the accumulator, reduced once) and [`Gradients`] (what the optimizer takes) |
| `optim/` | [`OptType`] and everything that depends on it (state slots, bytes, checkpoint file), [`Optimizer`]; one file per optimizer |
| `schedule.rs` | [`learning_rate`], [`clip_scale`] |
| `checkpoint/` | checkpoints of an engine's state, mid-step too: `manifest.rs`, `save.rs`, `load.rs`, `resume.rs` |
| `data/`, `io.rs` | token sources (`shards.rs`: a `ferrotext tokenize` directory); parameter files and the metrics log |
| `export.rs` | a checkpoint's parameters as a Hugging Face directory (the format itself: `ferrotext-hf`) |
| `keys.rs` | every key's group, form and meaning for `ferrotext keys`; nearest names for typos |
| `tensorboard.rs` | TensorBoard event files of the per-step scalars (`tensorboard=true`) |
| `error.rs` | [`TrainError`] in four classes ([`ErrorClass`]) |

# The key decision: the gate decides, the types do the rest

When the gate opens, parameters enter each micro-batch typed `{R:data}` (a free cast, outside the
differentiated function). Everything else follows from the `spmd` type rules: the gradients come
out `{U:data}`, add up without communication, and the `reshard` to the plain layout in `update`
is the step's one all-reduce. The engine checks every gradient against the accumulator type the
gate promised, so a tag dropped anywhere is an error naming the parameter, never a silent early
reduction.
*/
#![deny(missing_docs)]

pub mod checkpoint;
mod config;
mod cpu_time;
pub mod data;
mod engine;
mod error;
pub mod export;
mod gate;
mod gradients;
pub mod io;
pub mod keys;
mod optim;
mod plan;
mod router_bias;
mod run;
mod schedule;
pub mod tensorboard;
mod trainer;

pub use config::Precision;
pub use config::{
    gib, machine_memory_bytes, DatasetOrder, DatasetType, DeviceMemory, MemoryEstimate, NanPolicy,
    ResumeMode, ShardMode, TrainConfig,
};
pub use cpu_time::CpuTime;
pub use engine::{Batch, Engine, FwdBwd, StepMetrics};
pub use error::{ErrorClass, OutputProblem, PrecisionProblem, TrainError};
pub use gate::{deferral_gate, zero1_gate, zero1_spec, ClosedReason, Deferral, Overlap, Zero1};
pub use gradients::{Gradients, PartialGradients};
pub use optim::{Hyper, OptType, Optimizer, OPTIMIZER_FILE, OPT_TYPE_FORM};
pub use plan::{ParamLayout, PlanDecoder, RunPlan};
pub use router_bias::bias_update;
#[cfg(feature = "fault-injection")]
pub use run::Fault;
pub use run::{select_matmul_kernel, train, train_plan, RunOptions, StepCallback, TrainReport};
pub use schedule::{clip_scale, learning_rate};
pub use trainer::{plan_step, Trainer};
