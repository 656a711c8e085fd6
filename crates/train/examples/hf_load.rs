//! Issue 15's loading goal, measured: a Qwen3-0.6B-shaped HF directory (bf16, 2 shards, random
//! values) loads in at most 2× the time it takes to read its bytes, with peak RSS at most 1.3× the
//! f32 parameter bytes.
//!
//! ```text
//! cargo run --release -p ferrotext-train --example hf_load -- write DIR   # makes the directory
//! cargo run --release -p ferrotext-train --example hf_load -- load DIR    # measures (own process)
//! cargo run --release -p ferrotext-train --example hf_load -- load DIR --cold  # from disk (root)
//! ```
//! `load` first reads every file's bytes (8 MiB at a time, so the read adds nothing to the peak
//! RSS), then loads; both see the same page cache. Last it times the first writes to as much
//! fresh memory as the f32 values take: the floor under any loader, since each value lands on a
//! page that was never touched (on a VM whose host backs guest memory lazily this alone can be
//! many times the read). Not a test: it needs ~1.2 GB of disk and
//! ~2.5 GB of memory.

use std::io::Read;
use std::path::Path;
use std::time::Instant;

use ferrotext_hf as hf;
use ferrotext_models::decoder::{Config, Decoder};
use ferrotext_sharding::DType;
use ferrotext_tensor::Tensor;

fn model() -> Decoder {
    let cfg = Config::preset("qwen3-0.6b").expect("preset"); // ok: a built-in preset
    Decoder::new(cfg).expect("valid") // ok: a built-in preset is valid
}

/// Peak resident set size of this process, in bytes (`VmHWM`).
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (mode, dir, cold) = match args.as_slice() {
        [_, mode, dir] => (mode.as_str(), Path::new(dir), false),
        [_, mode, dir, flag] if flag == "--cold" => (mode.as_str(), Path::new(dir), true),
        _ => return Err("usage: hf_load write|load DIR [--cold]".into()),
    };
    // `--cold` (root): the page cache is dropped before the read and again before the load, so
    // both come from the disk, the read's timing is "the time it takes to read its bytes from
    // disk" and the load pays the same I/O.
    let drop_caches = || -> Result<(), Box<dyn std::error::Error>> {
        if cold {
            std::process::Command::new("sync").status()?;
            std::fs::write("/proc/sys/vm/drop_caches", "3")
                .map_err(|e| format!("--cold needs root to drop the page cache: {e}"))?;
        }
        Ok(())
    };
    let model = model();
    let infos = model.params();
    let f32_bytes: u64 = infos
        .iter()
        .map(|p| p.shape.iter().product::<usize>() as u64 * 4)
        .sum();
    match mode {
        "write" => {
            let values: Vec<Tensor> = infos
                .iter()
                .enumerate()
                .map(|(k, p)| {
                    Tensor::from_fn(&p.shape, |i| {
                        let h = (i as u64 ^ (k as u64) << 40).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                        ((h >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
                    })
                })
                .collect();
            // Two shards: the threshold at 60% of the bf16 bytes.
            let shard = f32_bytes / 2 * 6 / 10;
            hf::save_directory(dir, model.config(), &infos, &values, DType::BF16, shard)?;
            println!("wrote {}", dir.display());
        }
        "load" => {
            let mut files: Vec<_> = std::fs::read_dir(dir)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
                .collect();
            files.sort();
            drop_caches()?;
            let t = Instant::now();
            let mut buf = vec![0u8; 8 << 20];
            let mut bytes = 0u64;
            for f in &files {
                let mut file = std::fs::File::open(f)?;
                loop {
                    let n = file.read(&mut buf)?;
                    if n == 0 {
                        break;
                    }
                    bytes += n as u64;
                }
            }
            let read = t.elapsed().as_secs_f64();
            drop(buf);
            drop_caches()?;
            let t = Instant::now();
            let values = ferrotext_train::io::load_parameters(dir, &infos)?;
            let load = t.elapsed().as_secs_f64();
            let rss = peak_rss();
            // The floor under any loader: first writes to as much fresh memory as the f32 values
            // take (the kernel zeroes every new page; in a VM the host may fault it in too).
            // Measured while the values are alive, so no page of theirs is reused.
            let t = Instant::now();
            let mut fresh = vec![0u8; f32_bytes as usize];
            fresh.fill(1);
            let touch = t.elapsed().as_secs_f64();
            drop(fresh);
            println!(
                "{} files, {:.3} GB: read {read:.3} s, load {load:.3} s ({:.2}× read); peak RSS \
                 {:.3} GB = {:.3}× the f32 parameters ({:.3} GB); {} tensors; first touch of \
                 {:.3} GB fresh memory {touch:.3} s ({:.2}× read, load = {:.2}× it)",
                files.len(),
                bytes as f64 / 1e9,
                load / read,
                rss as f64 / 1e9,
                rss as f64 / f32_bytes as f64,
                f32_bytes as f64 / 1e9,
                values.len(),
                f32_bytes as f64 / 1e9,
                touch / read,
                load / touch,
            );
        }
        _ => return Err("usage: hf_load write|load DIR [--cold]".into()),
    }
    Ok(())
}
