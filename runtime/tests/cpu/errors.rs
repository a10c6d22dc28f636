//! Bad bindings and bad graphs are errors that name the value, never panics.

use crate::common::*;
use castor_ir::{DType, Graph, GraphBuilder, Op, Tensor};
use castor_runtime::RuntimeError;

fn mlp() -> Graph {
    let mut b = GraphBuilder::new("mlp");
    let x = b.input("x", ty(DType::F32, &[2, 3])).expect("name");
    let w = b.param("w", ty(DType::F32, &[3, 4])).expect("name");
    let mm = Op::MatMul {
        transpose_a: false,
        transpose_b: false,
    };
    let y = b.op("y", mm, &[x, w]).expect("typed");
    b.set_outputs(vec![y]);
    b.finish()
}

#[test]
fn missing_binding_names_the_value() {
    let x = Tensor::from_f32(DType::F32, [2, 3], vec![0.0; 6]);
    let err = run(&mlp(), &[("x", &x)]).unwrap_err();
    assert_eq!(
        err,
        RuntimeError::MissingBinding {
            name: "w".into(),
            expected: ty(DType::F32, &[3, 4])
        }
    );
    assert_eq!(
        err.to_string(),
        "no tensor is bound to `%w` (expected f32[3,4])"
    );
}

#[test]
fn mistyped_bindings_say_expected_and_found() {
    let x = Tensor::from_f32(DType::F32, [2, 3], vec![0.0; 6]);
    let wrong_shape = Tensor::from_f32(DType::F32, [4, 3], vec![0.0; 12]);
    let err = run(&mlp(), &[("x", &x), ("w", &wrong_shape)]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "the tensor bound to `%w` should be f32[3,4], found f32[4,3]"
    );

    let wrong_dtype = Tensor::from_f32(DType::BF16, [3, 4], vec![0.0; 12]);
    let err = run(&mlp(), &[("x", &x), ("w", &wrong_dtype)]).unwrap_err();
    assert_eq!(
        err,
        RuntimeError::BindingMismatch {
            name: "w".into(),
            expected: ty(DType::F32, &[3, 4]),
            found: ty(DType::BF16, &[3, 4])
        }
    );

    // I32 and I64 share storage but are different types.
    let mut b = GraphBuilder::new("ids");
    let ids = b.input("ids", ty(DType::I32, &[2])).expect("name");
    b.set_outputs(vec![ids]);
    let i64s = Tensor::from_i64(DType::I64, [2], vec![0, 1]);
    let err = run(&b.finish(), &[("ids", &i64s)]).unwrap_err();
    assert!(matches!(err, RuntimeError::BindingMismatch { .. }), "{err}");
}

#[test]
fn invalid_graphs_are_rejected() {
    let mut g = mlp();
    let w = g.lookup("w").expect("exists");
    g.retype(w, DType::I64);
    let err = run(&g, &[]).unwrap_err();
    assert!(matches!(err, RuntimeError::InvalidGraph { .. }), "{err}");
    assert!(
        err.to_string().contains("graph `mlp` is not valid"),
        "{err}"
    );
}
