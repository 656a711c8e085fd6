//! `ferrotext generate`: text from a ferrotext checkpoint or a Hugging Face directory, streamed to
//! stdout as it is sampled (the library's `generate` and `text` modules do the work).
//!
//! Where the model comes from: `--checkpoint` (a run directory, its `checkpoints/` root, or one
//! checkpoint; the config saved with it names the model), else the `train` keys (`model_name`,
//! `load_parameters_path` = a safetensors file or a HF directory, ...). Where the tokenizer comes
//! from: `--tokenizer`, else `tokenizer_path`, else the HF directory's `tokenizer.json`, else
//! bytes (what a model trained on the bundled corpus reads).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use anyhow::Result;
use clap::Args;
use ferrotext_generate::generate::{self, GenerateOptions, Stop};
use ferrotext_generate::sample::SamplingParams;
use ferrotext_generate::text::{StreamDecoder, TextCodec};
use ferrotext_generate::GenerateError;
use ferrotext_sharding::DType;
use ferrotext_train::{DatasetType, TrainConfig, TrainError};

use crate::common::{config_args, dtype_flag, usage};

/// Arguments of `ferrotext generate`.
#[derive(Args)]
pub struct GenerateArgs {
    /// The text to continue.
    #[arg(long)]
    prompt: String,
    /// A ferrotext checkpoint: a run directory, its `checkpoints/` directory (the latest
    /// checkpoint) or one checkpoint directory.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    temperature: f64,
    /// Keep only the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Keep the most likely tokens up to this total probability, in (0, 1].
    #[arg(long, default_value_t = 1.0, allow_hyphen_values = true)]
    top_p: f64,
    /// Seed of the draws.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Token ids that end the generation, comma-separated (added to a HF config's
    /// `eos_token_id`).
    #[arg(long, value_delimiter = ',')]
    eos: Vec<u32>,
    /// A `tokenizer.json` (overrides the model's own).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Recompute the whole context for every token instead of using the key/value cache (the
    /// slow reference).
    #[arg(long)]
    no_cache: bool,
    /// The compute dtype, `bfloat16` or `float32` (MaxText's `dtype`; `bf16`, `f32` also):
    /// overrides the checkpoint's or the `dtype` key's. The weights are read as f32 either way.
    #[arg(long)]
    dtype: Option<String>,
    /// With bf16 on a `FERROTEXT_MATMUL` kernel without a bf16 product: use ferrotext's own bf16
    /// kernel instead of refusing (the `matmul_bf16_fallback` key).
    #[arg(long)]
    matmul_bf16_fallback: bool,
    /// Without `--checkpoint`: an optional TOML config, then `key=value` (the `train` keys that
    /// name the model, e.g. `load_parameters_path=DIR`).
    args: Vec<String>,
}

/// The model, its parameters and where its tokenizer and end-of-sequence ids come from.
struct Source {
    config: TrainConfig,
    params: Vec<ferrotext_tensor::Tensor>,
    /// The Hugging Face directory the model comes from (named, or the one a checkpoint's run
    /// loaded): its tokenizer and end-of-sequence ids are the model's.
    hf_dir: Option<PathBuf>,
}

/// The checkpoint or parameters the arguments name.
fn source(args: &GenerateArgs) -> Result<Source> {
    if let Some(path) = &args.checkpoint {
        if !args.args.is_empty() {
            return Err(usage(
                "with --checkpoint the model is the one the checkpoint saved: give no config keys",
            ));
        }
        let root = path.join("checkpoints");
        let path = if root.is_dir() { root } else { path.clone() };
        // The user named it: a path that is not a readable checkpoint is their input.
        let (config, params) =
            ferrotext_train::checkpoint::read_parameters(&path).map_err(|e| {
                TrainError::Params {
                    path: path.display().to_string(),
                    reason: e.to_string(),
                }
            })?;
        // A model trained from a HF directory generates with that directory's tokenizer and
        // end-of-sequence ids, as the directory itself would.
        let hf_dir = config.hf_source().map(Path::to_path_buf);
        return Ok(Source {
            config,
            params,
            hf_dir,
        });
    }
    let mut config = config_args::parse_config(&args.args)?;
    // Generation reads no training data: the data keys' checks (e.g. byte-level data needing a
    // vocabulary of 256) do not apply to it.
    config.dataset_type = DatasetType::Synthetic;
    if config.load_parameters_path.is_empty() {
        return Err(usage(
            "nothing to generate from: give --checkpoint RUN_DIR or load_parameters_path=PATH \
             (a safetensors file or a Hugging Face directory)",
        ));
    }
    let plan = config.plan()?;
    let path = Path::new(&config.load_parameters_path);
    let params = ferrotext_train::io::load_parameters(path, plan.params())?;
    Ok(Source {
        hf_dir: config.hf_source().map(Path::to_path_buf),
        config,
        params,
    })
}

