//! Parameter files and metrics.
//!
//! Parameters are safetensors with HF-Qwen3 names and HF orientation: linear weights
//! (`*_proj.weight`, `lm_head.weight`) are stored `[out, in]` as HF stores them and transposed
//! to ferrotext's `[in, out]` on load (and back on save); embeddings and norm scales as they are.
//! So a checkpoint made with `transformers` for the same dims loads here, and ours load there.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use ferrotext_models::ParamInfo;
use ferrotext_tensor::Tensor;
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

use crate::engine::StepMetrics;
use crate::error::TrainError;

fn hf_transposed(name: &str) -> bool {
    name.ends_with("_proj.weight") || name == "lm_head.weight"
}

/// Loads every parameter of `infos` from a safetensors file.
///
/// # Errors
/// [`TrainError::Params`] naming the file and the problem: unreadable, not safetensors, a missing
/// tensor, a dtype other than F32, or a shape that does not fit the model.
pub fn load_parameters(path: &Path, infos: &[ParamInfo]) -> Result<Vec<Tensor>, TrainError> {
    let err = |reason: String| TrainError::Params {
        path: path.display().to_string(),
        reason,
    };
    let bytes = std::fs::read(path).map_err(|e| err(format!("cannot read: {e}")))?;
    let file = SafeTensors::deserialize(&bytes)
        .map_err(|e| err(format!("not a safetensors file: {e}")))?;
    infos
        .iter()
        .map(|info| {
            let view = file
                .tensor(&info.name)
                .map_err(|_| err(format!("missing tensor `{}`", info.name)))?;
            if view.dtype() != Dtype::F32 {
                return Err(err(format!(
                    "`{}` is {:?}; only F32 is supported",
                    info.name,
                    view.dtype()
                )));
            }
            let data: Vec<f32> = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            let mut shape = info.shape.clone();
            if hf_transposed(&info.name) {
                shape.reverse();
            }
            if view.shape() != shape.as_slice() {
                return Err(err(format!(
                    "`{}` has shape {:?}, the model needs {:?}",
                    info.name,
                    view.shape(),
                    shape
                )));
            }
            let t = Tensor::new(shape, data).map_err(|e| err(e.to_string()))?;
            if hf_transposed(&info.name) {
                t.transpose(&[1, 0]).map_err(|e| err(e.to_string()))
            } else {
                Ok(t)
            }
        })
        .collect()
}

/// Saves parameters to a safetensors file (written to a temporary name, then renamed).
///
/// # Errors
/// [`TrainError::Io`] when writing fails.
pub fn save_parameters(
    path: &Path,
    infos: &[ParamInfo],
    values: &[Tensor],
) -> Result<(), TrainError> {
    let io = |source: std::io::Error| TrainError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut stored = Vec::with_capacity(values.len());
    for (info, v) in infos.iter().zip(values) {
        let t = if hf_transposed(&info.name) {
            v.transpose(&[1, 0])?
        } else {
            v.clone()
        };
        let bytes: Vec<u8> = t.data().iter().flat_map(|x| x.to_le_bytes()).collect();
        stored.push((info.name.clone(), t.shape().to_vec(), bytes));
    }
    let views: Vec<(String, TensorView<'_>)> = stored
        .iter()
        .map(|(n, s, b)| TensorView::new(Dtype::F32, s.clone(), b).map(|v| (n.clone(), v)))
        .collect::<Result<_, _>>()
        .map_err(|e| TrainError::Params {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
    let meta: Option<HashMap<String, String>> =
        Some([("format".to_string(), "pt".to_string())].into());
    let bytes = safetensors::serialize(views, &meta).map_err(|e| TrainError::Params {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let tmp = path.with_extension("safetensors.tmp");
    let mut f = std::fs::File::create(&tmp).map_err(io)?;
    f.write_all(&bytes).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

/// Appends one JSON line per step.
///
/// # Errors
/// [`TrainError::Io`] when the file cannot be written.
pub fn write_metrics(path: &Path, metrics: &[StepMetrics]) -> Result<(), TrainError> {
    let io = |source: std::io::Error| TrainError::Io {
        path: path.display().to_string(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let mut out = String::new();
    for m in metrics {
        out.push_str(&serde_json::to_string(m).unwrap_or_default());
        out.push('\n');
    }
    std::fs::write(path, out).map_err(io)
}
