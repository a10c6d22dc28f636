//! Data movement: transpose, slice, concat, split, pad and broadcast, for every element type.
//!
//! `reshape` needs no kernel (the executor re-labels or copies the buffer). Each kernel here
//! writes its output in blocks of contiguous source runs, copied with `copy_from_slice`.

use super::par::for_each_block;
use super::pool::Elem;
use super::strides::{broadcast_strides, coalesce, offset};

/// Permutes the axes of `x` (shape `dims`): output axis `i` is input axis `perm[i]`.
pub fn transpose<T: Elem>(x: &[T], dims: &[usize], perm: &[usize]) -> Vec<T> {
    let mut out = T::buffer(x.len());
    if x.is_empty() {
        return out;
    }
    // Output dims with their input strides; size-1 dims dropped, and output axes that are
    // consecutive input axes merged.
    let in_strides = castor_ir::Shape(dims.to_vec()).strides();
    let mut od: Vec<usize> = Vec::with_capacity(dims.len());
    let mut os: Vec<usize> = Vec::with_capacity(dims.len());
    for &p in perm {
        let (d, s) = (dims[p], in_strides[p]);
        if d == 1 {
            continue;
        }
        match (od.last_mut(), os.last_mut()) {
            (Some(ld), Some(ls)) if *ls == s * d => {
                *ld *= d;
                *ls = s;
            }
            _ => {
                od.push(d);
                os.push(s);
            }
        }
    }
    let Some((&inner, outer)) = od.split_last() else {
        out.copy_from_slice(x);
        return out;
    };
    let (inner_stride, outer_strides) = (os[os.len() - 1], &os[..os.len() - 1]);
    if inner_stride == 1 {
        // The innermost axis stays innermost: copy contiguous runs.
        for_each_block(&mut out, inner, inner, |row, dst| {
            let start = offset(row, outer, outer_strides);
            dst.copy_from_slice(&x[start..start + inner]);
        });
    } else {
        for_each_block(&mut out, inner, inner, |row, dst| {
            let start = offset(row, outer, outer_strides);
            for (j, v) in dst.iter_mut().enumerate() {
                *v = x[start + j * inner_stride];
            }
        });
    }
    out
}

/// Splits `dims` around `axis` into (outer, len, inner) element counts.
fn around(dims: &[usize], axis: usize) -> (usize, usize, usize) {
    let outer = dims[..axis].iter().product();
    let inner = dims[axis + 1..].iter().product();
    (outer, dims[axis], inner)
}

/// Elements `start..end` along `axis` of `x` (shape `dims`).
pub fn slice<T: Elem>(x: &[T], dims: &[usize], axis: usize, start: usize, end: usize) -> Vec<T> {
    let (outer, len, inner) = around(dims, axis);
    let run = (end - start) * inner;
    if run == len * inner {
        return x.to_vec();
    }
    let mut out = T::buffer(outer * run);
    for_each_block(&mut out, run, run, |o, dst| {
        let src = (o * len + start) * inner;
        dst.copy_from_slice(&x[src..src + run]);
    });
    out
}

/// Concatenates `parts` (each with its shape) along `axis`; `out_dims` is the result's shape.
pub fn concat<T: Elem>(parts: &[(&[T], &[usize])], axis: usize, out_dims: &[usize]) -> Vec<T> {
    let (outer, len, inner) = around(out_dims, axis);
    let mut out = T::buffer(outer * len * inner);
    let runs: Vec<usize> = parts.iter().map(|(_, d)| d[axis] * inner).collect();
    for_each_block(&mut out, len * inner, len * inner, |o, dst| {
        let mut at = 0;
        for ((data, _), &run) in parts.iter().zip(&runs) {
            dst[at..at + run].copy_from_slice(&data[o * run..(o + 1) * run]);
            at += run;
        }
    });
    out
}

/// Consecutive pieces of `x` along `axis`, one per entry of `sizes`.
pub fn split<T: Elem>(x: &[T], dims: &[usize], axis: usize, sizes: &[usize]) -> Vec<Vec<T>> {
    let mut start = 0;
    sizes
        .iter()
        .map(|&s| {
            start += s;
            slice(x, dims, axis, start - s, start)
        })
        .collect()
}

/// `x` (shape `dims`) with `before` zeros (the type's default) before and `after` after it
/// along `axis`: the transpose of [`slice`].
pub fn pad<T: Elem>(x: &[T], dims: &[usize], axis: usize, before: usize, after: usize) -> Vec<T> {
    let (outer, len, inner) = around(dims, axis);
    let (run, out_run) = (len * inner, (before + len + after) * inner);
    let mut out = T::buffer(outer * out_run);
    for_each_block(&mut out, out_run, out_run, |o, dst| {
        let (head, rest) = dst.split_at_mut(before * inner);
        let (mid, tail) = rest.split_at_mut(run);
        head.fill(T::default());
        mid.copy_from_slice(&x[o * run..(o + 1) * run]);
        tail.fill(T::default());
    });
    out
}

/// `x` (shape `from`) broadcast to `to` by NumPy's rules (aligned on the right; `from` is
/// known to broadcast to `to`).
pub fn broadcast_to<T: Elem>(x: &[T], from: &[usize], to: &[usize]) -> Vec<T> {
    let n: usize = to.iter().product();
    let mut out = T::buffer(n);
    if n == 0 {
        return out;
    }
    let (dims, strides) = coalesce(to, &[broadcast_strides(from, to)]);
    let strides = &strides[0];
    let Some((&inner, outer)) = dims.split_last() else {
        // Every dim is 1: one element.
        out.fill(x[0]);
        return out;
    };
    let (inner_stride, outer_strides) = (strides[strides.len() - 1], &strides[..outer.len()]);
    for_each_block(&mut out, inner, inner, |row, dst| {
        let start = offset(row, outer, outer_strides);
        if inner_stride == 0 {
            dst.fill(x[start]);
        } else {
            dst.copy_from_slice(&x[start..start + inner]);
        }
    });
    out
}
