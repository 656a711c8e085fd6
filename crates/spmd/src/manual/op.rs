//! The manual-region primitives as the tape records them ([`ManualOp`]), and what an
//! `all_gather` produces ([`GatherTo`]): plain data, so the tape can hold them without knowing
//! how they run (`collectives` runs them and their transposes).

use super::typing::AxisState;

/// What an `all_gather` inside a region produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GatherTo {
    /// Gathered and still varying (transpose: `psum_scatter`).
    Varying,
    /// Gathered and reduced (transpose: `psum_scatter` of an unreduced cotangent).
    Reduced,
    /// Gathered and invarying (transpose: a local slice).
    Invarying,
}

/// A manual-region primitive, with what its transpose needs.
#[derive(Clone, Debug)]
pub(crate) enum ManualOp {
    /// `psum` over axes the value is varying on (`psum_invariant`) or unreduced on
    /// (`unreduced_psum`): an all-reduce; the result is invarying.
    Psum { axes: Vec<String>, from: AxisState },
    /// Reduce-scatter along `dim`: unreduced → varying, or varying → varying.
    PsumScatter {
        axes: Vec<String>,
        dim: usize,
        from: AxisState,
    },
    /// All-gather along `dim` from varying.
    AllGather {
        axes: Vec<String>,
        dim: usize,
        to: GatherTo,
    },
    /// All-to-all: chunk `j` of `split` goes to member `j`, received chunks concatenate on
    /// `concat`. Varying → varying.
    AllToAll {
        axes: Vec<String>,
        split: usize,
        concat: usize,
    },
    /// A free cast (`pvary`, `reduced_vary_cast`, `vary_unreduced_cast`, `preduced`).
    Pcast {
        axes: Vec<String>,
        from: AxisState,
        to: AxisState,
    },
    /// This device's block along `dim`: invarying → varying (transpose of an invarying gather).
    LocalSlice { axes: Vec<String>, dim: usize },
}
