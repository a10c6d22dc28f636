//! NaN and Inf in loaded weights: found when weights are read, named tensor by tensor.
//!
//! Headers cannot show them, so `castor inspect` finds them only with `--strict` (which then
//! reads every weight); commands that load weights anyway warn, or refuse with `--strict`.

use castor_ir::Tensor;
use std::fmt;

/// A weight tensor holding NaN or infinite values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NonFinite {
    pub tensor: String,
    pub nan: usize,
    pub inf: usize,
    pub numel: usize,
}

impl fmt::Display for NonFinite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "`{}` ({} NaN, {} Inf of {} values)",
            self.tensor, self.nan, self.inf, self.numel
        )
    }
}

/// The NaN and Inf count of one float tensor, if it has any (integer tensors have none).
pub fn non_finite(name: &str, t: &Tensor) -> Option<NonFinite> {
    let values = t.as_f32()?;
    let nan = values.iter().filter(|x| x.is_nan()).count();
    let inf = values.iter().filter(|x| x.is_infinite()).count();
    (nan + inf > 0).then(|| NonFinite {
        tensor: name.to_string(),
        nan,
        inf,
        numel: values.len(),
    })
}

/// Every tensor with NaN or Inf values, sorted by name.
pub fn find_non_finite<'a>(
    tensors: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
) -> Vec<NonFinite> {
    let mut found: Vec<NonFinite> = tensors
        .into_iter()
        .filter_map(|(n, t)| non_finite(n, t))
        .collect();
    found.sort_by(|a, b| a.tensor.cmp(&b.tensor));
    found
}

/// `2 tensor(s): `a` (1 NaN, 0 Inf of 12 values), `b` (...)`.
pub fn describe_non_finite(found: &[NonFinite]) -> String {
    let list: Vec<String> = found.iter().map(NonFinite::to_string).collect();
    format!("{} tensor(s): {}", found.len(), list.join(", "))
}
