//! Index arithmetic for broadcasting and strided walks.
//!
//! Kernels walk their output row by row: a shape is *coalesced* (size-1 dims dropped, adjacent
//! dims that every operand walks contiguously merged) so the innermost loop is as long as
//! possible and runs over plain slices, and the index arithmetic happens once per row.

/// Row-major strides, in elements, for reading `shape` broadcast to `out` (NumPy rules,
/// aligned on the right): 0 on dims that `shape` lacks or has as 1.
pub fn broadcast_strides(shape: &[usize], out: &[usize]) -> Vec<usize> {
    let pad = out.len() - shape.len();
    let mut strides = vec![0; out.len()];
    let mut s = 1;
    for i in (0..shape.len()).rev() {
        if shape[i] != 1 {
            strides[pad + i] = s;
        }
        s *= shape[i];
    }
    strides
}

/// Drops size-1 dims and merges adjacent dims that every operand in `strides` walks
/// contiguously (`stride[i] == stride[i + 1] * dims[i + 1]`). Returns the new dims and one
/// stride list per operand.
pub fn coalesce(dims: &[usize], strides: &[Vec<usize>]) -> (Vec<usize>, Vec<Vec<usize>>) {
    let mut out_dims: Vec<usize> = Vec::with_capacity(dims.len());
    let mut out_strides: Vec<Vec<usize>> = vec![Vec::with_capacity(dims.len()); strides.len()];
    for (i, &d) in dims.iter().enumerate() {
        if d == 1 {
            continue;
        }
        let merge = match out_dims.last_mut() {
            Some(last) => {
                let contiguous = strides
                    .iter()
                    .zip(&out_strides)
                    .all(|(s, os)| os.last() == Some(&(s[i] * d)));
                if contiguous {
                    *last *= d;
                }
                contiguous
            }
            None => false,
        };
        for (s, os) in strides.iter().zip(&mut out_strides) {
            match os.last_mut() {
                Some(last) if merge => *last = s[i],
                _ => os.push(s[i]),
            }
        }
        if !merge {
            out_dims.push(d);
        }
    }
    (out_dims, out_strides)
}

/// The offset of row `row` of a walk over `dims` (the outer dims, innermost last) with the
/// given strides.
#[inline]
pub fn offset(mut row: usize, dims: &[usize], strides: &[usize]) -> usize {
    let mut off = 0;
    for (&d, &s) in dims.iter().zip(strides).rev() {
        off += (row % d) * s;
        row /= d;
    }
    off
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcast_strides_follow_numpy() {
        assert_eq!(broadcast_strides(&[3, 1], &[2, 3, 4]), vec![0, 1, 0]);
        assert_eq!(broadcast_strides(&[2, 3, 4], &[2, 3, 4]), vec![12, 4, 1]);
        assert_eq!(broadcast_strides(&[], &[5]), vec![0]);
    }

    #[test]
    fn coalesce_merges_contiguous_dims() {
        // Same shape: one dim.
        let (d, s) = coalesce(&[2, 3, 4], &[vec![12, 4, 1], vec![12, 4, 1]]);
        assert_eq!((d, s), (vec![24], vec![vec![1], vec![1]]));
        // A bias over the last dim: [outer, inner].
        let (d, s) = coalesce(&[2, 3, 4], &[vec![12, 4, 1], vec![0, 0, 1]]);
        assert_eq!((d, s), (vec![6, 4], vec![vec![4, 1], vec![0, 1]]));
        // Size-1 dims vanish.
        let (d, s) = coalesce(&[1, 5, 1], &[vec![5, 1, 1]]);
        assert_eq!((d, s), (vec![5], vec![vec![1]]));
    }

    #[test]
    fn offsets_decompose_rows() {
        assert_eq!(offset(5, &[2, 3], &[10, 1]), 12);
        assert_eq!(offset(5, &[2, 3], &[0, 2]), 4);
        assert_eq!(offset(0, &[], &[]), 0);
    }
}
