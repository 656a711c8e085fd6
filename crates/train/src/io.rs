//! Parameter files, the metrics log, and the check that a run's outputs can be written.
//!
//! Parameters are safetensors with HF names and HF orientation, as each parameter's
//! [`ParamInfo::hf`] declares: matrices are stored `[out, in]` as HF stores them and transposed
//! to ferrotext's `[in, out]` on load (and back on save), stacked experts are one tensor per
//! expert (`mlp.experts.{e}.gate_proj.weight`), embeddings and norm scales are as they are. So a
//! checkpoint made with `transformers` for the same dims loads here, and ours load there.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use ferrotext_models::ParamInfo;
use ferrotext_tensor::Tensor;
use safetensors::tensor::{Dtype, TensorView};

use crate::engine::StepMetrics;
use crate::error::{OutputProblem, TrainError};

/// Loads every parameter of `infos` from a safetensors file ([`ferrotext_hf::load_file`]) or from
/// a Hugging Face model directory ([`ferrotext_hf::load_directory`]), each from the HF tensors its
/// [`ParamInfo::hf_tensors`] names: F32, BF16 or F16, converted to f32 in one pass.
///
/// # Errors
/// [`TrainError::Params`] naming the file and the problem: unreadable, not a regular file, not
/// safetensors, missing or unexpected tensors, an unsupported dtype, a shape that does not fit
/// the model, a non-finite value.
pub fn load_parameters(path: &Path, infos: &[ParamInfo]) -> Result<Vec<Tensor>, TrainError> {
    let err = |reason: String| TrainError::Params {
        path: path.display().to_string(),
        reason,
    };
    // Only a regular file: a FIFO or a device such as /dev/zero would block or read forever.
    let meta = std::fs::metadata(path).map_err(|e| err(format!("cannot read: {e}")))?;
    if meta.is_dir() {
        return Ok(ferrotext_hf::load_directory(path, infos)?);
    }
    if !meta.is_file() {
        return Err(err("is not a regular file".into()));
    }
    Ok(ferrotext_hf::load_file(path, infos)?)
}

