//! The macros that turn the op table (one entry per op, in `mod.rs`) into the [`super::Op`]
//! enum and everything that used to be a parallel `match` per property: mnemonic, class,
//! arity, attributes (printing and parsing) and typing rule.
//!
//! An entry is one of
//!
//! ```text
//! /// docs
//! Name => "mnemonic", class EXPR, arity (LO, HI), typing EXPR;
//! Name { field: Type, .. } => "mnemonic", class EXPR, arity (LO, HI), typing EXPR;
//! Name(key: Family) => family METHOD, class EXPR, arity (LO, HI), typing EXPR;
//! Name { key: Family => family METHOD; field: Type, .. } => class EXPR, ...;
//! ```
//!
//! The fields are the op's attributes, printed and parsed in declaration order through
//! [`super::attr::AttrValue`]; a family key (a [`super::UnaryOp`], say) is not an attribute but
//! names the op: its mnemonic is `key.METHOD()`, and parsing finds it among `Family::ALL`. The
//! class and typing expressions see the fields (typing by reference) and the operand types
//! under the name given once at the top of the table (`operands: NAME`), which the macro
//! threads through so that entries and generated code agree on it.

/// Generates the op enum and its per-op properties from the table (see the module docs).
macro_rules! define_ops {
    (operands: $ins:ident, reader: $rd:ident, mnemonic: $mnv:ident; $($entries:tt)*) => {
        define_ops!(@munch [$ins $rd $mnv] [] [] [] [] [] [] [] []; $($entries)*);
    };

    // A family key in a struct variant (`Reduce { op: ReduceOp => family name; axes: .. }`).
    (@munch [$ins:ident $rd:ident $mnv:ident]
        [$($var:tt)*] [$($mn:tt)*] [$($cl:tt)*] [$($ar:tt)*] [$($at:tt)*] [$($pa:tt)*]
        [$($fp:tt)*] [$($ty:tt)*];
        $(#[$m:meta])*
        $V:ident { $k:ident : $K:ty => family $method:ident ;
                   $( $(#[$fm:meta])* $f:ident : $ft:ty ),* $(,)? }
            => class $class:expr, arity $arity:expr, typing $typing:expr;
        $($rest:tt)*
    ) => {
        define_ops!(@munch [$ins $rd $mnv]
            [$($var)* $(#[$m])* $V { $k: $K, $( $(#[$fm])* $f: $ft ),* },]
            [$($mn)* Op::$V { $k, .. } => $k.$method(),]
            [$($cl)* Op::$V { .. } => $class,]
            [$($ar)* Op::$V { .. } => $arity,]
            [$($at)* Op::$V { $($f,)* .. } => {
                #[allow(unused_mut)]
                let mut attrs = Vec::new();
                $( AttrFields::push_attrs($f, stringify!($f), &mut attrs); )*
                attrs
            },]
            [$($pa)*]
            [$($fp)*
                if let Some($k) = <$K>::ALL.into_iter().find(|x| x.$method() == $mnv) {
                    let op = Op::$V {
                        $k,
                        $( $f: AttrFields::take_attrs(&mut $rd, stringify!($f))? ),*
                    };
                    $rd.finish()?;
                    return Ok(op);
                }
            ]
            [$($ty)* Op::$V { $k, $($f),* } => $typing,];
            $($rest)*
        );
    };

    // A struct variant: the fields are the attributes.
    (@munch [$ins:ident $rd:ident $mnv:ident]
        [$($var:tt)*] [$($mn:tt)*] [$($cl:tt)*] [$($ar:tt)*] [$($at:tt)*] [$($pa:tt)*]
        [$($fp:tt)*] [$($ty:tt)*];
        $(#[$m:meta])*
        $V:ident { $( $(#[$fm:meta])* $f:ident : $ft:ty ),* $(,)? }
            => $name:literal, class $class:expr, arity $arity:expr, typing $typing:expr;
        $($rest:tt)*
    ) => {
        define_ops!(@munch [$ins $rd $mnv]
            [$($var)* $(#[$m])* $V { $( $(#[$fm])* $f: $ft ),* },]
            [$($mn)* Op::$V { .. } => $name,]
            [$($cl)* Op::$V { .. } => $class,]
            [$($ar)* Op::$V { .. } => $arity,]
            [$($at)* Op::$V { $($f),* } => {
                #[allow(unused_mut)]
                let mut attrs = Vec::new();
                $( AttrFields::push_attrs($f, stringify!($f), &mut attrs); )*
                attrs
            },]
            [$($pa)* $name => Op::$V { $( $f: AttrFields::take_attrs(&mut $rd, stringify!($f))? ),* },]
            [$($fp)*]
            [$($ty)* Op::$V { $($f),* } => $typing,];
            $($rest)*
        );
    };

    // A tuple variant named by its family key (`Unary(u: UnaryOp) => family name`).
    (@munch [$ins:ident $rd:ident $mnv:ident]
        [$($var:tt)*] [$($mn:tt)*] [$($cl:tt)*] [$($ar:tt)*] [$($at:tt)*] [$($pa:tt)*]
        [$($fp:tt)*] [$($ty:tt)*];
        $(#[$m:meta])*
        $V:ident ( $k:ident : $K:ty ) => family $method:ident,
            class $class:expr, arity $arity:expr, typing $typing:expr;
        $($rest:tt)*
    ) => {
        define_ops!(@munch [$ins $rd $mnv]
            [$($var)* $(#[$m])* $V($K),]
            [$($mn)* Op::$V($k) => $k.$method(),]
            [$($cl)* Op::$V($k) => $class,]
            [$($ar)* Op::$V(_) => $arity,]
            [$($at)* Op::$V(_) => vec![],]
            [$($pa)*]
            [$($fp)*
                if let Some($k) = <$K>::ALL.into_iter().find(|x| x.$method() == $mnv) {
                    $rd.finish()?;
                    return Ok(Op::$V($k));
                }
            ]
            [$($ty)* Op::$V($k) => $typing,];
            $($rest)*
        );
    };

    // A unit variant.
    (@munch [$ins:ident $rd:ident $mnv:ident]
        [$($var:tt)*] [$($mn:tt)*] [$($cl:tt)*] [$($ar:tt)*] [$($at:tt)*] [$($pa:tt)*]
        [$($fp:tt)*] [$($ty:tt)*];
        $(#[$m:meta])*
        $V:ident => $name:literal, class $class:expr, arity $arity:expr, typing $typing:expr;
        $($rest:tt)*
    ) => {
        define_ops!(@munch [$ins $rd $mnv]
            [$($var)* $(#[$m])* $V,]
            [$($mn)* Op::$V => $name,]
            [$($cl)* Op::$V => $class,]
            [$($ar)* Op::$V => $arity,]
            [$($at)* Op::$V => vec![],]
            [$($pa)* $name => Op::$V,]
            [$($fp)*]
            [$($ty)* Op::$V => $typing,];
            $($rest)*
        );
    };

    // Every entry read: emit the enum and its properties.
    (@munch [$ins:ident $rd:ident $mnv:ident]
        [$($var:tt)*] [$($mn:tt)*] [$($cl:tt)*] [$($ar:tt)*] [$($at:tt)*] [$($pa:tt)*]
        [$($fp:tt)*] [$($ty:tt)*];
    ) => {
        /// One operation. Operands are positional; attributes are the fields.
        #[derive(Clone, Debug, PartialEq)]
        pub enum Op {
            $($var)*
        }

        impl Op {
            /// The op's name in the IR text.
            pub fn mnemonic(&self) -> &'static str {
                match self {
                    $($mn)*
                }
            }

            /// The op's class, which the precision passes use.
            #[allow(unused_variables)]
            pub fn class(&self) -> OpClass {
                match self {
                    $($cl)*
                }
            }

            /// Number of operands the op takes, as an inclusive range.
            pub fn arity(&self) -> (usize, usize) {
                match self {
                    $($ar)*
                }
            }

            /// Attributes in the order the text format prints them.
            pub fn attrs(&self) -> Vec<(&'static str, Attr)> {
                match self {
                    $($at)*
                }
            }

            /// Builds an op from its mnemonic and attributes (the inverse of
            /// [`Op::mnemonic`] and [`Op::attrs`]). Every attribute must be given exactly once.
            pub fn from_parts(
                $mnv: &str,
                attrs: Vec<(String, Attr)>,
            ) -> Result<Op, String> {
                let mut $rd = AttrReader::new($mnv, attrs);
                let op = match $mnv {
                    $($pa)*
                    _ => {
                        // Ops named by a family member (`gelu_tanh`, `sum`).
                        $($fp)*
                        return Err(format!("unknown op `{}`", $mnv));
                    }
                };
                $rd.finish()?;
                Ok(op)
            }

            /// The op's typing rule on operands whose count [`Op::infer`] has checked.
            #[allow(unused_variables)]
            fn typing(&self, $ins: &[&TensorType]) -> Result<Vec<TensorType>, String> {
                match self {
                    $($ty)*
                }
            }
        }
    };
}

/// A family of pointwise or reduction functions that share one op (`Unary(GeluTanh)`): the
/// enum, `ALL`, and each member's mnemonic, written once per member. `with NAME` adds a method
/// `NAME` giving the mnemonic of each member's gradient op (`gelu_tanh_grad`).
macro_rules! define_family {
    ($(#[$m:meta])* $E:ident with $grad:ident {
        $( $(#[$vm:meta])* $V:ident = $name:literal ),* $(,)?
    }) => {
        define_family! { $(#[$m])* $E { $( $(#[$vm])* $V = $name ),* } }

        impl $E {
            /// The mnemonic of the member's gradient op (`gelu_tanh_grad`).
            pub fn $grad(self) -> &'static str {
                match self {
                    $($E::$V => concat!($name, "_grad")),*
                }
            }
        }
    };
    ($(#[$m:meta])* $E:ident {
        $( $(#[$vm:meta])* $V:ident = $name:literal ),* $(,)?
    }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $E {
            $( $(#[$vm])* $V ),*
        }

        impl $E {
            pub const ALL: [$E; [$(stringify!($V)),*].len()] = [$($E::$V),*];

            pub fn name(self) -> &'static str {
                match self {
                    $($E::$V => $name),*
                }
            }
        }
    };
}

pub(crate) use {define_family, define_ops};
