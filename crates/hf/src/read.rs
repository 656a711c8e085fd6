//! Reading a HF directory's weights: every header checked first, then one tensor at a time from
//! memory-mapped shards.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use ferrotext_models::{HfLayout, ParamInfo};
use ferrotext_tensor::Tensor;
use memmap2::Mmap;
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;

use super::convert::{self, NonFinite, Stored};
use super::{listed, INDEX_FILE, ROPE_FREQUENCIES, ROUTER, SELECTION_BIAS, SINGLE_FILE};
use crate::error::HfError;
use crate::family::no_rename;
use crate::shards::{locate, map_files, parse_headers, release, shard_files, to_f32};
use crate::tied::{self, StoredHead};

/// Loads every parameter of `infos` from the HF directory `dir`, each from the HF tensors its
/// [`ParamInfo::hf_tensors`] names, converted to f32.
///
/// # Errors
/// [`HfError::Params`] naming the directory and the problem: no weights file, an index that
/// does not parse or names a shard that does not exist, a header that does not parse, missing
/// and unexpected tensors (listed together; a model that ties its head to the embedding reads a
/// stored `lm_head.weight` equal to the embedding as the tie and refuses any other, see
/// `tied`; stored RoPE frequencies, `…rotary_emb.inv_freq`, are skipped), a dtype other than
/// F32/BF16/F16, a shape that does not match the model, a non-finite value, a router selection
/// bias (`mlp.gate.e_score_correction_bias`) that is not all zeros or has no router to go with.
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
    let rename = crate::family::checkpoint_names(dir);
    load_files(dir, dir, &files, index, ("config.json", rename), infos)
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
    load_files(path, dir, &[name], None, ("the model", no_rename), infos)
}

