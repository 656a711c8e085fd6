//! Checkpoints of the engine's whole state, between any two calls — also in the middle of a
//! step.
//!
//! A checkpoint is a directory `step_SSSSSSSS_micro_MMM` under a root, holding
//! `params.safetensors` (HF names and orientation, as `load_parameters_path` reads),
//! `optimizer.safetensors` (AdamW moments `m/<name>`, `v/<name>`), `accumulator.safetensors`
//! (mid-step only: the *reduced* gradient totals `acc/<name>`), and `manifest.json` (format
//! version, config, step, micro-step count, token denominator, mesh, per-tensor shardings, and
//! the SHA-256 of every file). `latest` in the root names the newest checkpoint.
//!
//! Invariants: a checkpoint is written into a hidden temporary directory, every file fsynced,
//! then renamed into place, and only then is `latest` replaced (write + rename) — a crash at any
//! point leaves the previous checkpoint as `latest`, and a partial directory is never named by
//! it. Loading validates everything (version, file names, checksums, dtypes, shapes) and builds
//! the whole state before touching the engine: an error never leaves a half-restored engine.
//!
//! Mid-step: saving reduces the pending accumulator on the way out (one all-reduce per gradient,
//! in trace phase `checkpoint`) and stores the true totals; restoring re-splits them onto the
//! layout the current gate expects (the value on the index-0 device of each `data` group, zeros
//! elsewhere), so the pending reduction reproduces them exactly — whatever mesh or mode the
//! checkpoint came from. The file also keeps every device's own partial block: restored onto
//! the same mesh and layout, each device takes its block back, so the rest of the step sums in
//! the same order as an uninterrupted run and the weights come out bit for bit the same.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use ferrotext_sharding::NamedSharding;
use ferrotext_spmd::Ctx;
use ferrotext_tensor::Tensor;
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::TrainConfig;
use crate::engine::{Engine, PartialGradients, Pending};
use crate::error::TrainError;

/// The manifest format this build writes and the newest it reads.
pub const FORMAT_VERSION: u32 = 1;

/// One tensor of a checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TensorEntry {
    /// The file (within the checkpoint directory).
    pub file: String,
    /// The tensor's name in that file.
    pub name: String,
    /// Its global shape (as stored).
    pub shape: Vec<usize>,
    /// The sharding it had when saved, printed.
    pub sharding: String,
}

