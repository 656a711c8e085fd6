//! Writing a HF directory: `config.json`, and every parameter as the HF tensors it declares,
//! sharded with an index above a size threshold.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use ferrotext_models::decoder::Config;
use ferrotext_models::ParamInfo;
use ferrotext_sharding::DType;
use ferrotext_tensor::Tensor;
use safetensors::tensor::{Dtype, TensorView};

use super::{hf_config_json, ModelType, CONFIG_FILE, INDEX_FILE, SINGLE_FILE};
use crate::declared::Declared;
use crate::error::HfError;

/// HF's default `max_shard_size` (5 GB): above it, weights are split into shards.
pub const DEFAULT_SHARD_BYTES: u64 = 5_000_000_000;

/// A dtype the tensors are written in, checked once: `float32` (exact) or `bfloat16` (rounded to
/// nearest even: half the bytes, 8 bits of mantissa).
#[derive(Clone, Copy)]
struct Stored {
    file: Dtype,
}

impl Stored {
    /// `None` for a dtype an export does not write.
    fn new(dtype: DType) -> Option<Stored> {
        let file = match dtype {
            DType::F32 => Dtype::F32,
            DType::BF16 => Dtype::BF16,
            _ => return None,
        };
        Some(Stored { file })
    }

    /// How the checkpoint tensor `name` of a `kind` model is stored: float32 where the family's
    /// `save_pretrained` keeps it so ([`ModelType::keeps_f32`]), else this dtype.
    fn of_tensor(self, kind: ModelType, name: &str) -> Stored {
        if kind.keeps_f32(name) {
            Stored { file: Dtype::F32 }
        } else {
            self
        }
    }

    /// Bytes an element.
    fn size_bytes(self) -> usize {
        self.file.size()
    }

