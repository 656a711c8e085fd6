//! The repository explains itself: every reference its text makes resolves inside it.
//!
//! Walks the repository's `*.rs`, `*.md` and `*.toml` files (and the conformance cases,
//! `*.jsonl`, for rule ids only), skipping `target/` and hidden directories, and guarantees:
//!
//! 1. every rule id `R<n>.<m>` cited anywhere is defined (as a heading) in
//!    `docs/sharding-rules.md`, and the ids defined there are unique and numbered without gaps;
//! 2. every `docs/<file>` path named anywhere exists; every `§N` resolves to a heading numbered
//!    `N` in the document it refers to — the `docs/….md` path just before it on the same or the
//!    previous line, or, inside `docs/`, the file a markdown link around it points to, else the
//!    document itself — and a `§` outside `docs/` with no document before it is an error;
//! 3. every relative markdown link in a `*.md` file points to an existing file, and its
//!    `#anchor`, if any, to a heading of that file;
//! 4. nothing points outside the repository (the team checkout beside it, or that checkout's
//!    design, spec and conformance files), except the lines of [`ALLOWED`], each with its reason;
//! 5. every file path the text names exists: a backticked path with a directory
//!    (`crates/train/src/gate.rs`, `.ci/run`, `train/src/plan/mod.rs`, `decoder/loss.rs`) is a
//!    repository path or the end of one, and a bare source file name (`blas.rs`) is the name
//!    of a file of the repository — in markdown files and in the comments of `*.rs` and
//!    `*.toml` files. Paths a run writes or reads from outside (`target/…`, absolute paths,
//!    templates with `<…>`, `{…}` or `*`) and Python files of other projects (JAX's, MaxText's)
//!    are not files of the repository and are not checked; [`EXTERNAL`] lists the names of
//!    files outside it that the text may name.
//!
//! A mirror test runs the same checker on small in-memory texts that break each rule and asserts
//! that it reports every break, so the checker can fail.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// A line allowed to name a path outside the repository: a file (path from the repository root),
/// a substring of the line, and why it may.
pub struct Allowed {
    /// The file, relative to the repository root.
    pub file: &'static str,
    /// A substring that identifies the line.
    pub line_contains: &'static str,
    /// Why the reference is legitimate.
    pub reason: &'static str,
}

/// The lines allowed to point outside the repository.
pub const ALLOWED: &[Allowed] = &[
    Allowed {
        file: "crates/ferrotext/src/bench/peers.rs",
        line_contains: concat!("default_value = \"..", "/shared/peers\""),
        reason: "`bench peers` runs the peer implementations of the team checkout; this is the \
                 flag's default, set by `--peers`",
    },
    Allowed {
        file: "docs/performance.md",
        line_contains: "`ferrotext bench peers",
        reason: "documents `bench peers`'s `--peers` flag and its default",
    },
    Allowed {
        file: "docs/long-sequences.md",
        line_contains: "/shared/peers/torch/train.py",
        reason: "the measurements' command for the torch peer, which lives in the team checkout",
    },
];

/// File names the text may name that are not files of the repository, each with its reason.
pub const EXTERNAL: &[(&str, &str)] = &[];

/// Documents another branch is writing, which links may name before they exist here; once the
/// file exists it is checked like any other, and the entry must go (a test says so).
pub const PENDING: &[&str] = &[];

/// A broken reference: where it is and what is wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    /// The file, relative to the repository root.
    pub file: String,
    /// 1-based line number.
    pub line: usize,
    /// What does not resolve.
    pub what: String,
}

/// What a document under `docs/` defines: its numbered sections, its heading anchors and (for
/// the rules document) its rule ids.
#[derive(Default, Debug)]
pub struct DocIndex {
    /// Section numbers of its headings (`"4"`, `"4.2"`).
    pub sections: BTreeSet<String>,
    /// GitHub-style anchors of its headings.
    pub anchors: BTreeSet<String>,
    /// Rule ids its headings define (`"R3.12"`), in order, duplicates kept.
    pub rules: Vec<String>,
}

