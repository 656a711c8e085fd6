//! Parameter declarations, their Hugging Face layout and their deterministic initialisation.
//!
//! Every [`ParamInfo`] says how it is stored in a HF checkpoint ([`HfLayout`]), and loading,
//! saving and checkpoints all go through [`ParamInfo::to_hf`] / [`ParamInfo::from_hf`]: the
//! orientation of a weight is declared once, beside its shape, never guessed from its name.

use ferrotext_tensor::{kernel_threads, Tensor, TensorError};

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
    /// All zeros (biases).
    Zeros,
}

/// How a parameter is stored in a Hugging Face checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub enum HfLayout {
    /// One HF tensor `name`. `transposed`: ferrotext stores the matrix `[in, out]` (so `x·W` needs
    /// no transpose) and HF stores `[out, in]`; otherwise the same shape (embeddings, norm scales).
    Tensor {
        /// The HF tensor name, e.g. `model.layers.0.self_attn.q_proj.weight`.
        name: String,
        /// Whether HF's tensor is the transpose of ferrotext's `[in, out]` matrix.
        transposed: bool,
    },
    /// Routed experts stacked `[E, in, out]`; HF stores expert `e` alone as
    /// `{prefix}.{e}.{suffix}`, `[out, in]` (e.g. `model.layers.1.mlp.experts.3.gate_proj.weight`).
    Experts {
        /// E.g. `model.layers.1.mlp.experts`.
        prefix: String,
        /// E.g. `gate_proj.weight`.
        suffix: String,
    },
}

/// A value that does not fit a parameter's HF layout.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HfLayoutError {
    /// A tensor of the wrong shape.
    #[error("`{name}` has shape {got:?}; the model needs {expected:?}")]
    Shape {
        /// The tensor (HF name, or the parameter's name for a ferrotext value).
        name: String,
        /// The shape the layout needs.
        expected: Vec<usize>,
        /// The shape given.
        got: Vec<usize>,
    },
    /// The wrong number of HF tensors for one parameter.
    #[error("`{param}` is stored as {expected} HF tensors, got {got}")]
    Count {
        /// The parameter.
        param: String,
        /// Tensors its layout has.
        expected: usize,
        /// Tensors given.
        got: usize,
    },
    /// A tensor could not be built.
    #[error(transparent)]
    Tensor(#[from] TensorError),
}

/// One parameter: its checkpoint name, shape, logical axis per dimension, initialisation and HF
/// layout.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamInfo {
    /// The checkpoint name, e.g. `model.layers.0.self_attn.q_proj.weight` or, for stacked
    /// experts, `model.layers.1.mlp.experts.gate_proj`.
    pub name: String,
    /// Global shape.
    pub shape: Vec<usize>,
    /// Logical axis names per dimension (resolved to mesh axes by logical rules).
    pub logical: Vec<Option<&'static str>>,
    /// Initialisation.
    pub init: Init,
    /// How HF stores it.
    pub hf: HfLayout,
}

impl ParamInfo {
    /// The HF tensors this parameter is stored as, `(name, shape)`, in order (expert 0 first).
    pub fn hf_tensors(&self) -> Vec<(String, Vec<usize>)> {
        match &self.hf {
            HfLayout::Tensor { name, transposed } => {
                let mut shape = self.shape.clone();
                if *transposed {
                    shape.reverse();
                }
                vec![(name.clone(), shape)]
            }
            HfLayout::Experts { prefix, suffix } => {
                let (e, mut shape) = match self.shape.split_first() {
                    Some((e, rest)) => (*e, rest.to_vec()),
                    None => (0, Vec::new()),
                };
                shape.reverse();
                (0..e)
                    .map(|i| (format!("{prefix}.{i}.{suffix}"), shape.clone()))
                    .collect()
            }
        }
    }

    /// `value` (this parameter's global value) as its HF tensors, named and shaped as
    /// [`ParamInfo::hf_tensors`] lists them.
    ///
    /// # Errors
    /// [`HfLayoutError::Shape`] when `value` is not of this parameter's shape.
    pub fn to_hf(&self, value: &Tensor) -> Result<Vec<(String, Tensor)>, HfLayoutError> {
        if value.shape() != self.shape.as_slice() {
            return Err(HfLayoutError::Shape {
                name: self.name.clone(),
                expected: self.shape.clone(),
                got: value.shape().to_vec(),
            });
        }
        let (transposed, (rows, cols)) = self.stored_matrix();
        let block = rows * cols;
        self.hf_tensors()
            .into_iter()
            .enumerate()
            .map(|(e, (name, shape))| {
                let part = &value.data()[e * block..(e + 1) * block];
                let data = if transposed {
                    transpose(part, rows, cols)
                } else {
                    part.to_vec()
                };
                Ok((name, Tensor::new(shape, data)?))
            })
            .collect()
    }

