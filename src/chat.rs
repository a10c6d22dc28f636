//! Chat templates: a checkpoint's `chat_template` rendered as transformers'
//! `apply_chat_template` renders it, through minijinja.
//!
//! The template comes from `chat_template.jinja` beside the tokenizer files (where
//! transformers saves it since 4.43), else from `tokenizer_config.json`'s `chat_template` (a
//! string, or a list of named templates of which `default` is taken, as transformers takes
//! it). The environment is transformers': `trim_blocks` and `lstrip_blocks`, loop controls,
//! `raise_exception(message)` (an error naming the template's message), `strftime_now(format)`,
//! a `tojson` that writes what Python's `json.dumps(x, ensure_ascii=False)` writes (not Jinja's
//! HTML-escaped one), Python's string and dict methods (`.strip()`, `.startswith()`,
//! `.items()`, ...), and the tokenizer's special tokens (`bos_token`, `eos_token`, ...) as
//! variables. `{% generation %} ... {% endgeneration %}` marks what the assistant says, as
//! transformers' `AssistantTracker` does: the rendered text comes with the byte ranges those
//! blocks wrote, the tokens an SFT loss is taken on.

use crate::CliError;
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind, State};
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// The characters a generation block's output is wrapped in while rendering (from Unicode's
/// private use area, which no template writes), removed from the result.
const GENERATION_START: char = '\u{F8F0}';
const GENERATION_END: char = '\u{F8F1}';

/// A chat template with the variables it is rendered with.
pub struct ChatTemplate {
    /// transformers' environment holding the template (parsed once), its generation tags as
    /// calls of the marker function.
    env: Environment<'static>,
    /// Where it came from, for people.
    origin: PathBuf,
    /// The tokenizer's special tokens by name (`bos_token`, `eos_token`, ...).
    specials: BTreeMap<String, String>,
    /// Whether it has `{% generation %}` blocks (what an assistant-only loss needs).
    marks_generation: bool,
}

/// A rendered conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rendered {
    pub text: String,
    /// The byte ranges of `text` that `{% generation %}` blocks wrote, in order.
    pub generation: Vec<Range<usize>>,
}

impl ChatTemplate {
    /// The chat template of the model in `dir` (the folder of its config.json), if it has one.
    pub fn find(dir: &Path) -> anyhow::Result<Option<ChatTemplate>> {
        let config_path = dir.join("tokenizer_config.json");
        let config: Option<serde_json::Value> = match std::fs::read_to_string(&config_path) {
            Ok(text) => Some(serde_json::from_str(&text).map_err(|e| {
                CliError::InvalidInput(format!("`{}`: {e}", config_path.display()))
            })?),
            Err(_) => None,
        };
        let specials = config.as_ref().map(special_tokens).unwrap_or_default();
        let file = dir.join("chat_template.jinja");
        if file.is_file() {
            let source = std::fs::read_to_string(&file).map_err(|e| {
                CliError::InvalidInput(format!("cannot read `{}`: {e}", file.display()))
            })?;
            return Ok(Some(ChatTemplate::new(source, file, specials)?));
        }
        let Some(template) = config.as_ref().and_then(|c| c.get("chat_template")) else {
            return Ok(None);
        };
        let source = match template {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Array(named) => named
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(str::to_string)
                .ok_or_else(|| {
                    CliError::InvalidInput(format!(
                        "`{}`: chat_template is a list of named templates without one named \
                         `default`",
                        config_path.display()
                    ))
                })?,
            other => {
                return Err(CliError::InvalidInput(format!(
                    "`{}`: chat_template must be a string or a list of named templates, found \
                     {other}",
                    config_path.display()
                ))
                .into())
            }
        };
        Ok(Some(ChatTemplate::new(source, config_path, specials)?))
    }

    /// A template from its text; `origin` names it in errors. The text is parsed here, so a
    /// template that cannot be parsed is an error before anything runs.
    pub fn new(
        source: String,
        origin: PathBuf,
        specials: BTreeMap<String, String>,
    ) -> anyhow::Result<ChatTemplate> {
        let calls = with_generation_calls(&source);
        let mut template = ChatTemplate {
            env: environment(),
            origin,
            specials,
            marks_generation: calls != source,
        };
        let parsed = template.env.add_template_owned(TEMPLATE, calls);
        parsed.map_err(|e| template.error(e))?;
        Ok(template)
    }

    /// Where the template came from.
    pub fn origin(&self) -> &Path {
        &self.origin
    }

    /// Whether the template marks the assistant's turns with `{% generation %}` blocks.
    pub fn marks_generation(&self) -> bool {
        self.marks_generation
    }

