//! The run plan: a [`TrainConfig`] checked once and turned into every decision a run needs — the
//! decoder, the mesh, the two gates, and each parameter's layouts. Everything downstream (the
//! engine, the trainer, the loop, the cost model, the CLI) takes a [`RunPlan`]; nothing rebuilds
//! the model or the mesh, and nothing asks a gate twice.
//!
//! Invariants of a `RunPlan` (checked by [`TrainConfig::plan`], the only constructor):
//! 1. every config value is in range and every combination is supported (ZeRO-1 without FSDP or
//!    expert parallelism, heads divisible by `tensor`, a micro-batch the batch axes divide, …);
//! 2. the decoder accepts its config (`Decoder::new` succeeded);
//! 3. the mesh's axes multiply to the device count;
//! 4. `layouts[i]` belongs to `params()[i]`, and its `inside` layout is its `plain` one tagged
//!    exactly as [`RunPlan::deferral`] says — or, when the gate is closed and
//!    [`RunPlan::overlap`] is [`Overlap::EveryMicroBatch`], as that overlap says.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferrotext_models::decoder::Decoder;
use ferrotext_models::{ParamInfo, RematPolicy};
use ferrotext_sharding::{AxisType, DType, LogicalAxisRules, Mesh, PartitionSpec};

use crate::config::{
    gib, machine_memory_bytes, memory, DeviceMemory, MemoryEstimate, Precision, ShardMode,
    TrainConfig,
};
use crate::error::TrainError;
use crate::gate::{deferral_gate, zero1_gate, zero1_spec, Deferral, Overlap, Zero1};

/// The decoder type a plan holds (one name to change when the model types are renamed).
pub type PlanDecoder = Decoder;

/// Where one parameter lives, decided by the plan.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamLayout {
    /// Storage layout (from the logical rules, untagged).
    pub plain: PartitionSpec,
    /// Layout inside micro-batches: `plain` tagged `{R:…}` when deferral is open (or when
    /// overlap reduces every micro-batch).
    pub inside: PartitionSpec,
    /// Where the reduced gradient and the optimizer state live: `plain`, or its ZeRO-1 `data`
    /// shard.
    pub target: PartitionSpec,
}

/// A validated run: see the module docs. Cheap to clone (shared).
#[derive(Clone, Debug)]
pub struct RunPlan {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: TrainConfig,
    precision: Precision,
    decoder: Decoder,
    params: Vec<ParamInfo>,
    mesh: Arc<Mesh>,
    compute_mesh: Arc<Mesh>,
    deferral: Deferral,
    overlap: Overlap,
    zero1: Zero1,
    layouts: Vec<ParamLayout>,
    batch_spec: PartitionSpec,
    output_dir: PathBuf,
    metrics_path: PathBuf,
}

/// MaxText's logical rules, with `embed` kept off the `expert` axis: under expert parallelism
/// that axis splits the batch and the experts, and dense weights stay whole over it (MaxText
/// would shard them over it like FSDP, which closes deferral).
pub(crate) fn engine_rules() -> LogicalAxisRules {
    LogicalAxisRules::maxtext()
        .without_axis("embed", "expert")
        .without_axis("embed", "context")
        .without_axis("embed_no_exp", "context")
        .without_axis("embed_moe", "context")
}

