//! Reading a HF directory's weights: every header checked first, then one tensor at a time from
//! memory-mapped shards.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use ferrotext_models::{HfLayout, ParamInfo};
use ferrotext_tensor::Tensor;
use memmap2::{Mmap, UncheckedAdvice};
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;

use super::convert::{self, NonFinite, Stored};
use super::{listed, INDEX_FILE, ROUTER, SELECTION_BIAS, SINGLE_FILE};
use crate::error::HfError;

/// Loads every parameter of `infos` from the HF directory `dir`, each from the HF tensors its
/// [`ParamInfo::hf_tensors`] names, converted to f32.
///
/// # Errors
/// [`HfError::Params`] naming the directory and the problem: no weights file, an index that
/// does not parse or names a shard that does not exist, a header that does not parse, missing
/// and unexpected tensors (listed together), a dtype other than F32/BF16/F16, a shape that does
/// not match the model, a non-finite value, a router selection bias
/// (`mlp.gate.e_score_correction_bias`) that is not all zeros or has no router to go with.
///
/// # Performance
/// One pass over the file bytes: each stored tensor is widened and (for `[out, in]` matrices)
/// transposed in tiles straight into its parameter's buffer, on up to 8 threads, and its file
/// pages are released once converted. What remains is mostly the kernel handing out the f32
/// buffers' fresh pages.
pub fn load_directory(dir: &Path, infos: &[ParamInfo]) -> Result<Vec<Tensor>, HfError> {
    // 1. the shard files, and which shard holds each tensor (the index, when there is one)
    let (files, index) = shard_files(dir).map_err(|reason| HfError::Params {
        path: dir.display().to_string(),
        reason,
    })?;
    load_files(dir, dir, &files, index, "config.json", infos)
}

/// Loads every parameter of `infos` from one safetensors file (a ferrotext parameter file, or
/// a lone HF `model.safetensors`), as [`load_directory`] does: F32, BF16 or F16, converted in
/// one pass, every name, dtype and shape checked first.
///
/// # Errors
/// As [`load_directory`], naming the file.
pub fn load_file(path: &Path, infos: &[ParamInfo]) -> Result<Vec<Tensor>, HfError> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| HfError::Params {
            path: path.display().to_string(),
            reason: "is not a file name".into(),
        })?;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    load_files(path, dir, &[name], None, "the model", infos)
}

