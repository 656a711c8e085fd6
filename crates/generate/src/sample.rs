//! Choosing the next token from a row of logits: greedy, or sampled after temperature, top-k and
//! top-p (nucleus) filtering, in that order (the order Hugging Face's `generate` applies them).
//!
//! Invariants: the same [`SamplingParams`] (seed included) and the same logits give the same
//! token on every machine (the draws come from a SplitMix64 stream, probabilities are computed in
//! f64 in a fixed order); ties break towards the lower token id.

use ferrotext_models::Rng;

/// How to pick the next token.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Logits are divided by this before sampling; `0` picks the most likely token (greedy).
    pub temperature: f64,
    /// Keep only the `top_k` most likely tokens (`0`: no limit).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (`1`: all).
    pub top_p: f64,
    /// Seed of the draws.
    pub seed: u64,
}

impl Default for SamplingParams {
    /// Greedy decoding.
    fn default() -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// Why sampling parameters or logits were refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SampleError {
    /// A parameter outside its range; names the parameter and the accepted range.
    #[error("{name} = {value} is out of range: {expected}")]
    OutOfRange {
        /// The parameter (`temperature`, `top_p`).
        name: &'static str,
        /// The value given, as text.
        value: String,
        /// The accepted range, in words.
        expected: &'static str,
    },
    /// The logits hold NaN or +∞ (−∞ is a masked token and fine), or are empty.
    #[error("the model's logits are not usable for sampling: {0}")]
    BadLogits(String),
}

impl SamplingParams {
    /// Checks the ranges: `temperature` finite and ≥ 0, `top_p` in (0, 1].
    ///
    /// # Errors
    /// [`SampleError::OutOfRange`] naming the first parameter out of range.
    pub fn validate(&self) -> Result<(), SampleError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(SampleError::OutOfRange {
                name: "temperature",
                value: self.temperature.to_string(),
                expected: "a finite number ≥ 0 (0 is greedy)",
            });
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SampleError::OutOfRange {
                name: "top_p",
                value: self.top_p.to_string(),
                expected: "a number in (0, 1] (1 keeps every token)",
            });
        }
        Ok(())
    }
}

/// Picks tokens with one set of parameters and one stream of draws.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
}

impl Sampler {
    /// A sampler for `params`.
    ///
    /// # Errors
    /// [`SampleError::OutOfRange`] for parameters out of range.
    pub fn new(params: SamplingParams) -> Result<Sampler, SampleError> {
        params.validate()?;
        let rng = Rng::new(params.seed, 0x005A_4D50_4C45);
        Ok(Sampler { params, rng })
    }

    /// The next token for one row of logits over the vocabulary.
    ///
    /// # Errors
    /// [`SampleError::BadLogits`] for an empty row, a NaN or +∞, or a row with every token masked.
    pub fn next(&mut self, logits: &[f32]) -> Result<u32, SampleError> {
        if logits.is_empty() {
            return Err(SampleError::BadLogits("the row is empty".into()));
        }
        if let Some(i) = logits
            .iter()
            .position(|x| x.is_nan() || *x == f32::INFINITY)
        {
            return Err(SampleError::BadLogits(format!(
                "token {i} has logit {}",
                logits[i]
            )));
        }
        let greedy = argmax(logits);
        if logits[greedy] == f32::NEG_INFINITY {
            return Err(SampleError::BadLogits("every token is masked".into()));
        }
        if self.params.temperature == 0.0 {
            return Ok(greedy as u32);
        }
        let candidates = self.candidates(logits);
        let u = self.rng.uniform();
        let mut cumulative = 0.0;
        for &(token, p) in &candidates {
            cumulative += p;
            if u < cumulative {
                return Ok(token);
            }
        }
        // Rounding left `u` above the last cumulative sum: take the last candidate.
        Ok(candidates.last().map_or(greedy as u32, |c| c.0))
    }

