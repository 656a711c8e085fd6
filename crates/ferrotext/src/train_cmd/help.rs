//! The list of keys under `ferrotext train --help`: each group of the key table
//! (`ferrotext_train::keys`) with its most used keys, and a pointer to `ferrotext keys` for the
//! rest.
//!
//! Invariant: the groups, their titles, their sizes and every name shown come from the key table
//! at run time; [`MOST_USED`] only chooses which names a group shows first, and a name the table
//! no longer has is left out (a test checks there is none), so the help cannot name a key that
//! does not exist.

use std::fmt::Write as _;

use ferrotext_train::keys::{self, Group, KEYS};

/// The keys most runs set, shown first in their group.
const MOST_USED: &[&str] = &[
    "model_name",
    "num_experts",
    "local_devices",
    "ici_data_parallelism",
    "ici_fsdp_parallelism",
    "ici_tensor_parallelism",
    "overlap_grad_reduce",
    "deterministic",
    "steps",
    "gradient_accumulation_steps",
    "per_device_batch_size",
    "max_target_length",
    "dataset_type",
    "dataset_path",
    "tokenizer_path",
    "learning_rate",
    "opt_type",
    "warmup_steps_fraction",
    "gradient_clipping_threshold",
    "shard_optimizer_over_data",
    "enable_checkpointing",
    "checkpoint_period",
    "resume",
    "load_parameters_path",
    "save_parameters_path",
    "base_output_directory",
    "run_name",
    "tensorboard",
    "profile",
];

/// Keys a group without a [`MOST_USED`] one shows (its first, in table order).
const FALLBACK_PER_GROUP: usize = 3;

/// Where the names of a group's line wrap.
const WIDTH: usize = 100;

/// The text after `ferrotext train --help`'s options: every key group with its most used keys,
/// and a pointer to `ferrotext keys`.
pub fn keys_help() -> String {
    let mut out = format!(
        "Keys by group, the most used first (each `key=value`; MaxText's names where it has one).\n\
         Run `ferrotext keys` for all {} with their forms, defaults and meanings.\n",
        KEYS.len()
    );
    for group in groups() {
        let names = shown(group);
        let in_group = KEYS.iter().filter(|k| k.group == group).count();
        let more = in_group - names.len();
        let mut items: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        if more > 0 {
            items.push(format!("and {more} more"));
        }
        let head = format!("  {:<13}", group.title());
        out.push_str(&wrap(&head, &items));
    }
    out
}

/// The key groups in the order `ferrotext keys` prints them.
fn groups() -> Vec<Group> {
    let mut groups: Vec<Group> = KEYS.iter().map(|k| k.group).collect();
    groups.sort();
    groups.dedup();
    groups
}

/// The names `group`'s line shows: its [`MOST_USED`] keys in that order, or, when it has none,
/// its first keys in table order.
fn shown(group: Group) -> Vec<&'static str> {
    let most_used: Vec<&'static str> = MOST_USED
        .iter()
        .filter_map(|name| keys::find(name))
        .filter(|k| k.group == group)
        .map(|k| k.name)
        .collect();
    if !most_used.is_empty() {
        return most_used;
    }
    KEYS.iter()
        .filter(|k| k.group == group)
        .take(FALLBACK_PER_GROUP)
        .map(|k| k.name)
        .collect()
}

/// `head` then `items` joined by `, `, wrapped before [`WIDTH`] with continuation lines indented
/// under the first item; ends with a line break.
fn wrap(head: &str, items: &[String]) -> String {
    let indent = " ".repeat(head.chars().count());
    let mut out = head.to_string();
    let mut line_len = out.chars().count();
    for (i, item) in items.iter().enumerate() {
        let piece = if i + 1 < items.len() {
            format!("{item},")
        } else {
            item.clone()
        };
        let at_start = line_len == indent.len();
        if !at_start && line_len + 1 + piece.chars().count() > WIDTH {
            out.push('\n');
            out.push_str(&indent);
            line_len = indent.len();
        } else if !at_start {
            out.push(' ');
            line_len += 1;
        }
        let _ = write!(out, "{piece}");
        line_len += piece.chars().count();
    }
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_most_used_key_exists() {
        for name in MOST_USED {
            assert!(keys::find(name).is_some(), "`{name}` is not a key");
        }
    }

    #[test]
    fn every_group_is_listed_with_at_least_one_key_and_lines_fit() {
        let help = keys_help();
        for group in groups() {
            let line = help
                .lines()
                .find(|l| l.trim_start().starts_with(&format!("{} ", group.title())))
                .unwrap_or_default();
            assert!(shown(group).iter().all(|n| help.contains(n)), "{help}");
            assert!(!line.is_empty(), "{help}");
        }
        assert!(help.lines().all(|l| l.chars().count() <= WIDTH), "{help}");
        assert!(help.contains("`ferrotext keys`"));
    }

    #[test]
    fn wrapping_indents_under_the_first_item() {
        let items: Vec<String> = (0..30).map(|i| format!("key_{i}")).collect();
        let text = wrap("  head ", &items);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines.len() > 1);
        assert!(lines[1].starts_with("       key_"), "{text}");
        assert!(lines.iter().all(|l| l.len() <= WIDTH));
        assert!(text.ends_with("key_29\n"));
    }
}