/// The load itself: `files` of `dir` (with the index's name → file map when sharded); errors
/// name `origin`; `model` names where the expected shapes come from.
fn load_files(
    origin: &Path,
    dir: &Path,
    files: &[String],
    index: Option<BTreeMap<String, String>>,
    model: &str,
    infos: &[ParamInfo],
) -> Result<Vec<Tensor>, HfError> {
    let err = |reason: String| HfError::Params {
        path: origin.display().to_string(),
        reason,
    };
    let mut maps = Vec::with_capacity(files.len());
    for file in files {
        let path = dir.join(file);
        let f = crate::files::open_regular(&path).map_err(|e| {
            err(match (e.kind(), index.is_some()) {
                (std::io::ErrorKind::InvalidInput, _) => format!("`{file}` {e}"),
                (_, true) => format!("shard `{file}` listed in {INDEX_FILE} cannot be read: {e}"),
                (_, false) => format!("`{file}` cannot be read: {e}"),
            })
        })?;
        // SAFETY: the file is opened read-only and only read through this map. Like every
        // memory-mapped reader (safetensors' own included) we rely on no other process
        // truncating or rewriting a checkpoint while it loads.
        let map = unsafe { Mmap::map(&f) }.map_err(|e| err(format!("`{file}`: {e}")))?;
        maps.push(map);
    }
    let shards = maps
        .iter()
        .zip(files)
        .map(|(m, file)| {
            SafeTensors::deserialize(m).map_err(|e| {
                err(format!(
                    "`{file}`: the safetensors header does not parse: {e}"
                ))
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut located: BTreeMap<String, usize> = BTreeMap::new();
    match &index {
        Some(weight_map) => {
            for (name, file) in weight_map {
                let s = files.iter().position(|f| f == file).unwrap_or(0);
                if shards[s].tensor(name).is_err() {
                    return Err(err(format!(
                        "{INDEX_FILE} places `{name}` in `{file}`, which does not hold it"
                    )));
                }
                located.insert(name.clone(), s);
            }
        }
        None => {
            for name in shards[0].names() {
                located.insert(name.clone(), 0);
            }
        }
    }
    // 2. names: what the model needs against what the directory has, listed together
    let wanted: Vec<Vec<(String, Vec<usize>)>> = infos.iter().map(ParamInfo::hf_tensors).collect();
    let wanted_names: BTreeSet<&str> = wanted.iter().flatten().map(|(n, _)| n.as_str()).collect();
    let missing: Vec<String> = wanted_names
        .iter()
        .filter(|n| !located.contains_key(**n))
        .map(|n| n.to_string())
        .collect();
    // A router's selection bias (DeepSeek-V3) goes with a router the model has, `[experts]`.
    let routers: BTreeMap<&str, usize> = wanted
        .iter()
        .flatten()
        .filter_map(|(n, shape)| Some((n.strip_suffix(ROUTER)?, *shape.first()?)))
        .collect();
    let mut biases: Vec<(String, Vec<usize>)> = Vec::new();
    let mut unexpected = Vec::new();
    for name in located
        .keys()
        .filter(|n| !wanted_names.contains(n.as_str()))
    {
        match name
            .strip_suffix(SELECTION_BIAS)
            .and_then(|layer| routers.get(layer))
        {
            Some(&experts) => biases.push((name.clone(), vec![experts])),
            None => unexpected.push(name.clone()),
        }
    }
    if !missing.is_empty() || !unexpected.is_empty() {
        let mut parts = Vec::new();
        if !missing.is_empty() {
            let place = match (&index, files.first()) {
                (Some(_), _) => INDEX_FILE,
                (None, Some(file)) => file.as_str(),
                (None, None) => SINGLE_FILE,
            };
            parts.push(format!(
                "{} missing tensor(s) (not in {place}): {}",
                missing.len(),
                listed(&missing, 8)
            ));
        }
        if !unexpected.is_empty() {
            parts.push(format!(
                "{} unexpected tensor(s): {}",
                unexpected.len(),
                listed(&unexpected, 8)
            ));
        }
        return Err(err(format!(
            "does not match the model of {model}: {}",
            parts.join("; ")
        )));
    }
    // 3. every dtype and shape, before anything is converted
    let mut wrong = Vec::new();
    for (name, shape) in wanted.iter().flatten().chain(&biases) {
        let view = shards[located[name]]
            .tensor(name)
            .map_err(|e| err(format!("`{name}`: {e}")))?;
        if !matches!(view.dtype(), Dtype::F32 | Dtype::BF16 | Dtype::F16) {
            wrong.push(format!(
                "`{name}` is {:?} (supported: F32, BF16, F16)",
                view.dtype()
            ));
        } else if view.shape() != shape.as_slice() {
            wrong.push(format!(
                "`{name}` has shape {:?}, {model} needs {shape:?}",
                view.shape()
            ));
        }
    }
    if !wrong.is_empty() {
        let n = wrong.len();
        let shown: Vec<String> = wrong.into_iter().take(8).collect();
        let more = if n > 8 {
            format!(" and {} more", n - 8)
        } else {
            String::new()
        };
        return Err(err(format!("{}{more}", shown.join("; "))));
    }
    for (name, _) in &biases {
        let s = located[name];
        let values = to_f32(&shards[s], name).map_err(err)?;
        if let Some(i) = values.iter().position(|&x| x != 0.0) {
            return Err(err(format!(
                "`{name}` is not zero ({} at index {i}): ferrotext's router has no selection \
                 bias, so it would pick other experts than this checkpoint's model; only an \
                 all-zero e_score_correction_bias is supported",
                values[i]
            )));
        }
    }
    // 4. convert: every stored tensor cut into runs of whole output rows, written straight into
    //    its parameter's f32 buffer by whichever thread takes the run next
    let mut values: Vec<Vec<f32>> = infos
        .iter()
        .map(|i| vec![0.0; i.shape.iter().product()])
        .collect();
    let mut parts = Vec::new();
    let mut runs = Vec::new();
    for (k, ((info, tensors), out)) in infos.iter().zip(&wanted).zip(&mut values).enumerate() {
        let transposed = matches!(
            info.hf,
            HfLayout::Experts { .. }
                | HfLayout::Tensor {
                    transposed: true,
                    ..
                }
        );
        let block = out.len() / tensors.len().max(1);
        // As `ParamInfo::from_hf`: a transposed part is the `[rows, cols]` matrix of the last
        // two dimensions (one expert's, for stacked experts); anything else is a plain copy.
        let (rows, cols) = match info.shape.as_slice() {
            [.., r, c] if transposed && r * c == block => (*r, *c),
            _ => (block, 1),
        };
        let per = if cols == 1 {
            RUN_ELEMENTS
        } else {
            (RUN_ELEMENTS / cols).max(convert::TILE) * cols
        };
        let mut rest: &mut [f32] = out;
        for (name, _) in tensors {
            let take = block.min(rest.len());
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(take);
            rest = tail;
            let s = located[name];
            let view = shards[s]
                .tensor(name)
                .map_err(|e| err(format!("`{name}`: {e}")))?;
            let kind = match view.dtype() {
                Dtype::F32 => Stored::F32,
                Dtype::BF16 => Stored::Bf16,
                Dtype::F16 => Stored::F16,
                other => {
                    return Err(err(format!(
                        "`{name}` is {other:?} (supported: F32, BF16, F16)"
                    )))
                }
            };
            if view.data().len() != block * kind.size() {
                return Err(err(format!(
                    "`{name}` holds {} bytes, its shape needs {}",
                    view.data().len(),
                    block * kind.size()
                )));
            }
            let count = mine.chunks(per.max(1)).count();
            for (i, run) in mine.chunks_mut(per.max(1)).enumerate() {
                runs.push(Run {
                    param: k,
                    part: parts.len(),
                    first: i * per / cols,
                    out: run,
                });
            }
            parts.push(Part {
                name: name.clone(),
                shard: s,
                data: view.data(),
                kind,
                rows,
                cols,
                left: AtomicUsize::new(count),
            });
        }
    }
    let threads = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .clamp(1, 8)
        .min(runs.len().max(1));
    let queue = Mutex::new(runs.into_iter());
    // The first non-finite value in parameter order wins, so the message does not depend on
    // the schedule.
    let mut first_bad: Option<(usize, usize, NonFinite)> = None;
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (queue, parts, maps, shards) = (&queue, &parts, &maps, &shards);
                scope.spawn(move || {
                    let mut bad: Option<(usize, usize, NonFinite)> = None;
                    loop {
                        let next = match queue.lock() {
                            Ok(mut q) => q.next(),
                            Err(_) => None, // another thread panicked: its join reports it
                        };
                        let Some(run) = next else { break };
                        let part = &parts[run.part];
                        let done = if part.cols == 1 {
                            convert::plain(part.data, part.kind, run.first, run.out)
                        } else {
                            convert::transposed(
                                part.data, part.kind, part.rows, part.cols, run.first, run.out,
                            )
                        };
                        if let Err(found) = done {
                            let key = (run.param, run.part, found);
                            if bad.is_none_or(|b| (b.0, b.1, b.2 .0) > (key.0, key.1, key.2 .0)) {
                                bad = Some(key);
                            }
                        }
                        if part.left.fetch_sub(1, Ordering::AcqRel) == 1 {
                            release(&maps[part.shard], &shards[part.shard], &part.name);
                        }
                    }
                    bad
                })
            })
            .collect();
        for h in handles {
            match h.join() {
                Ok(Some(b)) => {
                    if first_bad.is_none_or(|f| (f.0, f.1, f.2 .0) > (b.0, b.1, b.2 .0)) {
                        first_bad = Some(b);
                    }
                }
                Ok(None) => {}
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
    });
    if let Some((_, part, (i, x))) = first_bad {
        let name = &parts[part].name;
        return Err(err(format!(
            "`{name}` holds a non-finite value ({x}) at flat index {i}"
        )));
    }
    drop(parts);
    infos
        .iter()
        .zip(values)
        .map(|(info, data)| Tensor::new(info.shape.clone(), data).map_err(|e| err(e.to_string())))
        .collect()
}

/// Output elements per unit of work (16 MiB of f32): large enough that taking one costs nothing,
/// small enough that the embedding spreads over the threads.
const RUN_ELEMENTS: usize = 4 << 20;

/// One stored tensor being converted.
struct Part<'a> {
    name: String,
    shard: usize,
    data: &'a [u8],
    kind: Stored,
    /// `[rows, cols]` of its output block; `cols == 1` for a plain copy.
    rows: usize,
    cols: usize,
    /// Runs not finished yet: the thread that finishes the last releases the file pages.
    left: AtomicUsize,
}

/// A run of whole output rows of one stored tensor: the unit of work of a load.
struct Run<'a> {
    param: usize,
    part: usize,
    /// Its first output row (a plain part's rows are single elements).
    first: usize,
    out: &'a mut [f32],
}

