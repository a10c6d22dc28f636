//! A model's tokenizer, found beside its config.json and loaded through the Hugging Face
//! `tokenizers` library; used to read training text, `eval --text` and `generate`.
//!
//! In order of preference: `tokenizer.json` (any fast tokenizer); `vocab.json` + `merges.txt`
//! (a byte-level BPE, as GPT-2's files are); `vocab.txt` (a WordPiece, as BERT's are,
//! lower-casing unless `tokenizer_config.json` says `do_lower_case: false`). Special tokens
//! named by `tokenizer_config.json` or `special_tokens_map.json` are registered as such. A
//! model with none of these files reads text as bytes only when its vocabulary is exactly the
//! 256 bytes (the embedded model's); any other model without a tokenizer is an error, never a
//! silent byte fallback.
//!
//! Text is encoded without truncation or padding whatever the tokenizer file asks for (a
//! `tokenizer.json` saved for inference often truncates to 128 tokens and pads to it).

use crate::CliError;
use castor_models::Model;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use tokenizers::models::bpe::BPE;
use tokenizers::models::wordpiece::WordPiece;
use tokenizers::{AddedToken, Tokenizer};

/// Where a model's tokens come from.
pub struct TextTokenizer {
    /// `None`: the 256 bytes are the vocabulary.
    inner: Option<Tokenizer>,
    /// The files it was loaded from, for people.
    source: String,
    /// The token that ends a document (end of text, or the separator).
    end_of_text: Option<u32>,
    /// The mask token of masked-LM training.
    mask: Option<u32>,
}

/// The special tokens of a tokenizer config (`tokenizer_config.json`, else
/// `special_tokens_map.json`) by role.
#[derive(Default)]
struct SpecialTokens {
    eos: Option<String>,
    sep: Option<String>,
    mask: Option<String>,
    /// Every named special token (bos, eos, unk, sep, pad, cls, mask).
    all: Vec<String>,
    lowercase: Option<bool>,
}

impl SpecialTokens {
    fn read(dir: &Path) -> SpecialTokens {
        let mut out = SpecialTokens::default();
        for file in ["tokenizer_config.json", "special_tokens_map.json"] {
            let Some(v) = std::fs::read_to_string(dir.join(file))
                .ok()
                .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            else {
                continue;
            };
            // A token is a string, or an object with `content`.
            let token = |key: &str| -> Option<String> {
                match &v[key] {
                    serde_json::Value::String(s) => Some(s.clone()),
                    serde_json::Value::Object(o) => o
                        .get("content")
                        .and_then(|c| c.as_str())
                        .map(str::to_string),
                    _ => None,
                }
            };
            out.eos = out.eos.or_else(|| token("eos_token"));
            out.sep = out.sep.or_else(|| token("sep_token"));
            out.mask = out.mask.or_else(|| token("mask_token"));
            for key in [
                "bos_token",
                "eos_token",
                "unk_token",
                "sep_token",
                "pad_token",
                "cls_token",
                "mask_token",
            ] {
                if let Some(t) = token(key) {
                    if !out.all.contains(&t) {
                        out.all.push(t);
                    }
                }
            }
            out.lowercase = out.lowercase.or(v["do_lower_case"].as_bool());
        }
        out
    }
}

/// End-of-text tokens of common tokenizers, for tokenizers whose config does not name one.
const END_OF_TEXT: [&str; 6] = [
    "<|endoftext|>",
    "</s>",
    "<|end_of_text|>",
    "<eos>",
    "[SEP]",
    "<|im_end|>",
];

fn invalid(path: &Path, what: String) -> anyhow::Error {
    CliError::InvalidInput(format!("`{}`: {what}", path.display())).into()
}