    /// The special token named `name` (`eos_token`, ...), as the tokenizer config gives it.
    pub fn special(&self, name: &str) -> Option<&str> {
        self.specials.get(name).map(String::as_str)
    }

    /// Renders `messages` (a JSON list of `{"role", "content", ...}`) as transformers'
    /// `apply_chat_template(messages, tokenize=False, add_generation_prompt=...)` does.
    pub fn render(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
    ) -> anyhow::Result<Rendered> {
        let template = self.env.get_template(TEMPLATE).map_err(|e| self.error(e))?;
        let mut context: BTreeMap<String, Value> = self
            .specials
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        context.insert(
            "messages".into(),
            Value::from(minijinja::value::Serde(messages)),
        );
        context.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        // transformers passes both, as None when not given.
        context.insert("tools".into(), Value::from(()));
        context.insert("documents".into(), Value::from(()));
        let marked = template.render(context).map_err(|e| self.error(e))?;
        Ok(unmark(&marked))
    }

    fn error(&self, e: Error) -> anyhow::Error {
        let mut message = match e.kind() {
            ErrorKind::InvalidOperation if e.detail().is_some_and(|d| d.starts_with(RAISED)) => {
                format!(
                    "the chat template refuses the conversation: {}",
                    e.detail().unwrap_or_default().trim_start_matches(RAISED)
                )
            }
            _ => e.to_string(),
        };
        if let Some(line) = e.line() {
            message = format!("line {line}: {message}");
        }
        CliError::InvalidInput(format!(
            "chat template `{}`: {message}",
            self.origin.display()
        ))
        .into()
    }
}

/// `value` as a conversation: a list of messages, each with a string `role` and a `content`
/// (what every template reads); the error says which is not.
pub fn as_messages(value: &serde_json::Value) -> Result<&Vec<serde_json::Value>, String> {
    let list = value
        .as_array()
        .ok_or_else(|| "must be a JSON list of messages".to_string())?;
    for (i, m) in list.iter().enumerate() {
        if !m.get("role").is_some_and(|r| r.is_string()) || m.get("content").is_none() {
            return Err(format!("message {i} needs a string `role` and a `content`"));
        }
    }
    Ok(list)
}

/// The template's name in its environment.
const TEMPLATE: &str = "chat_template";

/// The prefix of the errors `raise_exception` raises.
const RAISED: &str = "raise_exception: ";

/// transformers' environment (see the module's documentation).
fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .unwrap_or_default();
    env.set_syntax(syntax);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |message: String| -> Result<Value, Error> {
            Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("{RAISED}{message}"),
            ))
        },
    );
    env.add_function("strftime_now", |format: String| strftime_now(&format));
    env.add_function("__castor_generation", generation_block);
    env.add_filter("tojson", tojson);
    env
}

/// The body of a `{% generation %}` block, wrapped in the markers [`unmark`] removes.
fn generation_block(state: &mut State, kwargs: Kwargs) -> Result<String, Error> {
    let caller: Value = kwargs.get("caller")?;
    kwargs.assert_all_used()?;
    let body = caller.call(state, &[])?;
    Ok(format!("{GENERATION_START}{body}{GENERATION_END}"))
}

/// `{% generation %}` and `{% endgeneration %}` (with their whitespace control) as a call
/// block of the marker function: transformers parses them as a call block too, so the body
/// renders with the same whitespace.
fn with_generation_calls(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(close) = tag.find("%}") else {
            break;
        };
        let inner = &tag[2..close];
        let (open_ws, inner) = match inner.strip_prefix(['-', '+']) {
            Some(s) => (&tag[2..3], s),
            None => ("", inner),
        };
        let (inner, close_ws) = match inner.strip_suffix(['-', '+']) {
            Some(s) => (s, &inner[inner.len() - 1..]),
            None => (inner, ""),
        };
        match inner.trim() {
            "generation" => out.push_str(&format!(
                "{{%{open_ws} call __castor_generation() {close_ws}%}}"
            )),
            "endgeneration" => out.push_str(&format!("{{%{open_ws} endcall {close_ws}%}}")),
            _ => out.push_str(&tag[..close + 2]),
        }
        rest = &tag[close + 2..];
    }
    out.push_str(rest);
    out
}

/// The rendered text without the generation markers, and the ranges they enclosed.
fn unmark(marked: &str) -> Rendered {
    let mut text = String::with_capacity(marked.len());
    let mut generation = Vec::new();
    let mut open = Vec::new();
    for c in marked.chars() {
        match c {
            GENERATION_START => open.push(text.len()),
            GENERATION_END => {
                if let Some(start) = open.pop() {
                    // Nested blocks count once, as their outermost range.
                    if open.is_empty() {
                        generation.push(start..text.len());
                    }
                }
            }
            c => text.push(c),
        }
    }
    Rendered { text, generation }
}

