//! Corpus files: paths or globs expanded to files, and each file read as documents.
//!
//! Formats, by the file's extension: `.jsonl` / `.json` (one JSON object a line, the text in
//! `field`), `.parquet` (the string column `field`; snappy, zstd or uncompressed pages), `.txt`
//! (the whole file one document). Invariants: a pattern that matches nothing, a file without
//! the field, a record whose field is not a string (or null) is an error naming the file, the
//! line or row and the field; nothing is skipped silently. Documents come out in file order
//! (globs sorted), then record order.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use parquet::basic::Type as PhysicalType;
use parquet::column::reader::ColumnReader;
use parquet::file::reader::{FileReader, SerializedFileReader};

use crate::error::DataError;
use ferrotext_files::open_regular;

/// A corpus file's format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// JSON lines.
    Jsonl,
    /// Apache Parquet.
    Parquet,
    /// Plain UTF-8 text: one document a file.
    Text,
}

impl Format {
    /// The format a file's extension names.
    ///
    /// # Errors
    /// [`DataError::UnknownFormat`].
    pub fn of(path: &Path) -> Result<Format, DataError> {
        match path.extension().and_then(|e| e.to_str()) {
            Some("jsonl" | "json" | "ndjson") => Ok(Format::Jsonl),
            Some("parquet") => Ok(Format::Parquet),
            Some("txt" | "text") => Ok(Format::Text),
            _ => Err(DataError::UnknownFormat {
                path: path.to_path_buf(),
            }),
        }
    }
}

/// The files `patterns` name, in order: a path as is, a glob (`*`, `?`, `[`) as its matches
/// sorted.
///
/// # Errors
/// [`DataError::NoMatch`] for a pattern (or path) that names no file,
/// [`DataError::BadPattern`], [`DataError::UnknownFormat`].
pub fn expand(patterns: &[String]) -> Result<Vec<(PathBuf, Format)>, DataError> {
    let mut files = Vec::new();
    for pattern in patterns {
        let matched: Vec<PathBuf> = if pattern.contains(['*', '?', '[']) {
            let paths = glob::glob(pattern).map_err(|e| DataError::BadPattern {
                pattern: pattern.clone(),
                reason: e.msg.to_string(),
            })?;
            let mut found: Vec<PathBuf> = paths.filter_map(Result::ok).collect();
            found.retain(|p| p.is_file());
            found.sort();
            found
        } else {
            let p = PathBuf::from(pattern);
            if p.is_file() {
                vec![p]
            } else {
                Vec::new()
            }
        };
        if matched.is_empty() {
            return Err(DataError::NoMatch {
                pattern: pattern.clone(),
            });
        }
        for p in matched {
            let format = Format::of(&p)?;
            files.push((p, format));
        }
    }
    Ok(files)
}

/// Checks before anything is tokenized that every file has `field`: a parquet file's schema, a
/// jsonl file's first record (later records are checked as they are read).
///
/// # Errors
/// As [`for_each_document`], for the first record or the schema.
pub fn precheck(files: &[(PathBuf, Format)], field: &str) -> Result<(), DataError> {
    for (path, format) in files {
        match format {
            Format::Parquet => {
                let reader = parquet_reader(path)?;
                parquet_column(path, &reader, field)?;
            }
            Format::Jsonl => {
                let file = open_regular(path).map_err(DataError::read(path))?;
                let mut lines = BufReader::new(file).lines();
                let mut n = 0u64;
                for line in lines.by_ref() {
                    n += 1;
                    let line = line.map_err(DataError::read(path))?;
                    if !line.trim().is_empty() {
                        jsonl_text(path, n, &line, field)?;
                        break;
                    }
                }
            }
            Format::Text => {}
        }
    }
    Ok(())
}

/// Calls `f` with each document of `path`, in order.
///
/// # Errors
/// [`DataError::Read`], [`DataError::Parse`], [`DataError::MissingField`],
/// [`DataError::NotText`], and whatever `f` returns.
pub fn for_each_document(
    path: &Path,
    format: Format,
    field: &str,
    f: &mut dyn FnMut(String) -> Result<(), DataError>,
) -> Result<(), DataError> {
    match format {
        Format::Text => {
            let bytes = ferrotext_files::read_regular(path).map_err(DataError::read(path))?;
            let text = String::from_utf8(bytes).map_err(|e| DataError::Parse {
                path: path.to_path_buf(),
                line: None,
                reason: format!("not UTF-8 text: {e}"),
            })?;
            f(text)
        }
        Format::Jsonl => {
            let file = open_regular(path).map_err(DataError::read(path))?;
            let reader = BufReader::with_capacity(1 << 20, file);
            for (i, line) in reader.lines().enumerate() {
                let line = line.map_err(|e| DataError::Parse {
                    path: path.to_path_buf(),
                    line: Some(i as u64 + 1),
                    reason: e.to_string(),
                })?;
                if line.trim().is_empty() {
                    continue;
                }
                f(jsonl_text(path, i as u64 + 1, &line, field)?)?;
            }
            Ok(())
        }
        Format::Parquet => parquet_documents(path, field, f),
    }
}

