//! Generated pointwise kernels: the parser of their CUDA source (entry point parameters, the
//! `<entry>_body` lines, the scalar loop's input indices) and the evaluator that runs them
//! with the CPU executor's pointwise functions.

use super::args::Args;
use super::memory::{check_uses, use_, Io, Mem};
use super::R;
use crate::cpu::elementwise;
use crate::cuda::program::Launch;
use castor_ir::{round_to, BinaryOp, DType, UnaryOp};

/// An expression of a generated kernel's body.
#[derive(Clone, Debug)]
enum Expr {
    X(usize),
    T(usize),
    Const(f32),
    Bin(Box<Expr>, BinaryOp, Box<Expr>),
    F(UnaryOp, Box<Expr>),
    Df(UnaryOp, Box<Expr>),
}

/// How an input element is found from the output's flat index `i`.
#[derive(Clone, Debug, PartialEq)]
enum Index {
    Full,
    Scalar,
    /// `sum ((i / s) % d) * t`.
    Terms(Vec<(i64, i64, i64)>),
}

impl Index {
    fn at(&self, i: i64) -> i64 {
        match self {
            Index::Full => i,
            Index::Scalar => 0,
            Index::Terms(ts) => ts.iter().map(|&(s, d, t)| ((i / s) % d) * t).sum(),
        }
    }
}

/// A generated pointwise kernel, parsed from its source.
pub(super) struct Fused {
    inputs: Vec<(DType, Index)>,
    outputs: Vec<DType>,
    /// `t_j = round_to<dtype>(expr)`, in order.
    body: Vec<(DType, Expr)>,
    /// `*r_o = t_j`.
    results: Vec<usize>,
}

fn cuda_dtype(s: &str) -> R<DType> {
    match s {
        "float" => Ok(DType::F32),
        "__half" => Ok(DType::F16),
        "__nv_bfloat16" => Ok(DType::BF16),
        other => Err(format!("unknown CUDA type `{other}`")),
    }
}

fn functor(s: &str) -> R<UnaryOp> {
    Ok(match s {
        "GeluTanh" => UnaryOp::GeluTanh,
        "GeluErf" => UnaryOp::GeluErf,
        "Silu" => UnaryOp::Silu,
        "TanhFn" => UnaryOp::Tanh,
        "ExpFn" => UnaryOp::Exp,
        "RsqrtFn" => UnaryOp::Rsqrt,
        "NegFn" => UnaryOp::Neg,
        other => return Err(format!("unknown functor `{other}`")),
    })
}

/// A tiny recursive-descent parser of the body's expressions.
struct ExprParser<'s> {
    s: &'s str,
    at: usize,
}

