//! The reverse walk over a tape: each node's cotangent passed to its inputs through the op's
//! transpose, contributions of equal type added without communication (R4.4), and each leaf's
//! gradient given to the sink as soon as no node still to be walked can add to it.

use std::collections::HashMap;

use ferrotext_sharding::ArrayType;

use super::into::{adds_in_place, sink_targets, Into};
use super::tied::TiedRows;
use super::uses::Uses;
use super::GradientSink;
use crate::array::Array;
use crate::ctx::Ctx;
use crate::error::{ShardingTypeError, SpmdError};
use crate::rules::BinaryOp;
use crate::tape::{Backward, Tape};

/// The walk's running state: the contributions gathered per tape value, the leaves' final
/// cotangents, and which leaves went into the sink's buffers or were handed over.
struct Walk {
    cts: Vec<Option<Array>>,
    leaf_cts: Vec<Option<Array>>,
    /// Per tape value: added into the sink's buffer.
    sunk: Vec<bool>,
    /// Per leaf: the sink was told it is final.
    handed: Vec<bool>,
    /// Per rematerialized region (its node): the cotangents of its outputs after the first.
    region_cts: HashMap<usize, Vec<(usize, Array)>>,
    /// Per tied table (tape value) whose head went into the sink's buffer: the rows set aside
    /// until its cotangent is final, and the buffer's type.
    tied: HashMap<usize, (TiedRows, ArrayType)>,
}

