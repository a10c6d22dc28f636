//! Precision policies: a declarative table from op kind to rule, plus rules by name.
//!
//! The table is data, kept apart from the engine that applies it ([`crate::Autocast`]), in the
//! manner of TensorFlow's AMP lists and TVM's ToMixedPrecision registry. The defaults follow
//! the op classes: contractions are *allow* (always low precision), normalizations are *deny*
//! (computed in F32), elementwise ops *infer* (follow their neighbours) and layout ops are
//! *clear* (transparent). Users edit the lists by op kind and add rules by node or parameter
//! name glob, from the command line or a policy file (TOML or JSON):
//!
//! ```toml
//! [lists]
//! deny_add = ["gelu_tanh"]      # also allow_/infer_/clear_ + add/remove
//! infer_remove = ["exp"]        # an op in no list is never converted (like TensorFlow)
//!
//! [[rules]]
//! match = "lm_head*"            # node name or parameter name glob (`*`, `?`)
//! dtype = "f32"                 # "f32" keeps it in F32, "low" forces the policy's low dtype;
//!                               # precision names work too (fp32, float32, bf16, bfloat16,
//!                               # fp16, float16, half; any case)
//! ```

use crate::PassError;
use castor_ir::{BinaryOp, DType, Op, OpClass, Precision, ReduceOp, UnaryOp};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;
use wildmatch::WildMatch;

/// What the table says about an op kind (TensorFlow's list names; TVM's in parentheses).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Rule {
    /// Always low precision (TVM: always).
    Allow,
    /// Follows its inputs and neighbours (TVM: follow).
    Infer,
    /// Never: computes in F32 (TVM: never).
    Deny,
    /// Transparent: takes its neighbours' colour; no arithmetic.
    Clear,
}

impl Rule {
    pub const ALL: [Rule; 4] = [Rule::Allow, Rule::Infer, Rule::Deny, Rule::Clear];

    pub fn name(self) -> &'static str {
        match self {
            Rule::Allow => "allow",
            Rule::Infer => "infer",
            Rule::Deny => "deny",
            Rule::Clear => "clear",
        }
    }

    /// The rule an op class gets by default.
    pub fn for_class(class: OpClass) -> Rule {
        match class {
            OpClass::Contraction => Rule::Allow,
            OpClass::Normalization => Rule::Deny,
            OpClass::Elementwise => Rule::Infer,
            OpClass::Layout | OpClass::Communication => Rule::Clear,
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a name rule sends the nodes it matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Keep in F32 (compute and store).
    F32,
    /// Force the policy's low-precision dtype.
    Low,
}

/// A rule by node or parameter name.
#[derive(Clone, Debug)]
pub struct NameRule {
    /// 1-based, in the order rules were added (command line first, then the policy file).
    pub number: usize,
    pub pattern: String,
    pub target: Target,
    /// Where it came from: `--keep-f32`, `--force-low` or the policy file's name.
    pub source: String,
    matcher: WildMatch,
}

impl NameRule {
    pub fn matches(&self, name: &str) -> bool {
        self.matcher.matches(name)
    }

    /// How the rule is cited in reasons and errors: `rule 2 '*.ln_*' -> f32`.
    pub fn describe(&self, low: Option<DType>) -> String {
        let to = match (self.target, low) {
            (Target::F32, _) => "f32".to_string(),
            (Target::Low, Some(d)) => d.to_string(),
            (Target::Low, None) => "low".to_string(),
        };
        format!(
            "rule {} '{}' -> {to} ({})",
            self.number, self.pattern, self.source
        )
    }
}

/// Policy file syntax.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyFileFormat {
    Toml,
    Json,
}

/// A precision policy: the precision, the op-kind table and the name rules.
#[derive(Clone, Debug)]
pub struct Policy {
    pub precision: Precision,
    /// Op kind -> rule, and where the entry came from (`default: contraction`, a file edit).
    table: BTreeMap<&'static str, (Rule, String)>,
    rules: Vec<NameRule>,
    /// Keep the residual stream in the low dtype (llm.c's and Apex O2's choice) rather than
    /// autocast's F32 (see [`Policy::set_residual_low`]).
    residual_low: bool,
    /// Which products stay BF16 under `--precision fp8` ([`crate::Fp8Products`]).
    fp8: Fp8Options,
}

