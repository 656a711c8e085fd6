//! Loading: a checkpoint's files read, verified and assembled into the whole state, then
//! installed on an engine.
//!
//! Invariants: every check runs before the engine is touched — the manifest (version, seal,
//! numbers), the config against the current one, the data position, every file's checksum
//! against the manifest, every tensor's name, dtype and shape — and the new state is built
//! completely before [`Engine::restore_checkpoint`] swaps it in, so an error leaves the engine as
//! it was. A file is read only through a plain name inside the checkpoint directory.

use std::path::Path;

use ferrotext_models::ParamInfo;
use ferrotext_sharding::{ArrayType, NamedSharding};
use ferrotext_spmd::{Array, Ctx};
use ferrotext_tensor::Tensor;
use safetensors::SafeTensors;

use super::resume::check_config;
use super::verify::{check_tensor_list, finite, not_safetensors, read_verified, tensor};
use super::{
    ckpt_err, device_count, mesh_description, read_manifest, resolve, sequences_consumed,
    validate_manifest, CheckpointProblem, Manifest,
};
use crate::config::TrainConfig;
use crate::engine::{Engine, EngineState, Restored, RestoredPending, TreeNodeState};
use crate::error::TrainError;
use crate::optim::OPTIMIZER_FILE;
use crate::router_bias::RouterBalance;

impl Engine {
    /// Restores the state saved at `path` (a checkpoint directory, or a root whose `latest`
    /// names one) onto this engine, whatever mesh it was saved from.
    ///
    /// # Errors
    /// [`TrainError::Checkpoint`] naming the file and the problem (missing, corrupt, truncated,
    /// a shape the model does not have, a newer format, a name outside the directory); the
    /// engine is untouched then. A collective failure.
    ///
    /// # Collectives
    /// None: every device reads the files and keeps its shards.
    pub fn restore_checkpoint(
        &mut self,
        cx: &mut Ctx<'_>,
        path: &Path,
    ) -> Result<usize, TrainError> {
        let dir = resolve(path)?;
        let loaded = self.load(&dir)?;
        let state = self.state()?;
        let layouts = state.plan.layouts();
        // Build the new state completely, then swap it in.
        let mut params = Vec::with_capacity(loaded.params.len());
        for (value, layout) in loaded.params.iter().zip(layouts) {
            let named = NamedSharding::new(cx.mesh().clone(), layout.plain.clone())?;
            params.push(cx.from_global(value, named)?);
        }
        let opt_state = match &loaded.opt_state {
            Some(slots) => Some((
                shard_opt_state(cx, &state, slots)?,
                loaded.manifest.optimizer_steps,
            )),
            None => None,
        };
        let pending = match &loaded.pending {
            Some(p) => Some(restore_pending(cx, &state, p, &loaded.manifest)?),
            None => None,
        };
        let step = loaded.manifest.step;
        self.install(
            cx,
            Restored {
                params,
                opt_state,
                pending,
                step,
            },
        )?;
        Ok(step)
    }

    /// Everything checkpoint `dir` holds, checked against this engine's plan and config; the
    /// engine is only read.
    fn load(&self, dir: &Path) -> Result<Loaded, TrainError> {
        let state = self.state()?;
        let config = state.plan.config();
        let infos = state.plan.params();
        let manifest = read_manifest(dir)?;
        validate_manifest(dir, &manifest)?;
        check_config(dir, &manifest.config, config, manifest.micro_steps)?;
        check_data_position_now(dir, &manifest, config)?;
        let params = read_params(dir, &manifest, infos)?;
        // `validate_manifest` and `check_config` made sure the file is listed when the
        // optimizer keeps state: a missing one is an error, never a silent reset.
        let opt_state = if state.opt_state.is_some() {
            Some(read_opt_state(dir, &manifest, infos)?)
        } else {
            None
        };
        let pending = if manifest.micro_steps > 0 {
            Some(read_accumulator(dir, &manifest, &state)?)
        } else {
            None
        };
        Ok(Loaded {
            manifest,
            params,
            opt_state,
            pending,
        })
    }
}

