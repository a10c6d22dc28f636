//! Small real tokenizers for tests, in the formats checkpoints ship: a `tokenizer.json` shaped
//! like all-MiniLM-L6-v2's (WordPiece, BERT normalizer, `[CLS] ... [SEP]` template, and the
//! truncation to 128 tokens and padding to 128 that an inference export carries), BERT's
//! `vocab.txt`, and GPT-2's `vocab.json` + `merges.txt` with `<|endoftext|>`.

use super::root;
use std::collections::BTreeMap;
use std::path::Path;

pub const WORDPIECE_SPECIALS: [&str; 5] = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"];

/// A WordPiece vocabulary for the project's corpus: the specials, every character alone and
/// as a `##` continuation, and the 300 most frequent lower-cased words.
pub fn wordpiece_vocab() -> Vec<String> {
    let corpus = std::fs::read_to_string(root().join("assets").join("corpus.txt")).unwrap();
    let lower = corpus.to_lowercase();
    let mut vocab: Vec<String> = WORDPIECE_SPECIALS.iter().map(|s| s.to_string()).collect();
    let mut chars: Vec<char> = lower.chars().filter(|c| c.is_ascii_graphic()).collect();
    chars.sort();
    chars.dedup();
    for c in &chars {
        vocab.push(c.to_string());
    }
    for c in chars.iter().filter(|c| c.is_ascii_alphanumeric()) {
        vocab.push(format!("##{c}"));
    }
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for w in lower.split(|c: char| !c.is_ascii_alphanumeric()) {
        if w.len() > 1 {
            *counts.entry(w).or_default() += 1;
        }
    }
    let mut words: Vec<(&str, usize)> = counts.into_iter().collect();
    words.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    for (w, _) in words.into_iter().take(300) {
        vocab.push(w.to_string());
    }
    vocab
}

/// A `tokenizer.json` as all-MiniLM-L6-v2 ships it, over `vocab`: truncation to 128 tokens
/// and fixed padding to 128 included.
pub fn minilm_like_tokenizer_json(vocab: &[String]) -> serde_json::Value {
    let id = |t: &str| vocab.iter().position(|v| v == t).unwrap();
    let added: Vec<serde_json::Value> = WORDPIECE_SPECIALS
        .iter()
        .map(|t| {
            serde_json::json!({"id": id(t), "content": t, "single_word": false, "lstrip": false,
                               "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let map: serde_json::Map<String, serde_json::Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), serde_json::json!(i)))
        .collect();
    serde_json::json!({
        "version": "1.0",
        "truncation": {"direction": "Right", "max_length": 128, "strategy": "LongestFirst", "stride": 0},
        "padding": {"strategy": {"Fixed": 128}, "direction": "Right", "pad_to_multiple_of": null,
                    "pad_id": 0, "pad_type_id": 0, "pad_token": "[PAD]"},
        "added_tokens": added,
        "normalizer": {"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true,
                       "strip_accents": null, "lowercase": true},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": "[SEP]", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "[SEP]", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}},
                     {"SpecialToken": {"id": "[SEP]", "type_id": 1}}],
            "special_tokens": {
                "[CLS]": {"id": "[CLS]", "ids": [id("[CLS]")], "tokens": ["[CLS]"]},
                "[SEP]": {"id": "[SEP]", "ids": [id("[SEP]")], "tokens": ["[SEP]"]}
            }
        },
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                  "max_input_chars_per_word": 100, "vocab": map}
    })
}

/// A tiny BERT config with `vocab` tokens and `architectures`.
pub fn bert_config(dir: &Path, vocab: usize, architecture: &str) {
    std::fs::create_dir_all(dir).unwrap();
    let config = serde_json::json!({
        "model_type": "bert", "architectures": [architecture], "vocab_size": vocab,
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 64, "max_position_embeddings": 64, "type_vocab_size": 2,
        "hidden_act": "gelu", "layer_norm_eps": 1e-12, "pad_token_id": 0
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

/// A BertForMaskedLM folder (config only) with the MiniLM-shaped tokenizer.json.
pub fn bert_with_tokenizer_json(dir: &Path) -> Vec<String> {
    let vocab = wordpiece_vocab();
    bert_config(dir, vocab.len(), "BertForMaskedLM");
    std::fs::write(
        dir.join("tokenizer.json"),
        minilm_like_tokenizer_json(&vocab).to_string(),
    )
    .unwrap();
    vocab
}

/// A BertForMaskedLM folder (config only) with BERT's slow-tokenizer file, `vocab.txt`.
pub fn bert_with_vocab_txt(dir: &Path) -> Vec<String> {
    let vocab = wordpiece_vocab();
    bert_config(dir, vocab.len(), "BertForMaskedLM");
    std::fs::write(dir.join("vocab.txt"), vocab.join("\n") + "\n").unwrap();
    vocab
}

/// GPT-2's byte-to-unicode table, as byte-level vocabularies spell bytes.
pub fn byte_char(b: u8) -> char {
    let printable = |b: u8| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    if printable(b) {
        return b as char;
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).unwrap()
}

/// A GPT-2 folder (config only, 300 tokens) with GPT-2's slow-tokenizer files: `vocab.json`
/// (the 256 bytes, six merges, `<|endoftext|>` last), `merges.txt` and a
/// `tokenizer_config.json` naming the end-of-text token.
pub fn gpt2_with_vocab_and_merges(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let config = std::fs::read_to_string(root().join("assets").join("tiny-gpt2.json"))
        .unwrap()
        .replace("\"vocab_size\": 256", "\"vocab_size\": 300");
    std::fs::write(dir.join("config.json"), config).unwrap();
    let mut vocab = serde_json::Map::new();
    for b in 0..=255u8 {
        vocab.insert(byte_char(b).to_string(), serde_json::json!(b));
    }
    let space = byte_char(b' ');
    let merges = [
        ("t".to_string(), "h".to_string()),
        ("e".into(), "r".into()),
        ("i".into(), "n".into()),
        (space.to_string(), "th".into()),
        (space.to_string(), "a".into()),
        ("o".into(), "n".into()),
    ];
    for (i, (a, b)) in merges.iter().enumerate() {
        vocab.insert(format!("{a}{b}"), serde_json::json!(256 + i));
    }
    vocab.insert("<|endoftext|>".into(), serde_json::json!(262));
    std::fs::write(
        dir.join("vocab.json"),
        serde_json::Value::Object(vocab).to_string(),
    )
    .unwrap();
    let mut text = "#version: 0.2\n".to_string();
    for (a, b) in &merges {
        text.push_str(&format!("{a} {b}\n"));
    }
    std::fs::write(dir.join("merges.txt"), text).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}"#,
    )
    .unwrap();
}
