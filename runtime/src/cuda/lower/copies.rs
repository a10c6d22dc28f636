//! Layout ops as strided views and copies (`strided_copy_b<N>` in `layout.cu`).
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

/// A strided view of a buffer: `dims` read with element `strides` from element `offset`.
/// Layout ops compose views; a view is copied out (once) only where a kernel needs its
/// elements contiguous.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct View {
    pub offset: i64,
    pub dims: Vec<usize>,
    pub strides: Vec<i64>,
}

impl View {
    /// A whole contiguous tensor.
    pub fn contiguous(dims: &[usize]) -> View {
        View {
            offset: 0,
            dims: dims.to_vec(),
            strides: strides(dims),
        }
    }

    /// True when the elements are contiguous in row-major order (possibly at an offset), so
    /// the view can be read as a plain tensor.
    pub fn is_contiguous(&self) -> bool {
        self.dims
            .iter()
            .zip(&self.strides)
            .zip(strides(&self.dims))
            .all(|((&d, &s), c)| d == 1 || s == c)
    }

    /// Dim `d` of the result is dim `perm[d]` of this view.
    pub fn transpose(&self, perm: &[usize]) -> View {
        View {
            offset: self.offset,
            dims: perm.iter().map(|&p| self.dims[p]).collect(),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
        }
    }

    /// Elements `start..start + len` along `axis`.
    pub fn slice(&self, axis: usize, start: usize, len: usize) -> View {
        let mut v = self.clone();
        v.offset += start as i64 * self.strides[axis];
        v.dims[axis] = len;
        v
    }

    /// NumPy broadcast to `out` (size-1 and missing dims read with stride 0).
    pub fn broadcast(&self, out: &[usize]) -> Option<View> {
        let lead = out.len().checked_sub(self.dims.len())?;
        let strides = (0..out.len())
            .map(|d| {
                if d < lead || self.dims[d - lead] == 1 {
                    0
                } else {
                    self.strides[d - lead]
                }
            })
            .collect();
        Some(View {
            offset: self.offset,
            dims: out.to_vec(),
            strides,
        })
    }

    /// The same elements in row-major order with shape `dims`, as a view, when the strides
    /// allow it without copying (dims split freely; dims merge only where they are laid out
    /// one after the other), as NumPy's no-copy reshape decides.
    pub fn reshape(&self, dims: &[usize]) -> Option<View> {
        let numel = |d: &[usize]| d.iter().product::<usize>();
        if numel(dims) != numel(&self.dims) {
            return None;
        }
        // Drop size-1 dims of the source; they carry no layout.
        let src: Vec<(usize, i64)> = self
            .dims
            .iter()
            .zip(&self.strides)
            .filter(|(&d, _)| d != 1)
            .map(|(&d, &s)| (d, s))
            .collect();
        let mut out = vec![0i64; dims.len()];
        let (mut i, mut j) = (0usize, 0usize);
        while j < dims.len() {
            if dims[j] == 1 {
                out[j] = 1;
                j += 1;
                continue;
            }
            if i >= src.len() {
                return None;
            }
            // Group source dims [i, i2) and target dims [j, j2) of equal element counts.
            let (mut i2, mut j2) = (i + 1, j + 1);
            let (mut a, mut b) = (src[i].0, dims[j]);
            while a != b {
                if a < b {
                    a *= src.get(i2)?.0;
                    i2 += 1;
                } else {
                    b *= dims[j2];
                    j2 += 1;
                }
            }
            // The source group must be one block: each dim's stride is the next one's
            // stride times its size.
            for k in i..i2 - 1 {
                if src[k].1 != src[k + 1].1 * src[k + 1].0 as i64 {
                    return None;
                }
            }
            // The target dims split the block's innermost stride.
            let mut stride = src[i2 - 1].1;
            for k in (j..j2).rev() {
                out[k] = stride;
                stride *= dims[k] as i64;
            }
            i = i2;
            j = j2;
        }
        if i != src.len() {
            return None;
        }
        Some(View {
            offset: self.offset,
            dims: dims.to_vec(),
            strides: out,
        })
    }

    /// The copy of this view into a contiguous tensor of its dims.
    pub fn materialize(&self) -> Result<CopyLayout, String> {
        layout(
            &self.dims,
            &self.strides,
            &strides(&self.dims),
            self.offset,
            0,
        )
    }