/// The parameters of the checkpoint at `path` (a checkpoint directory, or a root whose `latest`
/// names one) with the config of the run that saved them: every file's checksum and the
/// manifest checked as a resume checks them. The checkpoint is only read.
///
/// # Errors
/// As a resume: not a checkpoint, a manifest or file that fails its checks, a config that no
/// longer plans.
pub fn read_parameters(path: &Path) -> Result<(TrainConfig, Vec<Tensor>), TrainError> {
    let dir = resolve(path)?;
    let manifest = read_manifest(&dir)?;
    validate_manifest(&dir, &manifest)?;
    let plan = manifest.config.plan()?;
    let params = read_params(&dir, &manifest, plan.params())?;
    Ok((manifest.config, params))
}

/// Everything a checkpoint holds, validated, before it touches an engine.
struct Loaded {
    manifest: Manifest,
    params: Vec<Tensor>,
    /// The optimizer's state, global, `[slot][parameter]`.
    opt_state: Option<Vec<Vec<Tensor>>>,
    /// Mid-step: the step's gradients so far.
    pending: Option<LoadedPending>,
}

/// A mid-step checkpoint's `accumulator.safetensors`.
struct LoadedPending {
    /// The reduced totals, per parameter.
    totals: Vec<Tensor>,
    /// Per device, per parameter: the partial blocks (on the mesh and layout that saved them).
    partials: Option<Vec<Vec<Tensor>>>,
    /// The unit tree's subtrees (under `layout_invariant=true`, on the mesh and layout that
    /// saved them), oldest first.
    tree: Option<Vec<LoadedNode>>,
}

/// A subtree of a unit tree as a checkpoint holds it.
struct LoadedNode {
    level: u32,
    /// Per device, per parameter: the subtree's blocks.
    blocks: Vec<Vec<Tensor>>,
    /// Per device: its loss partial sum.
    losses: Vec<f32>,
}

/// The data position the current config implies for the manifest's step and micro-step is
/// the one it saved.
fn check_data_position_now(
    dir: &Path,
    manifest: &Manifest,
    config: &TrainConfig,
) -> Result<(), TrainError> {
    let manifest_path = dir.join("manifest.json");
    if manifest.dataset_order != config.dataset_order {
        return Err(ckpt_err(
            &manifest_path,
            CheckpointProblem::DatasetOrderChanged {
                saved: manifest.dataset_order,
                now: config.dataset_order,
            },
        ));
    }
    // Data that changed under a checkpoint is the user's input (exit 2), named by its path.
    let now = crate::data::fingerprint(config)?;
    if manifest.data_fingerprint != now {
        let show = |f: &Option<String>| f.clone().unwrap_or_else(|| "none".into());
        return Err(ferrotext_data::DataError::invalid(
            &config.dataset_path,
            format!(
                "checkpoint {} was saved reading shard data whose manifest has SHA-256 {}, \
                 this data's is {}: the data changed, and a resume would not read the tokens \
                 the run read (point dataset_path at the original shards, or start over with \
                 resume=fresh)",
                dir.display(),
                show(&manifest.data_fingerprint),
                show(&now)
            ),
        )
        .into());
    }
    let expected = sequences_consumed(config, manifest.step, manifest.micro_steps);
    if manifest.sequences_consumed != expected {
        return Err(ckpt_err(
            &manifest_path,
            CheckpointProblem::DataPositionMoved {
                found: manifest.sequences_consumed,
                step: manifest.step,
                micro_steps: manifest.micro_steps,
                expected,
            },
        ));
    }
    Ok(())
}

/// `params.safetensors` of checkpoint `dir` (checksum verified) as the parameters `infos`
/// declare, in their order.
pub(crate) fn read_params(
    dir: &Path,
    manifest: &Manifest,
    infos: &[ParamInfo],
) -> Result<Vec<Tensor>, TrainError> {
    let bytes = read_verified(dir, manifest, "params.safetensors")?;
    let path = dir.join("params.safetensors");
    let file = SafeTensors::deserialize(&bytes).map_err(not_safetensors(&path))?;
    check_tensor_list(dir, manifest, "params.safetensors", &file)?;
    let mut params = Vec::with_capacity(infos.len());
    for info in infos {
        let parts = info
            .hf_tensors()
            .iter()
            .map(|(name, shape)| finite(&path, name, tensor(&path, &file, name, shape)?))
            .collect::<Result<Vec<_>, _>>()?;
        params.push(
            info.from_hf(parts)
                .map_err(|e| ckpt_err(&path, CheckpointProblem::HfLayout(e)))?,
        );
    }
    Ok(params)
}

