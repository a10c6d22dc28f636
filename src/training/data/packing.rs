//! Packing: whole examples placed end to end in rows of `seq` tokens, best-fit decreasing, as
//! TRL's `pack_dataset(strategy="bfd")` places them (Ding et al., "Fewer Truncations Improve
//! Language Modeling"). Examples are taken longest first (ties in their order); each goes
//! into the open row whose free space is the smallest that holds it (of rows with equal
//! space, the one that reached it first), else starts a new row. TRL packs its dataset in
//! `datasets.map` batches of 1,000 examples, each batch on its own; so does this, so that
//! rows are the same as TRL's.

use std::collections::{BTreeMap, VecDeque};

/// Examples per packing batch (`datasets.map`'s default `batch_size`).
pub const PACKING_BATCH: usize = 1000;

/// The rows of examples (by index into `lengths`, each at least 1; longer than `seq` is cut
/// to `seq`) packed
/// best-fit decreasing, in TRL's order: batch by batch, rows in the order they were opened,
/// examples in the order they were placed.
pub fn pack_bfd(lengths: &[usize], seq: usize) -> Vec<Vec<usize>> {
    let mut rows = Vec::new();
    for (b, batch) in lengths.chunks(PACKING_BATCH).enumerate() {
        let first = b * PACKING_BATCH;
        for row in pack_batch(batch, seq) {
            rows.push(row.into_iter().map(|i| first + i).collect());
        }
    }
    rows
}

fn pack_batch(lengths: &[usize], seq: usize) -> Vec<Vec<usize>> {
    // Lengths as cut to a row: a longer example sorts with the full rows.
    let lengths: Vec<usize> = lengths.iter().map(|&n| n.min(seq)).collect();
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    // Stable: equal lengths keep their order, as Arrow's sort does.
    order.sort_by(|&a, &b| lengths[b].cmp(&lengths[a]));
    let mut rows: Vec<Vec<usize>> = Vec::new();
    // Free space -> the open rows with that much, oldest first (rows with none left are
    // closed and not listed).
    let mut open: BTreeMap<usize, VecDeque<usize>> = BTreeMap::new();
    for i in order {
        let length = lengths[i];
        // The smallest listed space that holds the example (listed queues are never empty).
        let fit = open
            .range_mut(length..)
            .next()
            .and_then(|(&space, queue)| queue.pop_front().map(|row| (row, space)));
        let (row, space) = match fit {
            Some((row, space)) => {
                if open.get(&space).is_some_and(VecDeque::is_empty) {
                    open.remove(&space);
                }
                (row, space)
            }
            None => {
                rows.push(Vec::new());
                (rows.len() - 1, seq)
            }
        };
        rows[row].push(i);
        let left = space - length;
        if left > 0 {
            open.entry(left).or_default().push_back(row);
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example of TRL's `pack_dataset` documentation: lengths 5, 2, 3, 1 into rows of 4
    /// (the first cut to 4) give rows [0], [2, 3], [1].
    #[test]
    fn packs_as_trl_documents() {
        assert_eq!(
            pack_bfd(&[4, 2, 3, 1], 4),
            vec![vec![0], vec![2, 3], vec![1]]
        );
    }

    /// Best fit, not first fit: a 2 goes into the row with 2 left, not the older one with 3.
    #[test]
    fn the_tightest_row_takes_an_example() {
        // 7 -> row 0 (3 left); 6 -> row 1 (4 left); 4 -> row 1 (0 left); 3 -> row 0 (0 left).
        assert_eq!(pack_bfd(&[6, 7, 3, 4], 10), vec![vec![1, 2], vec![0, 3]]);
        // 8 -> row 0 (2 left), 7 -> row 1 (3 left), 2 -> row 0, not row 1.
        assert_eq!(pack_bfd(&[7, 8, 2], 10), vec![vec![1, 2], vec![0]]);
    }

    /// Batches of 1,000 examples are packed on their own.
    #[test]
    fn batches_are_packed_apart() {
        let lengths = vec![1; PACKING_BATCH + 1];
        let rows = pack_bfd(&lengths, 2000);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0], (0..PACKING_BATCH).collect::<Vec<_>>());
        assert_eq!(rows[1], vec![PACKING_BATCH]);
    }
}
