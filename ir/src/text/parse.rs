use crate::builder::is_name_char;
use crate::{
    Accum, Attr, DType, Graph, IrError, Location, ModelShape, Op, Origin, Shape, TensorType, Value,
};
use std::collections::HashMap;

/// Parses the text format. Names may be used before their definition line (the verifier then
/// reports the cycle or the use-before-definition); every error carries a line and column.
pub fn parse(text: &str) -> Result<Graph, IrError> {
    let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l));
    let mut header = None;
    for (no, line) in lines.by_ref() {
        let t = line.trim();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        header = Some((no, line));
        break;
    }
    let (hno, hline) = header.ok_or_else(|| err(1, 1, "empty input: expected `graph NAME {`"))?;
    let mut c = Cursor::new(hno, hline);
    c.keyword("graph")?;
    let name = c.name("a graph name")?;
    c.punct('{')?;
    c.end()?;

    let mut stmts = Vec::new();
    let mut shape = None;
    let mut ret: Option<(usize, Vec<(String, Location)>)> = None;
    let mut closed = false;
    for (no, line) in lines.by_ref() {
        let t = line.trim();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        let mut c = Cursor::new(no, line);
        if t == "}" {
            closed = true;
            break;
        }
        if ret.is_some() {
            return Err(c.error("expected `}` after `return`"));
        }
        if t.starts_with("model") && !t[5..].starts_with(|ch: char| is_name_char(ch)) {
            if !stmts.is_empty() || shape.is_some() {
                return Err(c.error("the `model` line comes once, before the first node"));
            }
            c.keyword("model")?;
            c.skip_ws();
            let loc = c.loc();
            let attrs = c.attr_list()?;
            c.end()?;
            shape = Some(ModelShape::from_attrs(attrs).map_err(|m| err(loc.line, loc.column, &m))?);
        } else if t.starts_with("return") && !t[6..].starts_with(|ch: char| is_name_char(ch)) {
            c.keyword("return")?;
            let mut outs = Vec::new();
            if !c.at_end() {
                loop {
                    outs.push(c.value_ref()?);
                    if !c.eat(',') {
                        break;
                    }
                }
            }
            c.end()?;
            ret = Some((no, outs));
        } else {
            stmts.push(statement(&mut c)?);
        }
    }
    if !closed {
        let last = text.lines().count().max(1);
        return Err(err(last, 1, "missing closing `}`"));
    }
    for (no, line) in lines {
        if !line.trim().is_empty() && !line.trim().starts_with('#') {
            return Err(err(no, 1, "unexpected text after the closing `}`"));
        }
    }
    let (_, outs) =
        ret.ok_or_else(|| err(text.lines().count().max(1), 1, "missing `return` line"))?;

    // Value ids follow definition order, so names can be resolved before nodes are pushed.
    let mut ids: HashMap<&str, Value> = HashMap::new();
    let mut next = 0u32;
    for s in &stmts {
        for (n, loc, _) in &s.results {
            if ids.insert(n.as_str(), Value(next)).is_some() {
                return Err(err(
                    loc.line,
                    loc.column,
                    &format!("value `%{n}` is defined twice"),
                ));
            }
            next += 1;
        }
    }
    let resolve = |(n, loc): &(String, Location)| {
        ids.get(n.as_str())
            .copied()
            .ok_or_else(|| err(loc.line, loc.column, &format!("unknown value `%{n}`")))
    };

    let mut g = Graph::new(name);
    g.shape = shape;
    for s in &stmts {
        let inputs = s
            .operands
            .iter()
            .map(resolve)
            .collect::<Result<Vec<_>, _>>()?;
        let results = s
            .results
            .iter()
            .map(|(n, _, t)| (n.clone(), t.clone()))
            .collect();
        let node = g
            .push_node(s.op.clone(), inputs, results)
            .map_err(|e| err(s.loc.line, s.loc.column, &e.to_string()))?;
        g.set_location(node, s.loc);
        g.set_note(node, s.note.clone());
        g.set_acc(node, s.acc);
        g.set_block(node, s.block);
        g.set_origin(node, s.origin);
    }
    let outputs = outs.iter().map(resolve).collect::<Result<Vec<_>, _>>()?;
    g.set_outputs(outputs);
    Ok(g)
}

