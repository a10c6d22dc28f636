//! Text done right, from the command line: tokenizers in every format checkpoints ship, never
//! truncated or padded; documents joined with the end-of-text token; no byte fallback for a
//! model with another vocabulary; shuffled windows from a seed; masked-LM streams masked as
//! transformers' collator does; a model without a head trains only a named objective; and
//! `eval --text`.

use crate::common;

use common::tokenizer_files::*;
use common::*;
use std::path::Path;

fn corpus() -> std::path::PathBuf {
    root().join("assets").join("corpus.txt")
}

/// `castor train` with `args` on the CPU; its stdout, or the failure.
fn train(args: &[&str]) -> std::process::Output {
    let mut all = vec!["train"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--device", "cpu"]);
    castor(&all)
}

/// The token count of the `data` line (`... : 1,234 training tokens ...`).
fn training_tokens(out: &str) -> usize {
    let line = out
        .lines()
        .find(|l| l.starts_with("data "))
        .unwrap_or_else(|| panic!("{out}"));
    line.split(": ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .replace(',', "")
        .parse()
        .unwrap()
}

/// A folder without weights is a model through its config.json (its tokenizer files beside it).
fn model_str(dir: &Path) -> String {
    path_str(&dir.join("config.json")).to_string()
}

#[test]
fn a_tokenizer_json_that_truncates_and_pads_tokenizes_the_whole_corpus() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("minilm");
    bert_with_tokenizer_json(&dir);
    // What the tokenizers library makes of the corpus with truncation and padding off: one
    // document, framed [CLS] ... [SEP].
    let mut tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let framed = tok
        .with_truncation(None)
        .unwrap()
        .with_padding(None)
        .encode(std::fs::read_to_string(corpus()).unwrap(), true)
        .unwrap()
        .len();
    assert!(framed > 2000, "{framed}");
    let o = train(&[
        &model_str(&dir),
        "--data",
        path_str(&corpus()),
        "--steps",
        "2",
        "--batch",
        "2",
        "--seq",
        "32",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    // Not "128 training tokens": the whole corpus, as the library tokenizes it.
    assert_eq!(training_tokens(&out), framed, "{out}");
    assert!(out.contains("(tokenizer.json)"), "{out}");
    assert!(
        out.contains("masked for mlm (15%: 80% mask, 10% random, 10% kept)"),
        "{out}"
    );
    assert!(out.contains("objective mlm"), "{out}");

    // A 27-character file is a few tokens, not 128 tokens of padding: too short to train on.
    let short = tmp.path().join("short.txt");
    std::fs::write(&short, "the compiler plans memory.\n").unwrap();
    let o = train(&[&model_str(&dir), "--data", path_str(&short), "--steps", "1"]);
    assert_eq!(o.status.code(), Some(3));
    assert!(
        stderr(&o).contains("has 8 training tokens, fewer than one sequence of 64"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn vocab_txt_and_vocab_json_with_merges_load_through_the_tokenizers_library() {
    let tmp = tempfile::tempdir().unwrap();
    // BERT's vocab.txt: the same WordPiece as the tokenizer.json above.
    let wp = tmp.path().join("wordpiece");
    bert_with_vocab_txt(&wp);
    let json = tmp.path().join("json");
    bert_with_tokenizer_json(&json);
    let count = |dir: &Path| {
        let o = train(&[
            &model_str(dir),
            "--data",
            path_str(&corpus()),
            "--steps",
            "1",
            "--batch",
            "1",
            "--seq",
            "16",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        (training_tokens(&stdout(&o)), stdout(&o))
    };
    let (a, out) = count(&wp);
    assert!(out.contains("(vocab.txt (WordPiece))"), "{out}");
    assert_eq!(a, count(&json).0);

    // GPT-2's vocab.json + merges.txt: byte-level BPE, so fewer tokens than bytes.
    let bpe = tmp.path().join("bpe");
    gpt2_with_vocab_and_merges(&bpe);
    let o = train(&[
        &model_str(&bpe),
        "--data",
        path_str(&corpus()),
        "--steps",
        "1",
        "--batch",
        "1",
        "--seq",
        "16",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("(vocab.json + merges.txt (byte-level BPE))"),
        "{out}"
    );
    let bytes = std::fs::metadata(corpus()).unwrap().len() as usize;
    let n = training_tokens(&out);
    // Merges shorten the text; one document ends with <|endoftext|>.
    assert!(n < bytes * 95 / 100 && n > bytes / 2, "{n} of {bytes}");

    // Half a BPE tokenizer, or none for a vocabulary that is not the bytes: errors, never a
    // silent byte fallback.
    std::fs::remove_file(bpe.join("merges.txt")).unwrap();
    let o = train(&[
        &model_str(&bpe),
        "--data",
        path_str(&corpus()),
        "--steps",
        "1",
    ]);
    assert_eq!(o.status.code(), Some(3));
    assert!(
        stderr(&o).contains("the model has vocab.json but no merges.txt"),
        "{}",
        stderr(&o)
    );
    std::fs::remove_file(bpe.join("vocab.json")).unwrap();
    let o = train(&[
        &model_str(&bpe),
        "--data",
        path_str(&corpus()),
        "--steps",
        "1",
    ]);
    assert_eq!(o.status.code(), Some(3));
    assert!(
        stderr(&o).contains(
            "the model has no tokenizer (tokenizer.json, vocab.json + merges.txt, or vocab.txt \
             beside config.json), and its vocabulary of 300 tokens is not the 256 bytes"
        ),
        "{}",
        stderr(&o)
    );
}

#[test]
fn documents_are_joined_with_the_end_of_text_token() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("bpe");
    gpt2_with_vocab_and_merges(&model);
    let texts = [
        "the first document, about memory.",
        "a second one: on the other hand.",
    ];
    let docs = tmp.path().join("docs");
    std::fs::create_dir_all(&docs).unwrap();
    let mut jsonl = String::new();
    for (i, t) in texts.iter().enumerate() {
        std::fs::write(docs.join(format!("{i}.txt")), t).unwrap();
        jsonl.push_str(&format!("{}\n", serde_json::json!({ "text": t })));
    }
    std::fs::write(tmp.path().join("docs.jsonl"), jsonl).unwrap();
    std::fs::write(tmp.path().join("one.txt"), texts[0]).unwrap();
    let tokens = |data: &Path| {
        let o = train(&[
            &model_str(&model),
            "--data",
            path_str(data),
            "--steps",
            "1",
            "--batch",
            "1",
            "--seq",
            "4",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        training_tokens(&stdout(&o))
    };
    let one = tokens(&tmp.path().join("one.txt"));
    // The tokenizers library's count of each document, plus one <|endoftext|> after each.
    let bpe = tokenizers::models::bpe::BPE::from_file(
        path_str(&model.join("vocab.json")),
        path_str(&model.join("merges.txt")),
    )
    .build()
    .unwrap();
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(
        tokenizers::pre_tokenizers::byte_level::ByteLevel::default().add_prefix_space(false),
    ));
    let n = |t: &str| tok.encode(t, false).unwrap().len();
    assert_eq!(one, n(texts[0]) + 1);
    let both = n(texts[0]) + n(texts[1]) + 2;
    assert_eq!(tokens(&docs), both);
    assert_eq!(tokens(&tmp.path().join("docs.jsonl")), both);
}

#[test]
fn windows_are_shuffled_from_a_seed_or_read_in_order() {
    let tmp = tempfile::tempdir().unwrap();
    let config = root().join("assets").join("tiny-gpt2.json");
    let corpus = corpus();
    let losses = |name: &str, extra: &[&str]| {
        let log = tmp.path().join(format!("{name}.jsonl"));
        let mut args = vec![
            path_str(&config),
            "--data",
            path_str(&corpus),
            "--steps",
            "4",
            "--batch",
            "2",
            "--seq",
            "16",
            "--lr",
            "0",
            "--log",
            path_str(&log),
        ];
        args.extend_from_slice(extra);
        let o = train(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        (log_losses(&log), stdout(&o))
    };
    // With a learning rate of 0 the losses only depend on which windows are read.
    let (a, out) = losses("a", &[]);
    assert!(out.contains("shuffled (seed 0)"), "{out}");
    assert_eq!(losses("b", &["--seed", "0"]).0, a);
    assert_ne!(losses("c", &["--seed", "1"]).0, a);
    let (seq, out) = losses("d", &["--data-order", "sequential"]);
    assert!(out.contains("in order"), "{out}");
    assert_ne!(seq, a);
}

#[test]
fn a_model_without_a_head_trains_only_a_named_objective() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("base");
    let vocab = wordpiece_vocab();
    bert_config(&dir, vocab.len(), "BertModel");
    std::fs::write(
        dir.join("tokenizer.json"),
        minilm_like_tokenizer_json(&vocab).to_string(),
    )
    .unwrap();
    let args = [
        model_str(&dir),
        "--data".into(),
        path_str(&corpus()).into(),
        "--steps".into(),
        "1".into(),
        "--batch".into(),
        "1".into(),
        "--seq".into(),
        "16".into(),
    ];
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = train(&refs);
    assert_eq!(o.status.code(), Some(3));
    assert!(
        stderr(&o).contains(
            "BertModel has no LM or MLM head, so it has no loss to train by default: to \
             fine-tune it as a text classifier, give --num-labels N or --labels a,b,c (a new \
             classification head, as transformers' num_labels makes one, trained on labelled \
             .jsonl or .csv text); name one with --objective"
        ),
        "{}",
        stderr(&o)
    );
    let mut named = refs.clone();
    named.extend_from_slice(&["--objective", "sum"]);
    let o = train(&named);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("objective sum"), "{}", stdout(&o));
}

#[test]
fn eval_text_predicts_the_next_token_and_fills_masks() {
    let tmp = tempfile::tempdir().unwrap();
    // A causal model: the demo's trained byte-level GPT-2.
    let o = castor(&["demo", "--steps", "20", "--out", path_str(tmp.path())]);
    assert!(o.status.success(), "{}", stderr(&o));
    let ckpt = tmp.path().join("checkpoint");
    let o = castor(&[
        "eval",
        path_str(&ckpt),
        "--text",
        "The compiler",
        "--device",
        "cpu",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = stdout(&o);
    assert!(s.contains("tokens      12: \"T\" \"h\" \"e\""), "{s}");
    assert!(
        s.contains("loss        ") && s.contains("over 11 predicted tokens"),
        "{s}"
    );
    assert!(s.contains("next        \""), "{s}");
    assert!(s.contains("logits: f32[1,12,256]"), "{s}");
    // --out is optional with --text, and still written when given.
    let out = tmp.path().join("o.safetensors");
    let o = castor(&[
        "eval",
        path_str(&ckpt),
        "--text",
        "The compiler",
        "--out",
        path_str(&out),
        "--device",
        "cpu",
        "--grad",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let f = castor_models::SafetensorsFile::open(&out).unwrap();
    assert!(f.contains("logits") && f.contains("loss"));

    // A masked LM fills in its mask tokens (an untrained one, so only the form is checked).
    let bert = tmp.path().join("bert");
    bert_with_tokenizer_json(&bert);
    let o = castor(&["compile", path_str(&bert.join("config.json"))]);
    assert!(o.status.success(), "{}", stderr(&o));
    // eval needs weights: the train command saves a checkpoint of the initialized model.
    let saved = tmp.path().join("bert-saved");
    let o = train(&[
        &model_str(&bert),
        "--data",
        path_str(&corpus()),
        "--steps",
        "1",
        "--batch",
        "1",
        "--seq",
        "16",
        "--save",
        path_str(&saved),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = castor(&[
        "eval",
        path_str(&saved),
        "--text",
        "the compiler [MASK] memory.",
        "--device",
        "cpu",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = stdout(&o);
    assert!(
        s.contains("\"[CLS]\" \"the\" \"compiler\" \"[MASK]\""),
        "{s}"
    );
    assert!(s.contains("mask 3      \""), "{s}");

    // --input and --text exclude each other.
    let o = castor(&[
        "eval",
        path_str(&saved),
        "--text",
        "a",
        "--input",
        "x.safetensors",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("cannot be used with"), "{}", stderr(&o));
}

/// `eval --text` shows tokens as the tokenizer's decoder writes them (`" th"`, `"\n"`), not
/// as raw byte-level vocabulary strings (`"Ġth"`, `"Ċ"`); a bare encoder prints its tokens
/// too.
#[test]
fn eval_text_decodes_tokens_as_people_read_them() {
    let tmp = tempfile::tempdir().unwrap();
    let bpe = tmp.path().join("bpe");
    gpt2_with_vocab_and_merges(&bpe);
    let saved = tmp.path().join("bpe-saved");
    let o = train(&[
        &model_str(&bpe),
        "--data",
        path_str(&corpus()),
        "--steps",
        "1",
        "--batch",
        "1",
        "--seq",
        "16",
        "--save",
        path_str(&saved),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = castor(&[
        "eval",
        path_str(&saved),
        "--text",
        "the thin\nan",
        "--device",
        "cpu",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = stdout(&o);
    let tokens = s.lines().find(|l| l.starts_with("tokens ")).unwrap();
    assert_eq!(
        tokens, "tokens      7: \"th\" \"e\" \" th\" \"in\" \"\\n\" \"a\" \"n\"",
        "{s}"
    );
    let next = s.lines().find(|l| l.starts_with("next ")).unwrap();
    assert!(!next.contains('Ġ') && !next.contains('Ċ'), "{next}");

    // A bare BertModel: no logits, its tokens all the same.
    let bert = tmp.path().join("bert");
    let vocab = bert_with_tokenizer_json(&bert);
    bert_config(&bert, vocab.len(), "BertModel");
    let saved = tmp.path().join("bert-saved");
    let o = train(&[
        &model_str(&bert),
        "--data",
        path_str(&corpus()),
        "--objective",
        "sum",
        "--steps",
        "1",
        "--batch",
        "1",
        "--seq",
        "16",
        "--save",
        path_str(&saved),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = castor(&[
        "eval",
        path_str(&saved),
        "--text",
        "the compiler",
        "--device",
        "cpu",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("tokens      4: \"[CLS]\" \"the\" \"compiler\" \"[SEP]\""),
        "{}",
        stdout(&o)
    );
}