/// [`OPTIMIZER_FILE`] of checkpoint `dir` (checksum verified): the state of the manifest's
/// optimizer for the parameters `infos`, `[slot][parameter]` in their order.
fn read_opt_state(
    dir: &Path,
    manifest: &Manifest,
    infos: &[ParamInfo],
) -> Result<Vec<Vec<Tensor>>, TrainError> {
    let bytes = read_verified(dir, manifest, OPTIMIZER_FILE)?;
    let path = dir.join(OPTIMIZER_FILE);
    let file = SafeTensors::deserialize(&bytes).map_err(not_safetensors(&path))?;
    check_tensor_list(dir, manifest, OPTIMIZER_FILE, &file)?;
    let names = manifest.config.opt_type.slots();
    let mut slots = vec![Vec::with_capacity(infos.len()); names.len()];
    for info in infos {
        for (slot, prefix) in slots.iter_mut().zip(names) {
            let name = format!("{prefix}/{}", info.name);
            slot.push(finite(
                &path,
                &name,
                tensor(&path, &file, &name, &info.shape)?,
            )?);
        }
    }
    Ok(slots)
}

/// `accumulator.safetensors` of checkpoint `dir` (checksum verified): the totals, and — only
/// when the checkpoint came from the mesh and layout of `state` — every device's partial blocks
/// and the unit tree's subtrees.
fn read_accumulator(
    dir: &Path,
    manifest: &Manifest,
    state: &EngineState<'_>,
) -> Result<LoadedPending, TrainError> {
    let infos = state.plan.params();
    let bytes = read_verified(dir, manifest, "accumulator.safetensors")?;
    let path = dir.join("accumulator.safetensors");
    let file = SafeTensors::deserialize(&bytes).map_err(not_safetensors(&path))?;
    check_tensor_list(dir, manifest, "accumulator.safetensors", &file)?;
    let totals = infos
        .iter()
        .map(|i| tensor(&path, &file, &format!("acc/{}", i.name), &i.shape))
        .collect::<Result<Vec<_>, _>>()?;
    // Partial blocks are only usable on the mesh and layout they came from.
    let same_layout = manifest.mesh == mesh_description(state)
        && manifest.accumulator_types
            == state
                .promised
                .iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>();
    if !same_layout {
        return Ok(LoadedPending {
            totals,
            partials: None,
            tree: None,
        });
    }
    let devices = device_count(state);
    let blocks = |prefix: &str| -> Result<Vec<Vec<Tensor>>, TrainError> {
        (0..devices)
            .map(|d| {
                infos
                    .iter()
                    .zip(state.promised)
                    .map(|(info, t)| {
                        let name = format!("{prefix}/{d}/{}", info.name);
                        tensor(&path, &file, &name, &t.shard_shape())
                    })
                    .collect()
            })
            .collect()
    };
    let partials = Some(blocks("partial")?);
    let tree = if manifest.unit_tree_levels.is_empty() {
        None
    } else {
        let mut nodes = Vec::with_capacity(manifest.unit_tree_levels.len());
        for (n, &level) in manifest.unit_tree_levels.iter().enumerate() {
            let name = format!("node/{n}/loss");
            nodes.push(LoadedNode {
                level,
                blocks: blocks(&format!("node/{n}"))?,
                losses: tensor(&path, &file, &name, &[devices])?.data().to_vec(),
            });
        }
        Some(nodes)
    };
    Ok(LoadedPending {
        totals,
        partials,
        tree,
    })
}

/// The optimizer's state, global, `[slot][parameter]`, as this device's shards of the
/// optimizer state's types.
fn shard_opt_state(
    cx: &mut Ctx<'_>,
    state: &EngineState<'_>,
    slots: &[Vec<Tensor>],
) -> Result<Vec<Vec<Tensor>>, TrainError> {
    let shard = |cx: &Ctx<'_>, t: &Tensor, ty: &ArrayType| -> Result<Tensor, TrainError> {
        Ok(cx
            .from_global(t, ty.sharding().clone())?
            .local()?
            .into_owned())
    };
    let mut local = vec![Vec::with_capacity(state.moment_types.len()); slots.len()];
    // Parameter by parameter, each slot in turn.
    for (p, ty) in state.moment_types.iter().enumerate() {
        for (slot, out) in slots.iter().zip(&mut local) {
            out.push(shard(cx, &slot[p], ty)?);
        }
    }
    Ok(local)
}

