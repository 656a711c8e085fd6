//! The routed experts of the sparse MoE path: every token copy through its expert's SwiGLU as
//! one grouped product, on this device ([`experts_local`]) or with the experts split over mesh
//! axes and the copies exchanged by `all_to_all` ([`experts_parallel`]; the module docs of
//! `moe` say how).

use ferrotext_sharding::ArrayType;
use ferrotext_spmd::{Array, Ctx, SpmdError};
use ferrotext_tensor::{Tensor, PAD_ROW};

/// Every copy's expert output `[n·k, d]` (token-major), all experts on this device.
pub(super) fn experts_local(
    cx: &mut Ctx<'_>,
    xf: &Array,
    w: &[Array],
    experts: &[u32],
    e: usize,
    k: usize,
) -> Result<Array, SpmdError> {
    // Sort the token copies by expert (stable), remember where each copy went.
    let mut order: Vec<usize> = (0..experts.len()).collect();
    order.sort_by_key(|&c| experts[c]);
    let sorted_tokens: Vec<u32> = order.iter().map(|&c| (c / k) as u32).collect();
    let mut back = vec![0u32; experts.len()];
    for (position, &c) in order.iter().enumerate() {
        back[c] = position as u32;
    }
    let mut group_sizes = vec![0usize; e];
    for &ex in experts {
        group_sizes[ex as usize] += 1;
    }
    let xs = cx.take_rows(xf, &sorted_tokens)?;
    let ys = expert_swiglu(cx, &xs, w, &group_sizes)?;
    cx.take_rows(&ys, &back)
}

/// `swiglu(x·wi_0[g], x·wi_1[g])·wo[g]` per group of rows.
fn expert_swiglu(
    cx: &mut Ctx<'_>,
    xs: &Array,
    w: &[Array],
    group_sizes: &[usize],
) -> Result<Array, SpmdError> {
    // The expert weights (f32 masters) in the activations' dtype, cast at use.
    let dtype = xs.ty().dtype();
    let (wi_0, wi_1, wo) = (
        cx.cast(&w[1], dtype)?,
        cx.cast(&w[2], dtype)?,
        cx.cast(&w[3], dtype)?,
    );
    let g = cx.grouped_matmul(xs, &wi_0, group_sizes)?;
    let u = cx.grouped_matmul(xs, &wi_1, group_sizes)?;
    let a = cx.swiglu(&g, &u)?;
    cx.grouped_matmul(&a, &wo, group_sizes)
}

/// [`experts_local`] with the experts split over `ep_axes`: copies travel to their expert's
/// device and back by `all_to_all` (see the module docs).
pub(super) fn experts_parallel(
    cx: &mut Ctx<'_>,
    xf: &Array,
    w: &[Array],
    experts: &[u32],
    e: usize,
    k: usize,
    ep_axes: &[&str],
) -> Result<Array, SpmdError> {
    let (_, ep) = cx.axis_index(ep_axes)?;
    let local_experts = w[1].ty().shape()[0];
    if local_experts * ep != e {
        return Err(SpmdError::ExpertsIndivisible {
            op: "moe",
            experts: e,
            devices: ep,
            axes: ep_axes.iter().map(|a| a.to_string()).collect(),
        });
    }
    let copies = experts.len();
    let cap = copies; // worst case: every copy goes to one device
                      // 1. the send buffer: chunk j holds the copies for device j, sorted by expert, then padding.
    let mut order: Vec<usize> = (0..copies).collect();
    order.sort_by_key(|&c| experts[c]);
    let mut send_rows = vec![PAD_ROW; ep * cap];
    let mut slot_of_copy = vec![0u32; copies];
    let mut filled = vec![0usize; ep];
    let mut counts = vec![0f32; ep * local_experts];
    for &c in &order {
        let ex = experts[c] as usize;
        let j = ex / local_experts;
        let slot = j * cap + filled[j];
        filled[j] += 1;
        send_rows[slot] = (c / k) as u32;
        slot_of_copy[c] = slot as u32;
        counts[ex] += 1.0; // = counts[j * local_experts + ex % local_experts]
    }
    // 2. counts and rows to the experts' devices.
    let counts_ty = ArrayType::manual(
        xf.ty().dtype(),
        vec![ep * local_experts],
        xf.ty().sharding().mesh().clone(),
        xf.ty().manual_tags().clone(),
    )?;
    let counts = cx.from_local(counts_ty, Tensor::new(vec![ep * local_experts], counts)?)?;
    let received_counts = cx.all_to_all(&counts, ep_axes, 0, 0)?;
    let xs_send = cx.take_rows(xf, &send_rows)?;
    let xs_recv = cx.all_to_all(&xs_send, ep_axes, 0, 0)?;
    // 3. here: rows grouped by local expert across the sources, padding last.
    let received: Vec<usize> = match received_counts.local() {
        Ok(t) => t.data().iter().map(|&c| c as usize).collect(),
        Err(_) => vec![0; ep * local_experts], // abstract mode: shapes only
    };
    let mut local_rows = Vec::with_capacity(ep * cap);
    let mut group_sizes = vec![0usize; local_experts];
    for (l, size) in group_sizes.iter_mut().enumerate() {
        for source in 0..ep {
            let before: usize = received[source * local_experts..source * local_experts + l]
                .iter()
                .sum();
            let count = received[source * local_experts + l];
            local_rows.extend((0..count).map(|r| (source * cap + before + r) as u32));
            *size += count;
        }
    }
    let mut back = vec![PAD_ROW; ep * cap];
    for (position, &row) in local_rows.iter().enumerate() {
        back[row as usize] = position as u32;
    }
    local_rows.resize(ep * cap, PAD_ROW);
    let xs = cx.take_rows(&xs_recv, &local_rows)?;
    let ys = expert_swiglu(cx, &xs, w, &group_sizes)?;
    // 4. results back to the devices the copies came from, then into token-major order.
    let ys_recv_layout = cx.take_rows(&ys, &back)?;
    let ys_home = cx.all_to_all(&ys_recv_layout, ep_axes, 0, 0)?;
    cx.take_rows(&ys_home, &slot_of_copy)
}
