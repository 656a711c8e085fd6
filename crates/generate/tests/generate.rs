//! Generation: greedy decoding through the key/value cache picks, at every position, the argmax
//! of a full forward over the whole context so far (the training forward, recomputed per token);
//! stop tokens and the context limit end it; every token reaches the callback in order.

use std::sync::Mutex;

use ferrotext_generate::generate::{generate, GenerateOptions, Stop};
use ferrotext_generate::sample::SamplingParams;
use ferrotext_models::decoder::{Config, Decoder};
use ferrotext_models::init_normal;
use ferrotext_tensor::Tensor;

fn model(preset: &str) -> (Decoder, Vec<Tensor>) {
    let mut cfg = Config::preset(preset).unwrap();
    cfg.base_num_decoder_layers = cfg.base_num_decoder_layers.min(3);
    let d = Decoder::new(cfg).unwrap();
    // a larger scale than training's init, so the greedy path is not one repeated token
    let params = d
        .params()
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let t = init_normal(p, 21, i);
            let data = t.data().iter().map(|x| x * 3.0).collect();
            Tensor::new(t.shape().to_vec(), data).unwrap()
        })
        .collect();
    (d, params)
}

fn options(max_new_tokens: usize, use_cache: bool) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens,
        sampling: SamplingParams::default(),
        stop_tokens: vec![],
        context: 64,
        use_cache,
    }
}

#[test]
fn greedy_with_the_cache_is_the_argmax_of_full_recomputation_at_every_position() {
    for preset in [
        "qwen3-tiny",
        "qwen3-moe-tiny",
        "deepseek3-tiny",
        "llama3-tiny",
        "qwen2-tiny",
    ] {
        let (d, params) = model(preset);
        let prompt = [5, 17, 99, 3, 42];
        let seen = Mutex::new(Vec::new());
        let record = |t: u32| {
            seen.lock().unwrap().push(t);
            Ok(())
        };
        let cached = generate(&d, &params, &prompt, &options(24, true), &record).unwrap();
        let full = generate(&d, &params, &prompt, &options(24, false), &|_| Ok(())).unwrap();
        assert_eq!(cached.tokens.len(), 24, "{preset}");
        assert_eq!(cached.stop, Stop::MaxNewTokens);
        assert_eq!(cached.tokens, full.tokens, "{preset}");
        assert_eq!(*seen.lock().unwrap(), cached.tokens, "{preset}: the stream");
        let distinct: std::collections::BTreeSet<_> = cached.tokens.iter().collect();
        assert!(
            distinct.len() > 2,
            "{preset}: a degenerate path {:?}",
            cached.tokens
        );
    }
}

#[test]
fn a_stop_token_ends_the_generation_and_the_context_bounds_it() {
    let (d, params) = model("qwen3-tiny");
    let prompt = [5, 17, 99, 3, 42];
    let free = generate(&d, &params, &prompt, &options(24, true), &|_| Ok(())).unwrap();
    // stop at the token greedy decoding produces 4th: it is emitted, then nothing more
    let mut o = options(24, true);
    o.stop_tokens = vec![free.tokens[3]];
    let first = free
        .tokens
        .iter()
        .position(|&t| t == free.tokens[3])
        .unwrap();
    let stopped = generate(&d, &params, &prompt, &o, &|_| Ok(())).unwrap();
    assert_eq!(stopped.stop, Stop::StopToken(free.tokens[3]));
    assert_eq!(stopped.tokens, free.tokens[..=first]);
    // a context of 9 holds the 5 prompt tokens and 4 new ones
    let mut o = options(24, true);
    o.context = 9;
    let short = generate(&d, &params, &prompt, &o, &|_| Ok(())).unwrap();
    assert_eq!(short.stop, Stop::ContextFull);
    assert_eq!(short.tokens, free.tokens[..4]);
}

