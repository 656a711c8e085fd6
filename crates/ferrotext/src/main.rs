//! `ferrotext`: the command-line front door. Composes the library layers; no library sees a flag.
//!
//! Exit codes: 0 success, 1 a run that failed (a failed run, an I/O failure, a bug in
//! ferrotext), 2 bad input (usage, config, mesh, files the user named).
//!
//! Module layers, each importing only from the layers below it (so no import circle):
//! `common` (what every command shares; it imports no other module of the binary), then
//! `launch` and `mesh_arg`, then the commands. A command may use another command's work, never
//! the other way round: `train` draws its loss curve through `plot` and records link bytes
//! through `emulate`'s probe; `bench cluster` runs its jobs through `emulate`. Nothing imports
//! from this file.

mod allocator;
mod bench;
mod collectives;
mod common;
mod conformance;
mod emulate;
mod export_cmd;
mod generate_cmd;
mod launch;
mod mesh_arg;
mod plot;
mod tokenize_cmd;
mod train_cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Train transformer language models on a mesh of devices with typed shardings.
#[derive(Parser)]
#[command(name = "ferrotext", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model: `ferrotext train [config.toml] key=value ...` (MaxText key names). With no
    /// arguments: qwen3-tiny on a data=4 in-process mesh, GA 4, the bundled corpus.
    #[command(after_help = train_cmd::keys_help())]
    Train(train_cmd::TrainArgs),
    /// Plan one training step in abstract mode (shapes only, nothing allocated or communicated):
    /// type-check the whole step on any mesh and print its collective schedule; with `--cluster`,
    /// predict the step's time and memory on that cluster.
    Plan(train_cmd::PlanArgs),
    /// Run a known schedule of collectives on an in-process mesh, check every result against a
    /// serial reference, and print the collective trace.
    Collectives(collectives::CollectivesArgs),
    /// Check the sharding type rules against conformance case files (JSON lines, abstract mode).
    Conformance(conformance::ConformanceArgs),
    /// Run a command under `mpirun` on emulated hosts (network namespaces on a bridge, links
    /// shaped with `tc`) and report the bytes on the links per step:
    /// `ferrotext emulate --hosts 2 --devices-per-host 2 --link 1gbit,100us -- train steps=6`.
    /// Needs root (or CAP_NET_ADMIN), `ip`, `tc`, `mpirun` and a build with `--features mpi`.
    Emulate(emulate::EmulateArgs),
    /// The launch agent `emulate` gives `mpirun` (runs a command inside a host's namespace).
    #[command(hide = true)]
    EmulateAgent(emulate::AgentArgs),
    /// Generate text from a checkpoint or a Hugging Face directory, streamed as it is sampled:
    /// `ferrotext generate --checkpoint ferrotext_runs/default --prompt "the cat"`.
    Generate(generate_cmd::GenerateArgs),
    /// List every `train` key with the form of its value, its default and its meaning, grouped.
    Keys,
    /// Draw the loss curves of one or more runs on one chart (SVG): `ferrotext plot RUN_DIR...`.
    Plot(plot::PlotArgs),
    /// Write a checkpoint's parameters as a Hugging Face model directory:
    /// `ferrotext export RUN_DIR OUT_DIR [--dtype bf16] [--step N]`.
    Export(export_cmd::ExportArgs),
    /// Tokenize jsonl / parquet / text files (paths or globs) with a model's tokenizer into a
    /// directory of token shards for `dataset_type=shards`:
    /// `ferrotext tokenize 'data/*.jsonl' --tokenizer MODEL_DIR --output shards/`.
    Tokenize(tokenize_cmd::TokenizeArgs),
    /// Benchmarks that write JSON.
    Bench {
        #[command(subcommand)]
        which: bench::BenchCommand,
    },
}

fn main() -> ExitCode {
    allocator::huge_pages_or_reexec();
    allocator::keep_freed_memory();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => return argument_error(&err),
    };
    // Neither runs as an MPI process: the agent starts daemons for mpirun, emulate starts mpirun.
    match &cli.command {
        Command::EmulateAgent(args) => return finish(emulate::agent(args)),
        Command::Emulate(args) => return finish(emulate::run(args)),
        _ => {}
    }
    let mut launch = match launch::Launch::detect() {
        Ok(launch) => launch,
        Err(err) => return report(&err, None),
    };
    emulate::probe::mark_started(&launch);
    let result = match cli.command {
        Command::Train(args) => train_cmd::run(&args, &launch),
        Command::Plan(args) => train_cmd::plan(&args),
        Command::Collectives(args) => collectives::run(&args, &mut launch),
        Command::Conformance(args) => conformance::run(&args),
        Command::Plot(args) => plot::run(&args),
        Command::Generate(args) => generate_cmd::run(&args),
        Command::Export(args) => export_cmd::run(&args),
        Command::Tokenize(args) => tokenize_cmd::run(&args),
        Command::Keys => {
            print!("{}", ferrotext_train::keys::table());
            Ok(())
        }
        Command::Bench { which } => bench::run(which, &mut launch),
        Command::Emulate(_) | Command::EmulateAgent(_) => Ok(()), // handled above
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => report(&err, Some(&launch)),
    }
}

