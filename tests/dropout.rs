//! Dropout in training (`--dropout off|config|P`): where the model builders put it (as
//! transformers' modules apply it), that a negative key offset is evaluation mode bit for bit,
//! that each micro-step draws a new mask from the seeded stream, and that a resumed run
//! continues that stream.

use crate::common::{self, *};
use castor_ir::{relative_error, DType, Dropout, Graph, Op, Tensor};
use castor_models::{AttentionImpl, Model, Objective};
use castor_passes::{Autodiff, Pass};
use castor_runtime::cpu::CpuExecutor;
use std::collections::HashMap;

/// (name, p, stream) of every dropout node of `g`.
fn dropouts(g: &Graph) -> Vec<(String, f64, usize)> {
    g.nodes()
        .filter_map(|(_, n)| match n.op {
            Op::Dropout { p, stream } => Some((g.name(n.outputs[0]).to_string(), p, stream)),
            _ => None,
        })
        .collect()
}

fn loss_graph(variant: &str, dropout: Dropout, attention: AttentionImpl) -> Graph {
    let mut model = Model::load(common::fixture(variant)).unwrap();
    model.set_attention(attention);
    model.set_dropout(dropout);
    model.build_loss_graph(2, 8, Objective::Lm).unwrap()
}

#[test]
fn dropout_sits_where_transformers_applies_it() {
    // GPT-2 (2 layers, every *_pdrop 0.1): the embeddings' sum, each layer's attention
    // probabilities, and the attention's and the MLP's outputs before their residual adds.
    let g = loss_graph("gpt2_lm", Dropout::Config, AttentionImpl::Eager);
    let names: Vec<String> = dropouts(&g).iter().map(|d| d.0.clone()).collect();
    assert_eq!(
        names,
        [
            "embeddings.dropout",
            "h.0.attn.probs.dropout",
            "h.0.attn.proj.dropout",
            "h.0.mlp.proj.dropout",
            "h.1.attn.probs.dropout",
            "h.1.attn.proj.dropout",
            "h.1.mlp.proj.dropout",
        ]
    );
    let d = dropouts(&g);
    assert!(d.iter().all(|(_, p, _)| *p == 0.1), "{d:?}");
    let streams: Vec<usize> = d.iter().map(|x| x.2).collect();
    assert_eq!(streams, (0..d.len()).collect::<Vec<_>>(), "one stream each");

    // BERT: after the embeddings' LayerNorm, the probabilities, and each sublayer's output.
    let mut bert = Model::load(common::fixture("bert_mlm")).unwrap();
    bert.set_dropout(Dropout::P(0.25));
    let g = bert.build_loss_graph(2, 8, Objective::Mlm).unwrap();
    let d = dropouts(&g);
    assert_eq!(d.len(), 1 + 3 * 2, "{d:?}");
    assert_eq!(d[0].0, "embeddings.dropout");
    assert!(d.iter().all(|(_, p, _)| *p == 0.25));

    // A BERT classifier also drops its pooled output (`classifier_dropout`, else the hidden
    // rate).
    let mut cls = Model::load(common::fixture("bert_cls")).unwrap();
    cls.set_dropout(Dropout::Config);
    let g = cls.build_loss_graph(2, 8, Objective::Classify).unwrap();
    let d = dropouts(&g);
    assert_eq!(d.len(), 1 + 3 * 2 + 1, "{d:?}");
    assert_eq!(d[d.len() - 1].0, "classifier.dropout");

    // The LLaMA family has attention_dropout only (0.0 in the fixture: nothing to insert
    // unless a probability is given).
    assert!(dropouts(&loss_graph(
        "llama_gqa",
        Dropout::Config,
        AttentionImpl::Eager
    ))
    .is_empty());
    let g = loss_graph("llama_gqa", Dropout::P(0.2), AttentionImpl::Eager);
    let d = dropouts(&g);
    assert_eq!(d.len(), 2, "{d:?}");
    assert!(d
        .iter()
        .all(|(n, p, _)| n.ends_with("self_attn.probs.dropout") && *p == 0.2));

    // Off: the eval-mode graph, without a key input.
    let g = loss_graph("gpt2_lm", Dropout::Off, AttentionImpl::Eager);
    assert!(dropouts(&g).is_empty() && g.lookup("dropout_key").is_none());

    // The fused attention (auto, fused, cudnn) drops its probabilities itself: each layer's
    // `attention` op carries the probability and the stream the eager `probs.dropout` node
    // takes (so both draw the same mask) and reads `dropout_key` last; no probabilities node.
    let eager = loss_graph("gpt2_lm", Dropout::Config, AttentionImpl::Eager);
    let eager_streams: Vec<usize> = dropouts(&eager)
        .iter()
        .filter(|d| d.0.ends_with("probs.dropout"))
        .map(|d| d.2)
        .collect();
    for attention in [
        AttentionImpl::Auto,
        AttentionImpl::Fused,
        AttentionImpl::Cudnn,
    ] {
        let g = loss_graph("gpt2_lm", Dropout::Config, attention);
        let key = g.lookup("dropout_key").unwrap();
        let mut streams = Vec::new();
        for (_, n) in g.nodes() {
            if let Op::Attention {
                dropout: Some(d), ..
            } = n.op
            {
                assert_eq!(d.p, 0.1);
                assert_eq!(n.inputs.last(), Some(&key));
                streams.push(d.stream);
            }
        }
        assert_eq!(streams, eager_streams, "{attention:?}");
        let names: Vec<String> = dropouts(&g).iter().map(|d| d.0.clone()).collect();
        assert_eq!(names.len(), 5, "{names:?}");
        assert!(names.iter().all(|n| !n.ends_with("probs.dropout")));
    }
}