struct Stmt {
    results: Vec<(String, Location, TensorType)>,
    op: Op,
    acc: Option<Accum>,
    block: Option<u32>,
    origin: Option<Origin>,
    operands: Vec<(String, Location)>,
    note: Option<String>,
    loc: Location,
}

fn statement(c: &mut Cursor) -> Result<Stmt, IrError> {
    c.skip_ws();
    let loc = c.loc();
    let mut results = Vec::new();
    loop {
        let (name, nloc) = c.value_ref()?;
        c.punct(':')?;
        let ty = c.tensor_type()?;
        results.push((name, nloc, ty));
        if !c.eat(',') {
            break;
        }
    }
    c.punct('=')?;
    c.skip_ws();
    let op_loc = c.loc();
    let mnemonic = c.word("an op name")?;
    let mut operands = Vec::new();
    if c.eat('(') && !c.eat(')') {
        loop {
            operands.push(c.value_ref()?);
            if c.eat(')') {
                break;
            }
            c.punct(',')?;
        }
    }
    let mut attrs = if c.peek() == Some('{') {
        c.attr_list()?
    } else {
        Vec::new()
    };
    // `acc`, `block` and `origin` belong to the node, not to the op.
    let acc = match attrs.iter().position(|(k, _)| k == "acc") {
        Some(i) => match attrs.remove(i).1 {
            Attr::Ident(a) => Some(
                a.parse::<Accum>()
                    .map_err(|m| err(op_loc.line, op_loc.column, &m))?,
            ),
            other => {
                return Err(err(
                    op_loc.line,
                    op_loc.column,
                    &format!("bad accumulation `{other}`"),
                ))
            }
        },
        None => None,
    };
    let block = match attrs.iter().position(|(k, _)| k == "block") {
        Some(i) => match attrs.remove(i).1 {
            Attr::Int(b) => Some(u32::try_from(b).map_err(|_| {
                err(
                    op_loc.line,
                    op_loc.column,
                    &format!("bad block index {b}: expected 0 to {}", u32::MAX),
                )
            })?),
            other => {
                return Err(err(
                    op_loc.line,
                    op_loc.column,
                    &format!("bad block index `{other}`: expected a number"),
                ))
            }
        },
        None => None,
    };
    let origin = match attrs.iter().position(|(k, _)| k == "origin") {
        Some(i) => match attrs.remove(i).1 {
            Attr::Ident(name) => Some(Origin::from_name(&name).ok_or_else(|| {
                err(
                    op_loc.line,
                    op_loc.column,
                    &format!(
                        "bad origin `{name}`: expected one of {}",
                        Origin::ALL.map(Origin::name).join(", ")
                    ),
                )
            })?),
            other => {
                return Err(err(
                    op_loc.line,
                    op_loc.column,
                    &format!("bad origin `{other}`: expected a name"),
                ))
            }
        },
        None => None,
    };
    let op = Op::from_parts(&mnemonic, attrs).map_err(|m| err(op_loc.line, op_loc.column, &m))?;
    if op.is_source() && !operands.is_empty() {
        return Err(err(
            op_loc.line,
            op_loc.column,
            &format!("`{mnemonic}` takes no operands"),
        ));
    }
    c.skip_ws();
    let note = if c.eat('#') {
        let rest = c.rest().trim().to_string();
        c.pos = c.chars.len();
        Some(rest)
    } else {
        None
    };
    c.end()?;
    Ok(Stmt {
        results,
        op,
        acc,
        block,
        origin,
        operands,
        note,
        loc,
    })
}

fn err(line: usize, column: usize, message: &str) -> IrError {
    IrError::Parse {
        line,
        column,
        message: message.to_string(),
    }
}

