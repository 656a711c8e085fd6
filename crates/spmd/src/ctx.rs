//! `Ctx`: one device's execution context — its communicator, its mode (real or abstract), its
//! kernel thread budget and the autodiff tape — and the mode-aware collective helpers every op
//! uses, so a real run and an abstract run record the same trace.

use std::sync::Arc;

use ferrotext_comm::{CollectiveKind, Communicator, Device};
use ferrotext_sharding::{ArrayType, DType, Mesh, NamedSharding, PartitionSpec};
use ferrotext_tensor::Tensor;

use crate::array::Array;
use crate::cast_memo::CastMemo;
use crate::error::SpmdError;
use crate::tape::{RematState, Tape};

/// Whether ops compute data or only types and the collective trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Every op computes this device's shard and issues its collectives.
    Real,
    /// Shape-only: every type rule is checked and every collective recorded with its size, but
    /// no data exists and nothing is communicated.
    Abstract,
}

/// Runs `program` on a real context for `dev`, with the device's kernels on its thread budget:
/// with more than one thread, `program` runs on a kernel pool of the device's own (see
/// [`ferrotext_tensor::with_kernel_pool`]), so the thread running the device is one of those
/// its kernels split over. Results do not depend on the budget. This is how a device program
/// should make its context; [`Ctx::new`] alone leaves parallel kernels on the global pool.
pub fn on_device<R, F>(dev: &mut Device, program: F) -> R
where
    R: Send,
    F: FnOnce(&mut Ctx<'_>) -> R + Send,
{
    let (threads, stack) = (dev.threads(), dev.stack_size());
    let name = format!("ferrotext-device-{}", dev.index());
    ferrotext_tensor::with_kernel_pool(threads, &name, stack, || {
        let mut cx = Ctx::new(dev.comm(), threads);
        program(&mut cx)
    })
}

/// One device's context for SPMD ops. See the module docs.
pub struct Ctx<'c> {
    comm: &'c mut Communicator,
    mode: Mode,
    threads: usize,
    pub(crate) tape: Option<Tape>,
    /// Casts remembered for reuse ([`Ctx::remember_casts`]).
    pub(crate) casts: CastMemo,
    /// Inside a rematerialized region: what its forward saves, or what its replay reuses.
    pub(crate) remat: Option<RematState>,
}

