//! What to suggest when a name glob (`--keep-f32`, `--force-low`, `--freeze`, `--no-decay`)
//! matches nothing: a typo must be an error, and the error should say what the user meant.
//!
//! Two kinds of suggestion, best first:
//! - the glob with the missing prefix: `h.0.*` matches nothing in a checkpoint whose names
//!   are `transformer.h.0.*`, so suggest `transformer.h.0.*`;
//! - the nearest names: the edit distance from the glob's literal text to the closest run of
//!   dot-separated components of each name (`attn.c_atn` is one edit from a part of
//!   `transformer.h.0.attn.c_attn.weight`), shorter names first among equals.

use wildmatch::WildMatch;

/// Up to `n` suggestions for `pattern` among `names`.
pub fn suggest<'a>(pattern: &str, names: impl IntoIterator<Item = &'a str> + Clone) -> Vec<String> {
    const N: usize = 3;
    let mut out: Vec<String> = Vec::new();
    let loose = WildMatch::new(&format!("*{pattern}"));
    if let Some(name) = names.clone().into_iter().find(|n| loose.matches(n)) {
        // The shortest prefix of `name` that makes the glob match it.
        if let Some(prefixed) = name
            .char_indices()
            .map(|(i, _)| format!("{}{pattern}", &name[..i]))
            .find(|g| WildMatch::new(g).matches(name))
        {
            out.push(prefixed);
        }
    }
    let literal: String = pattern
        .chars()
        .filter(|c| !matches!(c, '*' | '?'))
        .collect();
    let literal = literal.trim_matches('.');
    let mut scored: Vec<(usize, usize, &str)> = names
        .into_iter()
        .map(|name| (component_distance(literal, name), name.len(), name))
        .collect();
    scored.sort();
    for (_, _, name) in scored {
        if out.len() >= N {
            break;
        }
        if !out.iter().any(|o| o == name) {
            out.push(name.to_string());
        }
    }
    out
}

/// The smallest edit distance between `literal` and a run of consecutive dot-separated
/// components of `name`.
fn component_distance(literal: &str, name: &str) -> usize {
    let parts: Vec<&str> = name.split('.').collect();
    let mut best = usize::MAX;
    for i in 0..parts.len() {
        for j in i + 1..=parts.len() {
            best = best.min(levenshtein(literal, &parts[i..j].join(".")));
        }
    }
    best
}

fn levenshtein(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = if ca == cb {
                prev
            } else {
                1 + prev.min(cur).min(row[j])
            };
            prev = cur;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAMES: [&str; 4] = [
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.0.ln_1.weight",
        "transformer.h.1.ln_1.weight",
        "logits",
    ];

    #[test]
    fn a_missing_prefix_is_suggested_first() {
        assert_eq!(suggest("h.1.*", NAMES)[0], "transformer.h.1.*");
    }

    #[test]
    fn typos_find_the_nearest_names() {
        assert_eq!(
            suggest("*c_atn*", NAMES)[0],
            "transformer.h.0.attn.c_attn.weight"
        );
        assert_eq!(suggest("logit", NAMES)[0], "logits");
        assert_eq!(levenshtein("kitten", "sitting"), 3);
    }
}
