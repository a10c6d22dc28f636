//! Op attributes in the text format: the values ([`Attr`]), how each Rust field type prints
//! and parses ([`AttrValue`]), and the reader that takes attributes by name so that missing,
//! mistyped and unknown ones are all reported.

use crate::{DType, RopeScaling};
use std::fmt;

/// An attribute value in the text format.
#[derive(Clone, Debug, PartialEq)]
pub enum Attr {
    Int(i64),
    Float(f64),
    Bool(bool),
    Ints(Vec<i64>),
    /// A list with at least one number that is not an integer.
    Floats(Vec<f64>),
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
            Attr::Floats(v) => {
                f.write_str("[")?;
                for (i, x) in v.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{x:?}")?;
                }
                f.write_str("]")
            }
            Attr::Ident(s) => f.write_str(s),
        }
    }
}

/// An op field as the text format writes it: one attribute named after the field (every
/// [`AttrValue`]), or several, each named after its own field (a hyperparameter struct,
/// [`crate::optim`]), so that a struct shared by ops and settings prints as flat attributes.
pub(crate) trait AttrFields: Sized {
    fn push_attrs(&self, key: &'static str, out: &mut Vec<(&'static str, Attr)>);
    fn take_attrs(reader: &mut AttrReader<'_>, key: &str) -> Result<Self, String>;
}

impl<T: AttrValue> AttrFields for T {
    fn push_attrs(&self, key: &'static str, out: &mut Vec<(&'static str, Attr)>) {
        if let Some(a) = self.printed() {
            out.push((key, a));
        }
    }
    fn take_attrs(reader: &mut AttrReader<'_>, key: &str) -> Result<Self, String> {
        T::take(reader, key)
    }
}

/// A field type that is an op attribute: how it prints and how it is read back.
///
/// A type may have an *absent* value (no sliding window, no rope scaling): it is not printed,
/// and a missing attribute reads as it, so that a feature only some models use adds nothing
/// to the text of the graphs that do not use it.
pub(crate) trait AttrValue: Sized {
    fn to_attr(&self) -> Attr;
    fn from_attr(key: &str, attr: Attr) -> Result<Self, String>;

    /// The value a missing attribute stands for, if the type has one.
    fn absent() -> Option<Self> {
        None
    }

    /// The attribute as printed: `None` for the absent value.
    fn printed(&self) -> Option<Attr> {
        Some(self.to_attr())
    }

    /// Takes the attribute `key` from the reader as this type.
    fn take(reader: &mut AttrReader<'_>, key: &str) -> Result<Self, String> {
        match (reader.take_if_given(key), Self::absent()) {
            (Some(attr), _) => Self::from_attr(key, attr),
            (None, Some(absent)) => Ok(absent),
            (None, None) => Err(reader.missing(key)),
        }
    }
}

/// A size or index that only some ops have (a sliding window, a padding row): omitted when
/// `None`.
impl AttrValue for Option<usize> {
    fn to_attr(&self) -> Attr {
        Attr::Int(self.map_or(0, |n| n as i64))
    }

    fn from_attr(key: &str, attr: Attr) -> Result<Option<usize>, String> {
        usize::from_attr(key, attr).map(Some)
    }

    fn absent() -> Option<Self> {
        Some(None)
    }

    fn printed(&self) -> Option<Attr> {
        self.map(|n| Attr::Int(n as i64))
    }
}

/// Rotary frequency scaling as its numbers (see [`RopeScaling::numbers`]); omitted when none.
impl AttrValue for RopeScaling {
    fn to_attr(&self) -> Attr {
        Attr::Floats(self.numbers())
    }

    fn from_attr(key: &str, attr: Attr) -> Result<RopeScaling, String> {
        let numbers = match attr {
            Attr::Floats(v) => v,
            Attr::Ints(v) => v.into_iter().map(|i| i as f64).collect(),
            other => {
                return Err(format!(
                    "attribute `{key}` must be a list of numbers, found `{other}`"
                ))
            }
        };
        RopeScaling::from_numbers(&numbers).map_err(|e| format!("attribute `{key}`: {e}"))
    }

    fn absent() -> Option<Self> {
        Some(RopeScaling::None)
    }

    fn printed(&self) -> Option<Attr> {
        (*self != RopeScaling::None).then(|| self.to_attr())
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

/// A rate only some configurations have (Adafactor's first-moment `beta1`): omitted when
/// `None`.
impl AttrValue for Option<f64> {
    fn to_attr(&self) -> Attr {
        Attr::Float(self.unwrap_or(0.0))
    }

    fn from_attr(key: &str, attr: Attr) -> Result<Option<f64>, String> {
        f64::from_attr(key, attr).map(Some)
    }

    fn absent() -> Option<Self> {
        Some(None)
    }

    fn printed(&self) -> Option<Attr> {
        self.map(Attr::Float)
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

impl AttrValue for super::CollectiveOp {
    fn to_attr(&self) -> Attr {
        Attr::Ident(self.name().to_string())
    }

    fn from_attr(key: &str, attr: Attr) -> Result<super::CollectiveOp, String> {
        let name = ident(key, attr)?;
        super::CollectiveOp::ALL
            .into_iter()
            .find(|c| c.name() == name)
            .ok_or_else(|| format!("`{key}` must be sum or mean, found `{name}`"))
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

    fn take_if_given(&mut self, key: &str) -> Option<Attr> {
        let pos = self.attrs.iter().position(|(k, _)| k == key)?;
        Some(self.attrs.remove(pos).1)
    }

    fn missing(&self, key: &str) -> String {
        format!("`{}` needs attribute `{key}`", self.op)
    }

    /// Every attribute was taken: anything left is unknown to the op.
    pub fn finish(self) -> Result<(), String> {
        match self.attrs.first() {
            None => Ok(()),
            Some((k, _)) => Err(format!("`{}` has no attribute `{k}`", self.op)),
        }
    }
}
