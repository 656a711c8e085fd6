//! The fused gated units (`Ctx::glu`: SwiGLU and GeGLU) against the ops they fuse, on a mesh
//! that splits the rows: `unary(Silu | GeluTanh)` then `mul`, values and both gradients, and
//! the type errors they share with `mul`.

mod common;

use common::*;
use ferrotext_spmd::{Ctx, SpmdError, TypeErrorKind, UnaryOp};
use ferrotext_tensor::{GluActivation, Tensor};

const SHAPE: [usize; 2] = [8, 96];

fn gate() -> Tensor {
    Tensor::from_fn(&SHAPE, |i| (i % 97) as f32 * 0.13 - 6.0)
}

fn up() -> Tensor {
    Tensor::from_fn(&SHAPE, |i| 1.25 - (i % 11) as f32 * 0.2)
}

/// `Σ y ⊙ w` of the unit (fused or composed) and its gradients, gathered.
fn run(act: GluActivation, fused: bool) -> Vec<Vec<f32>> {
    let w = Tensor::from_fn(&SHAPE, |i| 0.5 + (i % 5) as f32 * 0.25);
    let m = mesh(&[("data", 2)]);
    let results = on_devices(&m, |cx: &mut Ctx<'_>| {
        let spec = p(&["data", ""], &[], &[]);
        let (g, u) = (
            place(cx, &gate(), spec.clone()),
            place(cx, &up(), spec.clone()),
        );
        let w = place(cx, &w, spec.clone());
        let (y, grads) = cx.value_and_grad(&[g, u], |cx, xs| {
            let y = if fused {
                cx.glu(&xs[0], &xs[1], act)?
            } else {
                let op = match act {
                    GluActivation::Silu => UnaryOp::Silu,
                    GluActivation::GeluTanh => UnaryOp::GeluTanh,
                };
                let a = cx.unary(op, &xs[0])?;
                cx.mul(&a, &xs[1])?
            };
            let yw = cx.mul(&y, &w)?;
            cx.reduce_sum(&yw, &[0, 1], None)
        })?;
        let mut out = vec![local(&y)];
        for g in &grads {
            let full = cx.reshard(g, &p(&["", ""], &[], &[]))?;
            out.push(local(&full));
        }
        Ok::<_, SpmdError>(out)
    });
    results.into_iter().next().unwrap().0
}

#[test]
fn the_fused_units_give_the_composed_values_and_gradients() {
    for act in [GluActivation::Silu, GluActivation::GeluTanh] {
        let (fused, composed) = (run(act, true), run(act, false));
        for (what, (f, c)) in ["loss", "dg", "du"].iter().zip(fused.iter().zip(&composed)) {
            assert_close(f, c, 1e-5, &format!("{act:?} {what}"));
        }
    }
}

#[test]
fn a_gated_unit_refuses_what_mul_refuses_naming_itself() {
    let m = mesh(&[("data", 2)]);
    on_devices(&m, |cx| {
        let g = place(cx, &gate(), p(&["data", ""], &[], &[]));
        let u = place(cx, &up(), p(&["", "data"], &[], &[]));
        let err = cx.glu(&g, &u, GluActivation::GeluTanh).unwrap_err();
        let te = err.type_error().expect("a type error");
        assert_eq!(te.kind, TypeErrorKind::ShardingMismatch);
        assert!(err.to_string().contains("geglu"), "{err}");
        let short = place(cx, &Tensor::zeros(&[8, 4]), p(&["data", ""], &[], &[]));
        let err = cx.glu(&g, &short, GluActivation::Silu).unwrap_err();
        assert!(err.to_string().contains("swiglu"), "{err}");
        Ok(())
    });
}