impl TextTokenizer {
    /// The tokenizer of `model`: files beside its config.json, or bytes for a 256-token
    /// vocabulary without files.
    pub fn for_model(model: &Model) -> anyhow::Result<TextTokenizer> {
        let dir = model
            .config()
            .file
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
        let vocab = model.vocab_size();
        let special = SpecialTokens::read(&dir);
        let json = dir.join("tokenizer.json");
        let (bpe_vocab, merges) = (dir.join("vocab.json"), dir.join("merges.txt"));
        let wordpiece = dir.join("vocab.txt");
        let (tok, source, path) = if json.is_file() {
            let tok = Tokenizer::from_file(&json)
                .map_err(|e| invalid(&json, format!("cannot load the tokenizer: {e}")))?;
            (tok, "tokenizer.json".to_string(), json)
        } else if bpe_vocab.is_file() && merges.is_file() {
            (
                byte_level_bpe(&bpe_vocab, &merges)?,
                "vocab.json + merges.txt (byte-level BPE)".to_string(),
                bpe_vocab,
            )
        } else if wordpiece.is_file() {
            (
                bert_wordpiece(&wordpiece, special.lowercase.unwrap_or(true))?,
                "vocab.txt (WordPiece)".to_string(),
                wordpiece,
            )
        } else if bpe_vocab.is_file() || merges.is_file() {
            let (has, lacks) = if bpe_vocab.is_file() {
                ("vocab.json", "merges.txt")
            } else {
                ("merges.txt", "vocab.json")
            };
            return Err(invalid(
                &dir,
                format!("the model has {has} but no {lacks}: a BPE tokenizer needs both"),
            ));
        } else if vocab == 256 {
            return Ok(TextTokenizer {
                inner: None,
                source: "bytes, the model's 256-token vocabulary (it has no tokenizer files)"
                    .into(),
                end_of_text: None,
                mask: None,
            });
        } else {
            return Err(invalid(
                &dir,
                format!(
                    "the model has no tokenizer (tokenizer.json, vocab.json + merges.txt, or \
                     vocab.txt beside config.json), and its vocabulary of {vocab} tokens is not \
                     the 256 bytes; copy the tokenizer files of the checkpoint it came from"
                ),
            ));
        };
        let mut tok = tok;
        let mut named: Vec<AddedToken> = Vec::new();
        for t in &special.all {
            if tok.token_to_id(t).is_some() {
                named.push(AddedToken::from(t.clone(), true));
            }
        }
        tok.add_special_tokens(&named);
        tok.with_truncation(None)
            .map_err(|e| invalid(&path, format!("cannot turn truncation off: {e}")))?;
        tok.with_padding(None);
        let size = tok.get_vocab_size(true);
        if size > vocab {
            return Err(invalid(
                &path,
                format!(
                    "the tokenizer has {size} tokens (added tokens included), but the model's \
                     vocabulary (vocab_size in config.json) has {vocab}: they belong to \
                     different models"
                ),
            ));
        }
        let id = |t: &Option<String>| t.as_deref().and_then(|t| tok.token_to_id(t));
        let specials: BTreeSet<String> = tok
            .get_added_tokens_decoder()
            .values()
            .filter(|t| t.special)
            .map(|t| t.content.clone())
            .collect();
        let end_of_text = id(&special.eos).or_else(|| id(&special.sep)).or_else(|| {
            END_OF_TEXT
                .iter()
                .find(|t| specials.contains(**t))
                .and_then(|t| tok.token_to_id(t))
        });
        let mask = id(&special.mask).or_else(|| {
            ["[MASK]", "<mask>"]
                .iter()
                .find(|t| specials.contains(**t))
                .and_then(|t| tok.token_to_id(t))
        });
        Ok(TextTokenizer {
            inner: Some(tok),
            source,
            end_of_text,
            mask,
        })
    }

    /// Where the tokens come from, for people: `tokenizer.json`, `bytes (...)`.
    pub fn describe(&self) -> &str {
        &self.source
    }

    /// True for the 256-byte vocabulary.
    pub fn is_bytes(&self) -> bool {
        self.inner.is_none()
    }

