//! Checkpoint errors carry their values (#31 item 5): a caller matches on the fields of
//! [`CheckpointProblem`] — the checksums, the shapes, the format version, the file — instead of
//! parsing the sentence. Each failure comes with its mirror: the intact checkpoint loads.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferrotext_comm::{run_spmd, SpmdOptions};
use ferrotext_spmd::Ctx;
use ferrotext_train::checkpoint::{read_parameters, CheckpointProblem, LatestProblem};
use ferrotext_train::data::{source_for, TokenSource};
use ferrotext_train::{Engine, ErrorClass, TrainConfig, TrainError};
use sha2::Digest;

mod common;

use common::{feed, small_config};

fn config() -> TrainConfig {
    small_config(&["gradient_accumulation_steps=2", "steps=4"])
}

/// A fresh checkpoint root for test `name`, and the checkpoint saved in it (mid-step: one
/// micro-batch of two fed, so all three tensor files are there).
fn saved(name: &str) -> (PathBuf, PathBuf) {
    let root = std::env::temp_dir().join(format!(
        "ferrotext-ckpt-errors-{}-{name}",
        std::process::id()
    ));
    std::fs::remove_dir_all(&root).ok();
    let cfg = config();
    let plan = cfg.plan().unwrap();
    let mesh = plan.compute_mesh().clone();
    let source: Arc<dyn TokenSource> = Arc::from(source_for(&cfg, 256).unwrap());
    let dir = run_spmd(
        &mesh,
        &SpmdOptions::default(),
        |dev| -> Result<_, TrainError> {
            let mut cx = Ctx::new(dev.comm(), 1);
            let mut e = Engine::new(&mut cx, &plan, None)?;
            feed(&mut cx, &mut e, source.as_ref(), &cfg, 0, 0)?;
            e.save_checkpoint(&mut cx, &root)
        },
    )
    .unwrap()
    .remove(0);
    (root, dir)
}

fn sha256_hex(bytes: &[u8]) -> String {
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Rewrites `manifest.json` through `edit`; `reseal` also rewrites its seal to match.
fn edit_manifest(dir: &Path, reseal: bool, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut m);
    let bytes = serde_json::to_vec_pretty(&m).unwrap();
    std::fs::write(&path, &bytes).unwrap();
    if reseal {
        let seal = format!("{}  manifest.json\n", sha256_hex(&bytes));
        std::fs::write(dir.join("manifest.sha256"), seal).unwrap();
    }
}

/// The mirror of every refusal below: the intact checkpoint reads, with the saved config's
/// embedding shape.
fn assert_loads(dir: &Path) {
    let (cfg, params) = read_parameters(dir).expect("the intact checkpoint loads");
    assert_eq!(cfg.base_emb_dim, Some(32));
    assert!(params.iter().any(|p| p.shape() == [256, 32]));
}

/// The problem of a checkpoint error, with its path; fails on any other error.
fn problem(err: TrainError) -> (String, CheckpointProblem) {
    assert_eq!(err.class(), ErrorClass::Failure, "{err}");
    match err {
        TrainError::Checkpoint { path, problem } => (path, problem),
        other => panic!("not a checkpoint error: {other}"),
    }
}