/// The text in `field` of the JSON object `line` (line `n` of `path`).
fn jsonl_text(path: &Path, n: u64, line: &str, field: &str) -> Result<String, DataError> {
    let value: serde_json::Value = serde_json::from_str(line).map_err(|e| DataError::Parse {
        path: path.to_path_buf(),
        line: Some(n),
        reason: format!("not a JSON object: {e}"),
    })?;
    let serde_json::Value::Object(mut map) = value else {
        return Err(DataError::Parse {
            path: path.to_path_buf(),
            line: Some(n),
            reason: "not a JSON object".into(),
        });
    };
    match map.remove(field) {
        Some(serde_json::Value::String(s)) => Ok(s),
        Some(other) => Err(DataError::NotText {
            path: path.to_path_buf(),
            field: field.into(),
            line: Some(n),
            found: json_kind(&other).into(),
        }),
        None => Err(DataError::MissingField {
            path: path.to_path_buf(),
            field: field.into(),
            line: Some(n),
            found: map.keys().cloned().collect(),
        }),
    }
}

/// What a JSON value is, in words.
fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// A parquet reader of `path`.
fn parquet_reader(path: &Path) -> Result<SerializedFileReader<std::fs::File>, DataError> {
    let file = open_regular(path).map_err(DataError::read(path))?;
    SerializedFileReader::new(file).map_err(|e| DataError::Parse {
        path: path.to_path_buf(),
        line: None,
        reason: format!("not a parquet file: {e}"),
    })
}

/// The leaf column `field` of a parquet file, checked to be a non-repeated byte array.
fn parquet_column(
    path: &Path,
    reader: &SerializedFileReader<std::fs::File>,
    field: &str,
) -> Result<usize, DataError> {
    let schema = reader.metadata().file_metadata().schema_descr();
    let names: Vec<String> = (0..schema.num_columns())
        .map(|i| schema.column(i).path().string())
        .collect();
    let Some(col) = names.iter().position(|n| n == field) else {
        return Err(DataError::MissingField {
            path: path.to_path_buf(),
            field: field.into(),
            line: None,
            found: names,
        });
    };
    let descr = schema.column(col);
    let not_text = |found: String| DataError::NotText {
        path: path.to_path_buf(),
        field: field.into(),
        line: None,
        found,
    };
    if descr.physical_type() != PhysicalType::BYTE_ARRAY {
        return Err(not_text(format!("a {} column", descr.physical_type())));
    }
    if descr.max_rep_level() > 0 {
        return Err(not_text("a repeated column".into()));
    }
    Ok(col)
}

/// Every value of the string column `field` of a parquet file, row group after row group.
fn parquet_documents(
    path: &Path,
    field: &str,
    f: &mut dyn FnMut(String) -> Result<(), DataError>,
) -> Result<(), DataError> {
    let reader = parquet_reader(path)?;
    let col = parquet_column(path, &reader, field)?;
    let max_def = reader
        .metadata()
        .file_metadata()
        .schema_descr()
        .column(col)
        .max_def_level();
    let parse = |e: parquet::errors::ParquetError| DataError::Parse {
        path: path.to_path_buf(),
        line: None,
        reason: e.to_string(),
    };
    let mut row = 0u64;
    for g in 0..reader.num_row_groups() {
        let group = reader.get_row_group(g).map_err(parse)?;
        let ColumnReader::ByteArrayColumnReader(mut column) =
            group.get_column_reader(col).map_err(parse)?
        else {
            return Err(DataError::NotText {
                path: path.to_path_buf(),
                field: field.into(),
                line: None,
                found: "not a byte-array column".into(),
            });
        };
        let (mut defs, mut values) = (Vec::new(), Vec::new());
        loop {
            defs.clear();
            values.clear();
            let (records, _, _) = column
                .read_records(1024, Some(&mut defs), None, &mut values)
                .map_err(parse)?;
            if records == 0 {
                break;
            }
            if max_def > 0 && defs.iter().any(|&d| d < max_def) {
                let at = defs.iter().position(|&d| d < max_def).unwrap_or(0);
                return Err(DataError::NotText {
                    path: path.to_path_buf(),
                    field: field.into(),
                    line: None,
                    found: format!("null in row {}", row + at as u64),
                });
            }
            for v in values.drain(..) {
                let text =
                    String::from_utf8(v.data().to_vec()).map_err(|_| DataError::NotText {
                        path: path.to_path_buf(),
                        field: field.into(),
                        line: None,
                        found: format!("binary data (not UTF-8) in row {row}"),
                    })?;
                row += 1;
                f(text)?;
            }
        }
    }
    Ok(())
}
