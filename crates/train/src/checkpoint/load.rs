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
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;
use sha2::{Digest, Sha256};

use super::resume::check_config;
use super::{
    ckpt_err, device_count, hex, is_plain_name, mesh_description, read_manifest, resolve,
    sequences_consumed, validate_manifest, CheckpointProblem, Manifest, ManifestMismatch,
};
use crate::config::TrainConfig;
use crate::engine::{Engine, EngineState, Restored, RestoredPending, TreeNodeState};
use crate::error::TrainError;
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
        let moments = match &loaded.moments {
            Some((m, v)) => {
                let (lm, lv) = shard_moments(cx, &state, m, v)?;
                Some((lm, lv, loaded.manifest.optimizer_steps))
            }
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
                moments,
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
        let moments = if state.moments.is_some() {
            Some(read_moments(dir, &manifest, infos)?)
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
            moments,
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
    moments: Option<(Vec<Tensor>, Vec<Tensor>)>,
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

/// `optimizer.safetensors` of checkpoint `dir` (checksum verified): AdamW's moments of the
/// parameters `infos`, in their order.
fn read_moments(
    dir: &Path,
    manifest: &Manifest,
    infos: &[ParamInfo],
) -> Result<(Vec<Tensor>, Vec<Tensor>), TrainError> {
    let bytes = read_verified(dir, manifest, "optimizer.safetensors")?;
    let path = dir.join("optimizer.safetensors");
    let file = SafeTensors::deserialize(&bytes).map_err(not_safetensors(&path))?;
    check_tensor_list(dir, manifest, "optimizer.safetensors", &file)?;
    let mut m = Vec::new();
    let mut v = Vec::new();
    for info in infos {
        for (moments, prefix) in [(&mut m, "m"), (&mut v, "v")] {
            let name = format!("{prefix}/{}", info.name);
            moments.push(finite(
                &path,
                &name,
                tensor(&path, &file, &name, &info.shape)?,
            )?);
        }
    }
    Ok((m, v))
}

/// `t` (tensor `name` of `path`) when every value is finite. Parameters and moments only: a
/// mid-step accumulator may hold a NaN gradient, which the step's end skips.
fn finite(path: &Path, name: &str, t: Tensor) -> Result<Tensor, TrainError> {
    match t.data().iter().position(|x| !x.is_finite()) {
        None => Ok(t),
        Some(index) => Err(ckpt_err(
            path,
            CheckpointProblem::NonFinite {
                name: name.into(),
                index,
            },
        )),
    }
}

/// Checks every file the manifest of checkpoint `dir` lists against its SHA-256, reading each
/// in pieces (an optimizer file is twice the parameters): what a restore reads is whole.
///
/// # Errors
/// As a restore: a listed file that is missing, unreadable, not a plain name, or whose
/// checksum differs.
pub(crate) fn verify_listed_files(dir: &Path, manifest: &Manifest) -> Result<(), TrainError> {
    for (file, want) in &manifest.files {
        if !is_plain_name(file) {
            return Err(ckpt_err(
                &dir.join("manifest.json"),
                CheckpointProblem::OutsideDirectory { file: file.clone() },
            ));
        }
        let path = dir.join(file);
        let unreadable = |e: std::io::Error| {
            ckpt_err(
                &path,
                CheckpointProblem::Unreadable {
                    error: e.to_string(),
                },
            )
        };
        let mut reader = ferrotext_files::open_regular(&path).map_err(unreadable)?;
        let mut hasher = Sha256::new();
        std::io::copy(&mut reader, &mut hasher).map_err(unreadable)?;
        same_checksum(&path, hex(&hasher.finalize()), want)?;
    }
    Ok(())
}

/// `found`, the SHA-256 of the file at `path`, is the one the manifest lists (`want`).
fn same_checksum(path: &Path, found: String, want: &str) -> Result<(), TrainError> {
    if found == want {
        return Ok(());
    }
    Err(ckpt_err(
        path,
        CheckpointProblem::ChecksumMismatch {
            expected: want.to_string(),
            found,
        },
    ))
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

/// The bytes of `file` in checkpoint `dir`: a plain name, listed in the manifest, its SHA-256
/// the one listed.
fn read_verified(dir: &Path, manifest: &Manifest, file: &str) -> Result<Vec<u8>, TrainError> {
    if !is_plain_name(file) {
        return Err(ckpt_err(
            &dir.join("manifest.json"),
            CheckpointProblem::OutsideDirectory { file: file.into() },
        ));
    }
    let path = dir.join(file);
    let bytes = ferrotext_files::read_regular(&path).map_err(|e| {
        ckpt_err(
            &path,
            CheckpointProblem::Unreadable {
                error: e.to_string(),
            },
        )
    })?;
    let want = manifest
        .files
        .get(file)
        .ok_or_else(|| ckpt_err(&path, CheckpointProblem::NotListed))?;
    same_checksum(&path, hex(&Sha256::digest(&bytes)), want)?;
    Ok(bytes)
}

/// The manifest's tensor list against `file` (`name` in checkpoint `dir`): each entry for the
/// file is a tensor it holds with that shape, none twice, and the file holds no other.
fn check_tensor_list(
    dir: &Path,
    manifest: &Manifest,
    name: &str,
    file: &SafeTensors<'_>,
) -> Result<(), TrainError> {
    let mismatch = |problem: String| {
        ckpt_err(
            &dir.join("manifest.json"),
            CheckpointProblem::Manifest(ManifestMismatch::TensorList {
                file: name.into(),
                problem,
            }),
        )
    };
    let mut listed = std::collections::HashSet::new();
    for entry in manifest.tensors.iter().filter(|t| t.file == name) {
        if !listed.insert(entry.name.as_str()) {
            return Err(mismatch(format!("names `{}` twice", entry.name)));
        }
        match file.tensor(&entry.name) {
            Ok(view) if view.shape() == entry.shape.as_slice() => {}
            Ok(view) => {
                return Err(mismatch(format!(
                    "gives `{}` shape {:?}; the file holds {:?}",
                    entry.name,
                    entry.shape,
                    view.shape()
                )))
            }
            Err(_) => {
                return Err(mismatch(format!(
                    "names `{}`, which the file does not hold",
                    entry.name
                )))
            }
        }
    }
    if let Some(unlisted) = file
        .names()
        .into_iter()
        .find(|n| !listed.contains(n.as_str()))
    {
        return Err(mismatch(format!(
            "does not name `{unlisted}`, which the file holds"
        )));
    }
    Ok(())
}

/// Maps a safetensors reader's error on `path` to [`CheckpointProblem::NotSafetensors`].
fn not_safetensors(path: &Path) -> impl Fn(safetensors::SafeTensorError) -> TrainError + '_ {
    move |e| {
        ckpt_err(
            path,
            CheckpointProblem::NotSafetensors {
                error: e.to_string(),
            },
        )
    }
}

/// Tensor `name` of `file` (at `path`): F32 and of `shape`.
fn tensor(
    path: &Path,
    file: &SafeTensors<'_>,
    name: &str,
    shape: &[usize],
) -> Result<Tensor, TrainError> {
    let view = file
        .tensor(name)
        .map_err(|_| ckpt_err(path, CheckpointProblem::NoTensor { name: name.into() }))?;
    if view.dtype() != Dtype::F32 {
        return Err(ckpt_err(
            path,
            CheckpointProblem::WrongDtype {
                name: name.into(),
                found: view.dtype(),
            },
        ));
    }
    if view.shape() != shape {
        return Err(ckpt_err(
            path,
            CheckpointProblem::WrongShape {
                name: name.into(),
                found: view.shape().to_vec(),
                expected: shape.to_vec(),
            },
        ));
    }
    let data = view
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok(Tensor::new(shape.to_vec(), data)?)
}

/// AdamW's moments, global, as this device's shards of the optimizer state's types.
fn shard_moments(
    cx: &mut Ctx<'_>,
    state: &EngineState<'_>,
    m: &[Tensor],
    v: &[Tensor],
) -> Result<(Vec<Tensor>, Vec<Tensor>), TrainError> {
    let shard = |cx: &Ctx<'_>, t: &Tensor, ty: &ArrayType| -> Result<Tensor, TrainError> {
        Ok(cx
            .from_global(t, ty.sharding().clone())?
            .local()?
            .into_owned())
    };
    let mut lm = Vec::new();
    let mut lv = Vec::new();
    for ((mi, vi), ty) in m.iter().zip(v).zip(state.moment_types) {
        lm.push(shard(cx, mi, ty)?);
        lv.push(shard(cx, vi, ty)?);
    }
    Ok((lm, lv))
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