impl ExprParser<'_> {
    fn rest(&self) -> &str {
        &self.s[self.at..]
    }

    fn skip_ws(&mut self) {
        while self.rest().starts_with(' ') {
            self.at += 1;
        }
    }

    fn eat(&mut self, tok: &str) -> bool {
        self.skip_ws();
        if self.rest().starts_with(tok) {
            self.at += tok.len();
            true
        } else {
            false
        }
    }

    fn expect(&mut self, tok: &str) -> R<()> {
        if self.eat(tok) {
            Ok(())
        } else {
            Err(format!(
                "expected `{tok}` at `{}` in `{}`",
                self.rest(),
                self.s
            ))
        }
    }

    fn ident(&mut self) -> &str {
        self.skip_ws();
        let start = self.at;
        while self
            .rest()
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            self.at += 1;
        }
        &self.s[start..self.at]
    }

    /// expr := term (('+' | '-') term)*
    fn expr(&mut self) -> R<Expr> {
        let mut e = self.term()?;
        loop {
            let op = if self.eat("+") {
                BinaryOp::Add
            } else if self.eat("-") {
                BinaryOp::Sub
            } else {
                return Ok(e);
            };
            e = Expr::Bin(Box::new(e), op, Box::new(self.term()?));
        }
    }

    /// term := atom (('*' | '/') atom)*
    fn term(&mut self) -> R<Expr> {
        let mut e = self.atom()?;
        loop {
            let op = if self.eat("*") {
                BinaryOp::Mul
            } else if self.eat("/") {
                BinaryOp::Div
            } else {
                return Ok(e);
            };
            e = Expr::Bin(Box::new(e), op, Box::new(self.atom()?));
        }
    }

    fn atom(&mut self) -> R<Expr> {
        if self.eat("(") {
            let e = self.expr()?;
            self.expect(")")?;
            return Ok(e);
        }
        if self.eat("0.0f") {
            return Ok(Expr::Const(0.0));
        }
        let id = self.ident().to_string();
        if id == "__int_as_float" {
            self.expect("(")?;
            self.expect("0x")?;
            let hex = self.ident().to_string();
            self.expect(")")?;
            let bits = u32::from_str_radix(&hex, 16).map_err(|_| format!("bad literal 0x{hex}"))?;
            return Ok(Expr::Const(f32::from_bits(bits)));
        }
        if let Some(k) = id.strip_prefix('x').and_then(|k| k.parse().ok()) {
            return Ok(Expr::X(k));
        }
        if let Some(j) = id.strip_prefix('t').and_then(|j| j.parse().ok()) {
            return Ok(Expr::T(j));
        }
        if self.eat("::") {
            let op = functor(&id)?;
            let which = self.ident().to_string();
            self.expect("(")?;
            let arg = Box::new(self.expr()?);
            self.expect(")")?;
            return match which.as_str() {
                "f" => Ok(Expr::F(op, arg)),
                "df" => Ok(Expr::Df(op, arg)),
                other => Err(format!("unknown functor method `{other}`")),
            };
        }
        Err(format!("unexpected `{}` in `{}`", self.rest(), self.s))
    }
}

fn parse_expr(s: &str) -> R<Expr> {
    let mut p = ExprParser { s, at: 0 };
    let e = p.expr()?;
    p.skip_ws();
    if !p.rest().is_empty() {
        return Err(format!("trailing `{}` in `{s}`", p.rest()));
    }
    Ok(e)
}

/// `((i / 37LL) % 5LL) * 1LL + ...`, `i` or `0`.
fn parse_index(s: &str) -> R<Index> {
    let s = s.trim();
    if s == "i" {
        return Ok(Index::Full);
    }
    if s == "0" {
        return Ok(Index::Scalar);
    }
    let num = |x: &str| -> R<i64> {
        x.trim()
            .trim_end_matches("LL")
            .parse()
            .map_err(|_| format!("bad number `{x}` in index `{s}`"))
    };
    let mut terms = Vec::new();
    for term in s.split(" + ") {
        // ((i / S) % D) * T
        let t = term
            .strip_prefix("((i / ")
            .ok_or_else(|| format!("bad index term `{term}`"))?;
        let (sdiv, rest) = t
            .split_once(") % ")
            .ok_or_else(|| format!("bad index term `{term}`"))?;
        let (d, mul) = rest
            .split_once(") * ")
            .ok_or_else(|| format!("bad index term `{term}`"))?;
        let (sdiv, d, mul) = (num(sdiv)?, num(d)?, num(mul)?);
        if sdiv <= 0 || d <= 0 {
            return Err(format!("bad index term `{term}`"));
        }
        terms.push((sdiv, d, mul));
    }
    Ok(Index::Terms(terms))
}