/// A position within one line.
struct Cursor {
    line: usize,
    chars: Vec<char>,
    pos: usize,
}

impl Cursor {
    fn new(line: usize, text: &str) -> Self {
        Cursor {
            line,
            chars: text.chars().collect(),
            pos: 0,
        }
    }

    fn loc(&self) -> Location {
        Location {
            line: self.line,
            column: self.pos + 1,
        }
    }

    /// "expected X, found Y" at the next non-blank character.
    fn expected(&mut self, what: &str) -> IrError {
        self.skip_ws();
        let m = format!("expected {what}, found {}", self.found());
        self.error(&m)
    }

    fn error(&self, message: &str) -> IrError {
        err(self.line, self.pos + 1, message)
    }

    fn skip_ws(&mut self) {
        while self.chars.get(self.pos).is_some_and(|c| c.is_whitespace()) {
            self.pos += 1;
        }
    }

    fn at_end(&mut self) -> bool {
        self.skip_ws();
        self.pos >= self.chars.len()
    }

    fn rest(&self) -> String {
        self.chars[self.pos..].iter().collect()
    }

    fn peek(&mut self) -> Option<char> {
        self.skip_ws();
        self.chars.get(self.pos).copied()
    }

    fn eat(&mut self, ch: char) -> bool {
        if self.peek() == Some(ch) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn punct(&mut self, ch: char) -> Result<(), IrError> {
        if self.eat(ch) {
            Ok(())
        } else {
            Err(self.expected(&format!("`{ch}`")))
        }
    }

    /// The next token (a word, or one character), described for an error message.
    fn found(&self) -> String {
        let rest = self.chars.get(self.pos..).unwrap_or(&[]);
        let Some(start) = rest.iter().position(|c| !c.is_whitespace()) else {
            return "end of line".into();
        };
        let word = |c: &char| c.is_ascii_alphanumeric() || *c == '_';
        if rest.get(start).is_some_and(word) {
            let w: String = rest[start..]
                .iter()
                .take_while(|c| word(c))
                .take(40)
                .collect();
            format!("`{w}`")
        } else {
            format!("`{}`", rest[start])
        }
    }

    fn end(&mut self) -> Result<(), IrError> {
        if self.at_end() {
            Ok(())
        } else {
            let m = format!("unexpected {}", self.found());
            Err(self.error(&m))
        }
    }

    fn take_while(&mut self, f: impl Fn(char) -> bool) -> String {
        let start = self.pos;
        while self.chars.get(self.pos).is_some_and(|&c| f(c)) {
            self.pos += 1;
        }
        self.chars[start..self.pos].iter().collect()
    }

    fn word(&mut self, what: &str) -> Result<String, IrError> {
        self.skip_ws();
        let w = self.take_while(|c| c.is_ascii_alphanumeric() || c == '_');
        if w.is_empty() {
            Err(self.expected(what))
        } else {
            Ok(w)
        }
    }

    fn name(&mut self, what: &str) -> Result<String, IrError> {
        self.skip_ws();
        let w = self.take_while(is_name_char);
        if w.is_empty() {
            Err(self.expected(what))
        } else {
            Ok(w)
        }
    }

    fn keyword(&mut self, kw: &str) -> Result<(), IrError> {
        self.skip_ws();
        let loc = self.loc();
        let w = self.take_while(|c| c.is_ascii_alphanumeric() || c == '_');
        if w == kw {
            Ok(())
        } else {
            Err(err(
                loc.line,
                loc.column,
                &format!("expected `{kw}`, found `{w}`"),
            ))
        }
    }

    fn value_ref(&mut self) -> Result<(String, Location), IrError> {
        self.skip_ws();
        let loc = self.loc();
        if !self.eat('%') {
            return Err(self.expected("a value like `%name`"));
        }
        let n = self.take_while(is_name_char);
        if n.is_empty() {
            return Err(self.error("expected a value name after `%`"));
        }
        Ok((n, loc))
    }

    fn tensor_type(&mut self) -> Result<TensorType, IrError> {
        self.skip_ws();
        let loc = self.loc();
        let d = self.word("a dtype")?;
        let dtype: DType = d
            .parse()
            .map_err(|m: String| err(loc.line, loc.column, &m))?;
        self.punct('[')?;
        let mut dims = Vec::new();
        if !self.eat(']') {
            loop {
                dims.push(self.unsigned()?);
                if self.eat(']') {
                    break;
                }
                self.punct(',')?;
            }
        }
        Ok(TensorType::new(dtype, Shape(dims)))
    }

    fn unsigned(&mut self) -> Result<usize, IrError> {
        self.skip_ws();
        let loc = self.loc();
        let s = self.take_while(|c| c.is_ascii_digit());
        s.parse().map_err(|_| {
            err(
                loc.line,
                loc.column,
                &format!("expected a dimension, found {}", self.found_or(&s)),
            )
        })
    }

    fn found_or(&self, s: &str) -> String {
        if s.is_empty() {
            self.found()
        } else {
            format!("`{s}`")
        }
    }

    /// `{key=value, ...}`.
    fn attr_list(&mut self) -> Result<Vec<(String, Attr)>, IrError> {
        self.punct('{')?;
        let mut attrs = Vec::new();
        if !self.eat('}') {
            loop {
                let key = self.word("an attribute name")?;
                self.punct('=')?;
                let value = self.attr()?;
                attrs.push((key, value));
                if self.eat('}') {
                    break;
                }
                self.punct(',')?;
            }
        }
        Ok(attrs)
    }

    fn attr(&mut self) -> Result<Attr, IrError> {
        if self.eat('[') {
            // Integers, unless some entry is not: then every entry is a float.
            let mut v = Vec::new();
            if !self.eat(']') {
                loop {
                    self.skip_ws();
                    let loc = self.loc();
                    // Lists are flat: a `[` here is reported, not parsed (no recursion).
                    match self.scalar()? {
                        number @ (Attr::Int(_) | Attr::Float(_)) => v.push(number),
                        other => {
                            return Err(err(
                                loc.line,
                                loc.column,
                                &format!("expected a number in a list attribute, found `{other}`"),
                            ))
                        }
                    }
                    if self.eat(']') {
                        break;
                    }
                    self.punct(',')?;
                }
            }
            let ints: Option<Vec<i64>> = v
                .iter()
                .map(|a| match a {
                    Attr::Int(i) => Some(*i),
                    _ => None,
                })
                .collect();
            return Ok(match ints {
                Some(ints) => Attr::Ints(ints),
                None => Attr::Floats(
                    v.iter()
                        .map(|a| match a {
                            Attr::Int(i) => *i as f64,
                            Attr::Float(x) => *x,
                            _ => f64::NAN,
                        })
                        .collect(),
                ),
            });
        }
        self.scalar()
    }

    /// One attribute value that is not a list.
    fn scalar(&mut self) -> Result<Attr, IrError> {
        self.skip_ws();
        let loc = self.loc();
        let tok =
            self.take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-' | '+'));
        if tok.is_empty() {
            return Err(self.expected("an attribute value"));
        }
        let bad = || {
            err(
                loc.line,
                loc.column,
                &format!(
                    "bad attribute value `{tok}`: expected a 64-bit integer, a number, \
                     true, false or a name"
                ),
            )
        };
        let starts_numeric = tok.starts_with(|c: char| c.is_ascii_digit() || c == '-' || c == '+');
        Ok(match tok.as_str() {
            "true" => Attr::Bool(true),
            "false" => Attr::Bool(false),
            "inf" | "-inf" | "NaN" => Attr::Float(tok.parse().map_err(|_| bad())?),
            _ if starts_numeric && tok.contains(['.', 'e', 'E']) => {
                Attr::Float(tok.parse().map_err(|_| bad())?)
            }
            _ if starts_numeric => Attr::Int(tok.parse().map_err(|_| bad())?),
            _ => Attr::Ident(tok),
        })
    }
}