/// The choices of `--precision fp8` beyond the default: products kept in BF16.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Fp8Options {
    /// Keep the first and the last layer's products in BF16 (`--fp8-skip-first-last`).
    pub skip_first_last: bool,
    /// Keep the products whose name, or whose weight's name, matches one of these globs in
    /// BF16 (`--keep-bf16`).
    pub keep_bf16: Vec<String>,
    /// The length of each amax history under `fp8:delayed` (`--amax-history`); `None` is
    /// [`DEFAULT_AMAX_HISTORY`].
    pub amax_history: Option<usize>,
}

/// Transformer Engine's default `amax_history_len`.
pub const DEFAULT_AMAX_HISTORY: usize = 16;

impl Fp8Options {
    /// The length of each amax history.
    pub fn history(&self) -> usize {
        self.amax_history.unwrap_or(DEFAULT_AMAX_HISTORY)
    }
}

impl Policy {
    /// The default table for `precision`.
    pub fn new(precision: Precision) -> Policy {
        let table = table_ops()
            .into_iter()
            .map(|op| {
                let class = op.class();
                (
                    op.mnemonic(),
                    (Rule::for_class(class), format!("default for {class}")),
                )
            })
            .collect();
        Policy {
            precision,
            table,
            rules: Vec::new(),
            residual_low: false,
            fp8: Fp8Options::default(),
        }
    }

    /// Sets the FP8 choices; an error unless the policy is `fp8`.
    pub fn set_fp8(&mut self, options: Fp8Options) -> Result<(), PassError> {
        if let Some(h) = options.amax_history {
            if !self.precision.is_delayed() {
                return Err(PassError::Policy {
                    source_name: "--amax-history".into(),
                    message: format!(
                        "sets the length of the amax histories of delayed scaling, but \
                         --precision {} keeps none (use fp8:delayed)",
                        self.precision
                    ),
                });
            }
            if h == 0 {
                return Err(PassError::Policy {
                    source_name: "--amax-history".into(),
                    message: "a history holds at least one amax (this step's)".into(),
                });
            }
        }
        if !self.precision.is_fp8() && options != Fp8Options::default() {
            let flag = if options.skip_first_last {
                "--fp8-skip-first-last"
            } else {
                "--keep-bf16"
            };
            return Err(PassError::Policy {
                source_name: flag.into(),
                message: format!(
                    "keeps products out of FP8, but --precision {} puts none in it (use fp8)",
                    self.precision
                ),
            });
        }
        if let Some(empty) = options.keep_bf16.iter().find(|g| g.is_empty()) {
            return Err(PassError::Policy {
                source_name: "--keep-bf16".into(),
                message: format!("empty name pattern `{empty}`"),
            });
        }
        self.fp8 = options;
        Ok(())
    }

    pub fn fp8(&self) -> &Fp8Options {
        &self.fp8
    }

    /// Stores the residual stream in the policy's low dtype: the adds whose sum a
    /// normalization reads (a pre-norm model's stream, a post-norm model's residual adds) and
    /// the embeddings that start it compute and store low, as llm.c and Apex O2 keep them;
    /// autocast's default keeps them F32. Name rules still decide the nodes they match.
    pub fn set_residual_low(&mut self) -> Result<(), PassError> {
        if self.precision.low().is_none() {
            return Err(PassError::Policy {
                source_name: "--residual".into(),
                message: format!(
                    "a low-precision residual stream needs a low-precision dtype; --precision \
                     {} has none (use bf16 or fp16)",
                    self.precision
                ),
            });
        }
        self.residual_low = true;
        Ok(())
    }

    pub fn residual_low(&self) -> bool {
        self.residual_low
    }

    /// The rule for an op kind and where it came from; `None` for ops the table does not
    /// govern (sources, casts, parameter copies).
    pub fn rule_for(&self, op: &Op) -> Option<(Rule, &str)> {
        self.table.get(op.mnemonic()).map(|(r, s)| (*r, s.as_str()))
    }

