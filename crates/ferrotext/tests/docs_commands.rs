//! Every `ferrotext` command the repository's text names is one the binary takes: the
//! subcommand (and `bench`'s), each `--flag` after it, and each `key=value` of `train` and
//! `plan` a key `ferrotext keys` lists.
//!
//! The text read: `README.md`, `ARCHITECTURE.md`, `docs/*.md` and the comments of every `*.rs`
//! file and `.ci/` script. A command is a code-block line or a backticked span that starts with
//! `ferrotext `, `target/release/ferrotext ` or `cargo run --release -- `; placeholders
//! (`key=value`, `[keys...]`, `FILE...`, upper-case words) are not checked. A mirror test runs
//! the checker on commands that break each rule.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

mod common;
use common::ferrotext;

/// What the binary takes: subcommands with their flags, `bench`'s with theirs, the train keys.
struct Cli {
    /// `train`, `plan`, ..., and `bench ga`, `bench cluster`, ...: their `--flags`.
    flags: BTreeMap<String, BTreeSet<String>>,
    /// Every `train` key.
    keys: BTreeSet<String>,
}

/// The `Commands:` of a `--help` text.
fn commands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .filter(|c| c != "help")
        .collect()
}

/// The `--flags` a `--help` text lists.
fn flags(help: &str) -> BTreeSet<String> {
    help.split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == '=')
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(|w| {
            w.trim_end_matches(|c: char| !c.is_alphanumeric())
                .to_string()
        })
        .collect()
}

