//! Saving: every device gathers the state, device 0 writes it (see the module docs for the
//! layout of a checkpoint).
//!
//! Invariants: a checkpoint is written into a hidden temporary directory `.tmp_<name>_<pid>`,
//! every file fsynced as it is written, the manifest and its seal last, then the directory;
//! only then is it published ([`publish`]): an existing checkpoint of the same name moved aside,
//! the new one renamed into place, `latest` replaced by write + rename, the old one removed.
//! A crash at any point leaves the previous checkpoint as `latest`. The live accumulator is
//! never changed: the reduction a mid-step save needs runs on a copy.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ferrotext_models::ParamInfo;
use ferrotext_spmd::{Array, Ctx};
use ferrotext_tensor::Tensor;
use safetensors::tensor::{Dtype, TensorView};
use sha2::{Digest, Sha256};

use super::resume::checkpoints_in;
use super::{
    checkpoint_name, ckpt_err, hex, io_err, mesh_description, sequences_consumed, sync_dir,
    write_synced, CheckpointProblem, Manifest, TensorEntry, FORMAT_VERSION, MANIFEST_SEAL,
};
use crate::engine::{Engine, EngineState, PendingState, PendingSum, TreeNodeState};
use crate::error::TrainError;
use crate::optim::{OptType, OPTIMIZER_FILE};
use crate::router_bias::RouterBalance;

impl Engine {
    /// Saves the whole state under `root` (see the module docs) and returns the checkpoint's
    /// directory. Every device takes part (gathers); device 0 writes.
    ///
    /// # Errors
    /// An I/O failure (the previous checkpoint stays `latest`); a collective failure.
    ///
    /// # Collectives
    /// All-gathers of split parameters and moments; mid-step, one all-reduce per gradient in
    /// phase `checkpoint` (the reduction `update` would have done). A barrier at the end.
    pub fn save_checkpoint(&self, cx: &mut Ctx<'_>, root: &Path) -> Result<PathBuf, TrainError> {
        self.save_checkpoint_with_hook(cx, root, &|_| Ok(()))
    }

    /// [`Engine::save_checkpoint`] calling `after_file(name)` after each file is written and
    /// after each step of publishing it (`aside`: an existing checkpoint of the same name moved
    /// aside; `rename`: the new one renamed into place; `latest`) — the test hook for injecting a
    /// failure at every point of a save.
    ///
    /// # Errors
    /// As [`Engine::save_checkpoint`], or the hook's error (the save stops there).
    pub fn save_checkpoint_with_hook(
        &self,
        cx: &mut Ctx<'_>,
        root: &Path,
        after_file: &dyn Fn(&str) -> std::io::Result<()>,
    ) -> Result<PathBuf, TrainError> {
        cx.comm().push_phase("checkpoint");
        let result = self.save_inner(cx, root, after_file);
        cx.comm().pop_phase();
        result
    }

    /// The save inside the `checkpoint` trace phase: gather (every device), write and publish
    /// (device 0), then a barrier.
    fn save_inner(
        &self,
        cx: &mut Ctx<'_>,
        root: &Path,
        after_file: &dyn Fn(&str) -> std::io::Result<()>,
    ) -> Result<PathBuf, TrainError> {
        let state = self.state()?;
        // 1. gather everything (every device)
        let gathered = gather_state(cx, &state)?;
        // 2. device 0 writes: temporary directory, fsync, rename, then `latest`
        let micro = gathered.pending.as_ref().map_or(0, |p| p.micro_steps);
        let name = checkpoint_name(state.step, micro);
        if cx.device() == 0 {
            let devices = cx.mesh().device_count();
            let tmp = write_temporary(root, &name, &state, &gathered, devices, after_file)?;
            publish(root, &tmp, &name, after_file)?;
            prune(root, state.plan.config().checkpoint_keep, &name)?;
        }
        // Nobody reads or overwrites the checkpoint before it is complete.
        let all_axes: Vec<String> = cx.mesh().axis_names().map(str::to_string).collect();
        cx.comm().barrier(&all_axes)?;
        Ok(root.join(&name))
    }
}

/// Everything a checkpoint holds, gathered onto every device as host tensors.
struct Gathered {
    /// Every parameter, global, in the plan's order.
    params: Vec<Tensor>,
    /// The optimizer's state, global, `[slot][parameter]`, and its step count (`None` for an
    /// optimizer that keeps none).
    opt_state: Option<(Vec<Vec<Tensor>>, u64)>,
    /// The step's gradients so far (`None` at a step boundary).
    pending: Option<GatheredPending>,
}