impl Fused {
    /// The kernel `name` of a generated module (which may hold several).
    pub(super) fn parse(src: &str, name: &str) -> R<Fused> {
        // The entry point's parameters: inputs, outputs, `i64 n`.
        let head = format!("extern \"C\" __global__ void {name}(");
        let sig = src
            .lines()
            .find(|l| l.starts_with(&head))
            .ok_or_else(|| format!("no entry point `{name}`"))?;
        let params = sig[head.len()..]
            .rsplit_once(')')
            .ok_or("bad entry point parameters")?
            .0;
        let mut inputs_dt = Vec::new();
        let mut outputs = Vec::new();
        for p in params.split(", ") {
            let words: Vec<&str> = p.split_whitespace().collect();
            match words.as_slice() {
                ["const", ty, "__restrict__", arg] if arg.starts_with("in") => {
                    inputs_dt.push(cuda_dtype(ty.trim_end_matches('*'))?)
                }
                [ty, "__restrict__", arg] if arg.starts_with("out") => {
                    outputs.push(cuda_dtype(ty.trim_end_matches('*'))?)
                }
                ["i64", "n"] => {}
                _ => return Err(format!("unexpected parameter `{p}`")),
            }
        }
        // The body.
        let head = format!("__device__ __forceinline__ void {name}_body(");
        let mut lines = src.lines().skip_while(|l| !l.starts_with(&head));
        lines.next().ok_or("no body function")?;
        let mut body = Vec::new();
        let mut results = vec![usize::MAX; outputs.len()];
        for line in lines {
            let line = line.trim();
            if line == "}" {
                break;
            }
            if let Some(rest) = line.strip_prefix("const float t") {
                let code = rest.split("  //").next().unwrap_or(rest).trim();
                let (j, rest) = code
                    .split_once(" = round_to<")
                    .ok_or_else(|| format!("bad body line `{line}`"))?;
                let (ty, expr) = rest
                    .split_once(">(")
                    .ok_or_else(|| format!("bad body line `{line}`"))?;
                let expr = expr
                    .strip_suffix(");")
                    .ok_or_else(|| format!("bad body line `{line}`"))?;
                let j: usize = j.parse().map_err(|_| format!("bad body line `{line}`"))?;
                if j != body.len() {
                    return Err(format!("body line t{j} out of order"));
                }
                body.push((cuda_dtype(ty)?, parse_expr(expr)?));
            } else if let Some(rest) = line.strip_prefix("*r") {
                let (o, t) = rest
                    .strip_suffix(';')
                    .and_then(|r| r.split_once(" = t"))
                    .ok_or_else(|| format!("bad result line `{line}`"))?;
                let o: usize = o.parse().map_err(|_| format!("bad result line `{line}`"))?;
                let t: usize = t.parse().map_err(|_| format!("bad result line `{line}`"))?;
                *results
                    .get_mut(o)
                    .ok_or_else(|| format!("result r{o} of {} outputs", outputs.len()))? = t;
            } else {
                return Err(format!("unexpected body line `{line}`"));
            }
        }
        if results.iter().any(|&t| t >= body.len()) {
            return Err("a result is not a body value".into());
        }
        // The scalar loop's call: each input's index expression.
        let call = format!("{name}_body(to_f32(in");
        let line = src.lines().map(str::trim).find(|l| l.starts_with(&call));
        let mut inputs = Vec::with_capacity(inputs_dt.len());
        for (k, &d) in inputs_dt.iter().enumerate() {
            let line = line.ok_or("no scalar loop")?;
            let open = format!("to_f32(in{k}[");
            let start = line
                .find(&open)
                .ok_or_else(|| format!("input {k} is not read in the scalar loop"))?
                + open.len();
            let end = line[start..]
                .find(']')
                .ok_or_else(|| format!("input {k}'s index is not closed"))?;
            inputs.push((d, parse_index(&line[start..start + end])?));
        }
        Ok(Fused {
            inputs,
            outputs,
            body,
            results,
        })
    }