impl TrainConfig {
    /// Checks every value and combination once and plans the run: the decoder, the mesh, the
    /// deferral and ZeRO-1 gates, and every parameter's layouts.
    ///
    /// # Errors
    /// [`TrainError::Usage`] naming the key for a bad value or combination; a layout the mesh
    /// cannot hold.
    pub fn plan(&self) -> Result<RunPlan, TrainError> {
        self.check_sizes()?;
        let precision = self.precision()?;
        let decoder = Decoder::new(self.model()?)
            .and_then(|d| d.with_compute_dtype(precision.dtype))
            .map(|d| {
                d.with_remat(self.remat_policy)
                    .with_vocab_tiling(self.num_vocab_tiling)
            })
            .map_err(|e| TrainError::usage("model_name", e.to_string()))?;
        self.check_scalars()?;
        let mesh = self.mesh()?;
        self.check_combinations(decoder.config(), &mesh)?;
        let output_dir =
            std::path::absolute(Path::new(&self.base_output_directory).join(&self.run_name))
                .map_err(|e| {
                    TrainError::usage(
                        "base_output_directory",
                        format!(
                            "base_output_directory `{}` cannot be made absolute: {e}",
                            self.base_output_directory
                        ),
                    )
                })?;
        let metrics_path = if self.metrics_file.is_empty() {
            output_dir.join("metrics.jsonl")
        } else {
            std::path::absolute(&self.metrics_file).map_err(|e| {
                TrainError::usage(
                    "metrics_file",
                    format!(
                        "metrics_file `{}` cannot be made absolute: {e}",
                        self.metrics_file
                    ),
                )
            })?
        };
        // ferrotext has no automatic partitioner: the engine computes on every axis Explicit;
        // under `shard_mode=auto` the axes keep their layouts but the gate keeps tags off.
        let compute_mesh = Arc::new(mesh.with_all_axis_types(AxisType::Explicit));
        let rules = engine_rules();
        let explicit = self.shard_mode == ShardMode::Explicit;
        let deferral = deferral_gate(explicit, &mesh, &rules);
        self.check_layout_invariant(&deferral, &mesh, decoder.config())?;
        let overlap = Overlap::decide(self.overlap_grad_reduce, &deferral, &compute_mesh, &rules);
        let mut zero1 = zero1_gate(self.shard_optimizer_over_data, explicit, &mesh);
        let params = decoder.params();
        let mut layouts = Vec::with_capacity(params.len());
        for info in &params {
            let plain = rules.resolve(&info.logical, &info.shape, &compute_mesh)?;
            let inside = overlap.inside_spec(&plain, deferral.inside_spec(&plain)?)?;
            let target = match &mut zero1 {
                Zero1::Open { replicated } => {
                    match zero1_spec(&plain, &info.shape, &compute_mesh)? {
                        Some(z) => z,
                        None => {
                            replicated.push(info.name.clone());
                            plain.clone()
                        }
                    }
                }
                Zero1::Closed(_) => plain.clone(),
            };
            layouts.push(ParamLayout {
                plain,
                inside,
                target,
            });
        }
        let batch_spec = rules.resolve(
            &[Some("activation_batch"), Some("activation_length")],
            &[self.micro_batch_rows(), self.max_target_length],
            &compute_mesh,
        )?;
        Ok(RunPlan {
            inner: Arc::new(Inner {
                config: self.clone(),
                precision,
                decoder,
                params,
                mesh,
                compute_mesh,
                deferral,
                overlap,
                zero1,
                layouts,
                batch_spec,
                output_dir,
                metrics_path,
            }),
        })
    }
}

impl RunPlan {
    /// The config the plan was made from.
    pub fn config(&self) -> &TrainConfig {
        &self.inner.config
    }

    /// The precision keys, checked (the decoder computes in its `dtype`).
    pub fn precision(&self) -> Precision {
        self.inner.precision
    }

    /// The decoder (its config checked; its compute dtype the config's `dtype`).
    pub fn decoder(&self) -> &PlanDecoder {
        &self.inner.decoder
    }

    /// The decoder's parameter declarations, in order.
    pub fn params(&self) -> &[ParamInfo] {
        &self.inner.params
    }

    /// The mesh as declared: axis types from `shard_mode`.
    pub fn mesh(&self) -> &Arc<Mesh> {
        &self.inner.mesh
    }

    /// The mesh the devices compute on: the declared one with every axis Explicit.
    pub fn compute_mesh(&self) -> &Arc<Mesh> {
        &self.inner.compute_mesh
    }

    /// The deferral gate's answer.
    pub fn deferral(&self) -> &Deferral {
        &self.inner.deferral
    }

    /// Where the gradient reduction overlaps the backward pass.
    pub fn overlap(&self) -> &Overlap {
        &self.inner.overlap
    }

    /// The ZeRO-1 gate's answer (with the tensors whose state stays replicated).
    pub fn zero1(&self) -> &Zero1 {
        &self.inner.zero1
    }

    /// Each parameter's layouts, in [`RunPlan::params`] order.
    pub fn layouts(&self) -> &[ParamLayout] {
        &self.inner.layouts
    }

    /// The layout of a micro-batch's `[rows, len]` token arrays.
    pub fn batch_spec(&self) -> &PartitionSpec {
        &self.inner.batch_spec
    }

    /// The run's output directory, `base_output_directory/run_name`, absolute. A relative
    /// `base_output_directory` (the default, `ferrotext_runs`) is relative to the current
    /// directory when the run was planned: resolved once, so every output of a run lands in one
    /// place even if the process changes directory, and printed absolute so the user sees where.
    pub fn output_dir(&self) -> &Path {
        &self.inner.output_dir
    }

    /// Where this run's checkpoints live: [`RunPlan::output_dir`]`/checkpoints`.
    pub fn checkpoint_root(&self) -> PathBuf {
        self.inner.output_dir.join("checkpoints")
    }

