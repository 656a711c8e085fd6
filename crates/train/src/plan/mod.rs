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
use ferrotext_models::ParamInfo;
use ferrotext_sharding::{AxisType, LogicalAxisRules, Mesh, PartitionSpec};

use crate::config::{Precision, ShardMode, TrainConfig};
use crate::error::TrainError;
use crate::gate::{deferral_gate, zero1_gate, zero1_spec, Deferral, Overlap, Zero1};

mod memory;

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
    /// [`RunPlan::keeps_weight_packings`], once decided.
    keeps_packings: std::sync::OnceLock<bool>,
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
        // Read now what a directory saved at the end declares from the source, so that a source
        // whose `generation_config.json` does not read fails the run before it trains.
        if !self.save_parameters_path.is_empty() {
            self.source_declarations()?;
        }
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
                keeps_packings: std::sync::OnceLock::new(),
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

    /// Whether a step keeps its weights' packings for all its micro-batches: with more than
    /// one micro-batch a step to reuse them, no rematerialization (which keeps memory lean),
    /// a compute dtype whose products here keep packings — bf16 casts remembered
    /// (`Ctx::remember_casts_and_packings`), or the `f32` weights themselves
    /// (`Array::keeping_packings`) where [`ferrotext_tensor::f32_products_keep_packings`] —
    /// and the run's estimate with them inside this machine's memory
    /// ([`RunPlan::weight_packings_fit_in`]; a product's bits do not depend on whether its
    /// weight's packing was kept). Decided once per plan.
    pub fn keeps_weight_packings(&self) -> bool {
        *self.inner.keeps_packings.get_or_init(|| {
            let dtype_keeps = match self.precision().dtype {
                ferrotext_sharding::DType::BF16 => true,
                ferrotext_sharding::DType::F32 => ferrotext_tensor::f32_products_keep_packings(),
                _ => false,
            };
            dtype_keeps
                && self.decoder().remat() == ferrotext_models::RematPolicy::None
                && self.config().gradient_accumulation_steps > 1
                && crate::config::machine_memory_bytes()
                    .is_none_or(|total| self.weight_packings_fit_in(total))
        })
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