    /// The whole table, for display.
    pub fn table(&self) -> impl Iterator<Item = (&'static str, Rule, &str)> {
        self.table.iter().map(|(k, (r, s))| (*k, *r, s.as_str()))
    }

    pub fn name_rules(&self) -> &[NameRule] {
        &self.rules
    }

    /// Adds a name rule (`--keep-f32 GLOB` or `--force-low GLOB`).
    pub fn add_rule(
        &mut self,
        pattern: &str,
        target: Target,
        source: &str,
    ) -> Result<(), PassError> {
        if target == Target::Low && self.precision.low().is_none() {
            return Err(PassError::Policy {
                source_name: source.to_string(),
                message: format!(
                    "'{pattern}' forces low precision, but --precision {} has no low-precision dtype (use bf16 or fp16)",
                    self.precision
                ),
            });
        }
        if pattern.is_empty() {
            return Err(PassError::Policy {
                source_name: source.to_string(),
                message: "empty name pattern".into(),
            });
        }
        let rule = NameRule {
            number: self.rules.len() + 1,
            pattern: pattern.to_string(),
            target,
            source: source.to_string(),
            matcher: WildMatch::new(pattern),
        };
        if let Some(other) = self
            .rules
            .iter()
            .find(|r| r.pattern == pattern && r.target != target)
        {
            let low = self.precision.low();
            return Err(PassError::Conflict {
                subject: format!("pattern '{pattern}'"),
                first: other.describe(low),
                second: rule.describe(low),
            });
        }
        self.rules.push(rule);
        Ok(())
    }

    /// The name rule that decides a node, given the node's name and the names of the
    /// parameters it reads. Rules that agree may overlap; rules that disagree are an error
    /// naming both.
    pub fn rule_for_names(
        &self,
        node: &str,
        params: &[&str],
    ) -> Result<Option<&NameRule>, PassError> {
        let mut found: Option<&NameRule> = None;
        for rule in &self.rules {
            if !(rule.matches(node) || params.iter().any(|p| rule.matches(p))) {
                continue;
            }
            match found {
                Some(first) if first.target != rule.target => {
                    let low = self.precision.low();
                    return Err(PassError::Conflict {
                        subject: format!("node `%{node}`"),
                        first: first.describe(low),
                        second: rule.describe(low),
                    });
                }
                Some(_) => {}
                None => found = Some(rule),
            }
        }
        Ok(found)
    }