/// The shard files of `dir` in a fixed order, and the index's name → file map when sharded.
#[allow(clippy::type_complexity)]
fn shard_files(dir: &Path) -> Result<(Vec<String>, Option<BTreeMap<String, String>>), String> {
    let meta = std::fs::metadata(dir).map_err(|e| format!("cannot read: {e}"))?;
    if !meta.is_dir() {
        return Err("is not a directory".into());
    }
    let index_path = dir.join(INDEX_FILE);
    if !index_path.exists() {
        if !dir.join(SINGLE_FILE).exists() {
            return Err(format!("has neither {SINGLE_FILE} nor {INDEX_FILE}"));
        }
        return Ok((vec![SINGLE_FILE.to_string()], None));
    }
    let text = crate::files::read_regular_to_string(&index_path)
        .map_err(|e| format!("{INDEX_FILE}: {e}"))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{INDEX_FILE} is not JSON: {e}"))?;
    let map = value
        .get("weight_map")
        .and_then(serde_json::Value::as_object)
        .ok_or_else(|| format!("{INDEX_FILE} has no `weight_map` object"))?;
    let mut weight_map = BTreeMap::new();
    let mut files = BTreeSet::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| format!("{INDEX_FILE}: the file of `{name}` is not a string"))?;
        let plain = !file.is_empty()
            && !file.contains('/')
            && !file.contains('\\')
            && file != "."
            && file != "..";
        if !plain {
            return Err(format!(
                "{INDEX_FILE} places `{name}` in `{file}`, outside the directory"
            ));
        }
        files.insert(file.to_string());
        weight_map.insert(name.clone(), file.to_string());
    }
    Ok((files.into_iter().collect(), Some(weight_map)))
}