/// Gathers the whole state (every device takes part): the parameters, the optimizer's state
/// (slot by slot), then the pending gradients.
fn gather_state(cx: &mut Ctx<'_>, state: &EngineState<'_>) -> Result<Gathered, TrainError> {
    let params: Vec<Tensor> = state
        .params
        .iter()
        .map(|p| cx.to_host(p))
        .collect::<Result<_, _>>()?;
    let opt_state = match state.opt_state {
        Some((slots, steps)) => {
            let mut global = vec![Vec::new(); slots.len()];
            // Parameter by parameter, each slot in turn: the order the gathers always had.
            for (p, ty) in state.moment_types.iter().enumerate() {
                for (slot, out) in slots.iter().zip(&mut global) {
                    out.push(cx.to_host(&cx.from_local(ty.clone(), slot[p].clone())?)?);
                }
            }
            Some((global, steps))
        }
        None => None,
    };
    let pending = match &state.pending {
        Some(p) => Some(gather_pending(cx, state, p)?),
        None => None,
    };
    Ok(Gathered {
        params,
        opt_state,
        pending,
    })
}

/// A step's gradients so far, gathered for device 0 to write.
struct GatheredPending {
    /// The reduced totals (what `update`'s reduction would give), per parameter.
    totals: Vec<Tensor>,
    /// Per parameter: the local block's shape and every device's block, in device order (this
    /// device's sum so far).
    partials: Vec<DeviceBlocks>,
    /// The unit tree's subtrees (`layout_invariant=true`), oldest first: level, the blocks as
    /// in `partials`, every device's loss partial sum.
    tree: Vec<(u32, Vec<DeviceBlocks>, Vec<f32>)>,
    micro_steps: usize,
    tokens: u64,
    loss_sum: f64,
    /// The step's expert loads so far, summed over the devices (`[layers · experts]`; empty
    /// without aux-loss-free balancing).
    expert_loads: Vec<f32>,
}

/// One value's local block shape and every device's block, concatenated in device order.
type DeviceBlocks = (Vec<usize>, Vec<f32>);

/// Gathers a step's gradients so far (every device takes part): the reduction `update` would
/// do, on a copy (the live sums stay partial), and every device's own blocks, so a restore onto
/// the same mesh and layout continues bit for bit (the sum's association is kept).
fn gather_pending(
    cx: &mut Ctx<'_>,
    state: &EngineState<'_>,
    p: &PendingState,
) -> Result<GatheredPending, TrainError> {
    let summed;
    let (grads, nodes): (&[Array], &[TreeNodeState]) = match &p.sum {
        PendingSum::Accumulator(grads) => (grads, &[]),
        PendingSum::Tree(nodes) => {
            summed = sum_tree_nodes(cx, nodes)?;
            (&summed, nodes)
        }
    };
    let mut totals = Vec::with_capacity(grads.len());
    for (g, layout) in grads.iter().zip(state.plan.layouts()) {
        let reduced = cx.reshard(g, &layout.plain)?;
        totals.push(cx.to_host(&reduced)?);
    }
    let partials = gather_device_blocks(cx, grads)?;
    let mut tree = Vec::with_capacity(nodes.len());
    for node in nodes {
        let blocks = gather_device_blocks(cx, &node.grads)?;
        let (_, losses) = gather_device_blocks(cx, std::slice::from_ref(&node.loss))?
            .pop()
            .ok_or_else(|| TrainError::Internal("a gathered loss is missing".into()))?;
        tree.push((node.level, blocks, losses));
    }
    // The expert loads: one all-reduce of layers × experts values, as `update`'s.
    let config = state.plan.config();
    let expert_loads =
        match RouterBalance::new(state.plan.decoder(), config.routed_bias_update_rate) {
            Some(balance) => balance
                .reduce(cx, state.plan.batch_spec(), &p.loads)?
                .unwrap_or_default(),
            None => Vec::new(),
        };
    Ok(GatheredPending {
        totals,
        partials,
        tree,
        micro_steps: p.micro_steps,
        tokens: p.tokens,
        loss_sum: p.loss_sum,
        expert_loads,
    })
}

