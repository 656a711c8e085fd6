//! How a tape's values are used ([`Uses`]): which are leaves, who reads each and when a leaf's
//! cotangent is final — computed once before the reverse walk.

use std::collections::HashMap;

use crate::array::Array;
use crate::tape::Tape;

/// How the tape's values are used, computed once before the walk.
pub(super) struct Uses {
    /// Tape value → index of the leaf (parameter) it is.
    pub(super) leaf_of: HashMap<usize, usize>,
    /// For each leaf value, the smallest index of a node that reads it: the walk's last
    /// contribution to it.
    pub(super) first_use: Vec<Option<usize>>,
    /// How many times each value is an input, over the whole tape.
    pub(super) uses: Vec<usize>,
    /// For each node, the leaf values whose cotangent is final once the walk has passed it.
    pub(super) finished_at: Vec<Vec<usize>>,
}

impl Uses {
    pub(super) fn new(tape: &Tape, leaves: &[Array]) -> Uses {
        let n = tape.nodes.len();
        let leaf_of: HashMap<usize, usize> = leaves
            .iter()
            .enumerate()
            .filter_map(|(k, l)| l.var.map(|v| (v, k)))
            .collect();
        let mut first_use: Vec<Option<usize>> = vec![None; n];
        let mut uses = vec![0usize; n];
        for (i, node) in tape.nodes.iter().enumerate() {
            for v in node.inputs.iter().flatten() {
                uses[*v] += 1;
                if leaf_of.contains_key(v) && first_use[*v].is_none() {
                    first_use[*v] = Some(i);
                }
            }
        }
        let mut finished_at: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (v, use_at) in first_use.iter().enumerate() {
            if let Some(i) = use_at {
                finished_at[*i].push(v);
            }
        }
        Uses {
            leaf_of,
            first_use,
            uses,
            finished_at,
        }
    }
}
