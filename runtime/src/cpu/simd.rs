//! Compiling hot loops for the CPU they run on.
//!
//! The default x86-64 target has only SSE2, so auto-vectorized loops use 4-lane vectors.
//! [`multiversion!`] defines a function whose body is compiled twice, once with AVX2 enabled,
//! and picks the AVX2 copy at run time when the CPU has it. The body's helpers must be
//! `#[inline(always)]` (as everything in `math` is) so they are compiled into each copy. Rust
//! never fuses multiplies and adds on its own, so both copies give bitwise identical results.

/// Defines `fn name(args) -> ret { body }` with an AVX2 copy of `body` chosen at run time.
/// Arguments are plain `name: Type` pairs; no generics.
macro_rules! multiversion {
    (
        $(#[$attr:meta])*
        $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block
    ) => {
        $(#[$attr])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? $body
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU supports AVX2, as just checked.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $body
        }
    };
}
pub(crate) use multiversion;