/// The documents under `docs/` and every other file path that exists, keyed by path from the
/// repository root.
#[derive(Default, Debug)]
pub struct Repo {
    /// `docs/….md` (and any other markdown file) → its index.
    pub docs: BTreeMap<String, DocIndex>,
    /// Every file and directory path that exists (relative, `/`-separated).
    pub paths: BTreeSet<String>,
}

/// The rules document.
pub const RULES_DOC: &str = "docs/sharding-rules.md";

/// References to paths outside the repository, assembled at run time so this file does not
/// match itself.
fn forbidden() -> Vec<String> {
    vec![
        ["..", "/shared"].concat(),
        ["spec/", "unreduced-semantics.md"].concat(),
        ["maxtext-", "reference.md"].concat(),
        ["DESIGN", ".md"].concat(),
        ["DESIGN", " §"].concat(),
        ["spec", " §"].concat(),
        ["reference", " §"].concat(),
        ["conformance/", "FORMAT.md"].concat(),
        ["STYLE", ".md"].concat(),
        ["multihost-", "emulation.md"].concat(),
    ]
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The files the checks read: `(relative path, text)`.
fn walk(root: &Path) -> (Vec<(String, String)>, BTreeSet<String>) {
    let mut files = Vec::new();
    let mut paths = BTreeSet::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let mut entries: Vec<_> = fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
            .map(|e| e.expect("readable directory entry"))
            .collect();
        entries.sort_by_key(|e| e.file_name());
        for entry in entries {
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = entry.path();
            let rel = path
                .strip_prefix(root)
                .expect("under the root")
                .to_string_lossy()
                .replace('\\', "/");
            let kind = entry.file_type().expect("file type");
            if kind.is_dir() {
                if name == "target" || (name.starts_with('.') && name != ".ci") {
                    continue;
                }
                paths.insert(rel);
                stack.push(path);
            } else if kind.is_file() {
                paths.insert(rel.clone());
                let wanted = [".rs", ".md", ".toml", ".jsonl"]
                    .iter()
                    .any(|ext| name.ends_with(ext));
                if wanted {
                    if let Ok(text) = fs::read_to_string(&path) {
                        files.push((rel, text));
                    }
                }
            }
        }
    }
    files.sort();
    (files, paths)
}

/// The GitHub anchor of a heading's text: lower case, spaces to `-`, punctuation dropped.
pub fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// A heading's text, without its `#`s and inline backticks.
fn heading(line: &str) -> Option<&str> {
    let rest = line.trim_start_matches('#');
    (rest.len() < line.len() && rest.starts_with(' ')).then(|| rest.trim())
}

/// A rule id at the start of `s` (`R3.12`), with its length in bytes.
fn rule_id_at(s: &str) -> Option<(String, usize)> {
    let b = s.as_bytes();
    if b.first() != Some(&b'R') {
        return None;
    }
    let digits = |from: usize| b[from..].iter().take_while(|c| c.is_ascii_digit()).count();
    let n = digits(1);
    if n == 0 || b.get(1 + n) != Some(&b'.') {
        return None;
    }
    let m = digits(2 + n);
    if m == 0 {
        return None;
    }
    let end = 2 + n + m;
    // `R1.2.3` or `R1.2x` is not a rule id.
    let next = b.get(end).copied();
    if next.is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_')
        || (next == Some(b'.') && b.get(end + 1).is_some_and(u8::is_ascii_digit))
    {
        return None;
    }
    Some((s[..end].to_string(), end))
}

/// Rule ids cited in `text`: `(line, id)`.
pub fn rule_ids(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let mut prev: Option<char> = None;
        for (at, c) in line.char_indices() {
            let boundary = !prev.is_some_and(|p| p.is_alphanumeric() || p == '_');
            if c == 'R' && boundary {
                if let Some((id, _)) = rule_id_at(&line[at..]) {
                    out.push((i + 1, id));
                }
            }
            prev = Some(c);
        }
    }
    out
}

