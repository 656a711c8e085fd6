//! A checkpoint's files read verified: each a plain name the manifest lists, its SHA-256 the
//! listed one, its tensor list the manifest's, each tensor F32 of the declared shape, parameters
//! and optimizer state finite. Loading (`load.rs`) reads every file through these.

use std::path::Path;

use ferrotext_tensor::Tensor;
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;
use sha2::{Digest, Sha256};

use super::{ckpt_err, hex, is_plain_name, CheckpointProblem, Manifest, ManifestMismatch};
use crate::error::TrainError;

/// `t` (tensor `name` of `path`) when every value is finite. Parameters and moments only: a
/// mid-step accumulator may hold a NaN gradient, which the step's end skips.
pub(super) fn finite(path: &Path, name: &str, t: Tensor) -> Result<Tensor, TrainError> {
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

/// The bytes of `file` in checkpoint `dir`: a plain name, listed in the manifest, its SHA-256
/// the one listed.
pub(super) fn read_verified(
    dir: &Path,
    manifest: &Manifest,
    file: &str,
) -> Result<Vec<u8>, TrainError> {
    if !is_plain_name(file) {
        return Err(ckpt_err(
            &dir.join("manifest.json"),
            CheckpointProblem::OutsideDirectory { file: file.into() },
        ));
    }
    let path = dir.join(file);
    let bytes = super::read_file(&path)?;
    let want = manifest
        .files
        .get(file)
        .ok_or_else(|| ckpt_err(&path, CheckpointProblem::NotListed))?;
    same_checksum(&path, hex(&Sha256::digest(&bytes)), want)?;
    Ok(bytes)
}

/// The manifest's tensor list against `file` (`name` in checkpoint `dir`): each entry for the
/// file is a tensor it holds with that shape, none twice, and the file holds no other.
pub(super) fn check_tensor_list(
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
pub(super) fn not_safetensors(
    path: &Path,
) -> impl Fn(safetensors::SafeTensorError) -> TrainError + '_ {
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
pub(super) fn tensor(
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