/// `manifest.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    /// Format version (see [`FORMAT_VERSION`]).
    pub format_version: u32,
    /// The config of the run that saved it.
    pub config: TrainConfig,
    /// Optimizer steps completed.
    pub step: usize,
    /// Micro-batches accumulated since the last update (0 at a step boundary).
    pub micro_steps: usize,
    /// Target tokens of those micro-batches (the pending division's denominator).
    pub token_denominator: u64,
    /// Σ loss of those micro-batches.
    pub pending_loss_sum: f64,
    /// AdamW's step count (0 for SGD).
    pub optimizer_steps: u64,
    /// The mesh it was saved from, printed.
    pub mesh: String,
    /// The deferral gate's decision at save time.
    pub deferral: String,
    /// The accumulator's types at save time (mid-step only), printed.
    #[serde(default)]
    pub accumulator_types: Vec<String>,
    /// Every tensor.
    pub tensors: Vec<TensorEntry>,
    /// SHA-256 (hex) of every file.
    pub files: BTreeMap<String, String>,
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn ckpt_err(path: &Path, reason: impl Into<String>) -> TrainError {
    TrainError::Checkpoint {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}

fn hf_transposed(name: &str) -> bool {
    name.ends_with("_proj.weight") || name == "lm_head.weight"
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
        .map_err(|e| ckpt_err(path, e.to_string()))?;
    let bytes = safetensors::serialize(views, &None).map_err(|e| ckpt_err(path, e.to_string()))?;
    write_synced(path, &bytes)?;
    Ok(hex(&Sha256::digest(&bytes)))
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    let mut f = std::fs::File::create(path).map_err(io_err(path))?;
    f.write_all(bytes).map_err(io_err(path))?;
    f.sync_all().map_err(io_err(path))
}

fn sync_dir(path: &Path) -> Result<(), TrainError> {
    std::fs::File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(io_err(path))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The directory a checkpoint path means: a checkpoint directory itself, or a root whose
/// `latest` names one.
///
/// # Errors
/// Neither a checkpoint nor a root with `latest`.
pub fn resolve(path: &Path) -> Result<PathBuf, TrainError> {
    if path.join("manifest.json").is_file() {
        return Ok(path.to_path_buf());
    }
    let latest = path.join("latest");
    let name = std::fs::read_to_string(&latest).map_err(|_| {
        ckpt_err(
            path,
            "no manifest.json and no `latest` here: not a checkpoint",
        )
    })?;
    let name = name.trim();
    if !is_plain_name(name) {
        return Err(ckpt_err(
            &latest,
            format!("names `{name}`, which is outside its directory"),
        ));
    }
    Ok(path.join(name))
}

/// A file name that stays inside its directory.
fn is_plain_name(name: &str) -> bool {
    !name.is_empty()
        && !name.contains(['/', '\\'])
        && name != "."
        && name != ".."
        && !name.starts_with('.')
}

/// The newest checkpoint under `root`, if any.
pub fn latest(root: &Path) -> Option<PathBuf> {
    resolve(root)
        .ok()
        .filter(|p| p.join("manifest.json").is_file())
}

/// Everything a checkpoint holds, validated, before it touches an engine.
struct Loaded {
    manifest: Manifest,
    params: Vec<Tensor>,
    moments: Option<(Vec<Tensor>, Vec<Tensor>)>,
    accumulator: Option<Vec<Tensor>>,
    /// Per device, per parameter: the partial blocks (present for mid-step checkpoints).
    partials: Option<Vec<Vec<Tensor>>>,
}

fn read_verified(dir: &Path, manifest: &Manifest, file: &str) -> Result<Vec<u8>, TrainError> {
    if !is_plain_name(file) {
        return Err(ckpt_err(
            &dir.join("manifest.json"),
            format!("points outside its directory: `{file}`"),
        ));
    }
    let path = dir.join(file);
    let bytes = std::fs::read(&path).map_err(|e| ckpt_err(&path, format!("cannot read: {e}")))?;
    let want = manifest
        .files
        .get(file)
        .ok_or_else(|| ckpt_err(&path, "is not listed in the manifest"))?;
    if &hex(&Sha256::digest(&bytes)) != want {
        return Err(ckpt_err(
            &path,
            "checksum mismatch: the file is corrupt or was modified",
        ));
    }
    Ok(bytes)
}

fn tensor(
    path: &Path,
    file: &SafeTensors<'_>,
    name: &str,
    shape: &[usize],
) -> Result<Tensor, TrainError> {
    let view = file
        .tensor(name)
        .map_err(|_| ckpt_err(path, format!("has no tensor `{name}`")))?;
    if view.dtype() != Dtype::F32 {
        return Err(ckpt_err(
            path,
            format!("`{name}` is {:?}, expected F32", view.dtype()),
        ));
    }
    if view.shape() != shape {
        return Err(ckpt_err(
            path,
            format!(
                "`{name}` has shape {:?}, the model needs {shape:?}",
                view.shape()
            ),
        ));
    }
    let data = view
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok(Tensor::new(shape.to_vec(), data)?)
}

impl Engine {
    fn mesh_description(&self) -> String {
        self.promised
            .first()
            .map_or_else(String::new, |t| t.mesh().to_string())
    }

    fn device_count(&self) -> usize {
        self.promised.first().map_or(1, |t| t.mesh().device_count())
    }

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

    /// [`Engine::save_checkpoint`] calling `after_file(name)` after each file is written — the
    /// test hook for injecting a failure at every point of a save.
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

    fn save_inner(
        &self,
        cx: &mut Ctx<'_>,
        root: &Path,
        after_file: &dyn Fn(&str) -> std::io::Result<()>,
    ) -> Result<PathBuf, TrainError> {
        // 1. gather everything (every device)
        let params: Vec<Tensor> = self
            .params
            .iter()
            .map(|p| cx.to_host(p))
            .collect::<Result<_, _>>()?;
        let moments = match self.opt.moments() {
            Some((m, v, t)) => {
                let mut gm = Vec::with_capacity(m.len());
                let mut gv = Vec::with_capacity(v.len());
                for (ty, (mi, vi)) in self.moment_types.iter().zip(m.iter().zip(v)) {
                    gm.push(cx.to_host(&cx.from_local(ty.clone(), mi.clone())?)?);
                    gv.push(cx.to_host(&cx.from_local(ty.clone(), vi.clone())?)?);
                }
                Some((gm, gv, t))
            }
            None => None,
        };
        let all_axes: Vec<String> = cx.mesh().axis_names().map(str::to_string).collect();
        let pending = match &self.pending {
            Some(p) => {
                // The reduction `update` would have done, on a copy: the live accumulator stays
                // partial.
                let mut totals = Vec::with_capacity(p.acc.grads.len());
                for (g, spec) in p.acc.grads.iter().zip(&self.plain) {
                    let reduced = cx.reshard(g, spec)?;
                    totals.push(cx.to_host(&reduced)?);
                }
                // Every device's own partial block too, so a restore onto the same mesh and gate
                // continues bit for bit (the sum's association is kept).
                let mut partials = Vec::with_capacity(p.acc.grads.len());
                for g in &p.acc.grads {
                    let local = g.local()?;
                    let n = cx.mesh().device_count();
                    let mut all = vec![0.0f32; local.len() * n];
                    cx.comm().all_gather(&all_axes, local.data(), &mut all)?;
                    partials.push((local.shape().to_vec(), all));
                }
                Some((totals, p.micro_steps, p.tokens, p.loss_sum, partials))
            }
            None => None,
        };
        // 2. device 0 writes: temporary directory, fsync, rename, then `latest`
        let micro = pending.as_ref().map_or(0, |p| p.1);
        let name = format!("step_{:08}_micro_{micro:03}", self.step);
        let final_dir = root.join(&name);
        if cx.device() == 0 {
            std::fs::create_dir_all(root).map_err(io_err(root))?;
            let tmp = root.join(format!(".tmp_{name}_{}", std::process::id()));
            if tmp.exists() {
                std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
            }
            std::fs::create_dir_all(&tmp).map_err(io_err(&tmp))?;
            let mut files = BTreeMap::new();
            let mut tensors = Vec::new();
            let mut entry = |file: &str, name: String, t: &Tensor, sharding: String| {
                tensors.push(TensorEntry {
                    file: file.into(),
                    name,
                    shape: t.shape().to_vec(),
                    sharding,
                });
            };
            let stored_params: Vec<(String, Tensor)> = self
                .infos
                .iter()
                .zip(&params)
                .map(|(info, t)| {
                    Ok((
                        info.name.clone(),
                        if hf_transposed(&info.name) {
                            t.transpose(&[1, 0])?
                        } else {
                            t.clone()
                        },
                    ))
                })
                .collect::<Result<_, TrainError>>()?;
            for ((n, t), p) in stored_params.iter().zip(&self.params) {
                entry("params.safetensors", n.clone(), t, p.ty().to_string());
            }
            files.insert(
                "params.safetensors".to_string(),
                write_tensors(&tmp.join("params.safetensors"), &stored_params)?,
            );
            after_file("params.safetensors").map_err(io_err(&tmp))?;
            let mut optimizer_steps = 0;
            if let Some((m, v, t)) = &moments {
                optimizer_steps = *t;
                let mut stored = Vec::new();
                for (info, (mi, vi)) in self.infos.iter().zip(m.iter().zip(v)) {
                    stored.push((format!("m/{}", info.name), mi.clone()));
                    stored.push((format!("v/{}", info.name), vi.clone()));
                }
                for (n, t) in &stored {
                    entry("optimizer.safetensors", n.clone(), t, "replicated".into());
                }
                files.insert(
                    "optimizer.safetensors".to_string(),
                    write_tensors(&tmp.join("optimizer.safetensors"), &stored)?,
                );
                after_file("optimizer.safetensors").map_err(io_err(&tmp))?;
            }
            let (mut token_denominator, mut pending_loss_sum) = (0, 0.0);
            if let Some((totals, _, tokens, loss, partials)) = &pending {
                token_denominator = *tokens;
                pending_loss_sum = *loss;
                let mut stored: Vec<(String, Tensor)> = self
                    .infos
                    .iter()
                    .zip(totals)
                    .map(|(i, t)| (format!("acc/{}", i.name), t.clone()))
                    .collect();
                let devices = cx.mesh().device_count();
                for (info, (shape, all)) in self.infos.iter().zip(partials) {
                    let block = all.len() / devices.max(1);
                    for d in 0..devices {
                        let t =
                            Tensor::new(shape.clone(), all[d * block..(d + 1) * block].to_vec())?;
                        stored.push((format!("partial/{d}/{}", info.name), t));
                    }
                }
                for (n, t) in &stored {
                    entry(
                        "accumulator.safetensors",
                        n.clone(),
                        t,
                        "reduced total".into(),
                    );
                }
                files.insert(
                    "accumulator.safetensors".to_string(),
                    write_tensors(&tmp.join("accumulator.safetensors"), &stored)?,
                );
                after_file("accumulator.safetensors").map_err(io_err(&tmp))?;
            }
            let manifest = Manifest {
                format_version: FORMAT_VERSION,
                config: self.config.clone(),
                step: self.step,
                micro_steps: micro,
                token_denominator,
                pending_loss_sum,
                optimizer_steps,
                mesh: self.mesh_description(),
                accumulator_types: self
                    .pending
                    .as_ref()
                    .map(|p| p.acc.grads.iter().map(|g| g.ty().to_string()).collect())
                    .unwrap_or_default(),
                deferral: self.gate.describe(),
                tensors,
                files,
            };
            let json =
                serde_json::to_vec_pretty(&manifest).map_err(|e| ckpt_err(&tmp, e.to_string()))?;
            write_synced(&tmp.join("manifest.json"), &json)?;
            after_file("manifest.json").map_err(io_err(&tmp))?;
            sync_dir(&tmp)?;
            if final_dir.exists() {
                std::fs::remove_dir_all(&final_dir).map_err(io_err(&final_dir))?;
            }
            std::fs::rename(&tmp, &final_dir).map_err(io_err(&final_dir))?;
            sync_dir(root)?;
            let latest_tmp = root.join(".latest.tmp");
            write_synced(&latest_tmp, name.as_bytes())?;
            std::fs::rename(&latest_tmp, root.join("latest")).map_err(io_err(root))?;
            sync_dir(root)?;
            after_file("latest").map_err(io_err(root))?;
        }
        // Nobody reads or overwrites the checkpoint before it is complete.
        let all_axes: Vec<String> = cx.mesh().axis_names().map(str::to_string).collect();
        cx.comm().barrier(&all_axes)?;
        Ok(final_dir)
    }

    fn load(&self, dir: &Path) -> Result<Loaded, TrainError> {
        let manifest_path = dir.join("manifest.json");
        let text = std::fs::read(&manifest_path)
            .map_err(|e| ckpt_err(&manifest_path, format!("cannot read: {e}")))?;
        let manifest: Manifest = serde_json::from_slice(&text)
            .map_err(|e| ckpt_err(&manifest_path, format!("not a manifest: {e}")))?;
        if manifest.format_version > FORMAT_VERSION {
            return Err(ckpt_err(
                &manifest_path,
                format!(
                    "format version {} is newer than this ferrotext reads ({FORMAT_VERSION})",
                    manifest.format_version
                ),
            ));
        }
        for file in manifest
            .files
            .keys()
            .chain(manifest.tensors.iter().map(|t| &t.file))
        {
            if !is_plain_name(file) {
                return Err(ckpt_err(
                    &manifest_path,
                    format!("points outside its directory: `{file}`"),
                ));
            }
        }
        let bytes = read_verified(dir, &manifest, "params.safetensors")?;
        let path = dir.join("params.safetensors");
        let file = SafeTensors::deserialize(&bytes)
            .map_err(|e| ckpt_err(&path, format!("not a safetensors file: {e}")))?;
        let mut params = Vec::with_capacity(self.infos.len());
        for info in &self.infos {
            let mut shape = info.shape.clone();
            if hf_transposed(&info.name) {
                shape.reverse();
            }
            let t = tensor(&path, &file, &info.name, &shape)?;
            params.push(if hf_transposed(&info.name) {
                t.transpose(&[1, 0])?
            } else {
                t
            });
        }
        let moments = if self.opt.moments().is_some()
            && manifest.files.contains_key("optimizer.safetensors")
        {
            let bytes = read_verified(dir, &manifest, "optimizer.safetensors")?;
            let path = dir.join("optimizer.safetensors");
            let file = SafeTensors::deserialize(&bytes)
                .map_err(|e| ckpt_err(&path, format!("not a safetensors file: {e}")))?;
            let mut m = Vec::new();
            let mut v = Vec::new();
            for info in &self.infos {
                m.push(tensor(
                    &path,
                    &file,
                    &format!("m/{}", info.name),
                    &info.shape,
                )?);
                v.push(tensor(
                    &path,
                    &file,
                    &format!("v/{}", info.name),
                    &info.shape,
                )?);
            }
            Some((m, v))
        } else {
            None
        };
        let (accumulator, partials) = if manifest.micro_steps > 0 {
            let bytes = read_verified(dir, &manifest, "accumulator.safetensors")?;
            let path = dir.join("accumulator.safetensors");
            let file = SafeTensors::deserialize(&bytes)
                .map_err(|e| ckpt_err(&path, format!("not a safetensors file: {e}")))?;
            let totals = self
                .infos
                .iter()
                .map(|i| tensor(&path, &file, &format!("acc/{}", i.name), &i.shape))
                .collect::<Result<Vec<_>, _>>()?;
            // Partial blocks are only usable on the mesh and layout they came from.
            let same_layout = manifest.mesh == self.mesh_description()
                && manifest.accumulator_types
                    == self
                        .promised
                        .iter()
                        .map(|t| t.to_string())
                        .collect::<Vec<_>>();
            let partials = if same_layout {
                let devices = self.device_count();
                let mut per_device = Vec::with_capacity(devices);
                for d in 0..devices {
                    let mut blocks = Vec::with_capacity(self.infos.len());
                    for (info, t) in self.infos.iter().zip(&self.promised) {
                        blocks.push(tensor(
                            &path,
                            &file,
                            &format!("partial/{d}/{}", info.name),
                            &t.shard_shape(),
                        )?);
                    }
                    per_device.push(blocks);
                }
                Some(per_device)
            } else {
                None
            };
            (Some(totals), partials)
        } else {
            (None, None)
        };
        Ok(Loaded {
            manifest,
            params,
            moments,
            accumulator,
            partials,
        })
    }

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
        // Build the new state completely, then swap it in.
        let mut params = Vec::with_capacity(loaded.params.len());
        for (value, spec) in loaded.params.iter().zip(&self.plain) {
            params
                .push(cx.from_global(value, NamedSharding::new(cx.mesh().clone(), spec.clone())?)?);
        }
        let moments = match &loaded.moments {
            Some((m, v)) => {
                let shard = |cx: &Ctx<'_>,
                             t: &Tensor,
                             ty: &ferrotext_sharding::ArrayType|
                 -> Result<Tensor, TrainError> {
                    Ok(cx.from_global(t, ty.sharding().clone())?.local()?.clone())
                };
                let mut lm = Vec::new();
                let mut lv = Vec::new();
                for ((mi, vi), ty) in m.iter().zip(v).zip(&self.moment_types) {
                    lm.push(shard(cx, mi, ty)?);
                    lv.push(shard(cx, vi, ty)?);
                }
                Some((lm, lv))
            }
            None => None,
        };
        let pending = match &loaded.accumulator {
            Some(totals) => {
                // Re-split each total onto the layout the current gate promises: plain → U puts
                // the value on the index-0 device and zeros elsewhere, so the pending reduction
                // gives the total back exactly.
                let mut grads = Vec::with_capacity(totals.len());
                match &loaded.partials {
                    // Same mesh and layout: every device takes back its own partial block.
                    Some(per_device) => {
                        for (block, promised) in per_device[cx.device()].iter().zip(&self.promised)
                        {
                            grads.push(cx.from_local(promised.clone(), block.clone())?);
                        }
                    }
                    None => {
                        for ((t, spec), promised) in
                            totals.iter().zip(&self.plain).zip(&self.promised)
                        {
                            let plain = cx.from_global(
                                t,
                                NamedSharding::new(cx.mesh().clone(), spec.clone())?,
                            )?;
                            grads.push(cx.reshard(&plain, promised.sharding().spec())?);
                        }
                    }
                }
                let mut used = Vec::with_capacity(params.len());
                for (p, spec) in params.iter().zip(&self.inside) {
                    used.push(if p.ty().sharding().spec() == spec {
                        p.clone()
                    } else {
                        cx.reshard(p, spec)?
                    });
                }
                Some(Pending {
                    used,
                    acc: PartialGradients {
                        grads,
                        plan: self.reduce_plan.clone(),
                    },
                    loss_sum: loaded.manifest.pending_loss_sum,
                    tokens: loaded.manifest.token_denominator,
                    micro_steps: loaded.manifest.micro_steps,
                    started: Instant::now(),
                })
            }
            None => None,
        };
        if let Some((m, v)) = moments {
            self.opt
                .set_moments(m, v, loaded.manifest.optimizer_steps)?;
        }
        self.params = params;
        self.pending = pending;
        self.step = loaded.manifest.step;
        Ok(self.step)
    }
}