/// Indexes a markdown document: section numbers, anchors, rule ids of its headings.
pub fn index_doc(text: &str) -> DocIndex {
    let mut index = DocIndex::default();
    let mut in_code = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        let Some(h) = heading(line) else { continue };
        index.anchors.insert(slug(h));
        let number: String = h
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.')
            .collect();
        let number = number.trim_end_matches('.');
        if !number.is_empty() {
            index.sections.insert(number.to_string());
        }
        if let Some((id, _)) = rule_id_at(h) {
            index.rules.push(id);
        }
    }
    index
}

/// `docs/…` paths named in `line`: `(byte offset, path)`, trailing punctuation removed.
fn doc_paths(line: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(found) = line[from..].find("docs/") {
        let at = from + found;
        from = at + 5;
        let before = line[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || "/_-.".contains(c)) {
            continue; // part of a longer path (`jax/docs/…`)
        }
        let path: String = line[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || "/_-.".contains(*c))
            .collect();
        let path = path.trim_end_matches('.').to_string();
        out.push((at, path));
    }
    out
}

/// The section number after a `§` at the start of `s` (`"4.2"`), if any.
fn section_at(s: &str) -> Option<String> {
    let s = s.strip_prefix('§')?.trim_start_matches(' ');
    let number: String = s
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    let number = number.trim_end_matches('.');
    (!number.is_empty()).then(|| number.to_string())
}

/// For a section sign inside `docs/`, the markdown file a link around it points to:
/// `[design 4.2](design.md#…)`; `None` for a link within the same file.
fn link_target_after(rest: &str) -> Option<String> {
    let close = rest.find(']')?;
    if rest[..close].contains('\n') || rest[..close].contains('[') {
        return None;
    }
    let target = rest[close..].strip_prefix("](")?;
    let end = target.find([')', '#'])?;
    (end > 0).then(|| target[..end].to_string())
}

/// Joins a relative link onto the directory of `file`, resolving `..` and `.`.
fn join(file: &str, link: &str) -> String {
    let mut parts: Vec<&str> = file.split('/').collect();
    parts.pop();
    for part in link.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    parts.join("/")
}

/// Every broken reference in `text`, the file `file` of `repo`.
pub fn check_text(file: &str, text: &str, repo: &Repo, allowed: &[Allowed]) -> Vec<Finding> {
    let mut findings = Vec::new();
    let mut report = |line: usize, what: String| {
        findings.push(Finding {
            file: file.to_string(),
            line,
            what,
        })
    };
    let in_docs = file.starts_with("docs/");
    let rules: BTreeSet<&String> = repo
        .docs
        .get(RULES_DOC)
        .map(|d| d.rules.iter().collect())
        .unwrap_or_default();

    // 1. Rule ids.
    for (line, id) in rule_ids(text) {
        if !rules.contains(&id) {
            report(line, format!("rule {id} is not defined in {RULES_DOC}"));
        }
    }
    if file.ends_with(".jsonl") {
        return findings; // generated case data: rule ids only
    }

    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        let n = i + 1;
        // 2. `docs/…` paths exist.
        for (_, path) in doc_paths(line) {
            let path = path.trim_end_matches('/');
            if !repo.paths.contains(path) && !PENDING.contains(&path) {
                report(n, format!("`{path}` does not exist"));
            }
        }
        // 2. `§N` resolves in the document it refers to.
        for (at, _) in line.match_indices('§') {
            let Some(number) = section_at(&line[at..]) else {
                continue;
            };
            let here: Vec<(usize, String)> = doc_paths(&line[..at]);
            let previous = i.checked_sub(1).map(|p| doc_paths(lines[p]));
            let doc = if in_docs {
                link_target_after(&line[at..])
                    .map(|t| join(file, &t))
                    .unwrap_or_else(|| file.to_string())
            } else if let Some((_, p)) = here.last() {
                p.clone()
            } else if let Some((_, p)) = previous.and_then(|v| v.last().cloned()) {
                p
            } else {
                report(
                    n,
                    format!("§{number} names no document (write `docs/….md §{number}`)"),
                );
                continue;
            };
            match repo.docs.get(&doc) {
                Some(index) if index.sections.contains(&number) => {}
                Some(_) => report(n, format!("{doc} has no section {number}")),
                None => report(
                    n,
                    format!("§{number} refers to {doc}, which is not a document"),
                ),
            }
        }
        // 3. Relative markdown links resolve, anchors included.
        if file.ends_with(".md") {
            let mut from = 0;
            while let Some(found) = line[from..].find("](") {
                let start = from + found + 2;
                from = start;
                let Some(len) = line[start..].find(')') else {
                    continue;
                };
                let target = &line[start..start + len];
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let (path, anchor) = match target.split_once('#') {
                    Some((p, a)) => (p, Some(a)),
                    None => (target, None),
                };
                let resolved = if path.is_empty() {
                    file.to_string()
                } else {
                    join(file, path)
                };
                let pending = PENDING.contains(&resolved.as_str());
                if !repo.paths.contains(resolved.trim_end_matches('/')) {
                    if !pending {
                        report(n, format!("link `{target}`: `{resolved}` does not exist"));
                    }
                    continue;
                }
                if let Some(anchor) = anchor {
                    let known = repo
                        .docs
                        .get(&resolved)
                        .is_some_and(|d| d.anchors.contains(anchor));
                    if !known {
                        report(
                            n,
                            format!("link `{target}`: no heading `#{anchor}` in {resolved}"),
                        );
                    }
                }
            }
        }
        // 5. Named file paths exist.
        let prose = file.ends_with(".md") || is_comment(line);
        if prose {
            for path in named_paths(line) {
                if !resolves(&path, repo) {
                    report(n, format!("`{path}` names no file of the repository"));
                }
            }
        }
        // 4. Nothing outside the repository.
        for pattern in forbidden() {
            if line.contains(&pattern) {
                let ok = allowed
                    .iter()
                    .any(|a| a.file == file && line.contains(a.line_contains));
                if !ok {
                    report(n, format!("`{pattern}` points outside the repository"));
                }
            }
        }
    }
    findings
}