    pub(super) fn run(&self, m: &mut Mem, l: &Launch) -> R<()> {
        let mut a = Args::new(l);
        let mut ins = Vec::with_capacity(self.inputs.len());
        for k in 0..self.inputs.len() {
            ins.push(a.need(m, &format!("in{k}"))?);
        }
        let mut outs = Vec::with_capacity(self.outputs.len());
        for o in 0..self.outputs.len() {
            outs.push(a.need(m, &format!("out{o}"))?);
        }
        let n = a.count("n")?;
        a.end()?;
        let mut uses = Vec::new();
        let mut in_place = Vec::new();
        let names_in: Vec<String> = (0..ins.len()).map(|k| format!("in{k}")).collect();
        let names_out: Vec<String> = (0..outs.len()).map(|o| format!("out{o}")).collect();
        for (k, (&p, (d, index))) in ins.iter().zip(&self.inputs).enumerate() {
            let elems = match index {
                _ if n == 0 => 0,
                Index::Full => n as i64,
                Index::Scalar => 1,
                Index::Terms(_) => (0..n as i64).map(|i| index.at(i)).max().unwrap_or(0) + 1,
            };
            let s = d.size_bytes();
            uses.push(use_(
                names_in[k].clone(),
                Some(p),
                elems as u64 * s as u64,
                s,
                Io::R,
            ));
        }
        for (o, (&p, d)) in outs.iter().zip(&self.outputs).enumerate() {
            let s = d.size_bytes();
            uses.push(use_(
                names_out[o].clone(),
                Some(p),
                (n * s) as u64,
                s,
                Io::W,
            ));
            for (k, (_, index)) in self.inputs.iter().enumerate() {
                if *index == Index::Full {
                    in_place.push((names_out[o].as_str(), names_in[k].as_str()));
                }
            }
        }
        check_uses(m, &uses, &in_place)?;
        let mut xs = Vec::with_capacity(ins.len());
        for (&p, (d, index)) in ins.iter().zip(&self.inputs) {
            xs.push(match index {
                Index::Full => m.fv(p, 0, n, *d)?,
                _ => (0..n as i64)
                    .map(|i| m.f(p, index.at(i), *d))
                    .collect::<R<Vec<f32>>>()?,
            });
        }
        let mut ts: Vec<Vec<f32>> = Vec::with_capacity(self.body.len());
        for (d, e) in &self.body {
            let mut v = eval(e, &xs, &ts, n)?;
            v.iter_mut().for_each(|x| *x = round_to(*d, *x));
            ts.push(v);
        }
        for ((&p, d), &t) in outs.iter().zip(&self.outputs).zip(&self.results) {
            m.set_fv(p, 0, *d, &ts[t])?;
        }
        Ok(())
    }
}

fn eval(e: &Expr, xs: &[Vec<f32>], ts: &[Vec<f32>], n: usize) -> R<Vec<f32>> {
    Ok(match e {
        Expr::X(k) => xs
            .get(*k)
            .ok_or_else(|| format!("x{k} is no input"))?
            .clone(),
        Expr::T(j) => ts
            .get(*j)
            .ok_or_else(|| format!("t{j} is not yet made"))?
            .clone(),
        Expr::Const(c) => vec![*c; n],
        Expr::Bin(a, op, b) => {
            let (a, b) = (eval(a, xs, ts, n)?, eval(b, xs, ts, n)?);
            a.iter()
                .zip(&b)
                .map(|(&x, &y)| match op {
                    BinaryOp::Add => x + y,
                    BinaryOp::Sub => x - y,
                    BinaryOp::Mul => x * y,
                    BinaryOp::Div => x / y,
                })
                .collect()
        }
        Expr::F(op, a) => {
            let mut v = eval(a, xs, ts, n)?;
            elementwise::unary(*op, &mut v);
            v
        }
        Expr::Df(op, a) => {
            // f'(x) alone: the CPU twin's `dy *= f'(x)` with dy = 1 (exact).
            let x = eval(a, xs, ts, n)?;
            let mut d = vec![1.0f32; n];
            elementwise::unary_grad(*op, &x, &mut d);
            d
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_kernels_parse() {
        let e = parse_expr("x1 * GeluTanh::df(x0)").unwrap();
        assert!(matches!(e, Expr::Bin(_, BinaryOp::Mul, _)));
        let e = parse_expr("t0 * __int_as_float(0x3f000000)").unwrap();
        match e {
            Expr::Bin(_, _, c) => assert!(matches!(*c, Expr::Const(x) if x == 0.5)),
            _ => panic!("{e:?}"),
        }
        let i = parse_index("((i / 37LL) % 5LL) * 1LL + ((i / 1LL) % 37LL) * 5LL").unwrap();
        assert_eq!(i.at(38), 1 + 5);
    }
}