    /// Whether each stored HF tensor is the transpose of the parameter's matrix (a linear
    /// weight stored `[out, in]`, stacked experts), and that matrix's `(rows, cols)`.
    fn stored_matrix(&self) -> (bool, (usize, usize)) {
        let transposed = matches!(
            self.hf,
            HfLayout::Experts { .. }
                | HfLayout::Tensor {
                    transposed: true,
                    ..
                }
        );
        (transposed, matrix_dims(&self.shape, &self.hf))
    }

    /// The parameter's value from its HF tensors, given in [`ParamInfo::hf_tensors`] order.
    ///
    /// # Errors
    /// [`HfLayoutError::Count`] or [`HfLayoutError::Shape`] when `parts` do not match the
    /// layout.
    pub fn from_hf(&self, parts: Vec<Tensor>) -> Result<Tensor, HfLayoutError> {
        let wanted = self.hf_tensors();
        if parts.len() != wanted.len() {
            return Err(HfLayoutError::Count {
                param: self.name.clone(),
                expected: wanted.len(),
                got: parts.len(),
            });
        }
        let (transposed, (rows, cols)) = self.stored_matrix();
        for (part, (name, shape)) in parts.iter().zip(&wanted) {
            if part.shape() != shape.as_slice() {
                return Err(HfLayoutError::Shape {
                    name: name.clone(),
                    expected: shape.clone(),
                    got: part.shape().to_vec(),
                });
            }
        }
        if !transposed {
            // One tensor of the same layout: moved, not copied (a large embedding stays one copy).
            let data = parts
                .into_iter()
                .next()
                .map(Tensor::into_data)
                .unwrap_or_default();
            return Ok(Tensor::new(self.shape.clone(), data)?);
        }
        // HF's `[cols, rows]` back to `[rows, cols]`, one block per part.
        let data = if parts.len() == 1 {
            transpose(parts[0].data(), cols, rows)
        } else {
            let mut data = Vec::with_capacity(self.shape.iter().product());
            for part in &parts {
                data.extend(transpose(part.data(), cols, rows));
            }
            data
        };
        Ok(Tensor::new(self.shape.clone(), data)?)
    }
}

/// The `[rows, cols]` of one HF block: a matrix, one expert's matrix, or the whole value.
fn matrix_dims(shape: &[usize], hf: &HfLayout) -> (usize, usize) {
    match (hf, shape) {
        (HfLayout::Experts { .. }, [_, r, c]) | (HfLayout::Tensor { .. }, [r, c]) => (*r, *c),
        _ => (shape.iter().product(), 1),
    }
}

/// The `[cols, rows]` transpose of a row-major `[rows, cols]` block, in 32×32 tiles so both
/// sides stay in cache (a plain loop strides a whole row per element on one side).
fn transpose(block: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    const TILE: usize = 32;
    let mut out = vec![0.0; block.len()];
    for i0 in (0..rows).step_by(TILE) {
        for j0 in (0..cols).step_by(TILE) {
            for i in i0..(i0 + TILE).min(rows) {
                for j in j0..(j0 + TILE).min(cols) {
                    out[j * rows + i] = block[i * cols + j];
                }
            }
        }
    }
    out
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
        self.0 = self.0.wrapping_add(SPLITMIX_STEP);
        splitmix(self.0)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        unit(self.next_u64())
    }

    /// Uniform integer in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform();
        let u2 = self.uniform();
        box_muller(u1, u2)
    }

    /// The value the `i`-th [`Rng::normal`] call from this state would return (`i = 0` is the
    /// next one), without advancing the generator: SplitMix64's `j`-th output depends only on
    /// its state plus `j` steps, so any element of a stream is computed on its own and a long
    /// stream can be drawn in parallel, bit for bit.
    pub fn normal_at(&self, i: u64) -> f64 {
        let call = |j: u64| unit(splitmix(self.0.wrapping_add(j.wrapping_mul(SPLITMIX_STEP))));
        box_muller(call(2 * i + 1), call(2 * i + 2))
    }
}