/// Whether `line` of a source file is (or ends in) a comment.
fn is_comment(line: &str) -> bool {
    line.contains("//") || line.trim_start().starts_with('#')
}

/// The file paths a line names: backticked spans that are a path with a directory, or a source
/// file's name (see rule 5).
pub fn named_paths(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    for span in line.split('`').skip(1).step_by(2) {
        let span = span.trim_end_matches(['.', ',', ':', ';']);
        let span = span.split(['#', ' ']).next().unwrap_or_default();
        // A line number, an item path and an anchor name the file before them.
        let span = span.split("::").next().unwrap_or_default();
        let span = span.split(':').next().unwrap_or_default();
        if span.is_empty()
            || span.starts_with(['/', '~', '$', '-'])
            || span.starts_with("target/")
            || span.contains(['<', '{', '*', '…', '=', '@', '|', '(', '[', '\\'])
            || span.chars().any(char::is_uppercase) && !span.ends_with(".md")
        {
            continue;
        }
        let ours = ["crates/", "docs/", ".ci/"]
            .iter()
            .any(|r| span.starts_with(r));
        // Python files outside `crates/` are other projects' (JAX, MaxText, the peers').
        let source = [".rs", ".md", ".sh"].iter().any(|e| span.ends_with(e));
        // A one-letter stem is a field (`b.rs`, a stride), not a file.
        let field = span.len() == 4 && !span.contains('/');
        let with_dir = ours || (span.contains('/') && source);
        let source = source && !field;
        if source || with_dir {
            out.push(span.trim_end_matches('/').to_string());
        }
    }
    out
}

/// Whether `path` is a repository path, the end of one, or (a bare name) a file's name.
fn resolves(path: &str, repo: &Repo) -> bool {
    if repo.paths.contains(path) || PENDING.contains(&path) {
        return true;
    }
    let tail = format!("/{path}");
    let name = path.rsplit('/').next().unwrap_or(path);
    repo.paths.iter().any(|p| p.ends_with(&tail))
        || EXTERNAL.iter().any(|(external, _)| *external == name)
}