    /// Applies a policy file's list edits and rules. `source_name` names the file in errors.
    pub fn apply_file(
        &mut self,
        text: &str,
        format: PolicyFileFormat,
        source_name: &str,
    ) -> Result<(), PassError> {
        let bad = |message: String| PassError::Policy {
            source_name: source_name.to_string(),
            message,
        };
        let file: PolicyFile = match format {
            PolicyFileFormat::Toml => {
                toml::from_str(text).map_err(|e| bad(e.to_string().trim_end().to_string()))?
            }
            PolicyFileFormat::Json => serde_json::from_str(text).map_err(|e| bad(e.to_string()))?,
        };
        let lists = file.lists.unwrap_or_default();
        let edits: [(&str, Rule, bool, &Vec<String>); 8] = [
            ("allow_add", Rule::Allow, true, &lists.allow_add),
            ("infer_add", Rule::Infer, true, &lists.infer_add),
            ("deny_add", Rule::Deny, true, &lists.deny_add),
            ("clear_add", Rule::Clear, true, &lists.clear_add),
            ("allow_remove", Rule::Allow, false, &lists.allow_remove),
            ("infer_remove", Rule::Infer, false, &lists.infer_remove),
            ("deny_remove", Rule::Deny, false, &lists.deny_remove),
            ("clear_remove", Rule::Clear, false, &lists.clear_remove),
        ];
        // Each op kind may appear in one edit list only.
        let mut seen: BTreeMap<&str, &str> = BTreeMap::new();
        for (list, _, _, ops) in &edits {
            for op in ops.iter() {
                if let Some(first) = seen.insert(op.as_str(), list) {
                    return Err(PassError::Conflict {
                        subject: format!("op `{op}`"),
                        first: format!("`{first}` in {source_name}"),
                        second: format!("`{list}` in {source_name}"),
                    });
                }
            }
        }
        for (list, rule, add, ops) in edits {
            for op in ops {
                let Some((kind, entry)) = self.table.iter_mut().find(|(k, _)| **k == op.as_str())
                else {
                    let known: Vec<&str> = self.table.keys().copied().collect();
                    return Err(bad(format!(
                        "`{list}` names unknown op `{op}` (ops: {})",
                        known.join(", ")
                    )));
                };
                if add {
                    *entry = (rule, format!("`{list}` in {source_name}"));
                } else if entry.0 != rule {
                    return Err(bad(format!(
                        "`{list}` removes `{kind}`, which is not in the {} list (it is {})",
                        rule, entry.0
                    )));
                } else {
                    // Like TensorFlow: an op in no list is never converted.
                    *entry = (
                        Rule::Deny,
                        format!("`{list}` in {source_name} (in no list: never converted)"),
                    );
                }
            }
        }
        for (i, r) in file.rules.unwrap_or_default().into_iter().enumerate() {
            // `f32` or `low`, or a precision name (`fp32`, `bf16`, `bfloat16`, `half`, ...).
            let named = match r.dtype.to_ascii_lowercase().as_str() {
                "f32" => Some(Precision::Fp32),
                "low" => None,
                other => Some(other.parse::<Precision>().map_err(|_| {
                    bad(format!(
                        "rule {} (`{}`): dtype must be \"f32\" or \"low\" (or a precision name: \
                         fp32, float32, bf16, bfloat16, fp16, float16, half), found \"{}\"",
                        i + 1,
                        r.pattern,
                        r.dtype
                    ))
                })?),
            };
            let target = match named {
                Some(Precision::Fp32 | Precision::Tf32) => Target::F32,
                None => Target::Low,
                Some(p) => {
                    if p.low() != self.precision.low() {
                        return Err(bad(format!(
                            "rule {} (`{}`) asks for {}, but the policy's low dtype is {}",
                            i + 1,
                            r.pattern,
                            r.dtype,
                            self.precision
                                .low()
                                .map_or("none".to_string(), |d| d.to_string())
                        )));
                    }
                    Target::Low
                }
            };
            self.add_rule(&r.pattern, target, source_name)?;
        }
        Ok(())
    }
}

