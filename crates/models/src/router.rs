//! DeepSeek-V3's expert selection (`DeepseekV3TopkRouter.get_topk_indices` in transformers;
//! MaxText `get_topk` with `n_routing_groups`, `topk_routing_group`, `routed_bias`): which `k`
//! experts each token goes to, given its router scores.
//!
//! 1. `choice = scores + bias`: the selection-only bias (`e_score_correction_bias`, state moved
//!    by the aux-loss-free balancing, never a trained weight);
//! 2. with `n_routing_groups = G > 1`, the `E` experts form `G` consecutive groups of `E/G`; a
//!    group's score is the sum of its two best `choice` values (DeepSeek-V2's
//!    `group_limited_greedy`: its best one, [`GroupScore::Max`]), and only the `topk_routing_group`
//!    best groups stay eligible: the other experts' `choice` is set to **0** (transformers'
//!    `masked_fill(.., 0.0)`, not −∞: an eligible expert whose biased score is negative can lose
//!    to an ineligible one, as it does in transformers);
//! 3. the top `k` of `choice` per token (ties to the lower index).
//!
//! The gate weights are not made here: they are the *unbiased* scores of the chosen experts
//! (renormalised and scaled by [`crate::moe`]), so the bias moves the selection and nothing else,
//! and no gradient flows through the choice.
//!
//! Invariants (checked by [`GroupLimit::check`] once, at model construction): `G` divides `E`,
//! `1 ≤ topk_routing_group ≤ G`, groups of at least 2 experts when `G > 1`, and the eligible
//! experts (`topk_routing_group · E/G`) at least `k`.

use ferrotext_spmd::SpmdError;
use ferrotext_tensor::Tensor;

/// Group-limited routing (`n_routing_groups`, `topk_routing_group`; HF `n_group`, `topk_group`).
/// `n_routing_groups = 1` is plain top-k.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupLimit {
    /// Groups the experts are split into (`n_routing_groups`).
    pub n_routing_groups: usize,
    /// Groups a token may use (`topk_routing_group`).
    pub topk_routing_group: usize,
    /// How a group is scored.
    pub score: GroupScore,
}

/// How a group of experts is scored for the group limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GroupScore {
    /// The sum of its two best choices (DeepSeek-V3's `noaux_tc`).
    #[default]
    TopTwoSum,
    /// Its best choice (DeepSeek-V2's `group_limited_greedy`).
    Max,
}

impl Default for GroupLimit {
    fn default() -> Self {
        GroupLimit {
            n_routing_groups: 1,
            topk_routing_group: 1,
            score: GroupScore::TopTwoSum,
        }
    }
}

impl GroupLimit {
    /// Whether the groups restrict anything (more than one group).
    pub fn is_active(&self) -> bool {
        self.n_routing_groups > 1
    }

    /// The module invariants for `experts` routed experts and top-`k`.
    ///
    /// # Errors
    /// A sentence naming the keys and their values.
    pub fn check(&self, experts: usize, k: usize) -> Result<(), String> {
        let (g, tg) = (self.n_routing_groups, self.topk_routing_group);
        if g == 0 || !experts.is_multiple_of(g) {
            return Err(format!(
                "n_routing_groups ({g}) must be positive and divide the {experts} routed experts"
            ));
        }
        if tg == 0 || tg > g {
            return Err(format!(
                "topk_routing_group ({tg}) must be between 1 and n_routing_groups ({g})"
            ));
        }
        if g > 1 && experts / g < 2 && self.score == GroupScore::TopTwoSum {
            return Err(format!(
                "n_routing_groups ({g}) leaves {} expert(s) per group; a group is scored by its \
                 best two",
                experts / g
            ));
        }
        if tg * (experts / g) < k {
            return Err(format!(
                "topk_routing_group ({tg}) of n_routing_groups ({g}) leaves {} eligible experts \
                 for num_experts_per_tok = {k}",
                tg * (experts / g)
            ));
        }
        Ok(())
    }
}

/// The `k` experts of each row of `scores` (`[n, E]`, this device's tokens), token-major
/// (`out[t·k + j]`: token `t`'s `j`-th), chosen on `scores + bias` within the best groups (see
/// the module docs).
///
/// # Errors
/// A bias of the wrong length, `k` out of range.
pub fn select_experts(
    scores: &Tensor,
    k: usize,
    bias: Option<&[f32]>,
    groups: GroupLimit,
) -> Result<Vec<u32>, SpmdError> {
    let e = scores.shape().last().copied().unwrap_or(0);
    if let Some(b) = bias {
        if b.len() != e {
            return Err(SpmdError::WeightShape {
                op: "router",
                name: "e_score_correction_bias",
                expected: format!("[{e}]"),
                got: format!("[{}]", b.len()),
            });
        }
    }
    // 1. choice = scores + bias
    let mut choice: Vec<f32> = match bias {
        Some(b) => scores
            .data()
            .iter()
            .enumerate()
            .map(|(i, s)| s + b[i % e])
            .collect(),
        None => scores.data().to_vec(),
    };
    // 2. the group limit: experts outside the best groups get 0 (transformers' masked_fill)
    if groups.is_active() && e > 0 {
        let (g, per) = (groups.n_routing_groups, e / groups.n_routing_groups);
        for row in choice.chunks_mut(e) {
            let group_scores: Vec<f32> = match groups.score {
                GroupScore::TopTwoSum => row.chunks(per).map(best_two_sum).collect(),
                GroupScore::Max => row
                    .chunks(per)
                    .map(|m| m.iter().copied().fold(f32::NEG_INFINITY, f32::max))
                    .collect(),
            };
            let gs = Tensor::new(vec![g], group_scores)?;
            let (_, keep) = ferrotext_tensor::top_k(&gs, groups.topk_routing_group)?;
            for (group, members) in row.chunks_mut(per).enumerate() {
                if !keep.contains(&(group as u32)) {
                    members.fill(0.0);
                }
            }
        }
    }
    // 3. top-k of the choice
    let choice = Tensor::new(scores.shape().to_vec(), choice)?;
    Ok(ferrotext_tensor::top_k(&choice, k)?.1)
}

