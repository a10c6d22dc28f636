//! Kernel signatures: every entry point's parameters by name and kind, read from the
//! `extern "C" __global__` declarations of the kernel files themselves.
//!
//! The declarations are the one place a kernel's parameters are written. This module parses
//! them ([`parse_file`]; the runtime keeps the table of every family's files): a declaration inside a `#define` names a family of entry points
//! (`layer_norm_fwd_##io` is `layer_norm_fwd_*`; one named by a bare macro parameter takes its
//! entries from the macro's invocations in the file). The CUDA lowering builds each launch's
//! arguments by name through [`Signature::order`], the emulator reads them by name through the
//! same table, and a test checks every entry point's table against the PTX NVRTC compiles.

use crate::KernelFile;

/// How a parameter is passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ParamKind {
    /// A device pointer (data, a device table, or null where the kernel allows it).
    Ptr,
    I32,
    I64,
    U16,
    U32,
    U64,
    F64,
    /// A `CopyLayout` struct, by value.
    Layout,
}

impl ParamKind {
    /// The kind of a parameter of C type `ty`, if castor passes such parameters.
    fn of_c_type(ty: &str) -> Option<ParamKind> {
        if ty.contains('*') {
            return Some(ParamKind::Ptr);
        }
        let ty = ty.trim_start_matches("const ").trim();
        Some(match ty {
            "int" => ParamKind::I32,
            "i64" | "long long" => ParamKind::I64,
            "unsigned short" => ParamKind::U16,
            "unsigned int" | "unsigned" => ParamKind::U32,
            "u64" | "unsigned long long" => ParamKind::U64,
            "double" => ParamKind::F64,
            "CopyLayout" => ParamKind::Layout,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            ParamKind::Ptr => "a pointer",
            ParamKind::I32 => "an i32",
            ParamKind::I64 => "an i64",
            ParamKind::U16 => "a u16",
            ParamKind::U32 => "a u32",
            ParamKind::U64 => "a u64",
            ParamKind::F64 => "an f64",
            ParamKind::Layout => "a CopyLayout",
        }
    }
}

/// One parameter of a kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Param {
    pub name: String,
    /// The C type as declared (`const TI*`, `i64`), macro parameters unexpanded.
    pub c_type: String,
    pub kind: ParamKind,
}

/// The parameters of one family of entry points.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Signature {
    /// The file that declares it.
    pub file: &'static str,
    /// The declared name: an entry point, or a pattern with `*` for each macro parameter
    /// (`layer_norm_fwd_*`).
    pub family: String,
    pub params: Vec<Param>,
}

/// Why arguments given by name do not fit a signature.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("no kernel `{0}` among the kernel families")]
    UnknownEntry(String),
    #[error("`{entry}` has no parameter `{name}` (it takes {params})")]
    UnknownParam {
        entry: String,
        name: String,
        params: String,
    },
    #[error("`{entry}`: parameter `{name}` is not given")]
    Missing { entry: String, name: String },
    #[error("`{entry}`: parameter `{name}` is given twice")]
    Twice { entry: String, name: String },
}

impl Signature {
    /// Orders `args` given by parameter name into the kernel's parameter order: every
    /// parameter exactly once, no other name.
    pub fn order<A: Clone>(
        &self,
        entry: &str,
        args: &[(&str, A)],
    ) -> Result<Vec<A>, SignatureError> {
        let mut slots: Vec<Option<A>> = vec![None; self.params.len()];
        for (name, a) in args {
            let Some(i) = self.params.iter().position(|p| p.name == *name) else {
                return Err(SignatureError::UnknownParam {
                    entry: entry.into(),
                    name: (*name).into(),
                    params: self.names().join(", "),
                });
            };
            if slots[i].replace(a.clone()).is_some() {
                return Err(SignatureError::Twice {
                    entry: entry.into(),
                    name: (*name).into(),
                });
            }
        }
        slots
            .into_iter()
            .zip(&self.params)
            .map(|(a, p)| {
                a.ok_or_else(|| SignatureError::Missing {
                    entry: entry.into(),
                    name: p.name.clone(),
                })
            })
            .collect()
    }

    pub fn names(&self) -> Vec<&str> {
        self.params.iter().map(|p| p.name.as_str()).collect()
    }

    /// True if `entry` is one of the family's entry points.
    fn matches(&self, entry: &str) -> bool {
        glob_match(&self.family, entry)
    }

    /// Literal characters of the family pattern: the more, the more specific.
    fn specificity(&self) -> usize {
        self.family.chars().filter(|&c| c != '*').count()
    }
}

/// The signature of `entry` among `file`'s declarations (see [`parse_file`]): exact
/// declarations before patterns, the most specific pattern first.
pub fn find<'a>(declared: &'a [Signature], entry: &str) -> Option<&'a Signature> {
    declared
        .iter()
        .filter(|s| s.matches(entry))
        .max_by_key(|s| (!s.family.contains('*'), s.specificity()))
}