impl<'c> Ctx<'c> {
    /// A real context on `comm`, running kernels on `threads` threads: the products it calls
    /// take `threads` explicitly, and this sets the calling thread's budget for the row and
    /// elementwise kernels ([`ferrotext_tensor::set_kernel_threads`]), so a context is used on
    /// the thread that made it (a device thread).
    pub fn new(comm: &'c mut Communicator, threads: usize) -> Ctx<'c> {
        ferrotext_tensor::set_kernel_threads(threads);
        Ctx {
            comm,
            mode: Mode::Real,
            threads: threads.max(1),
            tape: None,
            casts: CastMemo::default(),
            remat: None,
        }
    }

    /// An abstract context: the same program, types and trace only. `comm` is typically
    /// `Communicator::new(0, mesh, Box::new(NoTransport))`, which plans any mesh in one process.
    pub fn new_abstract(comm: &'c mut Communicator) -> Ctx<'c> {
        Ctx {
            comm,
            mode: Mode::Abstract,
            threads: 1,
            tape: None,
            casts: CastMemo::default(),
            remat: None,
        }
    }

    /// Real or abstract.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The mesh.
    pub fn mesh(&self) -> &Arc<Mesh> {
        self.comm.mesh()
    }

    /// This device's index.
    pub fn device(&self) -> usize {
        self.comm.device()
    }

    /// Kernel threads of this device.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The communicator (phases, trace).
    pub fn comm(&mut self) -> &mut Communicator {
        self.comm
    }

    // -----------------------------------------------------------------------------------------
    // Making arrays

    /// This device's shard of a global value `global` laid out as `sharding` (every device passes
    /// the same global value; each keeps its slice).
    ///
    /// # Errors
    /// A shape that does not fit the sharding; and an unreduced sharding (docs/design.md §4.5: a
    /// value is made unreduced only by `reshard`, which zeroes the other replicas).
    pub fn from_global(
        &self,
        global: &Tensor,
        sharding: NamedSharding,
    ) -> Result<Array, SpmdError> {
        let ty = ArrayType::new(DType::F32, global.shape().to_vec(), sharding)?;
        if !ty.sharding().spec().unreduced().is_empty() {
            return Err(SpmdError::UnreducedConstruction {
                op: "from_global",
                ty: ty.to_string(),
            });
        }
        let local = match self.mode {
            Mode::Real => {
                let ranges = ty.sharding().shard_ranges(global.shape(), self.device())?;
                Some(global.slice(&ranges)?)
            }
            Mode::Abstract => None,
        };
        Ok(Array::new(ty, local))
    }

    /// An array from this device's shard (e.g. its micro-batch slice).
    ///
    /// # Errors
    /// [`SpmdError::ShardShape`] when `local`'s shape is not the type's shard shape.
    pub fn from_local(&self, ty: ArrayType, local: Tensor) -> Result<Array, SpmdError> {
        if local.shape() != ty.shard_shape().as_slice() {
            return Err(SpmdError::ShardShape {
                op: "from_local",
                ty: ty.to_string(),
                expected: ty.shard_shape(),
                got: local.shape().to_vec(),
            });
        }
        Ok(Array::new(ty, (self.mode == Mode::Real).then_some(local)))
    }

    /// Zeros of type `ty` (any type, unreduced included: zeros are a valid partial-sum split).
    pub fn zeros(&self, ty: ArrayType) -> Array {
        let local = (self.mode == Mode::Real).then(|| Tensor::accumulator_zeros(&ty.shard_shape()));
        Array::new(ty, local)
    }

    /// An array of type `ty` with every element `value` on every device. Refused for unreduced
    /// types unless `value` is 0 (docs/design.md §4.5).
    ///
    /// # Errors
    /// [`SpmdError::UnreducedConstant`] for a non-zero unreduced constant.
    pub fn full(&self, ty: ArrayType, value: f32) -> Result<Array, SpmdError> {
        if value != 0.0 && !ty.sharding().spec().unreduced().is_empty() {
            return Err(SpmdError::UnreducedConstant {
                value,
                ty: ty.to_string(),
            });
        }
        let local = (self.mode == Mode::Real).then(|| Tensor::full(&ty.shard_shape(), value));
        Ok(Array::new(ty, local))
    }

    /// A shape-only array (abstract mode, or a type probe).
    pub fn abstract_array(&self, ty: ArrayType) -> Array {
        Array::new(ty, None)
    }

    /// A type on this context's mesh.
    ///
    /// # Errors
    /// When the spec does not fit the mesh or the shape.
    pub fn array_type(&self, shape: &[usize], spec: PartitionSpec) -> Result<ArrayType, SpmdError> {
        Ok(ArrayType::new(
            DType::F32,
            shape.to_vec(),
            NamedSharding::new(self.mesh().clone(), spec)?,
        )?)
    }

    /// The global value of `x` on the host (every device gets it; gathers sharded dims).
    ///
    /// # Errors
    /// [`SpmdError::HostAccessUnreduced`] for an unreduced array (docs/design.md §4.4): reshard
    /// first.
    pub fn to_host(&mut self, x: &Array) -> Result<Tensor, SpmdError> {
        if !x.ty().sharding().spec().unreduced().is_empty() {
            return Err(SpmdError::HostAccessUnreduced {
                ty: x.ty().to_string(),
            });
        }
        let replicated = PartitionSpec::replicated()
            .with_reduced_set(x.ty().sharding().spec().reduced().clone())?;
        let full = self.reshard_untracked(x, &replicated)?;
        full.local_owned()
    }

    // -----------------------------------------------------------------------------------------
    // Mode-aware collectives over local blocks

    /// This device's index along `axes` (first axis major) and their total size: JAX's
    /// `lax.axis_index`, for per-device decisions inside `shard_map` (which experts a device
    /// holds).
    ///
    /// # Errors
    /// An unknown or repeated axis.
    pub fn axis_index(&self, axes: &[&str]) -> Result<(usize, usize), SpmdError> {
        let axes: Vec<String> = axes.iter().map(|a| a.to_string()).collect();
        self.rank_over(&axes)
    }

    /// This device's rank over `axes` (first axis major) and the group size.
    pub(crate) fn rank_over(&self, axes: &[String]) -> Result<(usize, usize), SpmdError> {
        let group = self.comm.group(axes)?;
        let rank = group.iter().position(|&d| d == self.device()).unwrap_or(0);
        Ok((rank, group.len()))
    }

    /// In-place sum over `axes`.
    pub(crate) fn all_reduce(
        &mut self,
        axes: &[String],
        local: &mut Option<Tensor>,
        elements: usize,
    ) -> Result<(), SpmdError> {
        match local {
            Some(t) => self.comm.all_reduce(axes, t.data_mut())?,
            None => {
                self.comm
                    .record_abstract(CollectiveKind::AllReduce, axes, elements, DType::F32)?
            }
        }
        Ok(())
    }

    /// Sum over `axes`, scattered along `dim` (rank `r` keeps block `r`, first axis major).
    pub(crate) fn reduce_scatter_dim(
        &mut self,
        axes: &[String],
        local: Option<Tensor>,
        local_shape: &[usize],
        dim: usize,
    ) -> Result<Option<Tensor>, SpmdError> {
        let (_, n) = self.rank_over(axes)?;
        let elements: usize = local_shape.iter().product();
        let Some(t) = local else {
            self.comm
                .record_abstract(CollectiveKind::ReduceScatter, axes, elements, DType::F32)?;
            return Ok(None);
        };
        let (part_shape, flat) = chunk_major(&t, dim, n)?;
        let mut out = vec![0.0; elements / n];
        self.comm.reduce_scatter(axes, &flat, &mut out)?;
        Ok(Some(Tensor::new(part_shape, out)?))
    }

    /// Concatenation over `axes` along `dim` (rank order, first axis major).
    pub(crate) fn all_gather_dim(
        &mut self,
        axes: &[String],
        local: Option<Tensor>,
        local_shape: &[usize],
        dim: usize,
    ) -> Result<Option<Tensor>, SpmdError> {
        let (_, n) = self.rank_over(axes)?;
        let elements: usize = local_shape.iter().product::<usize>() * n;
        let Some(t) = local else {
            self.comm
                .record_abstract(CollectiveKind::AllGather, axes, elements, DType::F32)?;
            return Ok(None);
        };
        let mut out = vec![0.0; elements];
        self.comm.all_gather(axes, t.data(), &mut out)?;
        Ok(Some(from_chunk_major(out, t.shape(), dim, n)?))
    }
}

/// `t` split into `n` equal blocks along `dim`, laid out block after block (what a collective's
/// rank-ordered chunks expect), with the block shape: `t`'s own elements when `dim` is
/// leading (every dimension before it of size 1: the blocks already lie in order), else one
/// strided copy.
///
/// # Errors
/// `dim` out of range, or `n` zero or not dividing it.
pub(crate) fn chunk_major(
    t: &Tensor,
    dim: usize,
    n: usize,
) -> Result<(Vec<usize>, std::borrow::Cow<'_, [f32]>), SpmdError> {
    let (outer, part_shape) = blocks_of(t.shape(), dim, n, false)?;
    if outer == 1 {
        return Ok((part_shape, std::borrow::Cow::Borrowed(t.data())));
    }
    // [outer, n, inner] → [n, outer, inner]: block k is every outer index's k-th run.
    let inner: usize = part_shape[dim..].iter().product();
    let moved = t
        .clone()
        .reshape(&[outer, n, inner])?
        .transpose(&[1, 0, 2])?;
    Ok((part_shape, std::borrow::Cow::Owned(moved.into_data())))
}

/// The inverse of [`chunk_major`]: `n` blocks of `part_shape` laid out block after block in
/// `flat`, concatenated along `dim` — `flat` itself when `dim` is leading, else one strided
/// copy.
///
/// # Errors
/// `dim` out of range, or `flat` not `n` blocks of `part_shape`.
pub(crate) fn from_chunk_major(
    flat: Vec<f32>,
    part_shape: &[usize],
    dim: usize,
    n: usize,
) -> Result<Tensor, SpmdError> {
    let (outer, shape) = blocks_of(part_shape, dim, n, true)?;
    if outer == 1 {
        return Ok(Tensor::new(shape, flat)?);
    }
    let inner: usize = part_shape[dim..].iter().product();
    Ok(Tensor::new(vec![n, outer, inner], flat)?
        .transpose(&[1, 0, 2])?
        .reshape(&shape)?)
}

/// For `n` blocks along `dim`: the product of the dimensions before `dim`, and the block shape
/// of `shape` (`gather`: the whole shape of blocks of `shape`).
fn blocks_of(
    shape: &[usize],
    dim: usize,
    n: usize,
    gather: bool,
) -> Result<(usize, Vec<usize>), SpmdError> {
    let extent = *shape.get(dim).ok_or_else(|| SpmdError::NoDimension {
        op: "chunk_major",
        dim,
        shape: shape.to_vec(),
    })?;
    let mut out = shape.to_vec();
    if gather {
        out[dim] = extent * n;
    } else if n == 0 || extent % n != 0 {
        return Err(SpmdError::Indivisible {
            op: "chunk_major",
            parts: n,
            dim,
            shape: shape.to_vec(),
        });
    } else {
        out[dim] = extent / n;
    }
    Ok((shape[..dim].iter().product(), out))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `t`'s blocks along `dim` by `Tensor::split`, laid out block after block: the reference.
    fn split_reference(t: &Tensor, dim: usize, n: usize) -> Vec<f32> {
        let parts = t.split(dim, n).expect("divides");
        parts.iter().flat_map(|p| p.data().to_vec()).collect()
    }

    /// Blocks along a leading dimension (every one before it of size 1) are the tensor's own
    /// elements, borrowed; along any other dimension one copy; either way `split`'s blocks in
    /// order, and `from_chunk_major` gives the tensor back (`concat`'s result).
    #[test]
    fn chunk_major_and_back_match_split_and_concat() {
        let t = Tensor::from_fn(&[3, 4, 6], |i| i as f32 * 0.5 - 7.0);
        let ones = Tensor::from_fn(&[1, 1, 6, 4], |i| i as f32);
        for (t, dim, n, leading) in [
            (&t, 0, 3, true),
            (&t, 1, 2, false),
            (&t, 2, 3, false),
            (&ones, 2, 2, true),
            (&ones, 3, 4, false),
        ] {
            let (part_shape, flat) = chunk_major(t, dim, n).expect("divides");
            assert_eq!(
                flat.as_ref(),
                split_reference(t, dim, n).as_slice(),
                "dim {dim}"
            );
            assert_eq!(
                matches!(flat, std::borrow::Cow::Borrowed(_)),
                leading,
                "dim {dim}"
            );
            let blocks: Vec<Tensor> = flat
                .chunks(flat.len() / n)
                .map(|c| Tensor::new(part_shape.clone(), c.to_vec()).expect("block"))
                .collect();
            let refs: Vec<&Tensor> = blocks.iter().collect();
            let want = Tensor::concat(&refs, dim).expect("concat");
            let back = from_chunk_major(flat.into_owned(), &part_shape, dim, n).expect("back");
            assert_eq!(back, want, "dim {dim}");
            assert_eq!(&back, t, "dim {dim}");
        }
        assert!(chunk_major(&t, 1, 3).is_err(), "3 parts of 4");
        assert!(chunk_major(&t, 3, 1).is_err(), "no dimension 3");
        assert!(
            from_chunk_major(vec![0.0; 5], &[2, 3], 1, 2).is_err(),
            "not 2 blocks"
        );
    }
}
