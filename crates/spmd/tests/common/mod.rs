//! Helpers shared by the spmd integration tests.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use ferrotext_comm::{run_spmd, SpmdOptions, Trace};
use ferrotext_sharding::{DimSpec, Mesh, PartitionSpec};
use ferrotext_spmd::{Array, Ctx, SpmdError};
use ferrotext_tensor::Tensor;

pub fn mesh(axes: &[(&str, usize)]) -> Arc<Mesh> {
    Arc::new(Mesh::explicit(axes.iter().map(|&(n, s)| (n, s))).unwrap())
}

/// `P(parts..., unreduced=u, reduced=r)` from string slices; `""` is a replicated dim and
/// `"a+b"` a dim split over `(a, b)`.
pub fn p(parts: &[&str], u: &[&str], r: &[&str]) -> PartitionSpec {
    let dims = parts.iter().map(|d| {
        if d.is_empty() {
            DimSpec::Replicated
        } else {
            DimSpec::axes(d.split('+'))
        }
    });
    PartitionSpec::tagged(dims, u.iter().copied(), r.iter().copied()).unwrap()
}

pub fn iota(shape: &[usize]) -> Tensor {
    Tensor::from_fn(shape, |i| i as f32)
}

/// Runs `f` on every device with a real context; returns each device's result and trace.
pub fn on_devices<T: Send>(
    mesh: &Arc<Mesh>,
    f: impl Fn(&mut Ctx<'_>) -> Result<T, SpmdError> + Sync,
) -> Vec<(T, Trace)> {
    let opts = SpmdOptions::default().with_timeout(Duration::from_secs(30));
    run_spmd(mesh, &opts, |dev| {
        let threads = dev.threads();
        let mut cx = Ctx::new(dev.comm(), threads);
        let value = f(&mut cx)?;
        let trace = cx.comm().take_trace();
        Ok::<_, SpmdError>((value, trace))
    })
    .unwrap_or_else(|e| panic!("spmd run failed: {e}"))
}

/// A global value placed with `spec` (plain or tagged reduced).
pub fn place(cx: &Ctx<'_>, value: &Tensor, spec: PartitionSpec) -> Array {
    let ty = cx.array_type(value.shape(), spec).unwrap();
    cx.from_global(value, ty.sharding().clone()).unwrap()
}

pub fn local(a: &Array) -> Vec<f32> {
    a.local().unwrap().data().to_vec()
}

pub fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}: element {i}: got {g}, want {w}"
        );
    }
}