/// A device's sum of its unit tree's subtrees, as `update` adds them (from the newest back).
fn sum_tree_nodes(cx: &mut Ctx<'_>, nodes: &[TreeNodeState]) -> Result<Vec<Array>, TrainError> {
    let (newest, older) = nodes
        .split_last()
        .ok_or_else(|| TrainError::Internal("a pending tree without subtrees".into()))?;
    let mut right = newest.grads.clone();
    for left in older.iter().rev() {
        right = left
            .grads
            .iter()
            .zip(&right)
            .map(|(l, r)| cx.add(l, r))
            .collect::<Result<_, _>>()?;
    }
    Ok(right)
}

/// Every device's local block of each of `values`, gathered onto every device.
fn gather_device_blocks(
    cx: &mut Ctx<'_>,
    values: &[Array],
) -> Result<Vec<DeviceBlocks>, TrainError> {
    let all_axes: Vec<String> = cx.mesh().axis_names().map(str::to_string).collect();
    let devices = cx.mesh().device_count();
    let mut out = Vec::with_capacity(values.len());
    for v in values {
        let local = v.local()?;
        let mut all = vec![0.0f32; local.len() * devices];
        cx.comm().all_gather(&all_axes, local.data(), &mut all)?;
        out.push((local.shape().to_vec(), all));
    }
    Ok(out)
}

/// A checkpoint being written into its hidden temporary directory: the SHA-256 of each file
/// written so far, and every tensor's entry in the order written.
struct TempCheckpoint<'h> {
    dir: PathBuf,
    files: BTreeMap<String, String>,
    tensors: Vec<TensorEntry>,
    after_file: &'h dyn Fn(&str) -> std::io::Result<()>,
}

impl<'h> TempCheckpoint<'h> {
    /// Creates `root` if needed and `root/.tmp_<name>_<pid>` afresh (a leftover of the same
    /// name is removed first).
    fn create(
        root: &Path,
        name: &str,
        after_file: &'h dyn Fn(&str) -> std::io::Result<()>,
    ) -> Result<Self, TrainError> {
        std::fs::create_dir_all(root).map_err(io_err(root))?;
        let dir = root.join(format!(".tmp_{name}_{}", std::process::id()));
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
        }
        std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        Ok(TempCheckpoint {
            dir,
            files: BTreeMap::new(),
            tensors: Vec::new(),
            after_file,
        })
    }

    /// Writes `stored` as `file` (fsynced), recording each tensor's entry with `sharding(i)` of
    /// its index and the file's SHA-256; then calls the hook.
    fn write(
        &mut self,
        file: &str,
        stored: &[(String, Tensor)],
        sharding: impl Fn(usize) -> String,
    ) -> Result<(), TrainError> {
        for (i, (name, t)) in stored.iter().enumerate() {
            self.tensors.push(TensorEntry {
                file: file.into(),
                name: name.clone(),
                shape: t.shape().to_vec(),
                sharding: sharding(i),
            });
        }
        let sha = write_tensors(&self.dir.join(file), stored)?;
        self.files.insert(file.to_string(), sha);
        (self.after_file)(file).map_err(io_err(&self.dir))
    }
}

/// Writes checkpoint `name` into a fresh temporary directory under `root` — parameters,
/// optimizer state, accumulator, then the manifest and its seal, every file fsynced, then the
/// directory — and returns that directory.
fn write_temporary(
    root: &Path,
    name: &str,
    state: &EngineState<'_>,
    gathered: &Gathered,
    devices: usize,
    after_file: &dyn Fn(&str) -> std::io::Result<()>,
) -> Result<PathBuf, TrainError> {
    let infos = state.plan.params();
    let mut tmp = TempCheckpoint::create(root, name, after_file)?;
    write_params(&mut tmp, infos, &gathered.params, state.params)?;
    if let Some((slots, _)) = &gathered.opt_state {
        write_opt_state(&mut tmp, state.plan.config().opt_type, infos, slots)?;
    }
    if let Some(p) = &gathered.pending {
        write_accumulator(&mut tmp, infos, p, devices)?;
    }
    let TempCheckpoint {
        dir,
        files,
        tensors,
        ..
    } = tmp;
    let mut manifest = build_manifest(state, gathered, tensors, files);
    manifest.data_fingerprint = crate::data::fingerprint(state.plan.config())?;
    let json = serde_json::to_vec_pretty(&manifest).map_err(|e| ckpt_err(&dir, encode(e)))?;
    write_synced(&dir.join("manifest.json"), &json)?;
    write_synced(
        &dir.join(MANIFEST_SEAL),
        format!("{}  manifest.json\n", hex(&Sha256::digest(&json))).as_bytes(),
    )?;
    after_file("manifest.json").map_err(io_err(&dir))?;
    sync_dir(&dir)?;
    Ok(dir)
}