/// Checks the rules document's own numbering: ids unique, and within each group `R<n>.*`
/// numbered consecutively from 0 or 1.
pub fn check_numbering(index: &DocIndex) -> Vec<String> {
    let mut problems = Vec::new();
    let mut groups: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for id in &index.rules {
        if !seen.insert(id) {
            problems.push(format!("{id} is defined twice"));
        }
        let (n, m) = id[1..].split_once('.').expect("an id has a dot");
        groups
            .entry(n.parse().expect("digits"))
            .or_default()
            .push(m.parse().expect("digits"));
    }
    for (n, mut ms) in groups {
        ms.sort_unstable();
        ms.dedup();
        let first = ms[0];
        if first > 1 || ms.iter().enumerate().any(|(k, &m)| m != first + k as u32) {
            problems.push(format!("R{n}.x is not numbered consecutively: {ms:?}"));
        }
    }
    problems
}

fn load_repo(root: &Path) -> (Repo, Vec<(String, String)>) {
    let (files, paths) = walk(root);
    let docs = files
        .iter()
        .filter(|(p, _)| p.ends_with(".md"))
        .map(|(p, t)| (p.clone(), index_doc(t)))
        .collect();
    (Repo { docs, paths }, files)
}

#[test]
fn every_reference_resolves_inside_the_repository() {
    let (repo, files) = load_repo(&repo_root());
    let rules = repo
        .docs
        .get(RULES_DOC)
        .unwrap_or_else(|| panic!("{RULES_DOC} is missing"));
    assert!(
        rules.rules.len() > 50,
        "{RULES_DOC} defines only {} rules",
        rules.rules.len()
    );
    let numbering = check_numbering(rules);
    assert!(numbering.is_empty(), "{RULES_DOC}: {numbering:#?}");
    assert!(repo.docs.contains_key("docs/design.md"));

    let findings: Vec<Finding> = files
        .iter()
        .flat_map(|(file, text)| check_text(file, text, &repo, ALLOWED))
        .collect();
    let listing: Vec<String> = findings
        .iter()
        .map(|f| format!("{}:{}: {}", f.file, f.line, f.what))
        .collect();
    assert!(
        findings.is_empty(),
        "{} unresolved references:\n{}",
        findings.len(),
        listing.join("\n")
    );
    // The walk saw the code that cites the rules (a walk that finds nothing passes trivially).
    let cited: usize = files.iter().map(|(_, t)| rule_ids(t).len()).sum();
    assert!(cited > 100, "only {cited} rule citations found");
    let named: usize = files
        .iter()
        .flat_map(|(f, t)| t.lines().map(move |l| (f, l)))
        .filter(|(f, l)| f.ends_with(".md") || is_comment(l))
        .map(|(_, l)| named_paths(l).len())
        .sum();
    assert!(named > 200, "only {named} file paths found");
    eprintln!(
        "{} files read, {cited} rule ids and {named} file paths checked",
        files.len()
    );
}

#[test]
fn every_allowed_line_is_still_there() {
    let (_, files) = load_repo(&repo_root());
    for a in ALLOWED {
        let found = files
            .iter()
            .any(|(f, t)| f == a.file && t.lines().any(|l| l.contains(a.line_contains)));
        assert!(
            found,
            "allowed line `{}` is gone from {}: remove it from ALLOWED ({})",
            a.line_contains, a.file, a.reason
        );
    }
}

#[test]
fn every_pending_document_is_still_pending() {
    let root = repo_root();
    for path in PENDING {
        assert!(
            !root.join(path).exists(),
            "{path} exists now: remove it from PENDING (and its EXTERNAL line) so it is checked"
        );
    }
}

