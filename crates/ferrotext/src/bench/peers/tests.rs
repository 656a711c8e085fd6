use super::*;
use std::path::Path;

#[test]
fn points_parse_and_refuse_what_does_not_split_the_micro_batch() {
    assert_eq!("4x8".parse(), Ok(Point { data: 4, ga: 8 }));
    assert_eq!("1X4".parse(), Ok(Point { data: 1, ga: 4 }));
    for bad in ["3x4", "0x1", "4x0", "4", "x4", "4x-1", "ax2"] {
        assert!(bad.parse::<Point>().is_err(), "{bad}");
    }
}

#[test]
fn rounds_alternate_the_engine_order() {
    let all = [Engine::Ferrotext, Engine::Jax, Engine::Torch];
    assert_eq!(round_order(&all, 0), all);
    assert_eq!(
        round_order(&all, 1),
        [Engine::Torch, Engine::Jax, Engine::Ferrotext]
    );
    assert_eq!(round_order(&all, 2), all);
}

#[test]
fn each_engines_figure_is_read_from_its_own_output() {
    let metrics = (0..5)
        .map(|s| {
            format!(
                "{{\"step\":{s},\"loss\":7.0,\"seconds\":{}}}\n",
                [9.0, 9.0, 0.3, 0.1, 0.2][s]
            )
        })
        .collect::<String>();
    // Steps 2, 3, 4 after two warm-up steps: median 0.2 s.
    assert!((ferrotext_median_ms(&metrics, 2).unwrap() - 200.0).abs() < 1e-9);
    assert!(ferrotext_median_ms(&metrics, 5).is_err(), "no timed step");
    let jax = "jax 0.7 | 4 cpu devices\nstep 3 loss 7.1 91.0 ms\ndefer: median step 93.4 ms over 8 steps | 5000 tokens/s\n";
    assert_eq!(jax_median_ms(jax).unwrap(), 93.4);
    assert!(jax_median_ms("step 3 loss 7.1\n").is_err());
    let torch = "{\"peer\": \"torch\", \"mode\": \"plain\", \"median_ms\": 150.0}\n{\"peer\": \"torch\", \"mode\": \"no_sync\", \"median_ms\": 131.5}\n";
    assert_eq!(torch_median_ms(torch).unwrap(), 131.5);
    assert!(torch_median_ms("{\"mode\": \"plain\", \"median_ms\": 1.0}").is_err());
}

#[test]
fn ratios_pair_the_runs_of_one_round() {
    let args = PeersArgs {
        peers: "p".into(),
        jax_python: None,
        torch_python: None,
        points: vec![Point { data: 4, ga: 2 }],
        engines: vec![Engine::Ferrotext, Engine::Jax, Engine::Torch],
        rounds: 2,
        warmup: 2,
        steps: 8,
        clip: 1.0,
        dtype: DType::F32,
        set: vec![],
        peer_args: vec![],
        timeout: 1,
        runs: "r".into(),
        out: "o".into(),
    };
    let point = args.points[0];
    let run = |round, engine, median_ms| Run {
        point,
        round,
        engine,
        median_ms,
    };
    let runs = [
        run(0, Engine::Ferrotext, 60.0),
        run(0, Engine::Jax, 100.0),
        run(0, Engine::Torch, 120.0),
        run(1, Engine::Torch, 150.0),
        run(1, Engine::Jax, 80.0),
        run(1, Engine::Ferrotext, 60.0),
    ];
    let rows = rows(&args, &runs);
    assert_eq!(rows[0].ferrotext_over_jax, [0.6, 0.75]);
    assert_eq!(rows[0].ferrotext_over_torch, [0.5, 0.4]);
    // Each engine gets the point's devices, GA, steps and clipping in its own words.
    let words = |engine| {
        let (cmd, dir) = args.command(engine, point, 1).unwrap();
        let words: Vec<String> = cmd.get_args().map(|a| a.to_string_lossy().into()).collect();
        (words.join(" "), dir)
    };
    let (ft, dir) = words(Engine::Ferrotext);
    assert_eq!(dir, Path::new("r/data4-ga2-round1"));
    // The child reads the config the point means.
    let items: Vec<String> = ft.split(' ').skip(1).map(str::to_string).collect();
    let child = TrainConfig::load(None, &items).unwrap();
    assert_eq!(
        (
            child.ici_data_parallelism,
            child.per_device_batch_size,
            child.gradient_accumulation_steps,
            child.steps,
            child.gradient_clipping_threshold,
            child.run_name.as_str(),
            child.opt_type,
        ),
        (4, 2.0, 2, 10, 1.0, "data4-ga2-round1", OptType::Sgd)
    );
    let (jax, _) = words(Engine::Jax);
    assert_eq!(
        jax,
        "train.py --dp 4 --defer --ga 2 --opt sgd --warmup 2 --steps 8 --clip 1"
    );
    let (torch, _) = words(Engine::Torch);
    assert_eq!(
        torch,
        "train.py --nproc 4 --mode no_sync --ga 2 --opt sgd --warmup 2 --steps 8 --clip 1"
    );
    assert_eq!(child.dtype, DType::F32);
    // bf16: ferrotext's and the PyTorch peer's own words; the JAX peer, which has none, is
    // refused before anything runs.
    let bf16 = PeersArgs {
        dtype: DType::BF16,
        engines: vec![Engine::Ferrotext, Engine::Torch],
        ..args.clone()
    };
    let words16 = |engine| {
        let (cmd, _) = bf16.command(engine, point, 1).unwrap();
        let words: Vec<String> = cmd.get_args().map(|a| a.to_string_lossy().into()).collect();
        words.join(" ")
    };
    assert!(words16(Engine::Ferrotext).contains("dtype=bfloat16"));
    assert!(words16(Engine::Torch).contains("--dtype bf16"));
    let with_jax = PeersArgs {
        engines: vec![Engine::Ferrotext, Engine::Jax],
        ..bf16.clone()
    };
    let refused = with_jax.check().unwrap_err().to_string();
    assert!(refused.contains("JAX peer has no bf16"), "{refused}");
}
