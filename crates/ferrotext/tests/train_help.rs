//! `ferrotext train --help` lists the keys: every group of the key table
//! (`ferrotext_train::keys`) with some of its keys, each one a key the table has, in its own
//! group, and a pointer to `ferrotext keys` for the full list. Nothing here names a key: the
//! groups and keys checked are the table's.

use ferrotext_train::keys::{self, Group, KEYS};

mod common;
use common::ferrotext;

/// The key groups, in the table's order.
fn groups() -> Vec<Group> {
    let mut groups: Vec<Group> = KEYS.iter().map(|k| k.group).collect();
    groups.sort();
    groups.dedup();
    groups
}

/// The key names the help shows under the group `title`: its line and the deeper-indented lines
/// that continue it, without the closing `and N more`.
fn names_under(help: &str, title: &str) -> Vec<String> {
    let mut lines = help
        .lines()
        .skip_while(|l| !(l.starts_with("  ") && l.trim_start().starts_with(&format!("{title} "))));
    let Some(first) = lines.next() else {
        return Vec::new();
    };
    let indent = |l: &str| l.len() - l.trim_start().len();
    let mut text = first.trim_start()[title.len()..].to_string();
    for line in lines.take_while(|l| !l.trim().is_empty() && indent(l) > indent(first)) {
        text.push(' ');
        text.push_str(line.trim());
    }
    text.split(',')
        .map(|n| n.trim().to_string())
        .filter(|n| !n.is_empty() && !n.starts_with("and "))
        .collect()
}

#[test]
fn train_help_lists_each_group_with_real_keys_and_points_to_ferrotext_keys() {
    let out = ferrotext(&["train", "--help"]);
    assert!(out.status.success(), "exit {:?}", out.status.code());
    let help = String::from_utf8(out.stdout).expect("utf-8 help");
    assert!(help.contains("`ferrotext keys`"), "{help}");
    assert!(
        help.contains(&format!("all {} ", KEYS.len())),
        "the help counts every key: {help}"
    );
    for group in groups() {
        let names = names_under(&help, group.title());
        assert!(
            !names.is_empty(),
            "no keys under `{}`:\n{help}",
            group.title()
        );
        for name in &names {
            let key = keys::find(name)
                .unwrap_or_else(|| panic!("`{name}` is not a key of the table:\n{help}"));
            assert_eq!(
                key.group,
                group,
                "`{name}` is listed under `{}`",
                group.title()
            );
        }
    }
}
