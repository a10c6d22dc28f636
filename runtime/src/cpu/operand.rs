//! A node's operands as the kernels see them.
//!
//! An operand is borrowed (a binding, or a value a later node still reads) or owned (this node
//! is the value's last use). Kernels that can work in place [`Args::take_f32`] their operand:
//! an owned buffer moves, a borrowed one is copied, so in-place kernels never need a second
//! output buffer and a dead activation's memory is reused at once.

use super::par;
use super::pool::Elem;
use crate::RuntimeError;
use castor_ir::{Tensor, TensorData, TensorType};

pub enum Operand<'a> {
    Borrowed(&'a Tensor),
    Owned(Tensor),
    /// Already taken by the kernel.
    Taken,
}

/// The element types tensors store, and how to get them in and out of [`TensorData`].
pub trait Storage: Elem {
    fn view(data: &TensorData) -> Option<&[Self]>;
    fn wrap(values: Vec<Self>) -> TensorData;
}

impl Storage for f32 {
    fn view(data: &TensorData) -> Option<&[f32]> {
        match data {
            TensorData::F32(v) => Some(v),
            _ => None,
        }
    }
    fn wrap(values: Vec<f32>) -> TensorData {
        TensorData::F32(values)
    }
}

impl Storage for i64 {
    fn view(data: &TensorData) -> Option<&[i64]> {
        match data {
            TensorData::I64(v) => Some(v),
            _ => None,
        }
    }
    fn wrap(values: Vec<i64>) -> TensorData {
        TensorData::I64(values)
    }
}

impl Storage for u8 {
    fn view(data: &TensorData) -> Option<&[u8]> {
        match data {
            TensorData::U8(v) => Some(v),
            _ => None,
        }
    }
    fn wrap(values: Vec<u8>) -> TensorData {
        TensorData::U8(values)
    }
}

impl Storage for bool {
    fn view(data: &TensorData) -> Option<&[bool]> {
        match data {
            TensorData::Bool(v) => Some(v),
            _ => None,
        }
    }
    fn wrap(values: Vec<bool>) -> TensorData {
        TensorData::Bool(values)
    }
}

/// The operands of the node being executed, with its name for error messages.
pub struct Args<'a> {
    pub node: &'a str,
    operands: Vec<Operand<'a>>,
}

impl<'a> Args<'a> {
    pub fn new(node: &'a str, operands: Vec<Operand<'a>>) -> Self {
        Args { node, operands }
    }

    pub fn len(&self) -> usize {
        self.operands.len()
    }

    /// An error for a broken executor invariant at this node.
    pub fn internal(&self, message: impl Into<String>) -> RuntimeError {
        RuntimeError::Internal {
            node: self.node.to_string(),
            message: message.into(),
        }
    }

    pub fn tensor(&self, i: usize) -> Result<&Tensor, RuntimeError> {
        match self.operands.get(i) {
            Some(Operand::Borrowed(t)) => Ok(t),
            Some(Operand::Owned(t)) => Ok(t),
            Some(Operand::Taken) => Err(self.internal(format!("operand {i} was already taken"))),
            None => Err(self.internal(format!("there is no operand {i}"))),
        }
    }

    pub fn shape(&self, i: usize) -> Result<&[usize], RuntimeError> {
        Ok(self.tensor(i)?.shape().dims())
    }

    /// Operand `i`'s elements as `T`.
    pub fn values<T: Storage>(&self, i: usize) -> Result<&[T], RuntimeError> {
        let t = self.tensor(i)?;
        T::view(t.data())
            .ok_or_else(|| self.internal(format!("operand {i} ({}) has the wrong storage", t.ty())))
    }

    pub fn f32(&self, i: usize) -> Result<&[f32], RuntimeError> {
        self.values(i)
    }

    /// The owned operands the kernel did not take.
    pub fn into_owned(self) -> impl Iterator<Item = Tensor> + 'a {
        self.operands.into_iter().filter_map(|op| match op {
            Operand::Owned(t) => Some(t),
            _ => None,
        })
    }

    /// True if operand `i` is owned, so taking it moves its buffer.
    pub fn is_owned(&self, i: usize) -> bool {
        matches!(self.operands.get(i), Some(Operand::Owned(_)))
    }

    /// Operand `i`'s type and data: moved if owned, copied if borrowed.
    pub fn take(&mut self, i: usize) -> Result<(TensorType, TensorData), RuntimeError> {
        let taken = self
            .operands
            .get_mut(i)
            .map(|op| std::mem::replace(op, Operand::Taken));
        match taken {
            Some(Operand::Owned(t)) => Ok((t.ty().clone(), t.into_data())),
            Some(Operand::Borrowed(t)) => {
                let data = match t.data() {
                    TensorData::F32(v) => TensorData::F32(par::copy(v)),
                    TensorData::I64(v) => TensorData::I64(par::copy(v)),
                    TensorData::Bool(v) => TensorData::Bool(par::copy(v)),
                    TensorData::U8(v) => TensorData::U8(par::copy(v)),
                };
                Ok((t.ty().clone(), data))
            }
            _ => Err(self.internal(format!("operand {i} is missing or already taken"))),
        }
    }

    /// Operand `i`'s F32 values, moved if owned, copied if borrowed.
    pub fn take_f32(&mut self, i: usize) -> Result<Vec<f32>, RuntimeError> {
        match self.take(i)? {
            (_, TensorData::F32(v)) => Ok(v),
            (ty, _) => Err(self.internal(format!("operand {i} ({ty}) has the wrong storage"))),
        }
    }
}