    /// Where per-step metrics go, absolute: `metrics_file`, or
    /// [`RunPlan::output_dir`]`/metrics.jsonl`.
    pub fn metrics_path(&self) -> &Path {
        &self.inner.metrics_path
    }

    /// Refuses a run whose [`RunPlan::memory_estimate`] exceeds this machine's memory
    /// (`MemTotal` of `/proc/meminfo`; no check where that cannot be read), before anything is
    /// allocated.
    ///
    /// # Errors
    /// [`TrainError::Usage`] with the estimate and the machine's memory.
    pub fn check_fits_in_memory(&self) -> Result<(), TrainError> {
        let Some(total) = machine_memory_bytes() else {
            return Ok(());
        };
        let estimate = self.memory_estimate()?;
        if estimate.total() > total {
            return Err(TrainError::usage(
                "per_device_batch_size",
                format!(
                    "this run needs about {} per process ({} of parameters and optimizer state, {} of activations for one micro-batch), more than this machine's {}; reduce per_device_batch_size, max_target_length or the model",
                    gib(estimate.total()),
                    gib(estimate.parameter_and_optimizer_bytes),
                    gib(estimate.activation_bytes),
                    gib(total)
                ),
            ));
        }
        Ok(())
    }

    /// The peak memory of one device, estimated: its parameters, the gradient accumulator
    /// (reduced in place by the update; `layout_invariant`'s tree keeps more sets), the
    /// optimizer state (÷ `data` under ZeRO-1), all `f32`, and one micro-batch's activations:
    /// the layers' in `dtype` (2 bytes in bf16) as `remat_policy` keeps them, the logits' in
    /// `f32` (whole, or one tile's under `num_vocab_tiling`), and in bf16 the weights' bf16
    /// copies the backward reads.
    /// Parameters count once per device over the axes that split them (`fsdp × tensor`).
    ///
    /// # Errors
    /// None for a plan's mesh; typed for safety.
    pub fn memory_per_device(&self) -> Result<DeviceMemory, TrainError> {
        let config = self.config();
        let mesh = self.mesh();
        let m = self.decoder().config();
        let params: f64 = self
            .params()
            .iter()
            .map(|p| p.shape.iter().map(|&d| d as f64).product::<f64>())
            .sum();
        let split = mesh.axes_size(&["fsdp", "tensor"])? as f64;
        let data = mesh.axis_size("data")? as f64;
        let local = params / split;
        let zero1 = if config.shard_optimizer_over_data {
            data
        } else {
            1.0
        };
        let state_bytes = config.opt_type.state_bytes_per_element() as f64;
        let batch_parts = mesh.axes_size(&["data", "fsdp", "expert"])? as f64;
        let rows = (config.micro_batch_rows() as f64 / batch_parts).max(1.0);
        // Context parallelism splits each sequence over its devices.
        let len = config.max_target_length as f64 / mesh.axis_size("context").unwrap_or(1) as f64;
        let tokens = rows * len;
        let (d, f) = (m.base_emb_dim as f64, m.base_mlp_dim as f64);
        let heads = m.base_num_query_heads as f64;
        let layers = m.base_num_decoder_layers as f64;
        let dtype = self.precision().dtype;
        let kept = dtype.size_bytes() as f64;
        // What one layer's backward needs: ~16 d-wide and 4 f-wide values per token (and
        // Gemma's sandwich norms'), and the tiled attention's log-sum-exps (f32, one per head
        // and token; no T×T scores).
        let d_wide = 16.0 + memory::sandwich_norm_widths(m);
        let whole_layer = tokens * (d_wide * d + 4.0 * f) * kept + tokens * heads * 4.0;
        // Kept per layer across the step: all of it without rematerialization; else the
        // layer's input and what the policy saves, plus one layer's whole set while its
        // backward recomputes it.
        let (per_layer, recompute) = match self.decoder().remat() {
            RematPolicy::None => (whole_layer, 0.0),
            policy => {
                let q = (m.base_num_query_heads * m.head_dim) as f64;
                let kv = (m.base_num_kv_heads * m.head_dim) as f64;
                let saved = policy.kept_widths(q as usize, kv as usize, d as usize, f as usize);
                (tokens * (d + saved as f64) * kept, whole_layer)
            }
        };
        // In bf16 each weight's bf16 copy (cast at use) is kept for the backward too — for
        // the whole step without rematerialization; with it, a layer's for its region only.
        let copies = match (dtype, self.decoder().remat()) {
            (DType::F32, _) => 0.0,
            (_, RematPolicy::None) => local * kept,
            _ => (2.0 * m.vocab_size as f64 * d + local / layers) * kept,
        };
        let logits = memory::logits_bytes(m, self.decoder().vocab_tiles(), tokens);
        let activation_bytes = layers * per_layer + recompute + logits + copies;
        // The micro-batches' partial sums live in flat bucket buffers that the update reduces
        // in place (all-reduce, or ZeRO-1's reduce-scatter): no second gradient set, except
        // the tree of `layout_invariant`, which keeps up to log2(GA) more.
        let (parameter_bytes, accumulator_bytes) = (local * 4.0, local * 4.0);
        let extra_sets = if config.layout_invariant {
            (config.gradient_accumulation_steps as f64).log2().ceil()
        } else {
            0.0
        };
        let gradient_bytes = extra_sets * local * 4.0;
        let optimizer_bytes = local * state_bytes / zero1;
        Ok(DeviceMemory {
            parameter_elements: params,
            local_parameter_elements: local,
            optimizer_stepped_elements: local / zero1,
            parameter_bytes,
            accumulator_bytes,
            gradient_bytes,
            optimizer_bytes,
            activation_bytes,
            total_bytes: parameter_bytes
                + accumulator_bytes
                + gradient_bytes
                + optimizer_bytes
                + activation_bytes,
        })
    }

