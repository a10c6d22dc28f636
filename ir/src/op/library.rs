//! Which code runs an op on CUDA, where more than castor's own kernels can: an attribute the
//! front end sets from the user's choice and the CUDA lowering reads. Executors without that
//! library (the CPU executor, the emulator) compute the same function their own way.

use super::attr::{Attr, AttrValue};

/// What runs a fused [`super::Op::Attention`] (and its gradient) on CUDA.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AttentionLibrary {
    /// castor's kernels (`attention.cu`, in `runtime/src/cuda/families/attention/`). The absent attribute.
    #[default]
    Kernels,
    /// cuDNN's fused scaled-dot-product attention; an error where cuDNN is missing or cannot
    /// express the op.
    Cudnn,
    /// cuDNN where it loads and expresses the op, else castor's kernels.
    Auto,
}

impl AttentionLibrary {
    pub const ALL: [AttentionLibrary; 3] = [
        AttentionLibrary::Kernels,
        AttentionLibrary::Cudnn,
        AttentionLibrary::Auto,
    ];

    /// The name in the IR text: `kernels`, `cudnn`, `auto`.
    pub fn name(self) -> &'static str {
        match self {
            AttentionLibrary::Kernels => "kernels",
            AttentionLibrary::Cudnn => "cudnn",
            AttentionLibrary::Auto => "auto",
        }
    }

    /// Whether cuDNN may run the op.
    pub fn may_use_cudnn(self) -> bool {
        self != AttentionLibrary::Kernels
    }
}

/// `library=cudnn` or `library=auto`; castor's kernels, the default, are not printed.
impl AttrValue for AttentionLibrary {
    fn to_attr(&self) -> Attr {
        Attr::Ident(self.name().to_string())
    }

    fn from_attr(key: &str, attr: Attr) -> Result<AttentionLibrary, String> {
        match attr {
            Attr::Ident(s) => AttentionLibrary::ALL
                .into_iter()
                .find(|l| l.name() == s)
                .ok_or_else(|| format!("`{key}` must be `kernels`, `cudnn` or `auto`, not `{s}`")),
            other => Err(format!(
                "`{key}` must be `kernels`, `cudnn` or `auto`, not `{other}`"
            )),
        }
    }

    fn absent() -> Option<Self> {
        Some(AttentionLibrary::Kernels)
    }

    fn printed(&self) -> Option<Attr> {
        (*self != AttentionLibrary::Kernels).then(|| self.to_attr())
    }
}