/// The loss and every gradient of GPT-2's training graph with dropout under `key`.
fn run(g: &Graph, key: [i64; 2]) -> Vec<Vec<f32>> {
    let (back, _) = Autodiff::default().run(g).unwrap();
    let model = Model::load(common::fixture("gpt2_lm")).unwrap();
    let params = model.load_params().unwrap();
    let ids: Vec<i64> = (0..16).map(|i| (i * 7 + 3) % 50).collect();
    let mut batch: HashMap<String, Tensor> = HashMap::from([
        (
            "input_ids".into(),
            Tensor::from_i64(DType::I64, [2, 8], ids.clone()),
        ),
        ("labels".into(), Tensor::from_i64(DType::I64, [2, 8], ids)),
        (
            "attention_mask".into(),
            Tensor::from_i64(DType::I64, [2, 8], vec![1; 16]),
        ),
    ]);
    batch.insert(
        "dropout_key".into(),
        Tensor::from_i64(DType::I64, [2], key.to_vec()),
    );
    let out = CpuExecutor::new()
        .run(&back, &|n| batch.get(n).or_else(|| params.get(n)))
        .unwrap();
    out.iter().map(|t| t.as_f32().unwrap().to_vec()).collect()
}

#[test]
fn a_negative_offset_is_evaluation_mode_and_each_offset_a_new_mask() {
    let eval = run(
        &loss_graph("gpt2_lm", Dropout::Off, AttentionImpl::Eager),
        [0, 0],
    );
    let g = loss_graph("gpt2_lm", Dropout::Config, AttentionImpl::Eager);
    // Evaluation mode: the loss and every gradient bit-identical to the graph without dropout.
    let off = run(&g, [5, -1]);
    for (a, b) in off.iter().zip(&eval) {
        assert_eq!(relative_error(a, b), 0.0);
    }
    // Training mode: a new mask per offset, the same mask for the same key.
    let (a, b, again) = (run(&g, [5, 0]), run(&g, [5, 1]), run(&g, [5, 0]));
    assert_eq!(a, again);
    assert_ne!(a[0], b[0]);
    assert_ne!(a[0], eval[0]);
    println!(
        "loss: eval {}, offset 0 {}, offset 1 {}",
        eval[0][0], a[0][0], b[0][0]
    );
}

/// From the CLI: dropout changes the losses, a resumed run continues the same masks, and
/// validation runs without dropout.
#[test]
fn a_resumed_run_continues_the_dropout_stream() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("gpt2_lm");
    let data = model.join("input.safetensors");
    let train = |steps: &str, log: &std::path::Path, extra: &[&str]| {
        let mut args = vec![
            "train",
            path_str(&model),
            "--data",
            path_str(&data),
            "--steps",
            steps,
            "--device",
            "cpu",
            "--seed",
            "3",
            "--log",
            path_str(log),
        ];
        args.extend_from_slice(extra);
        let o = castor(&args);
        ok(&o);
        o
    };
    let (off, straight, resumed) = (
        tmp.path().join("off.jsonl"),
        tmp.path().join("straight.jsonl"),
        tmp.path().join("resumed.jsonl"),
    );
    let ckpt = tmp.path().join("ckpt");
    train("4", &off, &[]);
    train("4", &straight, &["--dropout", "config"]);
    train(
        "2",
        &resumed,
        &["--dropout", "config", "--save", path_str(&ckpt)],
    );
    train("4", &resumed, &["--resume", path_str(&ckpt)]);
    let losses = log_losses(&straight);
    assert_eq!(losses.len(), 4);
    assert_eq!(log_losses(&resumed), losses);
    assert_ne!(log_losses(&off), losses);
}

/// A forward pass is evaluation: `compile --dropout config` asks for the training step, whose
/// IR holds the dropout nodes, rather than silently compiling a forward pass without them.
#[test]
fn compile_with_dropout_compiles_the_training_step() {
    let model = fixture("gpt2_lm");
    let ir = |extra: &[&str]| {
        let mut args = vec!["compile", path_str(&model), "--emit", "ir"];
        args.extend_from_slice(extra);
        let o = castor(&args);
        ok(&o);
        stdout(&o)
    };
    let with = ir(&["--dropout", "config"]);
    assert!(with.contains("dropout("), "{with}");
    assert!(with.contains("grad."), "not a training step:\n{with}");
    let forward = ir(&["--dropout", "off"]);
    assert!(!forward.contains("dropout("));
    assert!(!forward.contains("grad."));
}
