//! Bad user input that no single config key's value explains (an argument, a config file, an
//! output path) comes back as a typed usage error carrying the argument, the path and the
//! problem, and prints one sentence naming them. Each refusal has a mirror that is accepted.

use ferrotext_train::io::check_output_paths;
use ferrotext_train::{OutputProblem, TrainConfig, TrainError};

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrotext-cfgerr-{}-{name}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn an_argument_without_equals_is_named_and_one_with_it_is_taken() {
    match TrainConfig::parse(None, &["steps".to_string()]) {
        Err(e @ TrainError::NotKeyValue { .. }) => {
            assert!(e.is_usage());
            assert_eq!(e.to_string(), "`steps` is not `key=value`");
            let TrainError::NotKeyValue { argument } = e else {
                unreachable!()
            };
            assert_eq!(argument, "steps");
        }
        other => panic!("not NotKeyValue: {other:?}"),
    }
    assert_eq!(
        TrainConfig::parse(None, &["steps=7".to_string()])
            .unwrap()
            .steps,
        7
    );
}

#[test]
fn a_config_file_that_is_not_utf8_or_not_toml_names_its_path() {
    let dir = scratch("files");
    let binary = dir.join("binary.toml");
    std::fs::write(&binary, [0xff, 0xfe, 0x00]).unwrap();
    let broken = dir.join("broken.toml");
    std::fs::write(&broken, "steps = = 3\n").unwrap();
    let good = dir.join("good.toml");
    std::fs::write(&good, "steps = 3\n").unwrap();
    match TrainConfig::parse(Some(&binary), &[]) {
        Err(e @ TrainError::ConfigNotUtf8 { .. }) => {
            assert!(e.is_usage());
            assert_eq!(
                e.to_string(),
                format!("config {} is not UTF-8 text", binary.display())
            );
        }
        other => panic!("not ConfigNotUtf8: {other:?}"),
    }
    match TrainConfig::parse(Some(&broken), &[]) {
        Err(TrainError::ConfigSyntax { path, message }) => {
            assert_eq!(path, broken.display().to_string());
            assert!(!message.is_empty());
        }
        other => panic!("not ConfigSyntax: {other:?}"),
    }
    match TrainConfig::parse(Some(&dir.join("absent.toml")), &[]) {
        Err(e @ TrainError::ConfigUnreadable { .. }) => {
            assert!(e.is_usage());
            assert!(e.to_string().contains("absent.toml"), "{e}");
        }
        other => panic!("not ConfigUnreadable: {other:?}"),
    }
    assert_eq!(TrainConfig::parse(Some(&good), &[]).unwrap().steps, 3);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn an_output_path_that_is_a_directory_carries_key_path_and_problem() {
    let dir = scratch("outputs");
    let items = |metrics: &std::path::Path| {
        vec![
            format!("base_output_directory={}", dir.display()),
            format!("metrics_file={}", metrics.display()),
        ]
    };
    let config = TrainConfig::load(None, &items(&dir)).unwrap();
    match check_output_paths(&config) {
        Err(e @ TrainError::Output { .. }) => {
            assert!(e.is_usage());
            assert_eq!(
                e.to_string(),
                format!("metrics_file: {} is a directory", dir.display())
            );
            let TrainError::Output { key, path, problem } = e else {
                unreachable!()
            };
            assert_eq!(key, "metrics_file");
            assert_eq!(path, dir.display().to_string());
            assert_eq!(problem, OutputProblem::IsADirectory);
        }
        other => panic!("not Output: {other:?}"),
    }
    let fine = TrainConfig::load(None, &items(&dir.join("metrics.jsonl"))).unwrap();
    check_output_paths(&fine).unwrap();
    std::fs::remove_dir_all(&dir).ok();
}