    /// `values` as little-endian bytes of this dtype.
    fn encode(self, values: &[f32]) -> Vec<u8> {
        match self.file {
            Dtype::BF16 => values
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
            _ => values.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
}

/// Writes the HF directory `dir`: `config.json` for `cfg`'s `model_type`, and the parameters
/// (`infos`, `values` in the same order) as HF tensors of `dtype` (float32 where the family's own
/// `save_pretrained` keeps a tensor so: DeepSeek's routers) — one `model.safetensors`, or
/// shards of at most `shard_bytes` each (a larger single tensor gets a shard of its own) with
/// `model.safetensors.index.json`. A `deepseek_v3` directory also gets each router's zero
/// `mlp.gate.e_score_correction_bias`, which HF's model expects. Written to a temporary
/// directory and renamed into place; an existing `dir` is replaced only if it holds a
/// `config.json` (a model directory).
///
/// # Errors
/// [`HfError::Params`] when `dtype` is neither float32 nor bfloat16, no HF `model_type` expresses
/// `cfg`, `dir` exists and is not a model directory, or a value does not fit its parameter;
/// [`HfError::Io`] when writing fails.
/// Nothing is left at `dir` when it fails.
pub fn save_directory(
    dir: &Path,
    cfg: &Config,
    infos: &[ParamInfo],
    values: &[Tensor],
    dtype: DType,
    shard_bytes: u64,
) -> Result<(), HfError> {
    save_directory_declaring(
        dir,
        cfg,
        infos,
        values,
        dtype,
        shard_bytes,
        &Declared::none(),
    )
}

/// [`save_directory`], with what the model's source directory declared beyond the decoder
/// written back: its [`DECLARED_KEYS`](crate::DECLARED_KEYS) over the family's `config.json`,
/// and its [`DECLARED_FILES`](crate::DECLARED_FILES): `generation_config.json` and the
/// tokenizer ([`Declared`]).
///
/// # Errors
/// As [`save_directory`].
pub fn save_directory_declaring(
    dir: &Path,
    cfg: &Config,
    infos: &[ParamInfo],
    values: &[Tensor],
    dtype: DType,
    shard_bytes: u64,
    declared: &Declared,
) -> Result<(), HfError> {
    let err = |reason: String| HfError::Params {
        path: dir.display().to_string(),
        reason,
    };
    let written_as = Stored::new(dtype).ok_or_else(|| {
        err(format!(
            "tensors are saved as float32 or bfloat16, not {}",
            dtype.name()
        ))
    })?;
    // `torch_dtype` takes the long name (`bfloat16`).
    let config = declared.applied_to(hf_config_json(cfg, dtype.name()).map_err(err)?);
    if infos.len() != values.len() {
        return Err(err(format!(
            "{} values for {} parameters",
            values.len(),
            infos.len()
        )));
    }
    if dir.exists() && !dir.join(CONFIG_FILE).is_file() {
        return Err(err(
            "exists and is not a model directory (no config.json): not replaced".into(),
        ));
    }
    let kind = ModelType::of(cfg).map_err(err)?;
    // 1. which shard each HF tensor goes to, from the shapes alone
    let mut shard_of = Vec::new();
    let (mut shard, mut filled, mut total) = (0usize, 0u64, 0u64);
    // The MTP layer's copies of the embedding and head go right after what they copy.
    let copies = ferrotext_models::mtp::stored_copies(infos);
    // (a copy is written in the dtype of what it copies, so it is sized as that)
    let stored = infos.iter().flat_map(|info| {
        info.hf_tensors()
            .into_iter()
            .flat_map(|(name, shape)| {
                let copied = copies
                    .iter()
                    .filter(|c| c.of == name)
                    .map(|_| (name.clone(), shape.clone()))
                    .collect::<Vec<_>>();
                std::iter::once((name.clone(), shape)).chain(copied)
            })
            .chain(selection_bias(kind, info, infos))
    });
    for (name, shape) in stored {
        let name = (kind.family().rename)(&name).unwrap_or(name);
        let size = (shape.iter().product::<usize>()
            * written_as.of_tensor(kind, &name).size_bytes()) as u64;
        if filled > 0 && filled + size > shard_bytes {
            shard += 1;
            filled = 0;
        }
        filled += size;
        total += size;
        shard_of.push(shard);
    }
    let shards = shard + 1;
    let file_name = |s: usize| {
        if shards == 1 {
            SINGLE_FILE.to_string()
        } else {
            format!("model-{:05}-of-{shards:05}.safetensors", s + 1)
        }
    };
    // 2. write into a temporary sibling directory
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source: std::io::Error| HfError::Io {
            path: path.clone(),
            source,
        }
    };
    std::fs::create_dir_all(&parent).map_err(io(&parent))?;
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    let written = write_into(
        &tmp, &config, kind, infos, values, written_as, &shard_of, &file_name, total,
    )
    .and_then(|()| {
        declared.files.iter().try_for_each(|(name, bytes)| {
            let path = tmp.join(name);
            std::fs::write(&path, bytes).map_err(io(&path))
        })
    });
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    // 3. into place: an old model directory moves aside first and goes once the new one is in
    let aside = parent.join(format!(".{name}.old-{}", std::process::id()));
    if dir.exists() {
        std::fs::rename(dir, &aside).map_err(io(dir))?;
    }
    std::fs::rename(&tmp, dir).map_err(io(dir))?;
    if aside.exists() {
        std::fs::remove_dir_all(&aside).map_err(io(&aside))?;
    }
    Ok(())
}

/// Writes `config.json`, the shards and (when sharded) the index into `tmp`.
#[allow(clippy::too_many_arguments)]
fn write_into(
    tmp: &Path,
    config: &serde_json::Value,
    kind: ModelType,
    infos: &[ParamInfo],
    values: &[Tensor],
    stored: Stored,
    shard_of: &[usize],
    file_name: &dyn Fn(usize) -> String,
    total: u64,
) -> Result<(), HfError> {
    let err = |reason: String| HfError::Params {
        path: tmp.display().to_string(),
        reason,
    };
    let io = |path: PathBuf| {
        move |source: std::io::Error| HfError::Io {
            path: path.display().to_string(),
            source,
        }
    };
    let json = serde_json::to_vec_pretty(config).map_err(|e| err(e.to_string()))?;
    std::fs::write(tmp.join(CONFIG_FILE), json).map_err(io(tmp.join(CONFIG_FILE)))?;
    let meta: Option<HashMap<String, String>> =
        Some([("format".to_string(), "pt".to_string())].into());
    let mut weight_map = BTreeMap::new();
    // (name, dtype, shape, bytes) of the shard being filled
    type Pending = Vec<(String, Stored, Vec<usize>, Vec<u8>)>;
    let mut pending: Pending = Vec::new();
    let mut current = 0;
    let mut k = 0;
    let flush = |pending: &mut Pending, s: usize| {
        let path = tmp.join(file_name(s));
        let views = pending
            .iter()
            .map(|(n, as_, shape, b)| {
                TensorView::new(as_.file, shape.clone(), b).map(|v| (n.clone(), v))
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| err(e.to_string()))?;
        safetensors::serialize_to_file(views, &meta, &path).map_err(|e| err(e.to_string()))?;
        pending.clear();
        Ok::<(), HfError>(())
    };
    let copies = ferrotext_models::mtp::stored_copies(infos);
    for (info, value) in infos.iter().zip(values) {
        let mut tensors: Pending = Vec::new();
        for (name, t) in info.to_hf(value).map_err(|e| err(e.to_string()))? {
            // The MTP layer's copies follow what they copy, in its dtype and bytes (value for
            // value equal, as the loader checks them).
            let copied: Vec<String> = copies
                .iter()
                .filter(|c| c.of == name)
                .map(|c| (kind.family().rename)(&c.copy).unwrap_or_else(|| c.copy.clone()))
                .collect();
            let name = (kind.family().rename)(&name).unwrap_or(name);
            let as_ = stored.of_tensor(kind, &name);
            let (shape, bytes) = (t.shape().to_vec(), as_.encode(t.data()));
            let copies_here: Pending = copied
                .into_iter()
                .map(|copy| (copy, as_, shape.clone(), bytes.clone()))
                .collect();
            tensors.push((name, as_, shape, bytes));
            tensors.extend(copies_here);
        }
        if let Some((name, shape)) = selection_bias(kind, info, infos) {
            let zeros = vec![0.0; shape.iter().product()];
            let as_ = stored.of_tensor(kind, &name);
            tensors.push((name, as_, shape, as_.encode(&zeros)));
        }
        for (name, as_, shape, bytes) in tensors {
            let s = shard_of.get(k).copied().unwrap_or(current);
            k += 1;
            if s != current {
                flush(&mut pending, current)?;
                current = s;
            }
            weight_map.insert(name.clone(), file_name(s));
            pending.push((name, as_, shape, bytes));
        }
    }
    flush(&mut pending, current)?;
    if current > 0 {
        let index = serde_json::json!({
            "metadata": { "total_size": total },
            "weight_map": weight_map,
        });
        let json = serde_json::to_vec_pretty(&index).map_err(|e| err(e.to_string()))?;
        std::fs::write(tmp.join(INDEX_FILE), json).map_err(io(tmp.join(INDEX_FILE)))?;
    }
    Ok(())
}

/// The tensor HF stores after `info` that no ferrotext parameter holds (`all`: every
/// parameter): for `deepseek_v3`, each router's selection bias
/// `mlp.gate.e_score_correction_bias` (`[n_routed_experts]`), written as zeros when the model
/// has no such bias (under which both routers pick the same experts); `None` for every other
/// family, and for a model that declares the bias as a parameter.
pub fn selection_bias(
    kind: ModelType,
    info: &ParamInfo,
    all: &[ParamInfo],
) -> Option<(String, Vec<usize>)> {
    (kind.family().extra_tensor)(info, all)
}