    /// The copy of this view into `dst`, a view of the same dims in the destination buffer.
    pub fn copy_to(&self, dst: &View) -> Result<CopyLayout, String> {
        if dst.dims != self.dims {
            return Err(format!(
                "copying a view {:?} into {:?}",
                self.dims, dst.dims
            ));
        }
        layout(
            &self.dims,
            &self.strides,
            &dst.strides,
            self.offset,
            dst.offset,
        )
    }

    /// The copy of this view into elements `start..` of `out` along `axis` (a concat input,
    /// a pad's interior).
    pub fn place_into(
        &self,
        out: &[usize],
        axis: usize,
        start: usize,
    ) -> Result<CopyLayout, String> {
        let os = strides(out);
        layout(
            &self.dims,
            &self.strides,
            &os,
            self.offset,
            start as i64 * os[axis],
        )
    }
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

    /// Reads a view's elements in row-major order.
    fn read(v: &View, src: &[i32]) -> Vec<i32> {
        let mut out = vec![0; v.dims.iter().product()];
        apply(&v.materialize().unwrap(), src, &mut out);
        out
    }

    #[test]
    fn composed_views_read_what_the_copies_would() {
        let x: Vec<i32> = (0..2 * 3 * 12).collect(); // [2, 3, 12]
        let base = View::contiguous(&[2, 3, 12]);
        // split piece [.., 4..8] -> reshape [2, 3, 2, 2] -> transpose [0, 2, 1, 3]
        let piece = base.slice(2, 4, 4);
        let heads = piece
            .reshape(&[2, 3, 2, 2])
            .expect("splitting a dim is a view");
        let t = heads.transpose(&[0, 2, 1, 3]);
        // The same through contiguous copies at each step.
        let mut p = vec![0; 24];
        apply(&base.slice(2, 4, 4).materialize().unwrap(), &x, &mut p);
        let mut tt = vec![0; 24];
        apply(
            &transpose(&[2, 3, 2, 2], &[0, 2, 1, 3]).unwrap(),
            &p,
            &mut tt,
        );
        assert_eq!(read(&t, &x), tt);
        // Transposed back and merged: [2, 3, 4] is a view again only where dims are adjacent.
        let back = t.transpose(&[0, 2, 1, 3]);
        assert_eq!(back.reshape(&[2, 3, 4]), Some(piece.clone()));
        assert!(
            t.reshape(&[2, 12]).is_none(),
            "merging non-adjacent dims needs a copy"
        );
        // A slice along the leading axis of a contiguous tensor stays contiguous.
        assert!(base.slice(0, 1, 1).is_contiguous());
        assert!(!piece.is_contiguous());
        assert_eq!(
            base.reshape(&[6, 1, 12]).map(|v| v.is_contiguous()),
            Some(true)
        );
    }

    #[test]
    fn transpose_slice_concat_pad_and_broadcast_move_the_right_elements() {
        let x: Vec<i32> = (0..24).collect(); // [2, 3, 4]
        let mut t = vec![0; 24];
        apply(&transpose(&[2, 3, 4], &[2, 0, 1]).unwrap(), &x, &mut t);
        // t[k, i, j] = x[i, j, k]
        assert_eq!(t[(3 * 2 + 1) * 3 + 2], x[(3 + 2) * 4 + 3]);

        let mut s = vec![0; 2 * 3 * 2];
        apply(
            &View::contiguous(&[2, 3, 4])
                .slice(2, 1, 2)
                .materialize()
                .unwrap(),
            &x,
            &mut s,
        );
        assert_eq!(s[..4], [1, 2, 5, 6]);

        // concat([2,3,4], [2,3,4]) along 1 -> [2,6,4]; the second input at offset 3.
        let mut c = vec![-1; 48];
        apply(
            &View::contiguous(&[2, 3, 4])
                .place_into(&[2, 6, 4], 1, 0)
                .unwrap(),
            &x,
            &mut c,
        );
        apply(
            &View::contiguous(&[2, 3, 4])
                .place_into(&[2, 6, 4], 1, 3)
                .unwrap(),
            &x,
            &mut c,
        );
        assert_eq!(c[12..16], [0, 1, 2, 3]);
        assert_eq!(c[24..28], [12, 13, 14, 15]);
        assert!(c.iter().all(|&v| v >= 0));

        let mut b = vec![0; 2 * 3 * 4];
        apply(
            &View::contiguous(&[3, 1])
                .broadcast(&[2, 3, 4])
                .unwrap()
                .materialize()
                .unwrap(),
            &[7, 8, 9],
            &mut b,
        );
        assert_eq!(b[4..8], [8, 8, 8, 8]);
        assert_eq!(b[12..16], [7, 7, 7, 7]);
    }
}