/// Tensor `name` of `shard` as f32 values (its dtype checked already), refusing non-finite
/// values.
fn to_f32(shard: &SafeTensors<'_>, name: &str) -> Result<Vec<f32>, String> {
    let view = shard.tensor(name).map_err(|e| format!("`{name}`: {e}"))?;
    let bytes = view.data();
    let data: Vec<f32> = match view.dtype() {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        // bf16 is the top half of an f32: widening is exact.
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => return Err(format!("`{name}` is {other:?} (supported: F32, BF16, F16)")),
    };
    if let Some(i) = data.iter().position(|x| !x.is_finite()) {
        return Err(format!(
            "`{name}` holds a non-finite value ({}) at flat index {i}",
            data[i]
        ));
    }
    Ok(data)
}

/// Drops tensor `name`'s pages of `map` from this process's memory: it has been converted and is
/// not read again (a later read would fault the pages back in from the file).
fn release(map: &Mmap, shard: &SafeTensors<'_>, name: &str) {
    let Ok(view) = shard.tensor(name) else { return };
    let bytes = view.data();
    let offset = (bytes.as_ptr() as usize).wrapping_sub(map.as_ptr() as usize);
    if offset
        .checked_add(bytes.len())
        .is_some_and(|end| end <= map.len())
    {
        // SAFETY: `map` is a read-only private file mapping. MADV_DONTNEED on it only drops
        // pages; any later access re-reads them from the file, so the `SafeTensors` views that
        // still borrow the map stay valid. The range lies inside the map (checked above).
        let _ =
            unsafe { map.unchecked_advise_range(UncheckedAdvice::DontNeed, offset, bytes.len()) };
    }
}