/// Saves parameters to a safetensors file (written to a temporary name, then renamed), each as
/// the HF tensors of its [`ParamInfo::to_hf`] (HF names and orientation, experts unstacked).
///
/// # Errors
/// [`TrainError::Io`] when writing fails; [`TrainError::Params`] when a value does not have its
/// parameter's shape.
pub fn save_parameters(
    path: &Path,
    infos: &[ParamInfo],
    values: &[Tensor],
) -> Result<(), TrainError> {
    let io = |source: std::io::Error| TrainError::Io {
        path: path.display().to_string(),
        source,
    };
    let params_err = |reason: String| TrainError::Params {
        path: path.display().to_string(),
        reason,
    };
    let mut stored = Vec::with_capacity(values.len());
    for (info, v) in infos.iter().zip(values) {
        for (name, t) in info.to_hf(v).map_err(|e| params_err(e.to_string()))? {
            let bytes: Vec<u8> = t.data().iter().flat_map(|x| x.to_le_bytes()).collect();
            stored.push((name, t.shape().to_vec(), bytes));
        }
    }
    let views: Vec<(String, TensorView<'_>)> = stored
        .iter()
        .map(|(n, s, b)| TensorView::new(Dtype::F32, s.clone(), b).map(|v| (n.clone(), v)))
        .collect::<Result<_, _>>()
        .map_err(|e| params_err(e.to_string()))?;
    let meta: Option<HashMap<String, String>> =
        Some([("format".to_string(), "pt".to_string())].into());
    let bytes = safetensors::serialize(views, &meta).map_err(|e| params_err(e.to_string()))?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let tmp = path.with_extension("safetensors.tmp");
    let mut f = std::fs::File::create(&tmp).map_err(io)?;
    f.write_all(&bytes).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

/// True when `save_parameters_path` names a Hugging Face directory rather than one file: every
/// path that does not end in `.safetensors`.
pub fn saves_directory(path: &Path) -> bool {
    path.extension().is_none_or(|e| e != "safetensors")
}

/// Saves the final parameters where `config.save_parameters_path` says: a `.safetensors` path is
/// one file (F32), any other path a Hugging Face model directory of `save_parameters_dtype`
/// ([`ferrotext_hf::save_directory_declaring`], sharded above
/// [`ferrotext_hf::DEFAULT_SHARD_BYTES`], declaring what the model's source directory declared).
///
/// # Errors
/// As [`save_parameters`] and [`ferrotext_hf::save_directory`]; the source directory's
/// declarations cannot be read.
pub fn save_final_parameters(
    config: &crate::TrainConfig,
    infos: &[ParamInfo],
    values: &[Tensor],
) -> Result<(), TrainError> {
    let path = Path::new(&config.save_parameters_path);
    if !saves_directory(path) {
        return save_parameters(path, infos, values);
    }
    Ok(ferrotext_hf::save_directory_declaring(
        path,
        &config.model()?,
        infos,
        values,
        config.save_parameters_dtype,
        ferrotext_hf::DEFAULT_SHARD_BYTES,
        &config.source_declarations()?,
    )?)
}

/// The per-step metrics file, one JSON line per step, appended and flushed as each step ends, so
/// a run that is killed or fails keeps every step it finished.
///
/// Opened for a run that starts at step `s` (0, or the step a resume continues from), it keeps
/// the lines of steps before `s` and drops the rest (steps a killed run logged after its last
/// checkpoint, which the resumed run repeats), so the file never holds a step twice.
pub struct MetricsLog {
    path: std::path::PathBuf,
    file: std::fs::File,
}

impl MetricsLog {
    /// Opens `path` for a run starting at step `first_step` (see the type's docs); the kept
    /// lines are rewritten through a temporary file and a rename.
    ///
    /// # Errors
    /// [`TrainError::Io`] when the file or its directory cannot be written.
    pub fn open(path: &Path, first_step: usize) -> Result<MetricsLog, TrainError> {
        let io = |source: std::io::Error| TrainError::Io {
            path: path.display().to_string(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let kept: String = match ferrotext_files::read_regular_to_string(path) {
            Ok(old) => metrics_steps(&old)
                .map_err(|problem| TrainError::Output {
                    key: "metrics_file",
                    path: path.display().to_string(),
                    problem,
                })?
                .into_iter()
                .filter(|(step, _)| *step < first_step)
                .map(|(_, line)| format!("{line}\n"))
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(io(e)),
        };
        let tmp = path.with_extension("jsonl.tmp");
        std::fs::write(&tmp, kept).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(io)?;
        Ok(MetricsLog {
            path: path.to_path_buf(),
            file,
        })
    }

    /// Appends one step's line and flushes it to the OS.
    ///
    /// # Errors
    /// [`TrainError::Io`] when the write fails.
    pub fn append(&mut self, metrics: &StepMetrics) -> Result<(), TrainError> {
        let mut line = serde_json::to_string(metrics).map_err(|e| TrainError::Io {
            path: self.path.display().to_string(),
            source: e.into(),
        })?;
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .and_then(|()| self.file.flush())
            .map_err(|source| TrainError::Io {
                path: self.path.display().to_string(),
                source,
            })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The step of each line of a metrics file's `text`, with the line: every line must be a JSON
/// object with an integer `step` (blank lines aside), except a last line with no newline after
/// it — a write a kill cut off, which is dropped. Anything else means the file is not a metrics
/// file (a path given by mistake), and it is refused rather than rewritten.
fn metrics_steps(text: &str) -> Result<Vec<(usize, &str)>, OutputProblem> {
    let mut steps = Vec::new();
    let cut_off = !text.is_empty() && !text.ends_with('\n');
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let step = serde_json::from_str::<serde_json::Value>(line)
            .ok()
            .and_then(|v| v.get("step").and_then(serde_json::Value::as_u64));
        match step {
            Some(step) => steps.push((usize::try_from(step).unwrap_or(usize::MAX), *line)),
            None if cut_off && i + 1 == lines.len() => {}
            None => return Err(OutputProblem::NotAMetricsFile { line: i + 1 }),
        }
    }
    Ok(steps)
}

/// The longest file-name component Linux file systems accept (`NAME_MAX`).
const NAME_MAX: usize = 255;

/// Checks, before a run starts and without leaving anything behind, that every output of
/// `config` can be written: the metrics file, the final parameters, and the checkpoint directory.
/// Each must be of the right kind where it already exists (a file is not a directory, nor the
/// reverse), have no name component longer than the file system allows, and its nearest existing
/// directory must accept a new file (probed by creating and removing one, so read-only mounts,
/// `/proc` and the like are found even by root).
///
/// # Errors
/// [`TrainError::Output`] naming the key, the path and the problem.
pub fn check_output_paths(config: &crate::TrainConfig) -> Result<(), TrainError> {
    let mut outputs = vec![("metrics_file", config.metrics_path(), false)];
    if !config.save_parameters_path.is_empty() {
        let path = std::path::PathBuf::from(&config.save_parameters_path);
        let is_dir = saves_directory(&path);
        // A model directory is replaced whole, so an existing one must be a model directory.
        if is_dir && path.exists() && !path.join(ferrotext_hf::CONFIG_FILE).is_file() {
            return Err(TrainError::Output {
                key: "save_parameters_path",
                path: path.display().to_string(),
                problem: OutputProblem::NotAModelDirectory,
            });
        }
        outputs.push(("save_parameters_path", path, is_dir));
    }
    if config.enable_checkpointing {
        outputs.push((
            "base_output_directory/run_name",
            config.checkpoint_root(),
            true,
        ));
    }
    for (key, path, is_dir) in outputs {
        check_output(&path, is_dir).map_err(|problem| TrainError::Output {
            key,
            path: path.display().to_string(),
            problem,
        })?;
    }
    // The metrics file is rewritten at start (the steps a resume repeats dropped): an existing
    // file must be a metrics file.
    let metrics = config.metrics_path();
    match ferrotext_files::read_regular_to_string(&metrics) {
        Ok(text) => {
            metrics_steps(&text).map_err(|problem| TrainError::Output {
                key: "metrics_file",
                path: metrics.display().to_string(),
                problem,
            })?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
            return Err(TrainError::Output {
                key: "metrics_file",
                path: metrics.display().to_string(),
                problem: OutputProblem::NotAMetricsFile { line: 1 },
            })
        }
        Err(_) => {} // absent, or unreadable: opening it says so with the OS's reason
    }
    Ok(())
}

/// Checks, as [`check_output_paths`] checks a run's outputs, that `path` can be created or
/// replaced as a file (`is_dir`: a directory), for a command's output named by `key` (a flag or
/// an argument, such as `OUT_DIR`); nothing is left behind.
///
/// # Errors
/// [`TrainError::Output`] naming `key`, the path and the problem.
pub fn check_output_path(key: &'static str, path: &Path, is_dir: bool) -> Result<(), TrainError> {
    check_output(path, is_dir).map_err(|problem| TrainError::Output {
        key,
        path: path.display().to_string(),
        problem,
    })
}

/// `path` can be created or replaced as a file (`is_dir`: a directory).
fn check_output(path: &Path, is_dir: bool) -> Result<(), OutputProblem> {
    if let Some(long) = path
        .components()
        .map(|c| c.as_os_str().len())
        .find(|&n| n > NAME_MAX)
    {
        return Err(OutputProblem::NameTooLong {
            bytes: long,
            max: NAME_MAX,
        });
    }
    if path.as_os_str().is_empty() {
        return Err(OutputProblem::Empty);
    }
    match std::fs::metadata(path) {
        Ok(meta) if is_dir && !meta.is_dir() => return Err(OutputProblem::NotADirectory),
        Ok(meta) if !is_dir && meta.is_dir() => return Err(OutputProblem::IsADirectory),
        Ok(meta) if !is_dir && !meta.is_file() => return Err(OutputProblem::NotARegularFile),
        _ => {}
    }
    // The nearest existing ancestor (the path itself for an existing directory) must be a
    // directory that accepts a new file.
    let mut dir = if is_dir {
        path.to_path_buf()
    } else {
        path.parent().map(Path::to_path_buf).unwrap_or_default()
    };
    loop {
        let shown = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir.as_path()
        };
        match std::fs::metadata(shown) {
            Ok(meta) if meta.is_dir() => return probe_writable(shown),
            Ok(_) => {
                return Err(OutputProblem::AncestorNotADirectory {
                    ancestor: shown.display().to_string(),
                })
            }
            Err(_) if dir.pop() => continue,
            Err(_) => return probe_writable(Path::new(".")),
        }
    }
}

/// Creates and removes a uniquely named empty file in `dir`.
fn probe_writable(dir: &Path) -> Result<(), OutputProblem> {
    let probe = dir.join(format!(".ferrotext-write-check-{}", std::process::id()));
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
    {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => Err(OutputProblem::Refused {
            dir: dir.display().to_string(),
            error: e.to_string(),
        }),
    }
}
