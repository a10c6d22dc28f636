//! Static tensor shapes and the broadcasting rule.

use std::fmt;

/// A static shape; `[]` is a scalar.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Shape(pub Vec<usize>);

impl Shape {
    pub fn scalar() -> Self {
        Shape(Vec::new())
    }

    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// Number of elements, or `None` on overflow (shapes come from untrusted files).
    pub fn numel(&self) -> Option<usize> {
        self.0.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
    }

    /// The last dimension (1 for a scalar).
    pub fn last(&self) -> usize {
        self.0.last().copied().unwrap_or(1)
    }

    /// Resolves a possibly negative axis against this rank.
    pub fn axis(&self, axis: i64) -> Option<usize> {
        let rank = self.rank() as i64;
        let a = if axis < 0 { axis + rank } else { axis };
        (0..rank).contains(&a).then_some(a as usize)
    }

    /// Row-major strides in elements.
    pub fn strides(&self) -> Vec<usize> {
        let mut strides = vec![1; self.rank()];
        for i in (0..self.rank().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * self.0[i + 1];
        }
        strides
    }

    /// NumPy broadcasting: dims are aligned on the right; each pair must be equal or 1.
    pub fn broadcast(a: &Shape, b: &Shape) -> Option<Shape> {
        let rank = a.rank().max(b.rank());
        let mut out = vec![0; rank];
        for (i, o) in out.iter_mut().enumerate() {
            let da = dim_from_right(a, rank - 1 - i);
            let db = dim_from_right(b, rank - 1 - i);
            *o = match (da, db) {
                (x, y) if x == y => x,
                (1, y) => y,
                (x, 1) => x,
                _ => return None,
            };
        }
        Some(Shape(out))
    }
}

fn dim_from_right(s: &Shape, from_right: usize) -> usize {
    if from_right < s.rank() {
        s.0[s.rank() - 1 - from_right]
    } else {
        1
    }
}

impl From<Vec<usize>> for Shape {
    fn from(v: Vec<usize>) -> Self {
        Shape(v)
    }
}

impl From<&[usize]> for Shape {
    fn from(v: &[usize]) -> Self {
        Shape(v.to_vec())
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(v: [usize; N]) -> Self {
        Shape(v.to_vec())
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcast_rules() {
        let s = |v: &[usize]| Shape(v.to_vec());
        assert_eq!(
            Shape::broadcast(&s(&[2, 3, 4]), &s(&[4])),
            Some(s(&[2, 3, 4]))
        );
        assert_eq!(
            Shape::broadcast(&s(&[2, 1, 4]), &s(&[3, 1])),
            Some(s(&[2, 3, 4]))
        );
        assert_eq!(
            Shape::broadcast(&s(&[2, 3]), &s(&[4, 1, 3])),
            Some(s(&[4, 2, 3]))
        );
        assert_eq!(Shape::broadcast(&s(&[2, 3]), &s(&[4, 3, 1])), None);
        assert_eq!(Shape::broadcast(&s(&[2, 3]), &s(&[3, 2])), None);
        assert_eq!(s(&[2, 3, 4]).strides(), vec![12, 4, 1]);
        assert_eq!(s(&[]).numel(), Some(1));
        assert_eq!(s(&[usize::MAX, 2]).numel(), None);
    }
}
