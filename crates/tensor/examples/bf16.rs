//! GFLOP/s of bf16 × bf16 → f32 products against f32 products at training shapes, on one
//! core, per matrix-product library, the two dtypes alternated in one process so their ratio
//! holds on a busy machine.
//!
//! Shapes: a layer's weight products at 512 tokens (a micro-batch) for qwen3-peer (d 256, 8 q
//! / 4 kv heads of 32, MLP 768, vocab 2048) and qwen3-0.6b (d 1024, 16 q / 8 kv heads of 128,
//! MLP 3072, vocab 151936 in 8 column blocks of 18992), each as the forward `x·W`, `dx = dy·Wᵀ`
//! and `dW = xᵀ·dy` (activation products also stored as bf16, rounded after or as stored; the
//! weight gradient also rounded and added into an `f32` accumulator, as a step computes it).
//! Each library runs in a child process of its own (`FERROTEXT_MATMUL` is
//! read once per process); a library without a bf16 product runs bf16 on the portable kernel
//! (the fallback, named in the output); `auto` lets the process choose (f32 on the first library
//! found, bf16 on ferrotext's AVX512_BF16 kernel where the CPU has it). Writes
//! `target/bench/bf16.json`.
//!
//! `tokens=` sets the rows of a micro-batch (512; 128 is a device's share at data=4) and
//! `threads=` the threads of each product (1; 2 is the machine's cores), on a kernel pool as a
//! device's, with the allocator set as the `ferrotext` binary sets it. The same shapes through
//! PyTorch: `crates/ferrotext/bench/matmul_torch.py`; both in one sitting:
//! `crates/ferrotext/bench/matmul_sitting.sh`.
//!
//! ```text
//! cargo run --release -p ferrotext-tensor --example bf16 -- [libs=auto,mkl,openblas,portable] [pairs=5] [models=peer,0.6b] [tokens=512] [threads=1]
//! ```

use std::hint::black_box;
use std::time::Instant;

use ferrotext_tensor::{
    allow_bf16_fallback, dot_general, dot_general_bf16, dot_general_bf16_rounded,
    dot_general_bf16_rounded_accumulate_parts, matmul_kernel, Bf16Tensor, DotDims, Tensor,
};

