//! Which flags the user gave on the command line, as opposed to their defaults.
//!
//! A resumed run or a `--plan` fixes settings; a flag the user did not give takes the fixed
//! value, and a flag the user gave that disagrees with it is an error naming the setting and
//! both values. That needs to know what was typed, which clap's derive API does not keep, so
//! the CLI keeps the subcommand's `ArgMatches` beside its parsed arguments.

use clap::parser::ValueSource;

#[derive(Clone, Debug, Default)]
pub struct Given {
    matches: Option<clap::ArgMatches>,
}

impl Given {
    pub fn new(matches: clap::ArgMatches) -> Given {
        Given {
            matches: Some(matches),
        }
    }

    /// Nothing given: every flag has its default (commands built in code, such as the demo).
    pub fn defaults() -> Given {
        Given { matches: None }
    }

    /// True when the flag with this argument id (the field name) was on the command line.
    pub fn has(&self, id: &str) -> bool {
        self.matches.as_ref().is_some_and(|m| {
            m.try_contains_id(id).unwrap_or(false)
                && m.value_source(id) == Some(ValueSource::CommandLine)
        })
    }

    /// The flag as users write it: `keep_f32` -> `--keep-f32`.
    pub fn flag(id: &str) -> String {
        format!("--{}", id.replace('_', "-"))
    }
}