    /// Tokens the tokenizer can produce (added tokens included).
    pub fn len(&self) -> usize {
        self.inner.as_ref().map_or(256, |t| t.get_vocab_size(true))
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The token that ends a document, if the tokenizer has one.
    pub fn end_of_text(&self) -> Option<u32> {
        self.end_of_text
    }

    /// The mask token (`[MASK]`), if the tokenizer has one.
    pub fn mask(&self) -> Option<u32> {
        self.mask
    }

    /// Ids of the special tokens (never masked in masked-LM training).
    pub fn special_ids(&self) -> BTreeSet<u32> {
        self.inner
            .as_ref()
            .map(|t| {
                t.get_added_tokens_decoder()
                    .into_iter()
                    .filter(|(_, tok)| tok.special)
                    .map(|(id, _)| id)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// `text` as token ids; `special` adds what the tokenizer frames a text with (`[CLS]` and
    /// `[SEP]` for BERT, `<s>` for LLaMA). Never truncated or padded.
    pub fn encode(&self, text: &str, special: bool) -> anyhow::Result<Vec<u32>> {
        match &self.inner {
            None => Ok(text.bytes().map(u32::from).collect()),
            Some(t) => Ok(t
                .encode(text, special)
                .map_err(|e| CliError::InvalidInput(format!("tokenizing failed: {e}")))?
                .get_ids()
                .to_vec()),
        }
    }

    /// `text` as token ids with the byte range of `text` each came from (as [`Self::encode`];
    /// a token the framing adds has an empty range).
    pub fn encode_with_offsets(
        &self,
        text: &str,
        special: bool,
    ) -> anyhow::Result<Vec<(u32, std::ops::Range<usize>)>> {
        match &self.inner {
            None => Ok(text
                .bytes()
                .enumerate()
                .map(|(i, b)| (u32::from(b), i..i + 1))
                .collect()),
            Some(t) => {
                let e = t
                    .encode(text, special)
                    .map_err(|e| CliError::InvalidInput(format!("tokenizing failed: {e}")))?;
                Ok(e.get_ids()
                    .iter()
                    .zip(e.get_offsets())
                    .map(|(&id, &(start, end))| (id, start..end))
                    .collect())
            }
        }
    }

    /// A document as training tokens: framed as the tokenizer frames a text, then ended with
    /// the end-of-text token unless the framing already ends with it (BERT's `[SEP]`), so
    /// documents joined one after another stay apart.
    pub fn encode_document(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        let mut ids = self.encode(text, true)?;
        if let Some(end) = self.end_of_text {
            if ids.last() != Some(&end) {
                ids.push(end);
            }
        }
        Ok(ids)
    }

    /// Token ids as text (special tokens left out).
    pub fn decode(&self, ids: &[u32]) -> String {
        match &self.inner {
            None => {
                let bytes: Vec<u8> = ids.iter().filter_map(|&i| u8::try_from(i).ok()).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
            Some(t) => t.decode(ids, true).unwrap_or_default(),
        }
    }

    /// One token as text, as the tokenizer's decoder writes it (`" the"` for GPT-2's `Ġthe`,
    /// `"\n"` for `Ċ`), special tokens kept: what people read in a list of tokens, as
    /// `tokenizer.decode([id])` gives it. A token that is part of a UTF-8 character decodes
    /// to U+FFFD, as in transformers.
    pub fn token_text(&self, id: u32) -> String {
        match &self.inner {
            None => u8::try_from(id)
                .map(|b| String::from_utf8_lossy(&[b]).into_owned())
                .unwrap_or_else(|_| format!("<{id}>")),
            Some(t) => t
                .decode(&[id], false)
                .ok()
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| self.token(id)),
        }
    }

    /// One token as the tokenizer spells it (`Ġthe`, `##ing`, `[MASK]`), for tables.
    pub fn token(&self, id: u32) -> String {
        match &self.inner {
            None => crate::report::printable_byte(id),
            Some(t) => t.id_to_token(id).unwrap_or_else(|| format!("<{id}>")),
        }
    }
}

/// GPT-2's slow-tokenizer files as a fast tokenizer: byte-level BPE, no prefix space.
fn byte_level_bpe(vocab: &Path, merges: &Path) -> anyhow::Result<Tokenizer> {
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    let (v, m) = (vocab.to_string_lossy(), merges.to_string_lossy());
    let bpe = BPE::from_file(&v, &m).build().map_err(|e| {
        invalid(
            vocab,
            format!("cannot load the BPE vocabulary and merges: {e}"),
        )
    })?;
    let mut tok = Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tok.with_decoder(Some(ByteLevel::default()));
    tok.with_post_processor(Some(ByteLevel::default().trim_offsets(false)));
    Ok(tok)
}

/// BERT's `vocab.txt` as a fast tokenizer: BERT normalizer and pre-tokenizer, WordPiece,
/// `[CLS] ... [SEP]` framing.
fn bert_wordpiece(vocab: &Path, lowercase: bool) -> anyhow::Result<Tokenizer> {
    use tokenizers::decoders::wordpiece::WordPiece as WordPieceDecoder;
    use tokenizers::normalizers::bert::BertNormalizer;
    use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
    use tokenizers::processors::bert::BertProcessing;
    let wp = WordPiece::from_file(&vocab.to_string_lossy())
        .unk_token("[UNK]".into())
        .build()
        .map_err(|e| invalid(vocab, format!("cannot load the WordPiece vocabulary: {e}")))?;
    let mut tok = Tokenizer::new(wp);
    let id = |t: &str| {
        tok.token_to_id(t)
            .ok_or_else(|| invalid(vocab, format!("a BERT vocabulary needs the token `{t}`")))
    };
    let (sep, cls) = (id("[SEP]")?, id("[CLS]")?);
    tok.with_normalizer(Some(BertNormalizer::new(true, true, None, lowercase)));
    tok.with_pre_tokenizer(Some(BertPreTokenizer));
    tok.with_post_processor(Some(BertProcessing::new(
        ("[SEP]".into(), sep),
        ("[CLS]".into(), cls),
    )));
    tok.with_decoder(Some(WordPieceDecoder::default()));
    let specials: Vec<AddedToken> = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        .iter()
        .filter(|t| tok.token_to_id(t).is_some())
        .map(|t| AddedToken::from(t.to_string(), true))
        .collect();
    tok.add_special_tokens(&specials);
    Ok(tok)
}