/// The load itself: `files` of `dir` (with the index's name → file map when sharded); errors
/// name `origin`; `model` names where the expected shapes come from, and `rename` gives the
/// stored name of each declared HF name (the family's, `None`: the same).
///
/// Every check runs before anything is converted: the files mapped and their headers parsed,
/// the index against the shards, the names (missing and unexpected listed together), every
/// dtype and shape, the selection biases; only then are the tensors converted, in parallel.
fn load_files(
    origin: &Path,
    dir: &Path,
    files: &[String],
    index: Option<BTreeMap<String, String>>,
    (model, rename): (&str, fn(&str) -> Option<String>),
    infos: &[ParamInfo],
) -> Result<Vec<Tensor>, HfError> {
    let err = |reason: String| HfError::Params {
        path: origin.display().to_string(),
        reason,
    };
    // 1. the shard files, their headers, and which shard holds each tensor
    let maps = map_files(dir, files, index.is_some()).map_err(err)?;
    let shards = parse_headers(&maps, files).map_err(err)?;
    let mut located = locate(&shards, files, index.as_ref()).map_err(err)?;
    // 2. names: what the model needs against what the directory has, listed together
    let wanted: Vec<Vec<(String, Vec<usize>)>> = infos
        .iter()
        .map(|i| {
            i.hf_tensors()
                .into_iter()
                .map(|(n, shape)| (rename(&n).unwrap_or(n), shape))
                .collect()
        })
        .collect();
    // A model that ties its head to the embedding reads a stored copy of the embedding as
    // the tie itself; a head of its own stays, and is refused below with what to set.
    let (embedding, head) = tied::names(rename);
    let is_wanted = |name: &str| wanted.iter().flatten().any(|(n, _)| n == name);
    let tied_head = (is_wanted(&embedding) && !is_wanted(&head)).then_some(head.as_str());
    if let Some(head) = tied_head {
        let stored = tied::stored_head(&shards, &located, (&embedding, head)).map_err(err)?;
        if stored == StoredHead::Copy {
            // Read for the comparison only: its pages go now, not when the load ends.
            if let Some(s) = located.remove(head) {
                release(&maps[s], &shards[s], head);
            }
        }
    }
    // The multi-token-prediction layer's copies of the embedding and head: the sharing itself.
    let copies: Vec<(String, String)> = ferrotext_models::mtp::stored_copies(infos)
        .into_iter()
        .map(|c| {
            (
                rename(&c.copy).unwrap_or(c.copy),
                rename(&c.of).unwrap_or(c.of),
            )
        })
        .collect();
    tied::drop_copies(&maps, &shards, &mut located, &copies).map_err(err)?;
    let place = match (&index, files.first()) {
        (Some(_), _) => INDEX_FILE,
        (None, Some(file)) => file.as_str(),
        (None, None) => SINGLE_FILE,
    };
    let biases = check_names(&located, &wanted, (place, tied_head), model).map_err(err)?;
    // 3. every dtype and shape, before anything is converted
    let expected = wanted.iter().flatten().chain(&biases);
    check_dtypes_and_shapes(&shards, &located, expected, model).map_err(err)?;
    check_biases_zero(&shards, &located, &biases).map_err(err)?;
    // 4. convert: every stored tensor cut into runs of whole output rows, written straight into
    //    its parameter's f32 buffer by whichever thread takes the run next
    let mut values: Vec<Vec<f32>> = infos
        .iter()
        .map(|i| vec![0.0; i.shape.iter().product()])
        .collect();
    let (parts, runs) = plan_runs(infos, &wanted, &mut values, &shards, &located).map_err(err)?;
    if let Some((_, part, (i, x))) = convert_runs(&parts, runs, &maps, &shards) {
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

/// The names the model needs (`wanted`) against those `located`, missing and unexpected listed
/// together (`place`: where a missing one was looked for; `tied_head`: the head's name when the
/// model ties it to the embedding, so that a stored one is refused with what to set); returns
/// the router selection biases found, each with the shape it must have.
fn check_names(
    located: &BTreeMap<String, usize>,
    wanted: &[Vec<(String, Vec<usize>)>],
    (place, tied_head): (&str, Option<&str>),
    model: &str,
) -> Result<Vec<(String, Vec<usize>)>, String> {
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
        .filter(|n| !wanted_names.contains(n.as_str()) && !n.ends_with(ROPE_FREQUENCIES))
    {
        match name
            .strip_suffix(SELECTION_BIAS)
            .and_then(|layer| routers.get(layer))
        {
            Some(&experts) => biases.push((name.clone(), vec![experts])),
            None => unexpected.push(name.clone()),
        }
    }
    if missing.is_empty() && unexpected.is_empty() {
        return Ok(biases);
    }
    let mut parts = Vec::new();
    // A head of its own in a directory this model ties (`tied`): refused with what to set.
    if let Some(head) = tied_head.filter(|h| unexpected.iter().any(|n| n == h)) {
        unexpected.retain(|n| n != head);
        parts.push(format!(
            "unexpected tensor `{head}`: it is not a copy of the embedding, and this model ties \
             its head to the embedding (logits_via_embedding=true): set \
             logits_via_embedding=false to load it as a head of its own, as transformers 5 \
             does; it is refused rather than dropped"
        ));
    }
    // DeepSeek-V3's multi-token-prediction layer sits after the decoder's last layer
    // (`model.layers.{L}.*`, L = num_hidden_layers). A model without it refuses it, named,
    // never dropped (transformers drops it silently).
    let layers = wanted
        .iter()
        .flatten()
        .filter_map(|(n, _)| {
            n.strip_prefix("model.layers.")?
                .split('.')
                .next()?
                .parse()
                .ok()
        })
        .map(|i: usize| i + 1)
        .max()
        .unwrap_or(0);
    let mtp_prefix = format!("model.layers.{layers}.");
    let mtp = unexpected
        .iter()
        .filter(|n| n.starts_with(&mtp_prefix))
        .count();
    if mtp > 0 && unexpected.iter().any(|n| n.ends_with(".eh_proj.weight")) {
        unexpected.retain(|n| !n.starts_with(&mtp_prefix));
        parts.push(format!(
            "the checkpoint has a multi-token-prediction layer `model.layers.{layers}.*` ({mtp} \
             tensors) and this model has none (mtp_num_layers=0): set mtp_num_layers=1 to load, \
             train and export it; it is refused rather than dropped"
        ));
    }
    // The model's own MTP layer (`model.layers.{L - 1}.eh_proj.weight` wanted) not in the
    // directory: transformers 5 writes `num_nextn_predict_layers` 1 without the layer.
    let mtp_missing = missing.iter().any(|n| n.ends_with(".eh_proj.weight"));
    if mtp_missing {
        parts.push(
            "the directory has no multi-token-prediction layer, which this model has \
             (mtp_num_layers=1): set mtp_num_layers=0, or load a directory with the layer"
                .to_string(),
        );
    }
    if !missing.is_empty() {
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
    Err(format!(
        "does not match the model of {model}: {}",
        parts.join("; ")
    ))
}

/// Every `expected` tensor is F32, BF16 or F16 and of its shape; the problems listed together
/// (the first 8).
fn check_dtypes_and_shapes<'a>(
    shards: &[SafeTensors<'_>],
    located: &BTreeMap<String, usize>,
    expected: impl Iterator<Item = &'a (String, Vec<usize>)>,
    model: &str,
) -> Result<(), String> {
    let mut wrong = Vec::new();
    for (name, shape) in expected {
        let view = shards[located[name]]
            .tensor(name)
            .map_err(|e| format!("`{name}`: {e}"))?;
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
    if wrong.is_empty() {
        return Ok(());
    }
    let n = wrong.len();
    let shown: Vec<String> = wrong.into_iter().take(8).collect();
    let more = if n > 8 {
        format!(" and {} more", n - 8)
    } else {
        String::new()
    };
    Err(format!("{}{more}", shown.join("; ")))
}

/// Every router selection bias the model does not declare is all zeros (a model built without
/// `routed_bias` routes as a zero bias does).
fn check_biases_zero(
    shards: &[SafeTensors<'_>],
    located: &BTreeMap<String, usize>,
    biases: &[(String, Vec<usize>)],
) -> Result<(), String> {
    for (name, _) in biases {
        let s = located[name];
        let values = to_f32(&shards[s], name)?;
        if let Some(i) = values.iter().position(|&x| x != 0.0) {
            return Err(format!(
                "`{name}` is not zero ({} at index {i}): this model has no selection bias \
                 (routed_bias=false), so it would pick other experts than this checkpoint's \
                 model; set routed_bias=true to load it",
                values[i]
            ));
        }
    }
    Ok(())
}

/// The work of a conversion: every stored tensor of every parameter as a [`Part`], its output
/// block of `values` cut into [`Run`]s of whole output rows.
#[allow(clippy::type_complexity)]
fn plan_runs<'d, 'o>(
    infos: &[ParamInfo],
    wanted: &[Vec<(String, Vec<usize>)>],
    values: &'o mut [Vec<f32>],
    shards: &[SafeTensors<'d>],
    located: &BTreeMap<String, usize>,
) -> Result<(Vec<Part<'d>>, Vec<Run<'o>>), String> {
    let mut parts = Vec::new();
    let mut runs = Vec::new();
    for (k, ((info, tensors), out)) in infos.iter().zip(wanted).zip(values).enumerate() {
        let block = out.len() / tensors.len().max(1);
        let (rows, cols) = part_matrix(info, block);
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
                .map_err(|e| format!("`{name}`: {e}"))?;
            let kind = stored_kind(view.dtype(), name)?;
            if view.data().len() != block * kind.size() {
                return Err(format!(
                    "`{name}` holds {} bytes, its shape needs {}",
                    view.data().len(),
                    block * kind.size()
                ));
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
    Ok((parts, runs))
}

/// `[rows, cols]` of one stored part of `info` (`block` elements). As `ParamInfo::from_hf`: a
/// transposed part is the `[rows, cols]` matrix of the last two dimensions (one expert's, for
/// stacked experts); anything else is a plain copy, `[block, 1]`.
fn part_matrix(info: &ParamInfo, block: usize) -> (usize, usize) {
    let transposed = matches!(
        info.hf,
        HfLayout::Experts { .. }
            | HfLayout::Tensor {
                transposed: true,
                ..
            }
    );
    match info.shape.as_slice() {
        [.., r, c] if transposed && r * c == block => (*r, *c),
        _ => (block, 1),
    }
}

/// How a tensor of `dtype` is stored, for the converter.
fn stored_kind(dtype: Dtype, name: &str) -> Result<Stored, String> {
    match dtype {
        Dtype::F32 => Ok(Stored::F32),
        Dtype::BF16 => Ok(Stored::Bf16),
        Dtype::F16 => Ok(Stored::F16),
        other => Err(format!("`{name}` is {other:?} (supported: F32, BF16, F16)")),
    }
}

/// A non-finite value a conversion found: parameter, part, and the converter's (flat index,
/// value).
type Bad = (usize, usize, NonFinite);

/// Runs every conversion on up to 8 threads, each taking the next run from one queue and
/// releasing a part's file pages when it finishes the part's last run. Returns the first
/// non-finite value in parameter order, so the message does not depend on the schedule.
fn convert_runs(
    parts: &[Part<'_>],
    runs: Vec<Run<'_>>,
    maps: &[Mmap],
    shards: &[SafeTensors<'_>],
) -> Option<Bad> {
    let threads = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .clamp(1, 8)
        .min(runs.len().max(1));
    let queue = Mutex::new(runs.into_iter());
    let mut first_bad: Option<Bad> = None;
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let queue = &queue;
                scope.spawn(move || convert_worker(queue, parts, maps, shards))
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
    first_bad
}

/// One conversion thread: takes runs from `queue` until it is empty; returns the first
/// non-finite value it found, in parameter order.
fn convert_worker<'o>(
    queue: &Mutex<std::vec::IntoIter<Run<'o>>>,
    parts: &[Part<'_>],
    maps: &[Mmap],
    shards: &[SafeTensors<'_>],
) -> Option<Bad> {
    let mut bad: Option<Bad> = None;
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
