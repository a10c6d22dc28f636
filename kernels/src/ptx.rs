//! What a PTX module declares: its `.entry` points and each one's parameter list.
//!
//! The CUDA loader checks every launch's arguments against these lists before anything runs
//! (reading the PTX rather than probing the driver, which reports a probe past the last
//! parameter as an error that `compute-sanitizer` counts), and the offline tests check the
//! signature table and every lowered launch against them.

/// One parameter of an entry point, as the PTX declares it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PtxParam {
    /// The PTX type (`.u64`, `.u32`, `.u16`, `.f64`, ...), or `struct` for a by-value
    /// aggregate (`.align 8 .b8 name[N]`).
    pub ty: String,
    /// Its size in bytes.
    pub bytes: usize,
}

/// Each `.entry` of a PTX module, in order, with its parameters. `.param`s inside a body
/// (call arguments) are not an entry's.
pub fn entry_params(ptx: &str) -> Vec<(String, Vec<PtxParam>)> {
    let mut out: Vec<(String, Vec<PtxParam>)> = Vec::new();
    let mut in_list = false;
    for line in ptx.lines() {
        let line = line.trim();
        if let Some(rest) = line.split(".entry ").nth(1) {
            let name = rest.split('(').next().unwrap_or(rest).trim();
            out.push((name.to_string(), Vec::new()));
            // `.entry k()` has an empty list on its own line.
            in_list = !rest.trim_end().ends_with(')');
            continue;
        }
        if line.starts_with(')') || line.starts_with('{') {
            in_list = false;
        }
        let (true, Some((_, params)), Some(rest)) =
            (in_list, out.last_mut(), line.strip_prefix(".param "))
        else {
            continue;
        };
        params.push(param(rest));
    }
    out
}

/// `.u64 .ptr .align 1 name,` / `.f64 name` / `.align 8 .b8 name[216]`.
fn param(decl: &str) -> PtxParam {
    let decl = decl.trim_end_matches(',');
    if let (Some(open), Some(close)) = (decl.find('['), decl.find(']')) {
        let elem = decl
            .split_whitespace()
            .find_map(|t| type_bytes(t).filter(|_| t.starts_with('.')))
            .unwrap_or(1);
        let count: usize = decl[open + 1..close].parse().unwrap_or(0);
        return PtxParam {
            ty: "struct".into(),
            bytes: elem * count,
        };
    }
    let ty = decl
        .split_whitespace()
        .find(|t| type_bytes(t).is_some())
        .unwrap_or("");
    PtxParam {
        ty: ty.to_string(),
        bytes: type_bytes(ty).unwrap_or(0),
    }
}

/// The size of a PTX scalar type (`.u64`, `.s32`, `.f16`, `.b8`, `.pred`...).
fn type_bytes(ty: &str) -> Option<usize> {
    let bits = ty
        .strip_prefix(".u")
        .or_else(|| ty.strip_prefix(".s"))
        .or_else(|| ty.strip_prefix(".f"))
        .or_else(|| ty.strip_prefix(".b"))?;
    let bits: usize = bits.parse().ok()?;
    Some(bits / 8)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What NVRTC 13 writes for an entry taking pointers, scalars and a struct by value, and
    /// one taking nothing; the body's call parameters are not the entry's.
    #[test]
    fn reads_entry_parameter_lists() {
        let ptx = "\
.version 9.0
.target sm_90
.address_size 64

	// .globl	copy_b2
.visible .entry copy_b2(
	.param .u64 .ptr .align 1 copy_b2_param_0,
	.param .align 8 .b8 copy_b2_param_1[216],
	.param .u32 copy_b2_param_2,
	.param .f64 copy_b2_param_3,
	.param .u16 copy_b2_param_4
)
{
	.param .b64 param0;
	ret;
}
	// .globl	nothing
.visible .entry nothing()
{
	ret;
}
";
        let got = entry_params(ptx);
        let p = |ty: &str, bytes| PtxParam {
            ty: ty.into(),
            bytes,
        };
        assert_eq!(
            got,
            vec![
                (
                    "copy_b2".to_string(),
                    vec![
                        p(".u64", 8),
                        p("struct", 216),
                        p(".u32", 4),
                        p(".f64", 8),
                        p(".u16", 2)
                    ]
                ),
                ("nothing".to_string(), vec![]),
            ]
        );
    }
}