/// The sum of the two largest values of `xs` (at least two long).
fn best_two_sum(xs: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in xs {
        if x > a {
            b = a;
            a = x;
        } else if x > b {
            b = x;
        }
    }
    a + b
}

/// Tokens routed to each of `experts` experts by a routing `chosen` (as [`select_experts`]
/// returns it): the expert loads the aux-loss-free balancing reads.
pub fn expert_load(chosen: &[u32], experts: usize) -> Vec<f32> {
    let mut load = vec![0f32; experts];
    for &ex in chosen {
        if let Some(l) = load.get_mut(ex as usize) {
            *l += 1.0;
        }
    }
    load
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(rows: usize, data: Vec<f32>) -> Tensor {
        let e = data.len() / rows;
        Tensor::new(vec![rows, e], data).unwrap()
    }

    /// Two tokens, 8 experts in 4 groups of 2, top-2 groups, top-3 experts, with a bias; the
    /// answer worked by hand.
    #[test]
    fn groups_and_bias_pick_the_experts_worked_by_hand() {
        let scores = t(
            2,
            vec![
                0.9, 0.1, 0.5, 0.5, 0.2, 0.2, 0.8, 0.7, // token 0
                0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, // token 1
            ],
        );
        let bias = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.6, 0.0];
        let groups = GroupLimit {
            n_routing_groups: 4,
            topk_routing_group: 2,
            ..GroupLimit::default()
        };
        let got = select_experts(&scores, 3, Some(&bias), groups).unwrap();
        // Token 0: choice = [.9 .1 | .5 .5 | .2 .2 | .2 .7]; group scores 1.0, 1.0, 0.4, 0.9 →
        // groups 0 and 1 (the tie to the lower index); eligible .9 .1 .5 .5 → experts 0, 2, 3.
        // Without the bias group 3 (1.5) would win and expert 6 (0.8) be chosen.
        assert_eq!(&got[..3], &[0, 2, 3]);
        // Token 1: all equal → groups 0, 1 → experts 0, 1, 2.
        assert_eq!(&got[3..], &[0, 1, 2]);
        let unbiased = select_experts(&scores, 3, None, groups).unwrap();
        assert_eq!(&unbiased[..3], &[0, 6, 7]);
    }

    /// Ineligible experts count as 0, not −∞: an eligible expert with a negative biased score
    /// loses to them (transformers' masked_fill).
    #[test]
    fn ineligible_experts_score_zero_like_transformers() {
        let scores = t(1, vec![0.1, 0.1, 0.05, 0.05]);
        let bias = [0.0, -0.5, 0.0, 0.0];
        let groups = GroupLimit {
            n_routing_groups: 2,
            topk_routing_group: 1,
            ..GroupLimit::default()
        };
        // choice [.1 −.4 | .05 .05]: group scores −.3, .1 → group 1 only; masked [0 0 .05 .05];
        // top-3 = 2, 3 then expert 0 (a masked 0 beats nothing else; lower index wins the tie).
        let got = select_experts(&scores, 3, Some(&bias), groups).unwrap();
        assert_eq!(got, vec![2, 3, 0]);
    }

    #[test]
    fn one_group_is_plain_top_k() {
        let scores = t(1, vec![0.2, 0.9, 0.4, 0.6]);
        let got = select_experts(&scores, 2, None, GroupLimit::default()).unwrap();
        assert_eq!(got, vec![1, 3]);
    }

    #[test]
    fn loads_count_tokens_per_expert() {
        assert_eq!(
            expert_load(&[0, 2, 3, 0, 1, 2], 4),
            vec![2.0, 1.0, 2.0, 1.0]
        );
    }

    #[test]
    fn bad_group_settings_are_named() {
        let g = |n, t| GroupLimit {
            n_routing_groups: n,
            topk_routing_group: t,
            ..GroupLimit::default()
        };
        assert!(g(3, 1).check(8, 2).unwrap_err().contains("divide the 8"));
        assert!(g(4, 5)
            .check(8, 2)
            .unwrap_err()
            .contains("topk_routing_group (5)"));
        assert!(g(8, 2).check(8, 2).unwrap_err().contains("best two"));
        assert!(g(4, 1).check(8, 3).unwrap_err().contains("2 eligible"));
        assert!(g(4, 2).check(8, 3).is_ok());
    }
}
