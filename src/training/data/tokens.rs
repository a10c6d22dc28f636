//! Token ids of a stream, read in place: decoded text owns its ids; a `.bin` token file is
//! mapped into memory and each window widened when it is read, so a 10-billion-token file
//! costs its 20 GB of page cache, not 80 GB of i64 (and nothing is read twice).

use crate::CliError;
use std::path::Path;
use std::sync::Arc;

/// llm.c's token file header: 256 int32, the first three magic, version, token count.
pub const LLMC_MAGIC: i32 = 20240520;
pub const LLMC_HEADER_INTS: usize = 256;

/// Where a stream's ids live.
enum Store {
    Owned(Vec<i64>),
    /// Little-endian ids of `width` bytes from byte `offset` of a mapped file.
    Mapped {
        map: memmap2::Mmap,
        offset: usize,
        width: usize,
    },
}

impl Store {
    fn len(&self) -> usize {
        match self {
            Store::Owned(v) => v.len(),
            Store::Mapped { map, offset, width } => (map.len() - offset) / width,
        }
    }

    fn get(&self, i: usize) -> i64 {
        match self {
            Store::Owned(v) => v[i],
            Store::Mapped { map, offset, width } => {
                let at = offset + i * width;
                let b = &map[at..at + width];
                if *width == 2 {
                    i64::from(u16::from_le_bytes([b[0], b[1]]))
                } else {
                    i64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                }
            }
        }
    }
}

/// A run of token ids: all of a stream's, or its training or held-out part.
#[derive(Clone)]
pub struct Tokens {
    store: Arc<Store>,
    start: usize,
    len: usize,
}

impl Tokens {
    pub fn owned(ids: Vec<i64>) -> Tokens {
        let len = ids.len();
        Tokens {
            store: Arc::new(Store::Owned(ids)),
            start: 0,
            len,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Ids `a..b` of this run, widened.
    pub fn to_vec(&self, a: usize, b: usize) -> Vec<i64> {
        (a..b.min(self.len))
            .map(|i| self.store.get(self.start + i))
            .collect()
    }

    /// The first `n` ids and the rest.
    pub fn split_at(&self, n: usize) -> (Tokens, Tokens) {
        let n = n.min(self.len);
        (
            Tokens {
                store: Arc::clone(&self.store),
                start: self.start,
                len: n,
            },
            Tokens {
                store: Arc::clone(&self.store),
                start: self.start + n,
                len: self.len - n,
            },
        )
    }

    /// The first id outside `0..vocab`, as (index, id).
    pub fn first_outside(&self, vocab: usize) -> Option<(usize, i64)> {
        (0..self.len)
            .map(|i| (i, self.store.get(self.start + i)))
            .find(|&(_, t)| t < 0 || t as u64 >= vocab as u64)
    }
}

fn invalid(path: &Path, what: String) -> anyhow::Error {
    CliError::InvalidInput(format!("`{}`: {what}", path.display())).into()
}

/// Maps a `.bin` token file: llm.c's (by its magic) or nanoGPT's raw u16 tokens, checked
/// whole (header, size) before any id is read.
pub fn map_token_file(path: &Path) -> anyhow::Result<(Tokens, String)> {
    let file = std::fs::File::open(path).map_err(|e| {
        CliError::InvalidInput(format!("cannot read data `{}`: {e}", path.display()))
    })?;
    // SAFETY: the map is read only; castor never writes token files, and one changed by
    // another process while training reads other ids but no memory outside the map (every
    // read is bounds-checked against the length checked here).
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| {
        CliError::InvalidInput(format!("cannot map data `{}`: {e}", path.display()))
    })?;
    let (offset, width, what) = token_layout(path, &map)?;
    let store = Store::Mapped { map, offset, width };
    let len = store.len();
    Ok((
        Tokens {
            store: Arc::new(store),
            start: 0,
            len,
        },
        what,
    ))
}

/// Where a token file's ids start, their width in bytes, and what the file is.
fn token_layout(path: &Path, bytes: &[u8]) -> anyhow::Result<(usize, usize, String)> {
    let header_bytes = LLMC_HEADER_INTS * 4;
    let int = |i: usize| -> Option<i32> {
        let b = bytes.get(i * 4..i * 4 + 4)?;
        Some(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    if bytes.len() >= header_bytes && int(0) == Some(LLMC_MAGIC) {
        let version = int(1).unwrap_or(0);
        let width = match version {
            1 => 2,
            2 => 4,
            v => {
                return Err(invalid(
                    path,
                    format!("llm.c token file version {v}; known: 1 (u16 tokens), 2 (u32 tokens)"),
                ))
            }
        };
        let count = usize::try_from(int(2).unwrap_or(-1))
            .map_err(|_| invalid(path, "llm.c header has a negative token count".to_string()))?;
        let body = bytes.len() - header_bytes;
        if Some(body) != count.checked_mul(width) {
            return Err(invalid(
                path,
                format!(
                    "llm.c header says {count} tokens of {width} bytes, but {body} bytes follow it"
                ),
            ));
        }
        return Ok((
            header_bytes,
            width,
            format!("llm.c tokens, version {version}"),
        ));
    }
    if !bytes.len().is_multiple_of(2) {
        return Err(invalid(
            path,
            format!(
                "no llm.c header (magic {LLMC_MAGIC}), and {} bytes is not a whole number of \
                 raw u16 tokens",
                bytes.len()
            ),
        ));
    }
    Ok((0, 2, "raw u16 tokens".to_string()))
}