/// The step's gradients so far, as this device's accumulator of the types the current gate
/// promises. On the mesh and layout that saved them every device takes back its own partial
/// block; otherwise each total is re-split: plain → U puts the value on the index-0 device and
/// zeros elsewhere, so the pending reduction gives the total back exactly.
fn restore_pending(
    cx: &mut Ctx<'_>,
    state: &EngineState<'_>,
    loaded: &LoadedPending,
    manifest: &Manifest,
) -> Result<RestoredPending, TrainError> {
    let mut grads: Vec<Array> = Vec::with_capacity(loaded.totals.len());
    match &loaded.partials {
        // Same mesh and layout: every device takes back its own partial block.
        Some(per_device) => {
            for (block, promised) in per_device[cx.device()].iter().zip(state.promised) {
                grads.push(cx.from_local(promised.clone(), block.clone())?);
            }
        }
        None => {
            let layouts = state.plan.layouts();
            for ((t, layout), promised) in loaded.totals.iter().zip(layouts).zip(state.promised) {
                let plain = cx.from_global(
                    t,
                    NamedSharding::new(cx.mesh().clone(), layout.plain.clone())?,
                )?;
                grads.push(cx.reshard(&plain, promised.sharding().spec())?);
            }
        }
    }
    let tree = match &loaded.tree {
        Some(nodes) => Some(restore_tree(cx, state, nodes)?),
        None => None,
    };
    Ok(RestoredPending {
        grads,
        tree,
        loss_sum: f64::from_bits(manifest.pending_loss_sum_bits),
        tokens: manifest.token_denominator,
        micro_steps: manifest.micro_steps,
        loads: restored_loads(cx, state, manifest)?,
    })
}

/// This device's share of the checkpoint's pending expert loads: the totals on the first device
/// along the batch axes, zeros on the others (token counts: the update's sum gives the totals
/// back exactly, in any order).
///
/// # Errors
/// Loads that do not fit the model's MoE layers and experts (a corrupt manifest).
fn restored_loads(
    cx: &Ctx<'_>,
    state: &EngineState<'_>,
    manifest: &Manifest,
) -> Result<ferrotext_models::decoder::ExpertLoads, TrainError> {
    let totals = &manifest.pending_expert_loads;
    let Some(balance) = RouterBalance::new(
        state.plan.decoder(),
        state.plan.config().routed_bias_update_rate,
    ) else {
        return Ok(Vec::new());
    };
    if totals.is_empty() {
        return Err(TrainError::Checkpoint {
            path: "manifest.json".into(),
            problem: CheckpointProblem::NoExpertLoads,
        });
    }
    let axes: Vec<&str> = state.plan.batch_spec().partition_axes().collect();
    let first = cx.axis_index(&axes)?.0 == 0;
    balance.split_loads(totals, first)
}

/// This device's subtrees of a checkpoint's unit tree, typed as the engine promises (the loss
/// partial sums unreduced over the batch's axes, as the loss leaves the model).
fn restore_tree(
    cx: &mut Ctx<'_>,
    state: &EngineState<'_>,
    nodes: &[LoadedNode],
) -> Result<Vec<TreeNodeState>, TrainError> {
    let loss_spec = ferrotext_sharding::PartitionSpec::replicated()
        .with_unreduced(state.plan.batch_spec().partition_axes())?;
    let loss_ty = cx.array_type(&[], loss_spec)?;
    let d = cx.device();
    nodes
        .iter()
        .map(|node| {
            let (Some(blocks), Some(&loss)) = (node.blocks.get(d), node.losses.get(d)) else {
                return Err(TrainError::Internal(format!(
                    "a checkpoint's unit tree has no blocks for device {d}"
                )));
            };
            let grads = blocks
                .iter()
                .zip(state.promised)
                .map(|(block, ty)| cx.from_local(ty.clone(), block.clone()))
                .collect::<Result<_, _>>()?;
            let loss = Tensor::new(vec![], vec![loss])?;
            Ok(TreeNodeState {
                level: node.level,
                grads,
                loss: cx.from_local(loss_ty.clone(), loss)?,
            })
        })
        .collect()
}
