//! Layout ops as strided copies (`strided_copy_b<N>` in `kernels/layout.cu`).
//!
//! Every layout op but `reshape` (a view) moves a block of elements from one strided view to
//! another: a transpose reads with permuted strides, a slice or a split piece from an offset,
//! a concat writes each input into its offset of the output, a pad writes the interior of a
//! zeroed output, a broadcast reads with stride 0 along broadcast dims.

use super::super::program::{CopyLayout, MAX_RANK};

/// Row-major element strides of `dims`.
pub fn strides(dims: &[usize]) -> Vec<i64> {
    let mut s = vec![1i64; dims.len()];
    for d in (0..dims.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * dims[d + 1] as i64;
    }
    s
}

fn layout(
    shape: &[usize],
    src_stride: &[i64],
    dst_stride: &[i64],
    src_offset: i64,
    dst_offset: i64,
) -> Result<CopyLayout, String> {
    if shape.len() > MAX_RANK {
        return Err(format!(
            "a strided copy of rank {} (at most {MAX_RANK})",
            shape.len()
        ));
    }
    let mut l = CopyLayout {
        shape: [1; MAX_RANK],
        src_stride: [0; MAX_RANK],
        dst_stride: [0; MAX_RANK],
        src_offset,
        dst_offset,
        rank: shape.len() as i32,
        pad: 0,
    };
    for d in 0..shape.len() {
        l.shape[d] = shape[d] as i64;
        l.src_stride[d] = src_stride[d];
        l.dst_stride[d] = dst_stride[d];
    }
    Ok(l)
}

/// `out = transpose(x, perm)`: out dim `d` is x dim `perm[d]`.
pub fn transpose(x: &[usize], perm: &[usize]) -> Result<CopyLayout, String> {
    let xs = strides(x);
    let out: Vec<usize> = perm.iter().map(|&p| x[p]).collect();
    let src: Vec<i64> = perm.iter().map(|&p| xs[p]).collect();
    layout(&out, &src, &strides(&out), 0, 0)
}

/// Elements `start..start + len` of `x` along `axis`, into a contiguous output.
pub fn slice(x: &[usize], axis: usize, start: usize, len: usize) -> Result<CopyLayout, String> {
    let xs = strides(x);
    let mut out = x.to_vec();
    out[axis] = len;
    layout(&out, &xs, &strides(&out), start as i64 * xs[axis], 0)
}

/// A contiguous `x` into elements `start..` of `out` along `axis` (a concat input, a pad's
/// interior).
pub fn place_into(
    x: &[usize],
    out: &[usize],
    axis: usize,
    start: usize,
) -> Result<CopyLayout, String> {
    let os = strides(out);
    layout(x, &strides(x), &os, 0, start as i64 * os[axis])
}

/// NumPy broadcast of `x` to `out` (trailing dims aligned; size-1 dims read with stride 0).
pub fn broadcast(x: &[usize], out: &[usize]) -> Result<CopyLayout, String> {
    if x.len() > out.len() {
        return Err(format!(
            "cannot broadcast rank {} to rank {}",
            x.len(),
            out.len()
        ));
    }
    let xs = strides(x);
    let lead = out.len() - x.len();
    let src: Vec<i64> = (0..out.len())
        .map(|d| {
            if d < lead || x[d - lead] == 1 {
                0
            } else {
                xs[d - lead]
            }
        })
        .collect();
    layout(out, &src, &strides(out), 0, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a layout on the host as the kernel does.
    fn apply(l: &CopyLayout, src: &[i32], dst: &mut [i32]) {
        let rank = l.rank as usize;
        let n: i64 = l.shape[..rank].iter().product();
        for i in 0..n {
            let (mut rest, mut s, mut d) = (i, l.src_offset, l.dst_offset);
            for k in (0..rank).rev() {
                let idx = rest % l.shape[k];
                rest /= l.shape[k];
                s += idx * l.src_stride[k];
                d += idx * l.dst_stride[k];
            }
            dst[d as usize] = src[s as usize];
        }
    }

    #[test]
    fn transpose_slice_concat_pad_and_broadcast_move_the_right_elements() {
        let x: Vec<i32> = (0..24).collect(); // [2, 3, 4]
        let mut t = vec![0; 24];
        apply(&transpose(&[2, 3, 4], &[2, 0, 1]).unwrap(), &x, &mut t);
        // t[k, i, j] = x[i, j, k]
        assert_eq!(t[(3 * 2 + 1) * 3 + 2], x[(3 + 2) * 4 + 3]);

        let mut s = vec![0; 2 * 3 * 2];
        apply(&slice(&[2, 3, 4], 2, 1, 2).unwrap(), &x, &mut s);
        assert_eq!(s[..4], [1, 2, 5, 6]);

        // concat([2,3,4], [2,3,4]) along 1 -> [2,6,4]; the second input at offset 3.
        let mut c = vec![-1; 48];
        apply(
            &place_into(&[2, 3, 4], &[2, 6, 4], 1, 0).unwrap(),
            &x,
            &mut c,
        );
        apply(
            &place_into(&[2, 3, 4], &[2, 6, 4], 1, 3).unwrap(),
            &x,
            &mut c,
        );
        assert_eq!(c[12..16], [0, 1, 2, 3]);
        assert_eq!(c[24..28], [12, 13, 14, 15]);
        assert!(c.iter().all(|&v| v >= 0));

        let mut b = vec![0; 2 * 3 * 4];
        apply(&broadcast(&[3, 1], &[2, 3, 4]).unwrap(), &[7, 8, 9], &mut b);
        assert_eq!(b[4..8], [8, 8, 8, 8]);
        assert_eq!(b[12..16], [7, 7, 7, 7]);
    }
}
