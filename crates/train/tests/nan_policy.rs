//! A non-finite loss or gradient never trains on silently: `nan_policy=stop` ends the run with an
//! error naming the step; `skip_step` drops the step's update and counts it.

use ferrotext_train::{train, RunOptions, TrainError};

mod common;

/// A learning rate so large that the first update overflows the weights: every later step's
/// loss is NaN.
const DIVERGES: [&str; 2] = ["learning_rate=1e30", "opt_type=sgd"];

#[test]
fn a_non_finite_step_stops_the_run_naming_the_step() {
    let cfg = common::small_config(&DIVERGES);
    let err = train(&cfg, &RunOptions::default()).unwrap_err();
    match &err {
        TrainError::NonFinite { step, .. } => assert_eq!(*step, 1, "{err}"),
        other => panic!("expected NonFinite, got {other}"),
    }
    assert!(err.to_string().starts_with("step 1: the loss"), "{err}");
}

#[test]
fn skip_step_drops_the_update_and_counts_it() {
    let mut items = DIVERGES.to_vec();
    items.push("nan_policy=skip_step");
    let skipping = common::run(&items);
    let skipped: Vec<bool> = skipping.metrics.iter().map(|m| m.skipped).collect();
    assert_eq!(skipped, [false, true, true]);
    // The skipped steps left the weights as step 0 made them: a one-step run ends the same.
    let mut one = items.clone();
    one.push("steps=1");
    let after_step_0 = common::run(&one);
    assert_eq!(skipping.values, after_step_0.values);
    // The mirror: a sane run skips nothing.
    let sane = common::run(&["nan_policy=skip_step"]);
    assert!(sane
        .metrics
        .iter()
        .all(|m| !m.skipped && m.loss.is_finite()));
}

#[test]
fn a_parameter_file_holding_nan_is_refused_naming_the_tensor() {
    let dir = std::env::temp_dir().join(format!("ferrotext-nan-params-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("params.safetensors");
    let report = common::run(&["steps=1"]);
    let mut values = report.values.clone().unwrap();
    let mut data = values[1].data().to_vec();
    data[3] = f32::NAN;
    values[1] = ferrotext_tensor::Tensor::new(values[1].shape().to_vec(), data).unwrap();
    ferrotext_train::io::save_parameters(&path, &report.params, &values).unwrap();
    let load = format!("load_parameters_path={}", path.display());
    let err = train(&common::small_config(&[&load]), &RunOptions::default()).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains(&format!(
            "`{}` holds a non-finite value (NaN)",
            report.params[1].name
        )),
        "{msg}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