#[test]
fn sampling_is_seeded_and_differs_from_greedy() {
    let (d, params) = model("qwen3-tiny");
    let prompt = [5, 17, 99];
    let mut o = options(16, true);
    o.sampling = SamplingParams {
        temperature: 1.5,
        top_k: 50,
        top_p: 0.95,
        seed: 7,
    };
    let a = generate(&d, &params, &prompt, &o, &|_| Ok(())).unwrap();
    let b = generate(&d, &params, &prompt, &o, &|_| Ok(())).unwrap();
    assert_eq!(a.tokens, b.tokens, "the same seed draws the same tokens");
    let greedy = generate(&d, &params, &prompt, &options(16, true), &|_| Ok(())).unwrap();
    assert_ne!(
        a.tokens, greedy.tokens,
        "a hot sampler that never leaves greedy"
    );
}

#[test]
fn a_failing_callback_stops_the_generation_with_its_error() {
    let (d, params) = model("qwen3-tiny");
    let err = generate(&d, &params, &[1, 2], &options(8, true), &|_| {
        Err(ferrotext_generate::GenerateError::Internal(
            "closed pipe".into(),
        ))
    })
    .unwrap_err();
    assert!(err.to_string().contains("closed pipe"), "{err}");
}

/// The logits of the last position of `row`, through the full forward on a fresh device
/// context (no casts remembered: every weight is cast at use).
fn last_logits(decoder: &Decoder, params: &[Tensor], row: &[u32]) -> Vec<f32> {
    use ferrotext_sharding::{Mesh, NamedSharding, PartitionSpec};
    let mesh = std::sync::Arc::new(Mesh::explicit([("data", 1)]).unwrap());
    let out = ferrotext_comm::run_spmd(&mesh, &ferrotext_comm::SpmdOptions::default(), |dev| {
        ferrotext_spmd::on_device(dev, |cx| {
            let replicated = NamedSharding::new(mesh.clone(), PartitionSpec::replicated())?;
            let weights = params
                .iter()
                .map(|p| cx.from_global(p, replicated.clone()))
                .collect::<Result<Vec<_>, _>>()?;
            let ids = cx.ids_from_global(&[1, row.len()], PartitionSpec::replicated(), row)?;
            let logits = decoder.logits(cx, &weights, &ids)?;
            cx.to_host(&logits)
        })
    })
    .unwrap();
    let data = out[0].data();
    data[data.len() - decoder.config().vocab_size..].to_vec()
}

/// A bf16 generation casts each weight once (`Ctx::remember_casts`), not per token: its greedy
/// tokens are, at every position, the argmax of a full bf16 forward that casts every weight at
/// use, on the same context (the same computation, so the same bits). The mirror: those bf16
/// logits are not the f32 ones, so the comparison runs bf16.
#[test]
fn bf16_generation_with_casts_remembered_picks_what_casting_at_use_picks() {
    for preset in ["qwen3-tiny", "qwen3-moe-tiny", "deepseek3-tiny"] {
        let (f32_decoder, params) = model(preset);
        let mut cfg = Config::preset(preset).unwrap();
        cfg.base_num_decoder_layers = cfg.base_num_decoder_layers.min(3);
        let d = Decoder::new(cfg)
            .unwrap()
            .with_compute_dtype(ferrotext_sharding::DType::BF16)
            .unwrap();
        let prompt = [5u32, 17, 99, 3, 42];
        let got = generate(&d, &params, &prompt, &options(6, false), &|_| Ok(())).unwrap();
        let mut context = prompt.to_vec();
        for (i, &token) in got.tokens.iter().enumerate() {
            let logits = last_logits(&d, &params, &context);
            let best = (0..logits.len()).fold(0, |b, j| if logits[j] > logits[b] { j } else { b });
            assert_eq!(token as usize, best, "{preset}: token {i}");
            if i == 0 {
                assert_ne!(
                    logits,
                    last_logits(&f32_decoder, &params, &context),
                    "{preset}"
                );
            }
            context.push(token);
        }
    }
}