impl Ctx<'_> {
    /// The reverse walk. `sink` gets leaf `k`'s cotangent once no later (in walk order) node can
    /// add to it, or is told it was added into its buffer. Returns each leaf's cotangent, `None`
    /// for those added into the sink's buffers.
    pub(super) fn backward(
        &mut self,
        tape: Tape,
        out: &Array,
        seed: Array,
        leaves: &[Array],
        sink: &mut dyn GradientSink,
    ) -> Result<Vec<Option<Array>>, SpmdError> {
        let seeds = out.var.map(|v| (v, seed)).into_iter().collect();
        self.backward_from(tape, seeds, leaves, sink)
    }

    /// [`Ctx::backward`] from several seeds: `(tape value, its cotangent)` each (a
    /// rematerialized region's outputs).
    pub(crate) fn backward_from(
        &mut self,
        tape: Tape,
        seeds: Vec<(usize, Array)>,
        leaves: &[Array],
        sink: &mut dyn GradientSink,
    ) -> Result<Vec<Option<Array>>, SpmdError> {
        // Ops recorded by the profiler during the walk count as backward.
        let _phase = ferrotext_profile::phase_scope(ferrotext_profile::Phase::Backward);
        let n = tape.nodes.len();
        let uses = Uses::new(&tape, leaves);
        let mut walk = Walk {
            cts: (0..n).map(|_| None).collect(),
            leaf_cts: (0..n).map(|_| None).collect(),
            sunk: vec![false; n],
            handed: vec![false; leaves.len()],
            region_cts: HashMap::new(),
            tied: HashMap::new(),
        };
        for (v, seed) in seeds {
            walk.cts[v] = Some(seed);
        }
        for i in (0..n).rev() {
            let ct = walk.cts[i].take();
            match &tape.nodes[i].backward {
                Backward::RematOutput { index } => {
                    if let (Some(ct), Some(Some(region))) = (ct, tape.nodes[i].inputs.first()) {
                        walk.region_cts
                            .entry(*region)
                            .or_default()
                            .push((*index, ct));
                    }
                }
                Backward::Remat { .. } => self.region_node(&tape, &uses, i, ct, &mut walk, sink)?,
                _ => {
                    if let Some(ct) = ct {
                        let into = sink_targets(&tape, &uses, &walk.cts, i);
                        self.backward_node(&tape, i, ct, &mut walk, sink, &into)?;
                    }
                }
            }
            self.finish_leaves(&uses, i, &mut walk, sink)?;
        }
        let grads: Vec<Option<Array>> = leaves
            .iter()
            .map(|leaf| {
                let v = leaf.var.unwrap_or(usize::MAX);
                if walk.sunk.get(v).copied().unwrap_or(false) {
                    return None;
                }
                Some(match walk.leaf_cts.get_mut(v).and_then(Option::take) {
                    Some(ct) => ct,
                    // R4.12: zero cotangents are typed too.
                    None => self.zeros(leaf.ty().to_cotangent()),
                })
            })
            .collect();
        for (k, grad) in grads.iter().enumerate() {
            if !walk.handed[k] {
                sink.finished(self, k, grad.as_ref())?;
            }
        }
        Ok(grads)
    }

    /// Tells `sink` about the leaves whose cotangent is final now that node `i` is walked.
    fn finish_leaves(
        &mut self,
        uses: &Uses,
        i: usize,
        walk: &mut Walk,
        sink: &mut dyn GradientSink,
    ) -> Result<(), SpmdError> {
        for &v in &uses.finished_at[i] {
            // Leaves' cotangents sit in `cts` until the walk reaches them; move them now.
            if let Some(ct) = walk.cts[v].take() {
                walk.leaf_cts[v] = Some(ct);
            }
            let Some(&k) = uses.leaf_of.get(&v) else {
                continue;
            };
            if let Some((rows, expected)) = walk.tied.remove(&v) {
                if walk.leaf_cts[v].is_some() {
                    return Err(SpmdError::Internal {
                        op: "backward",
                        invariant: "a tied table's lookup adds its rows into the buffer",
                    });
                }
                let mut dest = sink.buffer(k, &expected).ok_or(SpmdError::Internal {
                    op: "backward",
                    invariant: "a tied table's buffer is offered until its cotangent is final",
                })?;
                rows.add_back(&mut dest)?;
            }
            if walk.sunk[v] {
                sink.finished(self, k, None)?;
                walk.handed[k] = true;
            } else if let Some(ct) = &walk.leaf_cts[v] {
                sink.finished(self, k, Some(ct))?;
                walk.handed[k] = true;
            }
        }
        Ok(())
    }

    /// Walks a rematerialized region's node `i` (see `crate::remat`): its outputs' cotangents
    /// (`ct` the first's), the region replayed and walked, its inputs' cotangents passed on —
    /// those of parameters whose whole gradient comes from the region offered to `sink`'s
    /// buffers by the replay's walk.
    fn region_node(
        &mut self,
        tape: &Tape,
        uses: &Uses,
        i: usize,
        ct: Option<Array>,
        walk: &mut Walk,
        sink: &mut dyn GradientSink,
    ) -> Result<(), SpmdError> {
        let node = &tape.nodes[i];
        let Backward::Remat { region, outputs } = &node.backward else {
            return Ok(());
        };
        let extra = walk.region_cts.remove(&i).unwrap_or_default();
        if ct.is_none() && extra.is_empty() {
            return Ok(());
        }
        let mut cts: Vec<Option<Array>> = (0..*outputs).map(|_| None).collect();
        cts[0] = ct;
        for (j, c) in extra {
            if let Some(slot) = cts.get_mut(j) {
                *slot = Some(c);
            }
        }
        let mut sink_of = vec![None; node.inputs.len()];
        for t in sink_targets(tape, uses, &walk.cts, i) {
            if !t.through_cast {
                sink_of[t.side] = Some(t.k);
            }
        }
        let grads = self.remat_transpose(region, cts, sink, &sink_of)?;
        for ((input, g), into_sink) in node.inputs.iter().zip(grads).zip(&sink_of) {
            let Some(v) = *input else {
                continue;
            };
            match g {
                None if into_sink.is_some() => walk.sunk[v] = true,
                None => {
                    return Err(SpmdError::Internal {
                        op: "remat",
                        invariant: "only a parameter offered to the sink goes into its buffer",
                    })
                }
                Some(g) => {
                    let expected = tape.nodes[v].ty.to_cotangent();
                    if g.ty() != &expected {
                        return Err(ShardingTypeError::cotangent("remat", &expected, g.ty()).into());
                    }
                    walk.cts[v] = Some(match walk.cts[v].take() {
                        None => g,
                        Some(acc) => self.add_contributions(acc, g)?,
                    });
                }
            }
        }
        Ok(())
    }

    /// Walks node `i` with its cotangent `ct`: a leaf keeps it, any other node passes its
    /// inputs' cotangents on. `into` lists the leaves whose whole cotangent this node gives
    /// through an input: a `dot_general`, a `take` or a grouped product first offers it to
    /// `sink`'s buffer (the leaf is marked in `walk.sunk` when it went there).
    fn backward_node(
        &mut self,
        tape: &Tape,
        i: usize,
        ct: Array,
        walk: &mut Walk,
        sink: &mut dyn GradientSink,
        into: &[Into],
    ) -> Result<(), SpmdError> {
        let node = &tape.nodes[i];
        if let Backward::Leaf = node.backward {
            walk.leaf_cts[i] = Some(ct);
            return Ok(());
        }
        // A product whose result dtype is not its operands' (the LM head's f32 logits): both
        // transposes take the cotangent in the operands' dtype, so it is cast once, here —
        // where `dot_general_transpose` would cast it — and an operand that is a weight's bf16
        // cast can then take the rounded product into its buffer like any other weight.
        let ct = match &node.backward {
            Backward::Dot { lhs, rhs, .. }
                if lhs.ty().dtype() == rhs.ty().dtype() && ct.ty().dtype() != lhs.ty().dtype() =>
            {
                self.cast_untracked(&ct, lhs.ty().dtype())?
            }
            _ => ct,
        };
        let mut needed: Vec<bool> = node.inputs.iter().map(Option::is_some).collect();
        if adds_in_place(&node.backward) {
            self.add_into_sink(tape, i, &ct, walk, sink, into, &mut needed)?;
        }
        let into_existing = self.add_into_existing(tape, i, &ct, walk, &mut needed)?;
        if (into_existing || adds_in_place(&node.backward)) && !needed.iter().any(|&n| n) {
            return Ok(());
        }
        let input_cts = self.transpose_node(&node.backward, &ct, &needed)?;
        for ((input, ict), &need) in node.inputs.iter().zip(input_cts).zip(&needed) {
            let (Some(v), Some(ict), true) = (input, ict, need) else {
                continue;
            };
            let expected = tape.nodes[*v].ty.to_cotangent();
            if ict.ty() != &expected {
                return Err(ShardingTypeError::cotangent("backward", &expected, ict.ty()).into());
            }
            walk.cts[*v] = Some(match walk.cts[*v].take() {
                None => ict,
                // R4.4: contributions of equal type add without communication.
                Some(acc) => self.add_contributions(acc, ict)?,
            });
        }
        Ok(())
    }

    /// A leaf's whole cotangent, into the sink's buffer, for each leaf of `into` whose buffer
    /// the sink offers; clears `needed` for the inputs so served.
    #[allow(clippy::too_many_arguments)]
    fn add_into_sink(
        &mut self,
        tape: &Tape,
        i: usize,
        ct: &Array,
        walk: &mut Walk,
        sink: &mut dyn GradientSink,
        into: &[Into],
        needed: &mut [bool],
    ) -> Result<(), SpmdError> {
        let node = &tape.nodes[i];
        for &Into {
            side,
            k,
            leaf,
            through_cast,
            tied_take,
        } in into
        {
            let expected = tape.nodes[leaf].ty.to_cotangent();
            let Some(mut dest) = sink.buffer(k, &expected) else {
                continue;
            };
            // A tied table: the lookup's rows set aside first (see `tied`), or handed.
            let tied = match tied_take.map(|t| &tape.nodes[t].backward) {
                Some(Backward::Take { table, ids, .. }) => {
                    match TiedRows::set_aside(self, (table, ids), &mut dest)? {
                        Some(rows) => Some(rows),
                        None => continue,
                    }
                }
                Some(_) => continue,
                None => None,
            };
            let added = match (&node.backward, through_cast) {
                (Backward::Dot { lhs, rhs, dims }, true) => {
                    self.dot_general_transpose_rounded_into((lhs, rhs), dims, ct, side, &mut dest)?
                }
                (_, true) => false,
                (backward, false) => self.add_contribution_into(backward, ct, side, &mut dest)?,
            };
            if let Some(rows) = tied {
                if added {
                    walk.tied.insert(leaf, (rows, expected.clone()));
                } else {
                    rows.restore(&mut dest)?;
                }
            }
            if added {
                walk.sunk[leaf] = true;
                needed[side] = false;
            }
        }
        Ok(())
    }

    /// A take's rows, or a slice, into the contribution its input already has (a tied
    /// embedding's head; a value cut into parts, as MLA's projections are): R4.4's sum without
    /// a zero table or a zero-padded copy (the same values; a `-0.0` the rows or the slice miss
    /// stays `-0.0`, where adding zeros would make it `+0.0`). Only these two: each element of
    /// the contribution gets one addend (a take's rows are summed per table row first), so the
    /// sum is R4.4's to the bit. Returns whether node `i` is such an op; clears `needed[0]`
    /// when its contribution went in.
    fn add_into_existing(
        &mut self,
        tape: &Tape,
        i: usize,
        ct: &Array,
        walk: &mut Walk,
        needed: &mut [bool],
    ) -> Result<bool, SpmdError> {
        let node = &tape.nodes[i];
        let into_existing = matches!(
            node.backward,
            Backward::Take { .. } | Backward::Slice { .. }
        );
        if let (true, Some(Some(v)), Some(true)) =
            (into_existing, node.inputs.first(), needed.first().copied())
        {
            let expected = tape.nodes[*v].ty.to_cotangent();
            if let Some(existing) = walk.cts[*v].as_mut() {
                if existing.ty() == &expected
                    && existing.local_bf16().is_none()
                    && !existing.is_abstract()
                {
                    let dest = existing.local_mut()?.data_mut();
                    if self.add_contribution_into(&node.backward, ct, 0, &mut [dest])? {
                        needed[0] = false;
                    }
                }
            }
        }
        Ok(into_existing)
    }

    /// `acc + ict` for two contributions of the same type (R4.4): added into whichever of the
    /// two no other array shares, in place (no new buffer; IEEE addition is commutative, so
    /// the bits are those of `acc + ict`), else into a new one.
    fn add_contributions(&mut self, mut acc: Array, mut ict: Array) -> Result<Array, SpmdError> {
        // In place on `f32` shards only: asking a bf16 shard for its `f32` view widens a copy
        // of it (two per sum of bf16 contributions, `x`'s from a layer's gate and up products,
        // before this was checked), and bf16 sums go through the rounding op below anyway.
        let f32_shards = acc.local_bf16().is_none() && ict.local_bf16().is_none();
        if acc.ty() == ict.ty() && f32_shards {
            if let (Some(a), Some(b)) = (acc.local_if_unique(), ict.local_opt().as_deref()) {
                a.add_assign(b)?;
                return Ok(acc);
            }
            if let (Some(b), Some(a)) = (ict.local_if_unique(), acc.local_opt().as_deref()) {
                b.add_assign(a)?;
                return Ok(ict);
            }
        }
        self.binary_untracked(BinaryOp::Add, &acc, &ict)
    }
}