/// The tokenizer: `--tokenizer`, `tokenizer_path`, the HF directory's, or bytes.
fn codec(args: &GenerateArgs, source: &Source, vocab: usize) -> Result<TextCodec> {
    let named = args
        .tokenizer
        .clone()
        .or_else(|| {
            (!source.config.tokenizer_path.is_empty())
                .then(|| source.config.tokenizer_path.clone().into())
        })
        .or_else(|| {
            let t = source.hf_dir.as_ref()?.join("tokenizer.json");
            t.is_file().then_some(t)
        });
    match named {
        Some(path) => Ok(TextCodec::from_file(&path)?),
        None if vocab >= 256 => Ok(TextCodec::Bytes),
        None => Err(usage(format!(
            "the model's vocabulary ({vocab}) is not bytes and it names no tokenizer: give \
             --tokenizer tokenizer.json"
        ))),
    }
}

/// The end-of-sequence ids of a HF directory, as transformers' `generate` takes them: the
/// `eos_token_id` (a number or a list) of its `generation_config.json` where that sets one, else
/// of its `config.json` (Llama 3.1 Instruct stops on three ids there and names one here).
fn hf_eos(dir: &Path) -> Vec<u32> {
    let eos_of = |file: &str| -> Option<Vec<u32>> {
        let text = ferrotext_files::read_regular_to_string(&dir.join(file)).ok()?;
        let json = serde_json::from_str::<serde_json::Value>(&text).ok()?;
        match json.get("eos_token_id")? {
            serde_json::Value::Number(n) => {
                Some(n.as_u64().map(|n| n as u32).into_iter().collect())
            }
            serde_json::Value::Array(xs) => Some(
                xs.iter()
                    .filter_map(|x| x.as_u64().map(|n| n as u32))
                    .collect(),
            ),
            _ => None,
        }
    };
    eos_of(ferrotext_hf::GENERATION_CONFIG_FILE)
        .or_else(|| eos_of(ferrotext_hf::CONFIG_FILE))
        .unwrap_or_default()
}

/// The compute dtype and, in bf16, what computes the products (`select_matmul_kernel` fixed
/// it before any product ran).
fn compute_line(plan: &ferrotext_train::RunPlan) -> String {
    match crate::train_cmd::bf16_kernel(plan) {
        Some(kernel) => format!("dtype bfloat16 on {kernel}"),
        None => format!("dtype {}", plan.precision().dtype.name()),
    }
}

/// `ferrotext generate`.
pub fn run(args: &GenerateArgs) -> Result<()> {
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    };
    // Check what needs no model first: bad flags fail before anything is read.
    sampling.validate().map_err(|e| usage(format!("{e}")))?;
    if args.max_new_tokens == 0 {
        return Err(usage("--max-new-tokens must be at least 1"));
    }
    let mut source = source(args)?;
    if let Some(dtype) = &args.dtype {
        source.config.dtype = dtype_flag(dtype, &[DType::BF16, DType::F32])?;
    }
    source.config.matmul_bf16_fallback |= args.matmul_bf16_fallback;
    ferrotext_train::select_matmul_kernel(&source.config)?;
    let plan = source.config.plan()?;
    let decoder = plan.decoder();
    let vocab = decoder.config().vocab_size;
    let codec = codec(args, &source, vocab)?;
    let prompt = codec.encode(&args.prompt)?;
    let mut stop_tokens = args.eos.clone();
    if let Some(dir) = &source.hf_dir {
        stop_tokens.extend(hf_eos(dir));
    }
    let options = GenerateOptions {
        max_new_tokens: args.max_new_tokens,
        sampling,
        stop_tokens,
        context: source.config.max_target_length,
        use_cache: !args.no_cache,
    };
    options.check(&prompt, vocab)?;
    let stream = Mutex::new(StreamDecoder::after(&codec, &prompt));
    let stdout = std::io::stdout();
    print!("{}", args.prompt);
    stdout.lock().flush()?;
    let line_open = AtomicBool::new(!args.prompt.ends_with('\n'));
    let emit = |token: u32| -> Result<(), GenerateError> {
        let text = stream
            .lock()
            .map_err(|_| GenerateError::Internal("the output stream's lock was poisoned".into()))?
            .push(token);
        if !text.is_empty() {
            line_open.store(!text.ends_with('\n'), Ordering::Relaxed);
        }
        let mut out = std::io::stdout().lock();
        out.write_all(text.as_bytes())
            .and_then(|()| out.flush())
            .map_err(|source| GenerateError::Io {
                path: "stdout".into(),
                source,
            })
    };
    let generated = generate::generate(decoder, &source.params, &prompt, &options, &emit)?;
    let rest = stream
        .into_inner()
        .map_err(|_| anyhow::anyhow!("the output stream's lock was poisoned"))?
        .finish();
    if rest.is_empty() && !line_open.load(Ordering::Relaxed) {
        std::io::stdout().flush()?;
    } else {
        println!("{rest}");
    }
    let stop = match generated.stop {
        Stop::MaxNewTokens => "max new tokens".to_string(),
        Stop::StopToken(t) => format!("stop token {t}"),
        Stop::ContextFull => format!("context full ({} positions)", options.context),
    };
    let per_token = generated.median_token_seconds().map_or(String::new(), |s| {
        format!(", then {:.2} ms/token (median)", s * 1e3)
    });
    eprintln!(
        "generated {} tokens after a {}-token prompt ({stop}); first token {:.1} ms{per_token}; \
         key/value cache {}; {}",
        generated.tokens.len(),
        prompt.len(),
        generated.first_token_seconds * 1e3,
        if options.use_cache { "on" } else { "off" },
        compute_line(&plan),
    );
    Ok(())
}