/// `*` matches any run of characters.
fn glob_match(pattern: &str, s: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == s;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !s.starts_with(first) || !s[first.len()..].ends_with(last) {
        return false;
    }
    let mut rest = &s[first.len()..s.len() - last.len()];
    for mid in &parts[1..parts.len() - 1] {
        match rest.find(mid) {
            Some(i) => rest = &rest[i + mid.len()..],
            None => return false,
        }
    }
    true
}

/// The signatures declared in one kernel file.
/// Every signature `file` declares (the table [`find`] looks entries up in).
pub fn parse_file(file: &KernelFile) -> Vec<Signature> {
    // Macro bodies continue over lines ending in `\`.
    let text = file.source.replace("\\\n", " ");
    let mut out = Vec::new();
    for line_start in find_all(&text, "extern \"C\" __global__ void") {
        let mut rest = &text[line_start + "extern \"C\" __global__ void".len()..];
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix("__launch_bounds__") {
            let Some(close) = after.find(')') else {
                continue;
            };
            rest = after[close + 1..].trim_start();
        }
        let Some(open) = rest.find('(') else { continue };
        let name = rest[..open].trim();
        let Some(close) = matching_paren(&rest[open..]) else {
            continue;
        };
        let params = parse_params(&rest[open + 1..open + close]);
        let define = enclosing_define(&text, line_start);
        let family = name
            .split("##")
            .enumerate()
            .map(|(i, part)| {
                // In `a_##io`, `io` is a macro parameter; the first part is literal.
                match &define {
                    Some((_, macro_params)) if i > 0 || macro_params.iter().any(|p| p == part) => {
                        glob_part(part, macro_params)
                    }
                    _ => part.to_string(),
                }
            })
            .collect::<String>();
        match (&define, family.as_str()) {
            // A declaration named by a bare macro parameter: one signature per invocation.
            (Some((macro_name, macro_params)), "*") => {
                let Some(k) = macro_params.iter().position(|p| p == name) else {
                    continue;
                };
                for args in invocations(&text, macro_name) {
                    if let Some(entry) = args.get(k) {
                        out.push(Signature {
                            file: file.name,
                            family: entry.clone(),
                            params: params.clone(),
                        });
                    }
                }
            }
            _ => out.push(Signature {
                file: file.name,
                family,
                params,
            }),
        }
    }
    out
}

/// `io` (a macro parameter) is `*`; `d` followed by a parameter keeps its literal prefix.
fn glob_part(part: &str, macro_params: &[String]) -> String {
    if macro_params.iter().any(|p| p == part) {
        return "*".into();
    }
    // `_d##P` splits into `_d` and `P`; a part may also end in a parameter after a literal.
    match macro_params
        .iter()
        .filter(|p| part.ends_with(p.as_str()))
        .max_by_key(|p| p.len())
    {
        Some(p) => format!("{}*", &part[..part.len() - p.len()]),
        None => part.to_string(),
    }
}

fn find_all(text: &str, pat: &str) -> Vec<usize> {
    text.match_indices(pat).map(|(i, _)| i).collect()
}

/// The length up to the parenthesis closing the one `s` starts with.
fn matching_paren(s: &str) -> Option<usize> {
    let mut depth = 0i32;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

fn parse_params(list: &str) -> Vec<Param> {
    list.split(',')
        .filter_map(|p| {
            let p = p.replace("__restrict__", " ");
            let p = p.split_whitespace().collect::<Vec<_>>().join(" ");
            let split = p.rfind([' ', '*'])?;
            let name = p[split + 1..].trim().to_string();
            let c_type = p[..split + 1].trim().to_string();
            let kind = ParamKind::of_c_type(&c_type)?;
            Some(Param { name, c_type, kind })
        })
        .collect()
}

/// The `#define NAME(params)` whose body holds position `at`, if any (its body is one line
/// once continuations are joined).
fn enclosing_define(text: &str, at: usize) -> Option<(String, Vec<String>)> {
    let line_start = text[..at].rfind('\n').map_or(0, |i| i + 1);
    let line = text[line_start..].trim_start();
    let rest = line.strip_prefix("#define ")?;
    let open = rest.find('(')?;
    let close = rest.find(')')?;
    let name = rest[..open].trim().to_string();
    let params = rest[open + 1..close]
        .split(',')
        .map(|p| p.trim().to_string())
        .collect();
    Some((name, params))
}

/// The argument lists of each invocation `NAME(...)` at the start of a line.
fn invocations(text: &str, name: &str) -> Vec<Vec<String>> {
    let call = format!("{name}(");
    text.lines()
        .filter_map(|l| l.trim().strip_prefix(call.as_str()))
        .filter_map(|rest| {
            let close = matching_paren(&format!("({rest}"))?;
            Some(
                rest[..close - 1]
                    .split(',')
                    .map(|a| a.trim().to_string())
                    .collect(),
            )
        })
        .collect()
}
