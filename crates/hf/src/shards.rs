//! A HF directory's safetensors files as they are stored: which files hold the weights (the
//! index's name → file map, or the one file), each opened by `ferrotext_files`' rule and
//! memory-mapped, their headers parsed, where each tensor lies, and one tensor read back as f32.
//! Knows no model: what the files must hold is `read`'s check; `family` reads the names only.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use memmap2::{Mmap, UncheckedAdvice};
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;

use crate::{INDEX_FILE, SINGLE_FILE};

/// The tensor names of the HF directory `dir`'s weights (the index's, or the single file's
/// header's), `None` when it has no weights file; what [`crate::read_config`] checks a declared
/// multi-token-prediction layer, and a tied model's stored head, against.
///
/// # Errors
/// An index or a header that does not parse; a file that cannot be read.
pub(crate) fn tensor_names(dir: &Path) -> Result<Option<Vec<String>>, String> {
    if !dir.join(INDEX_FILE).exists() && !dir.join(SINGLE_FILE).exists() {
        return Ok(None);
    }
    let (files, index) = shard_files(dir)?;
    if let Some(map) = index {
        return Ok(Some(map.into_keys().collect()));
    }
    let maps = map_files(dir, &files, false)?;
    let shards = parse_headers(&maps, &files)?;
    Ok(Some(
        shards
            .iter()
            .flat_map(|s| s.names().into_iter().cloned())
            .collect(),
    ))
}

/// Every file of `files` in `dir`, opened as a regular file and memory-mapped (`sharded`: they
/// are the shards an index lists, which the message says).
pub(crate) fn map_files(dir: &Path, files: &[String], sharded: bool) -> Result<Vec<Mmap>, String> {
    let mut maps = Vec::with_capacity(files.len());
    for file in files {
        let path = dir.join(file);
        let f = ferrotext_files::open_regular(&path).map_err(|e| match (e.kind(), sharded) {
            (std::io::ErrorKind::InvalidInput, _) => format!("`{file}` {e}"),
            (_, true) => format!("shard `{file}` listed in {INDEX_FILE} cannot be read: {e}"),
            (_, false) => format!("`{file}` cannot be read: {e}"),
        })?;
        // SAFETY: the file is opened read-only and only read through this map. Like every
        // memory-mapped reader (safetensors' own included) we rely on no other process
        // truncating or rewriting a checkpoint while it loads.
        let map = unsafe { Mmap::map(&f) }.map_err(|e| format!("`{file}`: {e}"))?;
        maps.push(map);
    }
    Ok(maps)
}

/// Each map's safetensors header, parsed.
pub(crate) fn parse_headers<'a>(
    maps: &'a [Mmap],
    files: &[String],
) -> Result<Vec<SafeTensors<'a>>, String> {
    maps.iter()
        .zip(files)
        .map(|(m, file)| {
            SafeTensors::deserialize(m)
                .map_err(|e| format!("`{file}`: the safetensors header does not parse: {e}"))
        })
        .collect()
}

/// Which shard holds each tensor: where the index places it (checked against that shard's
/// header), or the one file's every tensor.
pub(crate) fn locate(
    shards: &[SafeTensors<'_>],
    files: &[String],
    index: Option<&BTreeMap<String, String>>,
) -> Result<BTreeMap<String, usize>, String> {
    let mut located: BTreeMap<String, usize> = BTreeMap::new();
    match index {
        Some(weight_map) => {
            for (name, file) in weight_map {
                let s = files.iter().position(|f| f == file).unwrap_or(0);
                if shards[s].tensor(name).is_err() {
                    return Err(format!(
                        "{INDEX_FILE} places `{name}` in `{file}`, which does not hold it"
                    ));
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
    Ok(located)
}

/// The shard files of `dir` in a fixed order, and the index's name → file map when sharded.
#[allow(clippy::type_complexity)]
pub(crate) fn shard_files(
    dir: &Path,
) -> Result<(Vec<String>, Option<BTreeMap<String, String>>), String> {
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
    let text = ferrotext_files::read_regular_to_string(&index_path)
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
pub(crate) fn to_f32(shard: &SafeTensors<'_>, name: &str) -> Result<Vec<f32>, String> {
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
pub(crate) fn release(map: &Mmap, shard: &SafeTensors<'_>, name: &str) {
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