/// One weight: its name, fan-in and fan-out.
type Weight = (&'static str, usize, usize);

fn weights(model: &str) -> Vec<Weight> {
    match model {
        "peer" => vec![
            ("qkv", 256, 512),
            ("attn_out", 256, 256),
            ("mlp_up", 256, 768),
            ("mlp_down", 768, 256),
            ("lm_head", 256, 2048),
        ],
        _ => vec![
            ("qkv", 1024, 4096),
            ("attn_out", 2048, 1024),
            ("mlp_up", 1024, 3072),
            ("mlp_down", 3072, 1024),
            ("lm_head/8", 1024, 18992),
        ],
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The lhs and rhs shapes and dimension numbers of `[m,k]·[k,n]` with either operand stored
/// transposed.
fn layout(m: usize, n: usize, k: usize, lt: bool, rt: bool) -> (Vec<usize>, Vec<usize>, DotDims) {
    let ls = if lt { vec![k, m] } else { vec![m, k] };
    let rs = if rt { vec![n, k] } else { vec![k, n] };
    let dims = DotDims {
        lhs_contracting: vec![usize::from(!lt)],
        rhs_contracting: vec![usize::from(rt)],
        ..DotDims::default()
    };
    (ls, rs, dims)
}

/// The two operands of a product of these shapes, in `f32` (deterministic values in
/// [−0.5, 0.5]).
fn operands(ls: &[usize], rs: &[usize]) -> (Tensor, Tensor) {
    (
        Tensor::from_fn(ls, |i| ((i * 7 + 3) % 101) as f32 * 0.01 - 0.5),
        Tensor::from_fn(rs, |i| ((i * 5 + 1) % 97) as f32 * 0.01 - 0.5),
    )
}

/// Runs `first` and `second` once each, then times them in `pairs` alternating pairs (the
/// order swapped every pair); returns each one's GFLOP/s at `flops` a call, from its median.
fn alternated(pairs: usize, flops: f64, first: &dyn Fn(), second: &dyn Fn()) -> (f64, f64) {
    let time = |f: &dyn Fn()| {
        let t = Instant::now();
        f();
        t.elapsed().as_secs_f64()
    };
    first();
    second();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for p in 0..pairs {
        if p % 2 == 0 {
            a.push(time(first));
            b.push(time(second));
        } else {
            b.push(time(second));
            a.push(time(first));
        }
    }
    (flops / median(a) / 1e9, flops / median(b) / 1e9)
}

/// Times f32 and bf16 of one product in alternating pairs; returns (f32, bf16) GFLOP/s.
fn measure(
    ls: &[usize],
    rs: &[usize],
    dims: &DotDims,
    flops: f64,
    (pairs, threads): (usize, usize),
) -> (f64, f64) {
    let (l, r) = operands(ls, rs);
    let (l16, r16) = (Bf16Tensor::from_f32(&l), Bf16Tensor::from_f32(&r));
    let f32_run = || {
        black_box(dot_general(&l, &r, dims, threads).ok());
    };
    let bf16_run = || {
        black_box(dot_general_bf16(&l16, &r16, dims, threads).ok());
    };
    alternated(pairs, flops, &f32_run, &bf16_run)
}

/// Times a weight gradient as a step computes it, `dot_general_bf16_rounded_accumulate_parts`
/// (the product rounded to bf16 and added into an `f32` accumulator, a band of rows at a time),
/// against the product alone into a new `f32` result, in alternating pairs; returns their
/// GFLOP/s (alone, accumulated).
fn measure_accumulated(
    ls: &[usize],
    rs: &[usize],
    dims: &DotDims,
    flops: f64,
    (pairs, threads): (usize, usize),
) -> (f64, f64) {
    let (l, r) = operands(ls, rs);
    let (l, r) = (Bf16Tensor::from_f32(&l), Bf16Tensor::from_f32(&r));
    let len: usize = dims.output_shape(ls, rs).map_or(0, |s| s.iter().product());
    let acc = std::cell::RefCell::new(vec![0.0f32; len]);
    let alone = || {
        black_box(dot_general_bf16(&l, &r, dims, threads).ok());
    };
    let accumulated = || {
        let mut acc = acc.borrow_mut();
        let ok = dot_general_bf16_rounded_accumulate_parts(&l, &r, dims, threads, &mut [&mut acc]);
        black_box(ok.ok());
    };
    alternated(pairs, flops, &alone, &accumulated)
}

/// Times a bf16 product stored as bf16 two ways in alternating pairs: the `f32` result then a
/// rounding pass (`Bf16Tensor::from_f32`), and the product rounded as it is stored
/// (`dot_general_bf16_rounded`); returns their GFLOP/s (separate, fused).
fn measure_rounded(
    ls: &[usize],
    rs: &[usize],
    dims: &DotDims,
    flops: f64,
    (pairs, threads): (usize, usize),
) -> (f64, f64) {
    let (l, r) = operands(ls, rs);
    let (l, r) = (Bf16Tensor::from_f32(&l), Bf16Tensor::from_f32(&r));
    let separate = || {
        black_box(
            dot_general_bf16(&l, &r, dims, threads)
                .ok()
                .map(|y| Bf16Tensor::from_f32(&y)),
        );
    };
    let fused = || {
        black_box(dot_general_bf16_rounded(&l, &r, dims, threads).ok());
    };
    alternated(pairs, flops, &separate, &fused)
}

/// The child: this process's library, every shape, JSON rows on stdout. The products run on
/// a kernel pool of `threads` workers with this thread one of them, as a device's do
/// (`with_kernel_pool`): called from outside a pool, a split product handed every part to the
/// global pool and slept, and two threads ran qwen3-peer's shapes at 0.8–1.1× one thread.
fn child(models: &[String], pairs: usize, tokens: usize, threads: usize) {
    ferrotext_tensor::with_kernel_pool(threads, "bench", 16 << 20, || {
        child_on_pool(models, pairs, tokens, threads)
    });
}

/// [`child`] on its pool.
fn child_on_pool(models: &[String], pairs: usize, tokens: usize, threads: usize) {
    let f32_kernel = matmul_kernel();
    let bf16_kernel = allow_bf16_fallback().unwrap_or_else(|e| e.to_string());
    eprintln!("f32: {f32_kernel}\nbf16: {bf16_kernel}");
    let mut rows = Vec::new();
    for model in models {
        for (name, din, dout) in weights(model) {
            let t = tokens;
            for (product, m, n, k, lt, rt) in [
                ("x·W", t, dout, din, false, false),
                ("dy·Wᵀ", t, din, dout, false, true),
                ("xᵀ·dy", din, dout, t, true, false),
            ] {
                let (ls, rs, dims) = layout(m, n, k, lt, rt);
                let flops = 2.0 * (m * n * k) as f64;
                let (f, b) = measure(&ls, &rs, &dims, flops, (pairs, threads));
                // Activation products stored as bf16: rounded after, or as the product is
                // stored. The weight gradient: alone into a new f32 result, or rounded and added
                // into the step's accumulator as a step computes it.
                let gradient = product == "xᵀ·dy";
                let (sep, fused) = if gradient {
                    measure_accumulated(&ls, &rs, &dims, flops, (pairs, threads))
                } else {
                    measure_rounded(&ls, &rs, &dims, flops, (pairs, threads))
                };
                let (first, second, keys) = if gradient {
                    (
                        "into f32: alone",
                        "accumulated",
                        ("bf16_alone_gflops", "bf16_accumulated_gflops"),
                    )
                } else {
                    (
                        "to bf16: then round",
                        "fused",
                        ("bf16_then_round_gflops", "bf16_rounded_gflops"),
                    )
                };
                eprintln!(
                    "{model:>5} {name:<10} {product:<6} {m:>5}×{n:>5}×{k:>5}  f32 {f:>6.1}  bf16 {b:>6.1} GFLOP/s  ×{:.2}  {first} {sep:>6.1}  {second} {fused:>6.1}  ×{:.2}",
                    b / f,
                    fused / sep
                );
                let num = |x: f64| {
                    if x.is_nan() {
                        "null".to_string()
                    } else {
                        format!("{x:.2}")
                    }
                };
                rows.push(format!(
                    "{{\"model\":\"{model}\",\"weight\":\"{name}\",\"product\":\"{product}\",\"m\":{m},\"n\":{n},\"k\":{k},\"f32_gflops\":{f:.2},\"bf16_gflops\":{b:.2},\"bf16_over_f32\":{:.3},\"{}\":{},\"{}\":{}}}",
                    b / f,
                    keys.0,
                    num(sep),
                    keys.1,
                    num(fused)
                ));
            }
        }
    }
    let esc = |s: &str| s.replace('"', "'");
    println!(
        "{{\"f32_kernel\":\"{}\",\"bf16_kernel\":\"{}\",\"rows\":[{}]}}",
        esc(&f32_kernel),
        esc(&bf16_kernel),
        rows.join(",")
    );
}

/// glibc's tunables for the child: one arena, no `mmap`ed blocks, never trimmed, 2 MiB pages.
const ALLOCATOR_TUNABLES: &str = "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:\
glibc.malloc.trim_threshold=18446744073709551615:glibc.malloc.hugetlb=1";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut libs = "auto,mkl,openblas,portable".to_string();
    let (mut pairs, mut models) = (5usize, "peer,0.6b".to_string());
    let (mut tokens, mut threads) = (512usize, 1usize);
    for arg in std::env::args().skip(1) {
        match arg.split_once('=') {
            Some(("libs", v)) => libs = v.into(),
            Some(("pairs", v)) => pairs = v.parse()?,
            Some(("models", v)) => models = v.into(),
            Some(("tokens", v)) => tokens = v.parse()?,
            Some(("threads", v)) => threads = v.parse()?,
            _ => {
                return Err(format!(
                    "unknown argument {arg:?} (libs=, pairs=, models=, tokens=, threads=)"
                )
                .into())
            }
        }
    }
    let models: Vec<String> = models.split(',').map(String::from).collect();
    if std::env::var_os("FERROTEXT_BF16_BENCH_CHILD").is_some() {
        child(&models, pairs, tokens, threads);
        return Ok(());
    }
    let mut results = Vec::new();
    for lib in libs.split(',') {
        eprintln!("== {lib}");
        let mut cmd = std::process::Command::new(std::env::current_exe()?);
        cmd.args(std::env::args().skip(1))
            .env("FERROTEXT_BF16_BENCH_CHILD", "1")
            .stderr(std::process::Stdio::inherit());
        // The allocator as the `ferrotext` binary sets it (`crates/ferrotext/src/allocator.rs`):
        // no `mmap`ed blocks and no trimming, so a large result does not fault its pages in
        // again on every call (an LM head's column block: ~25% of its time on glibc's
        // defaults). A `GLIBC_TUNABLES` already set is left as it is.
        if std::env::var_os("GLIBC_TUNABLES").is_none() {
            cmd.env("GLIBC_TUNABLES", ALLOCATOR_TUNABLES);
        }
        // `auto`: the process's own choice (f32 on the first library found, bf16 on the
        // AVX512_BF16 kernel where the CPU has it).
        match lib {
            "auto" => cmd.env_remove("FERROTEXT_MATMUL"),
            _ => cmd.env("FERROTEXT_MATMUL", lib),
        };
        let out = cmd.output()?;
        if !out.status.success() {
            return Err(format!("the {lib} run failed").into());
        }
        let json = String::from_utf8(out.stdout)?;
        results.push(format!("{{\"library\":\"{lib}\",\"run\":{}}}", json.trim()));
    }
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().replace('"', "'"))
        })
        .unwrap_or_default();
    std::fs::create_dir_all("target/bench")?;
    let path = "target/bench/bf16.json";
    std::fs::write(
        path,
        format!(
            "{{\"benchmark\":\"bf16\",\"threads\":{threads},\"tokens\":{tokens},\"cpu\":\"{cpu}\",\"libraries\":[{}]}}\n",
            results.join(",")
        ),
    )?;
    eprintln!("wrote {path}");
    Ok(())
}