/// Ops the table governs: one representative per op kind.
fn table_ops() -> Vec<Op> {
    let mut ops = vec![
        Op::Embedding { padding: None },
        Op::MatMul {
            transpose_a: false,
            transpose_b: false,
        },
        Op::Scale { factor: 1.0 },
        Op::Dropout { p: 0.0, stream: 0 },
        Op::LayerNorm { eps: 0.0 },
        Op::RmsNorm { eps: 0.0 },
        Op::Softmax {
            causal: false,
            window: None,
        },
        Op::Attention {
            causal: false,
            window: None,
            scale: 1.0,
            library: castor_ir::AttentionLibrary::Kernels,
            dropout: None,
        },
        Op::Rope {
            theta: 0.0,
            scaling: castor_ir::RopeScaling::None,
        },
        Op::Reshape { shape: vec![] },
        Op::Transpose { perm: vec![] },
        Op::Slice {
            axis: 0,
            start: 0,
            end: 0,
        },
        Op::Concat { axis: 0 },
        Op::Split {
            axis: 0,
            sizes: vec![],
        },
        Op::CrossEntropy { ignore_index: 0 },
        // Collectives and a rank's shard: clear, like layout.
        Op::AllReduce {
            reduce: castor_ir::CollectiveOp::Sum,
            world: 1,
        },
        Op::ReduceScatter {
            world: 1,
            average: false,
        },
        Op::AllGather {
            world: 1,
            shape: vec![],
        },
        Op::Shard { world: 1 },
    ];
    ops.extend(UnaryOp::ALL.map(Op::Unary));
    ops.extend(BinaryOp::ALL.map(Op::Binary));
    ops.extend(ReduceOp::ALL.map(|op| Op::Reduce {
        op,
        axes: vec![],
        keepdim: false,
    }));
    ops
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    lists: Option<Lists>,
    rules: Option<Vec<FileRule>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
struct Lists {
    allow_add: Vec<String>,
    allow_remove: Vec<String>,
    infer_add: Vec<String>,
    infer_remove: Vec<String>,
    deny_add: Vec<String>,
    deny_remove: Vec<String>,
    clear_add: Vec<String>,
    clear_remove: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileRule {
    #[serde(rename = "match")]
    pattern: String,
    dtype: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_classes() {
        let p = Policy::new(Precision::Bf16);
        let rule = |op: Op| p.rule_for(&op).unwrap().0;
        assert_eq!(
            rule(Op::MatMul {
                transpose_a: false,
                transpose_b: true
            }),
            Rule::Allow
        );
        assert_eq!(
            rule(Op::Softmax {
                causal: true,
                window: None
            }),
            Rule::Deny
        );
        assert_eq!(rule(Op::Unary(UnaryOp::Exp)), Rule::Deny);
        assert_eq!(rule(Op::Unary(UnaryOp::GeluTanh)), Rule::Infer);
        assert_eq!(rule(Op::Reshape { shape: vec![1] }), Rule::Clear);
        assert!(p.rule_for(&Op::Cast { to: DType::F32 }).is_none());
    }

    #[test]
    fn file_edits_and_errors() {
        let mut p = Policy::new(Precision::Fp16);
        p.apply_file(
            "[lists]\ndeny_add = [\"gelu_tanh\"]\ninfer_remove = [\"add\"]\n[[rules]]\nmatch = \"lm_head*\"\ndtype = \"f32\"\n",
            PolicyFileFormat::Toml,
            "p.toml",
        )
        .unwrap();
        assert_eq!(
            p.rule_for(&Op::Unary(UnaryOp::GeluTanh)).unwrap().0,
            Rule::Deny
        );
        assert_eq!(
            p.rule_for(&Op::Binary(BinaryOp::Add)).unwrap().0,
            Rule::Deny
        );
        assert_eq!(
            p.name_rules()[0].describe(Some(DType::F16)),
            "rule 1 'lm_head*' -> f32 (p.toml)"
        );

        let e = Policy::new(Precision::Fp16)
            .apply_file(
                r#"{"lists": {"allow_add": ["softmax"], "deny_remove": ["softmax"]}}"#,
                PolicyFileFormat::Json,
                "p.json",
            )
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("conflicting") && e.contains("allow_add") && e.contains("deny_remove"),
            "{e}"
        );

        let e = Policy::new(Precision::Fp16)
            .apply_file(
                "[lists]\nallow_add = [\"frob\"]\n",
                PolicyFileFormat::Toml,
                "p.toml",
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown op `frob`"), "{e}");

        let e = Policy::new(Precision::Fp16)
            .apply_file(
                "[lists]\nalow_add = [\"matmul\"]\n",
                PolicyFileFormat::Toml,
                "p.toml",
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("p.toml") && e.contains("alow_add"), "{e}");

        let e = Policy::new(Precision::Fp32)
            .add_rule("x", Target::Low, "--force-low")
            .unwrap_err()
            .to_string();
        assert!(e.contains("no low-precision dtype"), "{e}");
    }

    #[test]
    fn disagreeing_name_rules_conflict() {
        let mut p = Policy::new(Precision::Bf16);
        p.add_rule("*.ln_*", Target::F32, "--keep-f32").unwrap();
        p.add_rule("h.0.*", Target::Low, "--force-low").unwrap();
        assert_eq!(
            p.rule_for_names("h.1.ln_1", &[]).unwrap().unwrap().number,
            1
        );
        let e = p.rule_for_names("h.0.ln_1", &[]).unwrap_err().to_string();
        assert!(
            e.contains("rule 1 '*.ln_*' -> f32") && e.contains("rule 2 'h.0.*' -> bf16"),
            "{e}"
        );
        // Parameter names match too.
        p.add_rule("lm_head.weight", Target::F32, "--keep-f32")
            .unwrap();
        assert_eq!(
            p.rule_for_names("logits", &["lm_head.weight"])
                .unwrap()
                .unwrap()
                .number,
            3
        );
    }
}