    /// The tokens that survive top-k and top-p with their renormalised probabilities, most likely
    /// first (ties: lower id first).
    fn candidates(&self, logits: &[f32]) -> Vec<(u32, f64)> {
        let t = self.params.temperature;
        let mut ranked: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .filter(|(_, &x)| x != f32::NEG_INFINITY)
            .map(|(i, &x)| (i as u32, x as f64 / t))
            .collect();
        let by_rank = |a: &(u32, f64), b: &(u32, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let k = self.params.top_k;
        if k > 0 && k < ranked.len() {
            // A partial selection: only the k kept tokens are sorted.
            ranked.select_nth_unstable_by(k - 1, by_rank);
            ranked.truncate(k);
        }
        ranked.sort_by(by_rank);
        let max = ranked[0].1;
        let mut total = 0.0;
        for c in ranked.iter_mut() {
            c.1 = ferrotext_tensor::fixed_math::exp_f64(c.1 - max);
            total += c.1;
        }
        for c in ranked.iter_mut() {
            c.1 /= total;
        }
        if self.params.top_p < 1.0 {
            let mut cumulative = 0.0;
            let keep = ranked
                .iter()
                .position(|c| {
                    cumulative += c.1;
                    cumulative >= self.params.top_p
                })
                .map_or(ranked.len(), |i| i + 1);
            ranked.truncate(keep);
            let kept: f64 = ranked.iter().map(|c| c.1).sum();
            for c in ranked.iter_mut() {
                c.1 /= kept;
            }
        }
        ranked
    }
}

/// The index of the largest value (the first one on ties).
pub fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
// Test data and reference values, computed and compared within this process: the C
// library's bits are fine here (`clippy.toml`).
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn sampler(temperature: f64, top_k: usize, top_p: f64, seed: u64) -> Sampler {
        Sampler::new(SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
        })
        .expect("valid parameters")
    }

    const LOGITS: [f32; 5] = [1.0, 3.0, 0.5, 3.0, -1.0];

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplingParams::default()).expect("greedy");
        assert_eq!(s.next(&LOGITS), Ok(1));
        assert_eq!(argmax(&[f32::NEG_INFINITY, -5.0]), 1);
    }

    #[test]
    fn top_k_one_and_a_tiny_top_p_are_greedy_at_any_temperature() {
        for seed in 0..20 {
            assert_eq!(sampler(2.0, 1, 1.0, seed).next(&LOGITS), Ok(1));
            assert_eq!(sampler(2.0, 0, 1e-9, seed).next(&LOGITS), Ok(1));
        }
    }

    #[test]
    fn draws_follow_the_softmax_of_the_kept_tokens() {
        // Temperature 1, top-k 3: tokens 1, 3 (logit 3) and 0 (logit 1), renormalised.
        let mut s = sampler(1.0, 3, 1.0, 7);
        let n = 40_000;
        let mut counts = [0usize; 5];
        for _ in 0..n {
            counts[s.next(&LOGITS).expect("a token") as usize] += 1;
        }
        let z = 2.0 * 3f64.exp() + 1f64.exp();
        let expected = [1f64.exp() / z, 3f64.exp() / z, 0.0, 3f64.exp() / z, 0.0];
        for (token, (&c, &p)) in counts.iter().zip(&expected).enumerate() {
            let freq = c as f64 / n as f64;
            assert!((freq - p).abs() < 0.01, "token {token}: {freq} vs {p}");
        }
    }

    #[test]
    fn top_p_keeps_the_smallest_set_that_reaches_p() {
        // p(1) = p(3) ≈ 0.468 each at temperature 1: top_p 0.5 keeps exactly those two.
        let s = sampler(1.0, 0, 0.5, 0);
        let kept: Vec<u32> = s.candidates(&LOGITS).iter().map(|c| c.0).collect();
        assert_eq!(kept, [1, 3]);
    }

    #[test]
    fn the_same_seed_gives_the_same_tokens() {
        let draw = |seed| {
            let mut s = sampler(1.5, 0, 0.95, seed);
            (0..50)
                .map(|_| s.next(&LOGITS).expect("token"))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
    }

    #[test]
    fn bad_parameters_and_logits_are_refused_with_their_name() {
        for (t, p, name) in [
            (-1.0, 1.0, "temperature"),
            (f64::NAN, 1.0, "temperature"),
            (1.0, 0.0, "top_p"),
            (1.0, 1.5, "top_p"),
        ] {
            let err = Sampler::new(SamplingParams {
                temperature: t,
                top_p: p,
                ..Default::default()
            })
            .expect_err("out of range");
            assert!(err.to_string().starts_with(name), "{err}");
        }
        let mut s = sampler(1.0, 0, 1.0, 0);
        assert!(matches!(s.next(&[]), Err(SampleError::BadLogits(_))));
        assert!(matches!(
            s.next(&[0.0, f32::NAN]),
            Err(SampleError::BadLogits(_))
        ));
        assert!(matches!(
            s.next(&[f32::NEG_INFINITY; 3]),
            Err(SampleError::BadLogits(_))
        ));
    }
}