/// The special tokens of a tokenizer config: every `*_token` given as a string or as an added
/// token (`{"content": ...}`), and `additional_special_tokens`.
fn special_tokens(config: &serde_json::Value) -> BTreeMap<String, String> {
    let content = |v: &serde_json::Value| match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    };
    let mut out = BTreeMap::new();
    if let Some(map) = config.as_object() {
        for (k, v) in map {
            if k.ends_with("_token") {
                if let Some(text) = content(v) {
                    out.insert(k.clone(), text);
                }
            }
        }
    }
    out
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent, separators=...,
/// sort_keys=...)`, as transformers' `tojson` filter calls it.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let _ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let (item, key) = match (&separators, indent) {
        (Some(s), _) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        (_, Some(_)) => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let mut out = String::new();
    write_json(
        &mut out,
        &json,
        &PyJson {
            indent,
            item,
            key,
            sort_keys: sort_keys.unwrap_or(false),
        },
        0,
    );
    Ok(Value::from_safe_string(out))
}

struct PyJson {
    indent: Option<usize>,
    item: String,
    key: String,
    sort_keys: bool,
}

fn write_json(out: &mut String, v: &serde_json::Value, f: &PyJson, depth: usize) {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = f.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    match v {
        J::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&f.item);
                }
                newline(out, depth + 1);
                write_json(out, x, f, depth + 1);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(map) if !map.is_empty() => {
            let mut entries: Vec<(&String, &J)> = map.iter().collect();
            if f.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, x)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(&f.item);
                }
                newline(out, depth + 1);
                out.push_str(&python_string(k));
                out.push_str(&f.key);
                write_json(out, x, f, depth + 1);
            }
            newline(out, depth);
            out.push('}');
        }
        J::String(s) => out.push_str(&python_string(s)),
        // Python writes floats with their shortest repr (`1.0`, not `1`).
        J::Number(n) if n.is_f64() => {
            let x = n.as_f64().unwrap_or(0.0);
            if x.fract() == 0.0 && x.abs() < 1e16 {
                out.push_str(&format!("{x:.1}"));
            } else {
                out.push_str(&x.to_string());
            }
        }
        other => out.push_str(&other.to_string()),
    }
}

/// A JSON string as Python's `json.dumps(ensure_ascii=False)` writes it.
fn python_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// `strftime_now(format)`: the current UTC time in C's `strftime` format, for the directives
/// chat templates use (`%d %b %Y`, `%B`, `%m`, `%y`, `%H:%M:%S`, `%A`, `%a`, `%j`, `%%`).
fn strftime_now(format: &str) -> Result<String, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format_time(format, secs)
}

fn format_time(format: &str, secs: u64) -> Result<String, Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = (secs / 86_400) as i64;
    let (year, month, day) = civil_from_days(days);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let (h, m, s) = (secs / 3600 % 24, secs / 60 % 60, secs % 60);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(d) = chars.next() else {
            out.push('%');
            break;
        };
        let month_name = MONTHS[(month - 1) as usize];
        match d {
            'd' => out.push_str(&format!("{day:02}")),
            'm' => out.push_str(&format!("{month:02}")),
            'Y' => out.push_str(&year.to_string()),
            'y' => out.push_str(&format!("{:02}", year % 100)),
            'B' => out.push_str(month_name),
            'b' => out.push_str(&month_name[..3]),
            'A' => out.push_str(DAYS[weekday]),
            'a' => out.push_str(&DAYS[weekday][..3]),
            'j' => out.push_str(&format!("{day_of_year:03}")),
            'H' => out.push_str(&format!("{h:02}")),
            'M' => out.push_str(&format!("{m:02}")),
            'S' => out.push_str(&format!("{s:02}")),
            '%' => out.push('%'),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: the directive %{other} is not supported"),
                ))
            }
        }
    }
    Ok(out)
}

/// The civil date of a day count from 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Days from 1970-01-01 to a civil date.
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_format_as_strftime_does() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(
            format_time("%d %b %Y %B %m %y %H:%M:%S %A %a %j %%", t).unwrap(),
            "29 Feb 2024 February 02 24 13:05:09 Thursday Thu 060 %"
        );
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert!(format_time("%Q", t).is_err());
    }

    #[test]
    fn generation_tags_become_call_blocks_with_their_whitespace_control() {
        assert_eq!(
            with_generation_calls("a{%- generation -%}b{% endgeneration %}{{ x }}{% if y %}"),
            "a{%- call __castor_generation() -%}b{% endcall %}{{ x }}{% if y %}"
        );
    }
}