/// `params.safetensors`: every parameter under its HF names and orientation, as it declares
/// (experts unstacked), each entry carrying the parameter's sharding.
fn write_params(
    tmp: &mut TempCheckpoint<'_>,
    infos: &[ParamInfo],
    params: &[Tensor],
    live: &[Array],
) -> Result<(), TrainError> {
    let mut stored: Vec<(String, Tensor)> = Vec::new();
    let mut shardings = Vec::new();
    for ((info, t), p) in infos.iter().zip(params).zip(live) {
        let parts = info
            .to_hf(t)
            .map_err(|e| ckpt_err(&tmp.dir, CheckpointProblem::HfLayout(e)))?;
        for (n, part) in parts {
            shardings.push(p.ty().to_string());
            stored.push((n, part));
        }
    }
    tmp.write("params.safetensors", &stored, |i| shardings[i].clone())
}

/// [`OPTIMIZER_FILE`]: the optimizer's state, slot `s` of parameter `p` as `s/p`, parameter by
/// parameter (AdamW: `m/<name>`, `v/<name>`).
fn write_opt_state(
    tmp: &mut TempCheckpoint<'_>,
    opt_type: OptType,
    infos: &[ParamInfo],
    slots: &[Vec<Tensor>],
) -> Result<(), TrainError> {
    let mut stored = Vec::new();
    for (p, info) in infos.iter().enumerate() {
        for (name, slot) in opt_type.slots().iter().zip(slots) {
            stored.push((format!("{name}/{}", info.name), slot[p].clone()));
        }
    }
    tmp.write(OPTIMIZER_FILE, &stored, |_| "replicated".into())
}

/// `accumulator.safetensors` (mid-step): the reduced totals `acc/<name>`, every device's partial
/// block `partial/<device>/<name>`, and the unit tree's subtrees `node/<n>/...`.
fn write_accumulator(
    tmp: &mut TempCheckpoint<'_>,
    infos: &[ParamInfo],
    p: &GatheredPending,
    devices: usize,
) -> Result<(), TrainError> {
    let mut stored: Vec<(String, Tensor)> = infos
        .iter()
        .zip(&p.totals)
        .map(|(i, t)| (format!("acc/{}", i.name), t.clone()))
        .collect();
    push_device_blocks(&mut stored, "partial", infos, &p.partials, devices)?;
    for (n, (_, grads, losses)) in p.tree.iter().enumerate() {
        push_device_blocks(&mut stored, &format!("node/{n}"), infos, grads, devices)?;
        stored.push((
            format!("node/{n}/loss"),
            Tensor::new(vec![losses.len()], losses.clone())?,
        ));
    }
    tmp.write("accumulator.safetensors", &stored, |_| {
        "reduced total".into()
    })
}

/// The manifest of a save: the state's position and the files and tensors written.
fn build_manifest(
    state: &EngineState<'_>,
    gathered: &Gathered,
    tensors: Vec<TensorEntry>,
    files: BTreeMap<String, String>,
) -> Manifest {
    let config = state.plan.config();
    let pending = gathered.pending.as_ref();
    let micro = pending.map_or(0, |p| p.micro_steps);
    let (token_denominator, pending_loss_sum) =
        pending.map_or((0, 0.0), |p| (p.tokens, p.loss_sum));
    Manifest {
        format_version: FORMAT_VERSION,
        config: config.clone(),
        step: state.step,
        micro_steps: micro,
        token_denominator,
        pending_loss_sum,
        pending_loss_sum_bits: pending_loss_sum.to_bits(),
        pending_expert_loads: pending.map_or_else(Vec::new, |p| p.expert_loads.clone()),
        optimizer_steps: gathered.opt_state.as_ref().map_or(0, |(_, t)| *t),
        dataset_order: config.dataset_order,
        sequences_consumed: sequences_consumed(config, state.step, micro),
        data_fingerprint: None,
        mesh: mesh_description(state),
        accumulator_types: state.pending.as_ref().map_or_else(Vec::new, |_| {
            state.promised.iter().map(ToString::to_string).collect()
        }),
        unit_tree_levels: pending
            .map(|p| p.tree.iter().map(|(level, _, _)| *level).collect())
            .unwrap_or_default(),
        deferral: state.plan.deferral().describe(),
        tensors,
        files,
    }
}

