//! Multi-token prediction under `layout_invariant=true` (issue 29 item 3). A test binary of its
//! own: `deterministic=true` needs the portable kernel, which a process fixes at its first run.

use ferrotext_train::{train, RunOptions, TrainReport};
mod common;

use common::small_config;

fn run(extra: &[&str]) -> TrainReport {
    let mut all = vec!["learning_rate=0.01", "steps=3"];
    all.extend_from_slice(extra);
    train(
        &small_config(&all),
        &RunOptions {
            return_params: true,
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

/// `layout_invariant=true` (each device's partial sums added in a tree) with the module: the
/// same global batch on data=4 × GA 1, data=2 × GA 2 and data=1 × GA 4 gives the same losses
/// and weights, bit for bit (the module's partial sums join the tree with the main loss's). The
/// reported `mtp_loss` is a metric summed outside the tree: equal to rounding only.
///
/// Where `FERROTEXT_MATMUL` forces a library (`.ci/kernel-paths`), `deterministic=true` is
/// refused in this process (tests/layout_invariant.rs checks the refusal); the same check then
/// runs in a child process of this test binary on the portable kernel.
#[test]
fn the_layout_invariant_path_keeps_its_bits_with_the_module() {
    let forced = std::env::var("FERROTEXT_MATMUL").unwrap_or_default();
    if !forced.is_empty() && forced != "portable" {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "the_layout_invariant_path_keeps_its_bits_with_the_module",
                "--test-threads=1",
            ])
            .env("FERROTEXT_MATMUL", "portable")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "the check on the portable kernel: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        return;
    }
    let run_on = |data: usize, ga: usize| {
        let keys = [
            format!("ici_data_parallelism={data}"),
            format!("local_devices={data}"),
            format!("gradient_accumulation_steps={ga}"),
        ];
        let mut all: Vec<&str> = keys.iter().map(String::as_str).collect();
        all.extend([
            "mtp_num_layers=1",
            "layout_invariant=true",
            "deterministic=true",
        ]);
        run(&all)
    };
    let a = run_on(4, 1);
    let losses = |r: &TrainReport| {
        r.metrics
            .iter()
            .map(|m| m.loss.to_bits())
            .collect::<Vec<_>>()
    };
    for other in [run_on(2, 2), run_on(1, 4)] {
        assert_eq!(losses(&other), losses(&a));
        assert_eq!(other.values, a.values);
        for (x, y) in other.metrics.iter().zip(&a.metrics) {
            let (x, y) = (x.mtp_loss.unwrap(), y.mtp_loss.unwrap());
            assert!((x - y).abs() <= 1e-6 * y, "{x} vs {y}");
        }
    }
}