#[test]
fn a_corrupt_file_carries_the_listed_and_the_found_checksum() {
    let (root, dir) = saved("checksum");
    assert_loads(&dir);
    let listed: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
    let listed = listed["files"]["params.safetensors"]
        .as_str()
        .unwrap()
        .to_string();
    let file = dir.join("params.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let err = read_parameters(&dir).unwrap_err();
    let text = err.to_string();
    let (path, problem) = problem(err);
    assert_eq!(path, file.display().to_string());
    match problem {
        CheckpointProblem::ChecksumMismatch { expected, found } => {
            assert_eq!(expected, listed);
            assert_eq!(found, sha256_hex(&bytes));
            assert_ne!(expected, found);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        text,
        format!(
            "checkpoint {}: checksum mismatch: the file is corrupt or was modified",
            file.display()
        )
    );
    std::fs::remove_dir_all(root).ok();
}

#[test]
fn a_missing_file_names_it() {
    let (root, dir) = saved("missing");
    assert_loads(&dir);
    let file = dir.join("params.safetensors");
    std::fs::remove_file(&file).unwrap();
    let (path, problem) = problem(read_parameters(&dir).unwrap_err());
    assert_eq!(path, file.display().to_string());
    assert!(
        matches!(problem, CheckpointProblem::Unreadable { .. }),
        "{problem:?}"
    );
    std::fs::remove_dir_all(root).ok();
}

#[test]
fn a_newer_format_carries_the_version_found_and_the_one_read() {
    let (root, dir) = saved("newer");
    assert_loads(&dir);
    edit_manifest(&dir, true, |m| m["format_version"] = 99.into());
    let err = read_parameters(&dir).unwrap_err();
    assert!(
        err.to_string()
            .ends_with("manifest.json: format version 99 is newer than this ferrotext reads (3)"),
        "{err}"
    );
    let (path, problem) = problem(err);
    assert_eq!(path, dir.join("manifest.json").display().to_string());
    match problem {
        CheckpointProblem::NewerFormat { found, supported } => {
            assert_eq!((found, supported), (99, 3));
        }
        other => panic!("{other:?}"),
    }
    std::fs::remove_dir_all(root).ok();
}

#[test]
fn a_wrong_shape_carries_the_tensor_and_both_shapes() {
    let (root, dir) = saved("shape");
    assert_loads(&dir);
    // A sealed manifest claiming a wider model than the tensors hold.
    edit_manifest(&dir, true, |m| m["config"]["base_emb_dim"] = 48.into());
    let (path, problem) = problem(read_parameters(&dir).unwrap_err());
    assert_eq!(path, dir.join("params.safetensors").display().to_string());
    match problem {
        CheckpointProblem::WrongShape {
            name,
            found,
            expected,
        } => {
            assert_eq!(found, [256, 32], "{name}");
            assert_eq!(expected, [256, 48], "{name}");
        }
        other => panic!("{other:?}"),
    }
    std::fs::remove_dir_all(root).ok();
}

#[test]
fn a_latest_outside_its_root_carries_the_name() {
    let (root, _) = saved("latest");
    // The mirror: `latest` as saved names the checkpoint, and the root reads through it.
    assert_loads(&root);
    std::fs::write(root.join("latest"), "../elsewhere").unwrap();
    let err = read_parameters(&root).unwrap_err();
    assert!(err.to_string().contains("resume=fresh"), "{err}");
    let (path, problem) = problem(err);
    assert_eq!(path, root.join("latest").display().to_string());
    match problem {
        CheckpointProblem::Latest(LatestProblem::Outside { name }) => {
            assert_eq!(name, "../elsewhere");
        }
        other => panic!("{other:?}"),
    }
    std::fs::remove_dir_all(root).ok();
}

/// A parameter set to NaN with every checksum and the seal redone (so only the values are
/// wrong) is refused by name: no run writes a non-finite parameter (a step that makes one is
/// not applied), so it can only be a modified file. The mirror: the intact checkpoint loads.
#[test]
fn a_non_finite_parameter_is_refused_even_with_every_checksum_redone() {
    let (root, dir) = saved("nan");
    assert_loads(&dir);
    let file = dir.join("params.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let first = 8 + header;
    bytes[first..first + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&file, &bytes).unwrap();
    let sum = sha256_hex(&bytes);
    edit_manifest(&dir, true, |m| {
        m["files"]["params.safetensors"] = sum.into()
    });
    let err = read_parameters(&dir).unwrap_err();
    assert!(
        err.to_string().contains("holds a non-finite value"),
        "{err}"
    );
    let (path, problem) = problem(err);
    assert_eq!(path, file.display().to_string());
    assert!(
        matches!(problem, CheckpointProblem::NonFinite { index: 0, .. }),
        "{problem:?}"
    );
    std::fs::remove_dir_all(root).ok();
}

/// `export` verifies every file a restore reads, not only the parameters it writes: a
/// truncated optimizer file, or a missing accumulator, refuses the export and writes nothing.
/// The mirror: the intact checkpoint exports.
#[test]
fn export_refuses_a_checkpoint_a_resume_would_refuse() {
    use ferrotext_train::export::export_checkpoint;
    let (root, dir) = saved("export");
    let out = root
        .join("..")
        .join(format!("ferrotext-ckpt-export-out-{}", std::process::id()));
    std::fs::remove_dir_all(&out).ok();
    let export = || {
        export_checkpoint(
            &dir,
            None,
            &out,
            ferrotext_sharding::DType::F32,
            ferrotext_hf::DEFAULT_SHARD_BYTES,
        )
    };
    export().expect("the intact checkpoint exports");
    std::fs::remove_dir_all(&out).unwrap();
    let optimizer = dir.join("optimizer.safetensors");
    let whole = std::fs::read(&optimizer).unwrap();
    std::fs::write(&optimizer, &whole[..whole.len() / 2]).unwrap();
    let (path, found) = problem(export().unwrap_err());
    assert_eq!(path, optimizer.display().to_string());
    assert!(
        matches!(found, CheckpointProblem::ChecksumMismatch { .. }),
        "{found:?}"
    );
    std::fs::write(&optimizer, &whole).unwrap();
    std::fs::remove_file(dir.join("accumulator.safetensors")).unwrap();
    let (path, found) = problem(export().unwrap_err());
    assert!(path.ends_with("accumulator.safetensors"), "{path}");
    assert!(
        matches!(found, CheckpointProblem::Unreadable { .. }),
        "{found:?}"
    );
    assert!(!out.exists(), "nothing written");
    std::fs::remove_dir_all(root).ok();
}

/// The manifest's tensor list must describe the files, even with the seal redone: an entry with
/// another shape, an entry listed twice, and an entry dropped are each refused naming the
/// tensor. The mirror: the intact checkpoint loads.
#[test]
fn a_tensor_list_that_disagrees_with_its_files_is_refused() {
    let (root, dir) = saved("tensor-list");
    assert_loads(&dir);
    let original = std::fs::read(dir.join("manifest.json")).unwrap();
    let seal = std::fs::read(dir.join("manifest.sha256")).unwrap();
    type Edit = fn(&mut Vec<serde_json::Value>);
    let edits: [(Edit, &str); 3] = [
        (
            |t| t[0]["shape"] = serde_json::json!([3, 5]),
            "shape [3, 5]",
        ),
        (|t| t.push(t[0].clone()), "twice"),
        (
            |t| {
                t.remove(0);
            },
            "does not name",
        ),
    ];
    for (edit, needle) in edits {
        edit_manifest(&dir, true, |m| {
            edit(m["tensors"].as_array_mut().unwrap());
        });
        let err = read_parameters(&dir).unwrap_err();
        assert!(err.to_string().contains(needle), "{needle}: {err}");
        let (_, found) = problem(err);
        assert!(
            matches!(
                found,
                CheckpointProblem::Manifest(
                    ferrotext_train::checkpoint::ManifestMismatch::TensorList { .. }
                )
            ),
            "{found:?}"
        );
        std::fs::write(dir.join("manifest.json"), &original).unwrap();
        std::fs::write(dir.join("manifest.sha256"), &seal).unwrap();
        assert_loads(&dir);
    }
    std::fs::remove_dir_all(root).ok();
}