    /// The memory one process of this run needs, estimated: [`RunPlan::memory_per_device`]
    /// times the devices of the process, plus the host copies of the parameters. A lower bound
    /// in spirit: it counts what must exist, not allocator slack.
    ///
    /// # Errors
    /// As [`RunPlan::memory_per_device`].
    pub fn memory_estimate(&self) -> Result<MemoryEstimate, TrainError> {
        let device = self.memory_per_device()?;
        let local = self.config().local_devices as f64;
        Ok(MemoryEstimate {
            parameter_and_optimizer_bytes: (device.total_bytes - device.activation_bytes) * local
                + device.parameter_elements * 4.0,
            activation_bytes: device.activation_bytes * local,
        })
    }
}

impl TrainConfig {
    /// `layout_invariant=true`'s preconditions: what makes a step's sums follow one tree over
    /// its (device, micro-batch) units whatever the layout.
    ///
    /// # Errors
    /// A usage error naming `layout_invariant` and the reason: products whose bits follow the
    /// thread count (`deterministic` off), a mesh axis other than `data` (its gradients are
    /// reduced inside the backward), the gate closed otherwise, a GA that is not a power of two, an
    /// MoE auxiliary loss (a function of the whole micro-batch), overlapped reductions, or
    /// several processes whose device count is not a power of two.
    fn check_layout_invariant(
        &self,
        deferral: &Deferral,
        mesh: &Mesh,
        model: &ferrotext_models::decoder::Config,
    ) -> Result<(), TrainError> {
        if !self.layout_invariant {
            return Ok(());
        }
        let refuse = |why: String| {
            Err(TrainError::usage(
                "layout_invariant",
                format!("layout_invariant=true {why}"),
            ))
        };
        if !self.deterministic {
            return refuse(
                "needs deterministic=true: a library's products change their bits with the \
                 thread count each layout gives a device"
                    .into(),
            );
        }
        if let Some(axis) = mesh
            .axes()
            .iter()
            .find(|a| a.name() != "data" && a.size() > 1)
        {
            return refuse(format!(
                "needs a data-parallel mesh, got {}={}: its gradients are reduced inside the \
                 backward, in an order the layout sets",
                axis.name(),
                axis.size()
            ));
        }
        let devices: usize = mesh.axes().iter().map(|a| a.size()).product();
        if !deferral.is_open() && devices > 1 {
            return refuse(format!(
                "needs the deferral gate open (gradients unreduced until the update), it is {}",
                deferral.describe()
            ));
        }
        if !self.gradient_accumulation_steps.is_power_of_two() {
            return refuse(format!(
                "needs a power-of-two gradient_accumulation_steps (a device's micro-batches \
                 must be one subtree of the step's sum), got {}",
                self.gradient_accumulation_steps
            ));
        }
        if model
            .moe
            .as_ref()
            .is_some_and(|m| m.load_balance_loss_weight > 0.0)
        {
            return refuse(
                "cannot take load_balance_loss_weight > 0: the auxiliary loss is a function of a \
                 whole micro-batch's routing, so its value depends on how the batch is cut"
                    .into(),
            );
        }
        if self.overlap_grad_reduce {
            return refuse(
                "cannot take overlap_grad_reduce=true: the reduction starts after the step's \
                 tree is summed"
                    .into(),
            );
        }
        if model.moe.as_ref().is_some_and(|m| m.withhold_tags) {
            return refuse(
                "cannot take moe_withhold_tags=true: the expert gradients are then all-reduced \
                 in every micro-batch, outside the step's tree"
                    .into(),
            );
        }
        if self.num_processes > 1 && !self.local_devices.is_power_of_two() {
            return refuse(format!(
                "over several processes needs a power-of-two local_devices (a process's \
                 devices must be one subtree of the sum across processes), got {}",
                self.local_devices
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gate::ClosedReason;

    #[test]
    fn a_relative_output_directory_is_resolved_once_against_the_current_directory() {
        let plan = TrainConfig::default().plan().unwrap();
        let here = std::env::current_dir().unwrap();
        assert_eq!(
            plan.output_dir(),
            here.join("ferrotext_runs").join("default")
        );
        assert_eq!(
            plan.checkpoint_root(),
            here.join("ferrotext_runs/default/checkpoints")
        );
        assert_eq!(
            plan.metrics_path(),
            here.join("ferrotext_runs/default/metrics.jsonl")
        );
        let absolute = TrainConfig {
            base_output_directory: "/runs".into(),
            run_name: "x".into(),
            metrics_file: "m.jsonl".into(),
            ..TrainConfig::default()
        }
        .plan()
        .unwrap();
        assert_eq!(absolute.output_dir(), Path::new("/runs/x"));
        assert_eq!(absolute.metrics_path(), here.join("m.jsonl"));
    }

    /// The plan keeps the gate's whole answer, and every inside layout is the storage layout
    /// tagged exactly as that answer says.
    #[test]
    fn layouts_follow_the_gates_answer() {
        let open = TrainConfig::default().plan().unwrap();
        assert_eq!(
            open.deferral(),
            &Deferral::Open {
                axes: vec!["data".into()]
            }
        );
        assert_eq!(
            open.zero1(),
            &Zero1::Closed(ClosedReason::Zero1NotRequested)
        );
        assert_eq!(open.layouts().len(), open.params().len());
        for layout in open.layouts() {
            assert_eq!(layout.inside, layout.plain.with_reduced(["data"]).unwrap());
            assert_eq!(layout.target, layout.plain);
        }
        let auto = TrainConfig {
            shard_mode: ShardMode::Auto,
            ..TrainConfig::default()
        }
        .plan()
        .unwrap();
        assert_eq!(
            auto.deferral(),
            &Deferral::Closed(ClosedReason::ShardModeAuto)
        );
        assert!(auto.layouts().iter().all(|l| l.inside == l.plain));
        // The declared mesh keeps the mode's axis types; the devices compute on Explicit axes.
        assert!(!auto.mesh().is_all_explicit());
        assert!(auto.compute_mesh().is_all_explicit());
        assert_eq!(
            auto.overlap(),
            &Overlap::Off("overlap_grad_reduce is false".into())
        );
    }

    /// Overlap with the gate closed by `shard_mode=auto` tags the inside layouts as an open gate
    /// would; with deferral open it changes no layout; where tags are illegal it stays off.
    #[test]
    fn overlap_tags_the_inside_layouts_only_when_every_micro_batch_reduces() {
        let with = |items: &[&str]| {
            let mut all = vec!["overlap_grad_reduce=true".to_string()];
            all.extend(items.iter().map(|s| s.to_string()));
            TrainConfig::load(None, &all).unwrap().plan().unwrap()
        };
        let deferred = with(&[]);
        assert_eq!(deferred.overlap(), &Overlap::LastMicroBatch);
        let open = TrainConfig::default().plan().unwrap();
        assert_eq!(deferred.layouts(), open.layouts());
        let ddp = with(&["shard_mode=auto"]);
        assert!(!ddp.deferral().is_open());
        assert_eq!(
            ddp.overlap(),
            &Overlap::EveryMicroBatch {
                axes: vec!["data".into()]
            }
        );
        assert_eq!(ddp.layouts(), open.layouts());
        let fsdp = with(&["ici_data_parallelism=2", "ici_fsdp_parallelism=2"]);
        match fsdp.overlap() {
            Overlap::Off(why) => assert!(why.contains("`fsdp` has size 2"), "{why}"),
            other => panic!("{other:?}"),
        }
        assert!(fsdp.layouts().iter().all(|l| l.inside == l.plain));
        let one = with(&["ici_data_parallelism=1", "local_devices=1"]);
        assert!(matches!(one.overlap(), Overlap::Off(why) if why.contains("size 1")));
    }
}