fn stdout(args: &[&str]) -> String {
    let out = ferrotext(args);
    assert!(out.status.success(), "ferrotext {args:?} failed");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl Cli {
    fn from_binary() -> Cli {
        let mut all = BTreeMap::new();
        for sub in commands(&stdout(&["--help"])) {
            all.insert(sub.clone(), flags(&stdout(&[&sub, "--help"])));
            if sub == "bench" {
                for b in commands(&stdout(&["bench", "--help"])) {
                    let help = stdout(&["bench", &b, "--help"]);
                    all.insert(format!("bench {b}"), flags(&help));
                }
            }
        }
        let keys = stdout(&["keys"])
            .lines()
            .filter(|l| l.starts_with("  "))
            .filter_map(|l| l.split_whitespace().next().map(str::to_string))
            .collect();
        Cli { flags: all, keys }
    }

    /// What is wrong with the command `words` (after the binary's name), if anything.
    fn check(&self, words: &[&str]) -> Vec<String> {
        let words: Vec<&str> = words
            .iter()
            .map(|w| w.trim_matches(|c| "[]()`\"',;".contains(c)))
            .filter(|w| !w.is_empty() && *w != "\\" && *w != "\\|" && *w != "|")
            .collect();
        let Some(&first) = words.first() else {
            return vec![];
        };
        if !first.chars().all(|c| c.is_ascii_lowercase() || c == '-') || first == "emulate-agent" {
            return vec![]; // a placeholder or the hidden agent
        }
        let (command, rest) = if first == "bench" {
            match words.get(1) {
                Some(b) if b.chars().all(|c| c.is_ascii_lowercase()) => {
                    (format!("bench {b}"), &words[2..])
                }
                _ => ("bench".to_string(), &words[1..]),
            }
        } else {
            (first.to_string(), &words[1..])
        };
        let Some(known) = self.flags.get(&command) else {
            return vec![format!("`ferrotext {command}` is no command")];
        };
        let mut problems = Vec::new();
        let mut after_flag = false;
        for (i, &w) in rest.iter().enumerate() {
            if w == "--" {
                // `emulate ... -- train ...`: the rest is the job's own command.
                problems.extend(self.check(&rest[i + 1..]));
                break;
            }
            if let Some(flag) = w.strip_prefix("--") {
                let flag = flag.split('=').next().unwrap_or_default();
                if !known.contains(&format!("--{flag}")) {
                    problems.push(format!("`ferrotext {command}` has no --{flag}"));
                }
                after_flag = !w.contains('=');
                continue;
            }
            let checked = matches!(command.as_str(), "train" | "plan");
            if let (false, true, Some((key, _))) = (after_flag, checked, w.split_once('=')) {
                let placeholder = key.is_empty()
                    || ["key", "k", "keys"].contains(&key)
                    || key
                        .chars()
                        .any(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'));
                if !placeholder && !self.keys.contains(key) {
                    problems.push(format!("`ferrotext {command}` takes no key `{key}`"));
                }
            }
            after_flag = false;
        }
        problems
    }
}

/// The commands a text names: `(line, words after the binary's name)`.
fn named_commands(text: &str, markdown: bool) -> Vec<(usize, Vec<String>)> {
    const STARTS: [&str; 3] = [
        "cargo run --release -- ",
        "target/release/ferrotext ",
        "ferrotext ",
    ];
    let mut out = Vec::new();
    let mut in_code = false;
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if markdown && trimmed.starts_with("```") {
            in_code = !in_code;
            continue;
        }
        let mut spans: Vec<&str> = line.split('`').skip(1).step_by(2).collect();
        if in_code {
            spans.push(line);
        }
        for span in spans {
            let span = span.trim_start_matches("sudo ").trim_start_matches("$ ");
            for start in STARTS {
                let Some(at) = span.find(start) else { continue };
                // `ferrotext` must begin the span or follow `mpirun … ` / `sudo ` / `srun … `.
                let before = &span[..at];
                let launcher = before.is_empty()
                    || before.ends_with('/')
                    || before.contains("mpirun ")
                    || before.contains("srun ")
                    || before.trim_end().ends_with("=")
                    || before
                        .trim()
                        .chars()
                        .all(|c| c.is_ascii_uppercase() || "_=0123456789 ".contains(c));
                if !launcher {
                    continue;
                }
                let words: Vec<String> = span[at + start.len()..]
                    .split_whitespace()
                    .map(|w| w.split('#').next().unwrap_or_default().to_string())
                    .take_while(|w| !w.is_empty())
                    .collect();
                out.push((i + 1, words));
                break;
            }
        }
    }
    out
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `(path, text, markdown)` of every file the check reads: markdown whole, the comments of
/// Rust sources and of the CI scripts.
fn texts(root: &Path) -> Vec<(String, String, bool)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("a readable directory") {
            let path = entry.expect("an entry").path();
            let name = path
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .to_string();
            let rel = path
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            if path.is_dir() {
                if name != "target" && (!name.starts_with('.') || name == ".ci") {
                    stack.push(path);
                }
                continue;
            }
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            if name.ends_with(".md") {
                out.push((rel, text, true));
            } else if name.ends_with(".rs") || rel.starts_with(".ci/") {
                let comments: String = text
                    .lines()
                    .map(|l| {
                        match l
                            .find("//")
                            .or_else(|| l.trim_start().starts_with('#').then_some(0))
                        {
                            Some(at) => &l[at..],
                            None => "",
                        }
                    })
                    .collect::<Vec<_>>()
                    .join("\n");
                out.push((rel, comments, false));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn every_command_the_text_names_is_one_the_binary_takes() {
    let cli = Cli::from_binary();
    assert!(cli.flags.contains_key("bench ga") && cli.keys.contains("steps"));
    let mut problems = Vec::new();
    let mut seen = 0;
    for (file, text, markdown) in texts(&repo_root()) {
        if file == "crates/ferrotext/tests/docs_commands.rs" {
            continue; // the mirror's deliberate breaks
        }
        for (line, words) in named_commands(&text, markdown) {
            seen += 1;
            let words: Vec<&str> = words.iter().map(String::as_str).collect();
            for p in cli.check(&words) {
                problems.push(format!("{file}:{line}: {p}"));
            }
        }
    }
    assert!(
        seen > 30,
        "only {seen} commands found: the scan misses them"
    );
    eprintln!("{seen} commands checked");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Mirror: the checker reports an unknown subcommand, bench subcommand, flag and key, also
/// after `emulate`'s `--`, and passes placeholders.
#[test]
fn mirror_the_checker_reports_each_break() {
    let cli = Cli::from_binary();
    let check = |cmd: &str| cli.check(&cmd.split_whitespace().collect::<Vec<_>>());
    assert!(check("train steps=3 dtype=bfloat16").is_empty());
    assert!(check("train [config.toml] key=value ...").is_empty());
    assert!(check("plan --cluster hosts=2,devices_per_host=2,link=1gbit --json").is_empty());
    assert_eq!(check("trian steps=3").len(), 1);
    assert_eq!(check("bench gaa").len(), 1);
    assert_eq!(check("export A B --dtyp bf16").len(), 1);
    assert_eq!(check("train stepz=3").len(), 1);
    assert_eq!(check("emulate --hosts 2 -- train stepz=6").len(), 1);
    let found = named_commands(
        "run `ferrotext train steps=1`, not ferrotext's own words\n```sh\nmpirun -n 2 target/release/ferrotext plan\n```\n",
        true,
    );
    let words: Vec<Vec<String>> = found.into_iter().map(|(_, w)| w).collect();
    assert_eq!(
        words,
        vec![
            vec!["train".to_string(), "steps=1".into()],
            vec!["plan".into()]
        ]
    );
}