/// Publishes the complete temporary directory `tmp` as `root/name` and names it in `latest`.
/// A checkpoint of the same name is replaced only once the new one is complete: the old one
/// moves aside, the new one in, then the old one goes (start-up puts an old one back if the new
/// one never arrived).
fn publish(
    root: &Path,
    tmp: &Path,
    name: &str,
    after_file: &dyn Fn(&str) -> std::io::Result<()>,
) -> Result<(), TrainError> {
    let final_dir = root.join(name);
    let aside = root.join(format!(".old_{name}"));
    let replacing = final_dir.exists();
    if replacing {
        if aside.exists() {
            // A leftover of an earlier replacement that finished: `final_dir` is whole.
            std::fs::remove_dir_all(&aside).map_err(io_err(&aside))?;
        }
        std::fs::rename(&final_dir, &aside).map_err(io_err(&aside))?;
        sync_dir(root)?;
        after_file("aside").map_err(io_err(root))?;
    }
    std::fs::rename(tmp, &final_dir).map_err(io_err(&final_dir))?;
    sync_dir(root)?;
    after_file("rename").map_err(io_err(root))?;
    let latest_tmp = root.join(".latest.tmp");
    write_synced(&latest_tmp, name.as_bytes())?;
    std::fs::rename(&latest_tmp, root.join("latest")).map_err(io_err(root))?;
    sync_dir(root)?;
    after_file("latest").map_err(io_err(root))?;
    if replacing {
        std::fs::remove_dir_all(&aside).map_err(io_err(&aside))?;
        sync_dir(root)?;
    }
    Ok(())
}

/// Appends `<prefix>/<device>/<parameter>` for every device's block of every parameter.
fn push_device_blocks(
    stored: &mut Vec<(String, Tensor)>,
    prefix: &str,
    infos: &[ParamInfo],
    blocks: &[DeviceBlocks],
    devices: usize,
) -> Result<(), TrainError> {
    for (info, (shape, all)) in infos.iter().zip(blocks) {
        let block = all.len() / devices.max(1);
        for d in 0..devices {
            let t = Tensor::new(shape.clone(), all[d * block..(d + 1) * block].to_vec())?;
            stored.push((format!("{prefix}/{d}/{}", info.name), t));
        }
    }
    Ok(())
}

/// Writes `entries` as one safetensors file, fsynced; returns its SHA-256.
fn write_tensors(path: &Path, entries: &[(String, Tensor)]) -> Result<String, TrainError> {
    let stored: Vec<(String, Vec<usize>, Vec<u8>)> = entries
        .iter()
        .map(|(n, t)| {
            (
                n.clone(),
                t.shape().to_vec(),
                t.data().iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = stored
        .iter()
        .map(|(n, s, b)| TensorView::new(Dtype::F32, s.clone(), b).map(|v| (n.clone(), v)))
        .collect::<Result<_, _>>()
        .map_err(|e| ckpt_err(path, encode(e)))?;
    let bytes = safetensors::serialize(views, &None).map_err(|e| ckpt_err(path, encode(e)))?;
    write_synced(path, &bytes)?;
    Ok(hex(&Sha256::digest(&bytes)))
}

/// Keeps the newest `keep` checkpoints under `root` (by step and micro-step) and the one
/// `latest` names; removes the other checkpoint directories. Anything else is left alone.
fn prune(root: &Path, keep: usize, current: &str) -> Result<(), TrainError> {
    if keep == 0 {
        return Ok(());
    }
    let found = checkpoints_in(root)?;
    let excess = found.len().saturating_sub(keep);
    for (_, path) in &found[..excess] {
        if path.file_name().and_then(|n| n.to_str()) == Some(current) {
            continue;
        }
        std::fs::remove_dir_all(path).map_err(io_err(path))?;
    }
    sync_dir(root)
}

/// An encoder's error (JSON, safetensors) as [`CheckpointProblem::Encode`].
fn encode(error: impl std::fmt::Display) -> CheckpointProblem {
    CheckpointProblem::Encode {
        error: error.to_string(),
    }
}