/// Mirror: the checker reports each kind of break in a small in-memory repository. (`\u{a7}` is
/// written escaped so that the walk over this file does not check these deliberate breaks.)
#[test]
fn mirror_the_checker_reports_each_break() {
    let rules_doc = "# Rules\n\n## 1. Data\n\n#### R1.1 — a rule\n\n#### R1.2 — another\n";
    let design_doc = "# Design\n\n## 4. Semantics\n\n### 4.2 Reduced next to sharded\n";
    let mut repo = Repo::default();
    repo.docs.insert(RULES_DOC.into(), index_doc(rules_doc));
    repo.docs
        .insert("docs/design.md".into(), index_doc(design_doc));
    for p in ["docs", RULES_DOC, "docs/design.md", "src", "src/a.rs"] {
        repo.paths.insert(p.into());
    }

    // A clean text passes.
    let good = "//! R1.1 and R1.2; docs/design.md \u{a7}4.2 and \u{a7}4; docs/sharding-rules.md \u{a7}1.\n\
                //! A wrapped reference to docs/design.md\n//! \u{a7}4.2 still resolves.\n";
    assert_eq!(check_text("src/a.rs", good, &repo, &[]), vec![]);

    // Each break is reported, on its line.
    let undefined = format!("R{}.{}", 1, 9);
    let bad = [
        format!("//! cites {undefined}"),
        "//! as \u{a7}4.2 says".to_string(),
        format!("//! see {}missing.md", ["do", "cs/"].concat()),
        "//! docs/design.md \u{a7}4.7".to_string(),
        format!("//! {}", ["..", "/shared/x"].concat()),
        format!("//! {}", ["DESIGN", ".md"].concat()),
    ]
    .join("\n");
    let found = check_text("src/a.rs", &bad, &repo, &[]);
    let lines: Vec<usize> = found.iter().map(|f| f.line).collect();
    assert_eq!(lines, vec![1, 2, 3, 4, 5, 6], "{found:#?}");
    assert!(found[0].what.contains(&undefined));
    assert!(found[1].what.contains("names no document"));
    assert!(found[2].what.contains("missing.md"));
    assert!(found[3].what.contains("no section 4.7"));

    // An allowed line passes, the same line elsewhere does not.
    let allowed = [Allowed {
        file: "src/a.rs",
        line_contains: "default",
        reason: "test",
    }];
    let outside = format!("default = \"{}\"", ["..", "/shared/peers"].concat());
    assert_eq!(check_text("src/a.rs", &outside, &repo, &allowed), vec![]);
    assert_eq!(check_text("src/b.rs", &outside, &repo, &allowed).len(), 1);

    // Inside docs/, links and their anchors resolve; a section sign follows its link.
    let doc = "See [design \u{a7}4.2](design.md#42-reduced-next-to-sharded).\n\
               See [design \u{a7}4.9](design.md#4-semantics), [x](nowhere.md), \
               [y](design.md#no-such-heading), and \u{a7}1 here.\n";
    let found = check_text(RULES_DOC, doc, &repo, &[]);
    let whats: Vec<&str> = found.iter().map(|f| f.what.as_str()).collect();
    assert_eq!(found.len(), 3, "{whats:#?}");
    assert!(whats[0].contains("no section 4.9"));
    assert!(whats[1].contains("nowhere.md"));
    assert!(whats[2].contains("no-such-heading"));

    // Named files: a path with a directory or a source file's name must exist; outputs and
    // templates are not checked.
    // (`\u{60}` is a backtick, written escaped so the walk over this file does not check it.)
    let files =
        "//! \u{60}src/a.rs\u{60}, \u{60}a.rs\u{60}, \u{60}target/x.json\u{60}, \u{60}b.rs\u{60}\n\
                 //! \u{60}src/gone.rs\u{60} and \u{60}gone.rs\u{60}\n";
    let found = check_text("src/b.rs", files, &repo, &[]);
    let whats: Vec<&str> = found.iter().map(|f| f.what.as_str()).collect();
    assert_eq!(
        found.iter().map(|f| f.line).collect::<Vec<_>>(),
        vec![2, 2],
        "{whats:#?}"
    );
    assert!(whats[0].contains("src/gone.rs") && whats[1].contains("`gone.rs`"));

    // Numbering: a duplicate and a gap are reported.
    let gappy = index_doc("#### R2.1 — a\n#### R2.3 — b\n#### R2.3 — c\n");
    assert_eq!(check_numbering(&gappy).len(), 2);
    // Ids inside longer tokens are not rule ids.
    assert!(rule_ids("XR1.1 R1.2.3 R1.2a").is_empty());
    assert_eq!(rule_ids("(R3.12(a), R1.7–R1.16)").len(), 3);
}
