//! Parameter declarations and their deterministic initialisation.

use ferrotext_tensor::Tensor;

/// How a parameter starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// `N(0, std²)`.
    Normal {
        /// Standard deviation.
        std: f32,
    },
    /// `N(0, 1/fan_in)` with `fan_in` the first dimension (weights stored `[in, out]`).
    FanIn,
    /// All ones (norm scales).
    Ones,
}

/// One parameter: its checkpoint name, shape, logical axis per dimension and initialisation.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamInfo {
    /// The checkpoint name, e.g. `layers.0.self_attn.q_proj.weight`.
    pub name: String,
    /// Global shape.
    pub shape: Vec<usize>,
    /// Logical axis names per dimension (resolved to mesh axes by logical rules).
    pub logical: Vec<Option<&'static str>>,
    /// Initialisation.
    pub init: Init,
}

/// SplitMix64: small, fast, and the same on every platform, so every device and every run
/// initialises identically from the seed.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed` and a `stream` (e.g. the parameter index).
    pub fn new(seed: u64, stream: u64) -> Rng {
        Rng(seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform integer in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// The global initial value of `info`, from `seed` and the parameter's index.
pub fn init_normal(info: &ParamInfo, seed: u64, index: usize) -> Tensor {
    let mut rng = Rng::new(seed, index as u64 + 1);
    match info.init {
        Init::Ones => Tensor::full(&info.shape, 1.0),
        Init::Normal { std } => {
            Tensor::from_fn(&info.shape, |_| (rng.normal() * std as f64) as f32)
        }
        Init::FanIn => {
            let std = 1.0 / (info.shape.first().copied().unwrap_or(1).max(1) as f64).sqrt();
            Tensor::from_fn(&info.shape, |_| (rng.normal() * std) as f32)
        }
    }
}