/// SplitMix64's increment (the golden ratio's fraction in 64 bits).
const SPLITMIX_STEP: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function of a state.
fn splitmix(state: u64) -> u64 {
    let mut z = state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The top 53 bits of `bits` as a uniform in `[0, 1)`.
fn unit(bits: u64) -> f64 {
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

/// A standard normal from two uniforms in `[0, 1)` (Box–Muller's cosine branch).
fn box_muller(u1: f64, u2: f64) -> f64 {
    let (ln, cos) = (
        ferrotext_tensor::fixed_math::ln_f64,
        ferrotext_tensor::fixed_math::cos_f64,
    );
    (-2.0 * ln(u1.max(1e-300))).sqrt() * cos(std::f64::consts::TAU * u2)
}

/// The global initial value of `info`, from `seed` and the parameter's index: element `i` of a
/// normal initialisation is the `i`-th [`Rng::normal`] of the parameter's stream times the
/// standard deviation. The elements are drawn on this thread's kernel budget
/// ([`kernel_threads`]) with [`Rng::normal_at`], so the values do not depend on it (a
/// qwen3-0.6b's 596 M values took most of a minute on one thread).
pub fn init_normal(info: &ParamInfo, seed: u64, index: usize) -> Tensor {
    let rng = Rng::new(seed, index as u64 + 1);
    let normals = |std: f64| {
        Tensor::from_index_fn(&info.shape, kernel_threads(), |i| {
            (rng.normal_at(i as u64) * std) as f32
        })
    };
    match info.init {
        Init::Ones => Tensor::full(&info.shape, 1.0),
        Init::Zeros => Tensor::full(&info.shape, 0.0),
        Init::Normal { std } => normals(f64::from(std)),
        Init::FanIn => {
            normals(1.0 / (info.shape.first().copied().unwrap_or(1).max(1) as f64).sqrt())
        }
    }
}

// The declaration helpers every weight map uses.

/// A `[in, out]` matrix initialised `N(0, 1/in)`; HF stores it `[out, in]` under `name`.
pub(crate) fn matrix(
    name: String,
    shape: [usize; 2],
    logical: [Option<&'static str>; 2],
) -> ParamInfo {
    ParamInfo {
        hf: HfLayout::Tensor {
            name: name.clone(),
            transposed: true,
        },
        name,
        shape: shape.to_vec(),
        logical: logical.to_vec(),
        init: Init::FanIn,
    }
}

/// An RMSNorm scale `[n]` of ones, as HF stores it.
pub(crate) fn norm_scale(name: String, n: usize, logical: Option<&'static str>) -> ParamInfo {
    ParamInfo {
        hf: HfLayout::Tensor {
            name: name.clone(),
            transposed: false,
        },
        name,
        shape: vec![n],
        logical: vec![logical],
        init: Init::Ones,
    }
}

/// A bias `[n]` of zeros, as HF stores it under `name`.
pub(crate) fn bias(name: String, n: usize, logical: Option<&'static str>) -> ParamInfo {
    ParamInfo {
        init: Init::Zeros,
        ..norm_scale(name, n, logical)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `to_hf` against indices written out by hand, and `from_hf` inverts it.
    #[test]
    fn experts_unstack_transposed_and_come_back() {
        let info = ParamInfo {
            name: "x".into(),
            shape: vec![2, 3, 4],
            logical: vec![None; 3],
            init: Init::Ones,
            hf: HfLayout::Experts {
                prefix: "p".into(),
                suffix: "w".into(),
            },
        };
        let v = ferrotext_tensor::Tensor::from_fn(&[2, 3, 4], |i| i as f32);
        let parts = info.to_hf(&v).unwrap();
        assert_eq!(parts[1].0, "p.1.w");
        assert_eq!(parts[1].1.shape(), &[4, 3]);
        // HF[e=1][o=2][i=1] = ours[e=1][i=1][o=2] = 12 + 4 + 2.
        assert_eq!(parts[1].1.data()[2 * 3 + 1], 18.0);
        let tensors: Vec<_> = parts.into_iter().map(|(_, t)| t).collect();
        assert_eq!(info.from_hf(tensors).unwrap(), v);
    }

    use ferrotext_tensor::with_kernel_pool;

    #[test]
    fn a_normal_drawn_by_index_is_the_streams_normal_at_that_place() {
        for (seed, stream) in [(0, 1), (7, 3), (u64::MAX, 0x5A4D)] {
            let mut sequential = Rng::new(seed, stream);
            let start = sequential.clone();
            for i in 0..2000 {
                let want = sequential.normal();
                assert_eq!(
                    start.normal_at(i).to_bits(),
                    want.to_bits(),
                    "seed {seed} i {i}"
                );
            }
            // From a state part-way along (after the 2000 draws and one odd `next_u64`).
            sequential.next_u64();
            let mid = sequential.clone();
            for i in 0..50 {
                assert_eq!(mid.normal_at(i).to_bits(), sequential.normal().to_bits());
            }
        }
    }

    #[test]
    fn a_parallel_initialisation_has_the_sequential_streams_values() {
        let param = |shape: Vec<usize>, init| ParamInfo {
            name: "w".into(),
            shape,
            logical: vec![None, None],
            init,
            hf: HfLayout::Tensor {
                name: "w".into(),
                transposed: false,
            },
        };
        // 60,000 elements: several chunks of the parallel fill, the last one short.
        for info in [
            param(vec![300, 200], Init::FanIn),
            param(vec![200, 300], Init::Normal { std: 0.02 }),
        ] {
            let std = match info.init {
                Init::Normal { std } => f64::from(std),
                _ => 1.0 / (info.shape[0] as f64).sqrt(),
            };
            let mut rng = Rng::new(9, 4 + 1);
            let want: Vec<u32> = (0..60_000)
                .map(|_| ((rng.normal() * std) as f32).to_bits())
                .collect();
            for threads in [1, 2, 3] {
                let got =
                    with_kernel_pool(threads, "init-test", 2 << 20, || init_normal(&info, 9, 4));
                let got: Vec<u32> = got.data().iter().map(|x| x.to_bits()).collect();
                assert!(got == want, "{:?} on {threads} threads", info.init);
            }
        }
    }
}