/// A command line the parser refused, as one `error:` line and exit code 2 (its tips folded
/// into the line); `--help` and `--version` print as the parser prints them.
fn argument_error(err: &clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(
        err.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        err.exit();
    }
    // The parser's message: `error: …`, maybe indented lines (the missing arguments) and
    // `tip:` lines, then the usage, which `--help` repeats.
    eprintln!("error: {}", argument_error_line(err));
    ExitCode::from(2)
}

/// The parser's refusal as one line (its tips and the missing arguments folded in).
fn argument_error_line(err: &clap::Error) -> String {
    let text = err.render().to_string();
    let (mut message, mut tips) = (Vec::new(), Vec::new());
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if line.starts_with("Usage:") || line.starts_with("For more information") {
            break;
        }
        match line.strip_prefix("tip: ") {
            Some(tip) => tips.push(tip),
            None => message.push(line.strip_prefix("error: ").unwrap_or(line)),
        }
    }
    let tips = if tips.is_empty() {
        String::new()
    } else {
        format!(" ({})", tips.join("; "))
    };
    format!("{}{tips}; see --help", message.join(" "))
}

/// Checks a job `ferrotext emulate` is to start on every host (the words after `--`) as this
/// command line's parser reads it, before any network exists: one line saying why it would not
/// start. A job may not be `emulate` itself.
pub(crate) fn check_job(job: &[String]) -> Result<(), String> {
    let argv = std::iter::once("ferrotext".to_string()).chain(job.iter().cloned());
    match Cli::try_parse_from(argv) {
        Ok(Cli {
            command: Command::Emulate(_) | Command::EmulateAgent(_),
        }) => Err("the job cannot be `emulate` itself: give the command each host runs".into()),
        Ok(_) => Ok(()),
        Err(err) => Err(format!("the job after `--`: {}", argument_error_line(&err))),
    }
}

/// The exit code of a command that runs outside MPI.
fn finish(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => report(&err, None),
    }
}

/// Prints `err` (prefixed by the process under MPI) and picks the exit code; under MPI with
/// several processes it ends the whole job instead of returning.
fn report(err: &anyhow::Error, launch: Option<&launch::Launch>) -> ExitCode {
    let code = exit_code(err);
    let message = one_line(err);
    match launch.filter(|l| l.processes() > 1) {
        Some(l) => eprintln!(
            "error (process {} of {}): {message}",
            l.process(),
            l.processes()
        ),
        None => eprintln!("error: {message}"),
    }
    if let Some(l) = launch {
        l.end_job_on_error(code);
    }
    ExitCode::from(code)
}

/// 2 for the user's input (a [`common::UsageError`], or a [`ferrotext_train::TrainError`],
/// [`ferrotext_generate::GenerateError`] or [`ferrotext_cost::CostError`] of the usage class), 1
/// for everything else: a bug in ferrotext, an I/O failure or a failed run is never reported as
/// the user's mistake.
fn exit_code(err: &anyhow::Error) -> u8 {
    let usage = err.downcast_ref::<common::UsageError>().is_some()
        || err
            .downcast_ref::<ferrotext_train::TrainError>()
            .is_some_and(ferrotext_train::TrainError::is_usage)
        || err
            .downcast_ref::<ferrotext_generate::GenerateError>()
            .is_some_and(ferrotext_generate::GenerateError::is_usage)
        || err
            .downcast_ref::<ferrotext_cost::CostError>()
            .is_some_and(ferrotext_cost::CostError::is_usage);
    if usage {
        2
    } else {
        1
    }
}

/// `err` and its causes as one line: each cause joined with `: ` unless its text is already in
/// the message (an I/O error's display often repeats its source), line breaks folded to `; `.
fn one_line(err: &anyhow::Error) -> String {
    let mut message = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if message.contains(&text) {
            continue;
        }
        if !message.is_empty() {
            message.push_str(": ");
        }
        message.push_str(&text);
    }
    message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}
