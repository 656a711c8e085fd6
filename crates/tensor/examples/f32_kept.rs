//! What keeping a weight's packing is worth, product by product: `dot_general` against a weight
//! as stored (this process's `f32` kernel, which packs it on every call) and against the same
//! weight keeping its packings (`Tensor::keeping_packings`: the portable kernel's panels, packed
//! on the first call and read after), alternated pair by pair, on the forward `x·W` and the
//! backward `dx = dy·Wᵀ` of qwen3-peer's and qwen3-0.6b's layer weights. The two results are
//! checked against each other (within 1e-4 of the largest element).
//!
//! The kept route runs where the process's products take it: on the portable kernel
//! (`FERROTEXT_MATMUL=portable`), or beside a BLAS with `FERROTEXT_F32_KEPT=1`. Without either,
//! both columns are the BLAS and the example says so. Writes `target/bench/f32_kept.json`.
//!
//! Run it with the allocator as the `ferrotext` binary sets it (each product allocates its
//! result; on glibc's defaults a large one faults its pages in again every time):
//!
//! ```text
//! GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=18446744073709551615:glibc.malloc.hugetlb=1 \
//!   FERROTEXT_F32_KEPT=1 cargo run --release -p ferrotext-tensor --example f32_kept -- \
//!   [tokens=128,512] [threads=1,2] [pairs=5]
//! ```

use std::time::Instant;

use ferrotext_tensor::{dot_general, f32_products_keep_packings, matmul_kernel, DotDims, Tensor};

/// A layer's weights `(name, fan-in, fan-out)`: qwen3-peer's and qwen3-0.6b's.
const WEIGHTS: [(&str, usize, usize); 8] = [
    ("peer qkv", 256, 512),
    ("peer attn_out", 256, 256),
    ("peer mlp_up", 256, 768),
    ("peer mlp_down", 768, 256),
    ("0.6b qkv", 1024, 4096),
    ("0.6b attn_out", 2048, 1024),
    ("0.6b mlp_up", 1024, 3072),
    ("0.6b mlp_down", 3072, 1024),
];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `tokens=…`, `threads=…` (comma lists of positive counts) and `pairs=…`; a bad argument is
/// one line and exit status 2.
fn arguments() -> (Vec<usize>, Vec<usize>, usize) {
    let (mut tokens, mut threads, mut pairs) = (vec![128usize, 512], vec![1usize, 2], 5usize);
    let usage = |what: &str| -> ! {
        eprintln!("error: {what}; the arguments are tokens=128,512 threads=1,2 pairs=5 (each ≥ 1)");
        std::process::exit(2)
    };
    let counts = |key: &str, v: &str| -> Vec<usize> {
        v.split(',')
            .map(|t| match t.parse::<usize>() {
                Ok(c) if c > 0 => c,
                _ => usage(&format!("{key}={t}")),
            })
            .collect()
    };
    for arg in std::env::args().skip(1) {
        match arg.split_once('=') {
            Some(("tokens", v)) => tokens = counts("tokens", v),
            Some(("threads", v)) => threads = counts("threads", v),
            Some(("pairs", v)) => match v.parse() {
                Ok(n) if n >= 1 => pairs = n,
                _ => usage(&format!("pairs={v}")),
            },
            _ => usage(&format!("unknown argument `{arg}`")),
        }
    }
    (tokens, threads, pairs)
}

fn main() {
    let (tokens, threads, pairs) = arguments();
    let kernel = matmul_kernel();
    if !f32_products_keep_packings() {
        println!(
            "{kernel}: this process keeps no f32 packings (set FERROTEXT_F32_KEPT=1 or \
             FERROTEXT_MATMUL=portable); both columns are the same route"
        );
    }
    println!("f32 products, {kernel} against a kept packing, GFLOP/s (median of {pairs} pairs)");
    let mut rows = Vec::new();
    for &t in &threads {
        for &m in &tokens {
            for (name, fan_in, fan_out) in WEIGHTS {
                let w = Tensor::from_fn(&[fan_in, fan_out], |i| ((i * 5 % 11) as f32 - 5.0) * 0.01);
                let kept = w.keeping_packings();
                let x = Tensor::from_fn(&[m, fan_in], |i| ((i * 7 % 13) as f32 - 6.0) * 0.01);
                let dy = Tensor::from_fn(&[m, fan_out], |i| ((i * 3 % 17) as f32 - 8.0) * 0.01);
                let backward = DotDims {
                    lhs_contracting: vec![1],
                    rhs_contracting: vec![1],
                    ..DotDims::default()
                };
                for (product, lhs, dims) in
                    [("x·W", &x, DotDims::matmul(2)), ("dy·Wᵀ", &dy, backward)]
                {
                    let flops = 2.0 * (m * fan_in * fan_out) as f64;
                    let reps = ((4e8 / flops) as usize).max(2);
                    let run = |rhs: &Tensor| {
                        let start = Instant::now();
                        let mut out = None;
                        for _ in 0..reps {
                            // ok: matrices of matching shapes, made here.
                            out = Some(dot_general(lhs, rhs, &dims, t).expect("product"));
                        }
                        let rate = flops * reps as f64 / start.elapsed().as_secs_f64() / 1e9;
                        (rate, out.expect("reps ≥ 2")) // ok: reps ≥ 2
                    };
                    let (mut theirs, mut ours) = (Vec::new(), Vec::new());
                    let (mut want, mut got) = (None, None);
                    for _ in 0..pairs {
                        let (rate, out) = run(&w);
                        theirs.push(rate);
                        want = Some(out);
                        let (rate, out) = run(&kept);
                        ours.push(rate);
                        got = Some(out);
                    }
                    let (want, got) = (want.expect("pairs ≥ 1"), got.expect("pairs ≥ 1")); // ok: checked
                    let scale = want.data().iter().fold(0f32, |s, x| s.max(x.abs()));
                    let gap = want
                        .data()
                        .iter()
                        .zip(got.data())
                        .fold(0f32, |s, (x, y)| s.max((x - y).abs()));
                    assert!(
                        gap <= 1e-4 * scale,
                        "{name} {product}: the kept route is {gap} off"
                    );
                    let (a, b) = (median(theirs), median(ours));
                    println!(
                        "{t} thr {m:>5} {name:<14} {product:<6} {fan_in:>5}×{fan_out:<5} {a:7.1} {b:7.1}  {:.2}×",
                        b / a
                    );
                    rows.push(format!(
                        "{{\"threads\":{t},\"tokens\":{m},\"weight\":\"{name}\",\"product\":\"{product}\",\"k\":{fan_in},\"n\":{fan_out},\"kernel_gflops\":{a:.2},\"kept_gflops\":{b:.2},\"ratio\":{:.3}}}",
                        b / a
                    ));
                }
            }
        }
    }
    let out = std::path::Path::new("target/bench");
    let json = format!(
        "{{\"kernel\":\"{kernel}\",\"kept\":{},\"pairs\":{pairs},\"rows\":[{}]}}\n",
        f32_products_keep_packings(),
        rows.join(",")
    );
    let written =
        std::fs::create_dir_all(out).and_then(|()| std::fs::write(out.join("f32_kept.json"), json));
    if let Err(e) = written {
        eprintln!("error: writing target/bench/f32_kept.json: {e}");
        std::process::exit(1);
    }
    println!("wrote target/bench/f32_kept.json");
}
