//! Op attributes in the text format: the values ([`Attr`]), how each Rust field type prints
//! and parses ([`AttrValue`]), and the reader that takes attributes by name so that missing,
//! mistyped and unknown ones are all reported.

use crate::DType;
use std::fmt;

/// An attribute value in the text format.
#[derive(Clone, Debug, PartialEq)]
pub enum Attr {
    Int(i64),
    Float(f64),
    Bool(bool),
    Ints(Vec<i64>),
    Ident(String),
}

impl fmt::Display for Attr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Attr::Int(i) => write!(f, "{i}"),
            // `{:?}` prints the shortest text that parses back to the same f64.
            Attr::Float(x) => write!(f, "{x:?}"),
            Attr::Bool(b) => write!(f, "{b}"),
            Attr::Ints(v) => {
                f.write_str("[")?;
                for (i, x) in v.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{x}")?;
                }
                f.write_str("]")
            }
            Attr::Ident(s) => f.write_str(s),
        }
    }
}

/// A field type that is an op attribute: how it prints and how it is read back.
pub(crate) trait AttrValue: Sized {
    fn to_attr(&self) -> Attr;
    fn from_attr(key: &str, attr: Attr) -> Result<Self, String>;

    /// Takes the attribute `key` from the reader as this type.
    fn take(reader: &mut AttrReader<'_>, key: &str) -> Result<Self, String> {
        let attr = reader.take(key)?;
        Self::from_attr(key, attr)
    }
}

impl AttrValue for bool {
    fn to_attr(&self) -> Attr {
        Attr::Bool(*self)
    }

    fn from_attr(key: &str, attr: Attr) -> Result<bool, String> {
        match attr {
            Attr::Bool(b) => Ok(b),
            other => Err(format!(
                "attribute `{key}` must be true or false, found `{other}`"
            )),
        }
    }
}

impl AttrValue for i64 {
    fn to_attr(&self) -> Attr {
        Attr::Int(*self)
    }

    fn from_attr(key: &str, attr: Attr) -> Result<i64, String> {
        match attr {
            Attr::Int(i) => Ok(i),
            other => Err(format!(
                "attribute `{key}` must be an integer, found `{other}`"
            )),
        }
    }
}

/// Axes, sizes and counts.
impl AttrValue for usize {
    fn to_attr(&self) -> Attr {
        Attr::Int(*self as i64)
    }

    fn from_attr(key: &str, attr: Attr) -> Result<usize, String> {
        let i = i64::from_attr(key, attr)?;
        usize::try_from(i).map_err(|_| format!("attribute `{key}` must be non-negative, found {i}"))
    }
}

/// Numbers; an integer is accepted where a float is expected.
impl AttrValue for f64 {
    fn to_attr(&self) -> Attr {
        Attr::Float(*self)
    }

    fn from_attr(key: &str, attr: Attr) -> Result<f64, String> {
        match attr {
            Attr::Float(x) => Ok(x),
            Attr::Int(i) => Ok(i as f64),
            other => Err(format!(
                "attribute `{key}` must be a number, found `{other}`"
            )),
        }
    }
}

/// Shapes, permutations and axis lists: `[1,2]`.
impl AttrValue for Vec<usize> {
    fn to_attr(&self) -> Attr {
        Attr::Ints(self.iter().map(|&x| x as i64).collect())
    }

    fn from_attr(key: &str, attr: Attr) -> Result<Vec<usize>, String> {
        match attr {
            Attr::Ints(v) => v
                .into_iter()
                .map(|i| {
                    usize::try_from(i)
                        .map_err(|_| format!("attribute `{key}` has negative entry {i}"))
                })
                .collect(),
            other => Err(format!(
                "attribute `{key}` must be a list like [1,2], found `{other}`"
            )),
        }
    }
}

/// A dtype by its name (`bf16`).
impl AttrValue for DType {
    fn to_attr(&self) -> Attr {
        Attr::Ident(self.name().to_string())
    }

    fn from_attr(key: &str, attr: Attr) -> Result<DType, String> {
        ident(key, attr)?.parse()
    }
}

/// An optional dtype: its name, or `none`.
impl AttrValue for Option<DType> {
    fn to_attr(&self) -> Attr {
        Attr::Ident(self.map_or("none", |d| d.name()).to_string())
    }

    fn from_attr(key: &str, attr: Attr) -> Result<Option<DType>, String> {
        match ident(key, attr)?.as_str() {
            "none" => Ok(None),
            other => other.parse().map(Some),
        }
    }
}

fn ident(key: &str, attr: Attr) -> Result<String, String> {
    match attr {
        Attr::Ident(s) => Ok(s),
        other => Err(format!("attribute `{key}` must be a name, found `{other}`")),
    }
}

/// Takes attributes by name, so that missing, mistyped and unknown ones are all reported.
pub(crate) struct AttrReader<'a> {
    attrs: Vec<(String, Attr)>,
    op: &'a str,
}

impl<'a> AttrReader<'a> {
    pub fn new(op: &'a str, attrs: Vec<(String, Attr)>) -> Self {
        AttrReader { attrs, op }
    }

    fn take(&mut self, key: &str) -> Result<Attr, String> {
        let pos = self
            .attrs
            .iter()
            .position(|(k, _)| k == key)
            .ok_or_else(|| format!("`{}` needs attribute `{key}`", self.op))?;
        Ok(self.attrs.remove(pos).1)
    }

    /// Every attribute was taken: anything left is unknown to the op.
    pub fn finish(self) -> Result<(), String> {
        match self.attrs.first() {
            None => Ok(()),
            Some((k, _)) => Err(format!("`{}` has no attribute `{k}`", self.op)),
        }
    }
}
