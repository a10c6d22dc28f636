//! Arena placement: best fit in a given order, finding the buffers that overlap in time
//! through an interval index over the schedule instead of scanning every placed buffer.

use super::Buffer;

/// The order in which buffers were placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlacementOrder {
    BySize,
    /// By size class (sizes within 1% are equal), then by first use.
    BySizeClass,
    FirstUse,
}

impl PlacementOrder {
    pub const ALL: [PlacementOrder; 3] = [
        PlacementOrder::BySize,
        PlacementOrder::BySizeClass,
        PlacementOrder::FirstUse,
    ];

    /// Buffer indices in this order, and the bytes each reserves while placing (its size, or
    /// for size classes the class's largest size, so equal slots stay interchangeable).
    pub(super) fn indices(self, buffers: &[Buffer]) -> (Vec<usize>, Vec<u64>) {
        let mut reserve: Vec<u64> = buffers.iter().map(|b| b.size).collect();
        let mut idx: Vec<usize> = (0..buffers.len()).collect();
        let life = |b: &Buffer| b.end - b.start;
        match self {
            PlacementOrder::FirstUse => {} // definition order
            PlacementOrder::BySize => idx.sort_by(|&a, &b| {
                let (x, y) = (&buffers[a], &buffers[b]);
                y.size
                    .cmp(&x.size)
                    .then(life(y).cmp(&life(x)))
                    .then(a.cmp(&b))
            }),
            PlacementOrder::BySizeClass => {
                // Classes of sizes within 1% of the class's largest, largest class first;
                // in a class, by first use (so chains of equal buffers alternate slots).
                idx.sort_by(|&a, &b| buffers[b].size.cmp(&buffers[a].size).then(a.cmp(&b)));
                let mut class = vec![0usize; buffers.len()];
                let (mut c, mut leader) = (0usize, u64::MAX);
                for &i in &idx {
                    if (buffers[i].size as f64) < 0.99 * leader as f64 {
                        c += 1;
                        leader = buffers[i].size;
                    }
                    class[i] = c;
                    reserve[i] = leader;
                }
                idx.sort_by(|&a, &b| {
                    class[a]
                        .cmp(&class[b])
                        .then(buffers[a].start.cmp(&buffers[b].start))
                        .then(a.cmp(&b))
                })
            }
        }
        (idx, reserve)
    }

    pub fn describe(self) -> &'static str {
        match self {
            PlacementOrder::BySize => "greedy by size, best fit",
            PlacementOrder::FirstUse => "first use, best fit",
            PlacementOrder::BySizeClass => "greedy by size class then first use, best fit",
        }
    }
}

/// Places `buffers` in `order` (indices into `buffers`), best fit; returns the arena size.
///
/// For each buffer, the address ranges occupied by placed buffers live at the same time as
/// it are found in a [`TimeIndex`]; in address order they leave gaps: the smallest gap that
/// holds the buffer's reserve wins (the lowest on ties), else the buffer goes above them all.
pub(super) fn place(
    layout: &IndexLayout,
    buffers: &mut [Buffer],
    order: &[usize],
    reserve: &[u64],
) -> u64 {
    let mut index = TimeIndex::new(layout);
    let mut occupied: Vec<(u64, u64)> = Vec::new();
    let mut arena = 0u64;
    for &i in order {
        let (start, end, size) = (buffers[i].start, buffers[i].end, reserve[i]);
        if size == 0 {
            // An empty buffer occupies nothing: it goes at 0 and is not recorded.
            buffers[i].offset = 0;
            continue;
        }
        occupied.clear();
        index.occupied(start, end, &mut occupied);
        // Each node's pieces come sorted; the stable sort, which uses such runs, measured
        // faster here than the unstable one.
        occupied.sort();
        let offset = best_fit(&occupied, size);
        buffers[i].offset = offset;
        arena = arena.max(offset + buffers[i].size);
        index.insert(start, end, (offset, offset + size));
    }
    arena
}

/// The offset of the smallest gap of at least `size` bytes between `occupied` address ranges
/// (sorted), the lowest on ties; else the top of them all.
fn best_fit(occupied: &[(u64, u64)], size: u64) -> u64 {
    let mut prev_end = 0u64;
    let mut best: Option<(u64, u64)> = None; // (gap, offset)
    for &(lo, hi) in occupied {
        if lo >= prev_end {
            let gap = lo - prev_end;
            if gap >= size && best.is_none_or(|(g, _)| gap < g) {
                best = Some((gap, prev_end));
            }
        }
        prev_end = prev_end.max(hi);
    }
    best.map_or(prev_end, |(_, o)| o)
}

/// Two bottom-up segment trees over the schedule's positions `0..len`: where each live range
/// `[start, end]` is kept. A range overlaps a query `[s, e]` when it contains `s` or starts in
/// `(s, e]`. The `cover` tree keeps each range at the `O(log len)` nodes that exactly cover it,
/// so the ranges containing a point are those on its leaf-to-root path; the `starts` tree
/// keeps each range at every ancestor of its start's leaf, so the ranges starting in an
/// interval are those at its `O(log len)` canonical nodes.
pub(super) struct IndexLayout {
    /// Leaves per tree: the power of two at or above `len`.
    leaves: usize,
}

impl IndexLayout {
    pub(super) fn new(buffers: &[Buffer]) -> IndexLayout {
        let len = buffers.iter().map(|b| b.end + 1).max().unwrap_or(0);
        IndexLayout {
            leaves: len.max(1).next_power_of_two(),
        }
    }

    /// Every node (of both trees, `starts` offset by `2 * leaves`) that keeps `[start, end]`.
    fn keeping(&self, start: usize, end: usize, mut f: impl FnMut(usize)) {
        let mut node = self.leaves + start;
        while node >= 1 {
            f(2 * self.leaves + node);
            node /= 2;
        }
        let (mut lo, mut hi) = (self.leaves + start, self.leaves + end + 1);
        while lo < hi {
            if lo % 2 == 1 {
                f(lo);
                lo += 1;
            }
            if hi % 2 == 1 {
                hi -= 1;
                f(hi);
            }
            lo /= 2;
            hi /= 2;
        }
    }

    /// Every node whose ranges overlap `[start, end]`, each range at exactly one of them.
    fn overlapping(&self, start: usize, end: usize, mut f: impl FnMut(usize)) {
        let mut node = self.leaves + start;
        while node >= 1 {
            f(node);
            node /= 2;
        }
        let (mut lo, mut hi) = (self.leaves + start + 1, self.leaves + end + 1);
        while lo < hi {
            if lo % 2 == 1 {
                f(2 * self.leaves + lo);
                lo += 1;
            }
            if hi % 2 == 1 {
                hi -= 1;
                f(2 * self.leaves + hi);
            }
            lo /= 2;
            hi /= 2;
        }
    }
}

/// The address ranges of the buffers placed so far, kept at their live ranges' nodes. A node
/// keeps the union of its ranges, as sorted disjoint pieces (ranges that overlap or touch
/// merge: best fit packs buffers side by side, and a zero gap between touching ranges holds
/// nothing a non-empty buffer needs), so a query gathers a few pieces per node rather than
/// every buffer: the union of the gathered pieces is the union of the overlapping buffers'
/// ranges, which is all that best fit reads.
struct TimeIndex<'a> {
    layout: &'a IndexLayout,
    pieces: Vec<Vec<(u64, u64)>>,
}

impl<'a> TimeIndex<'a> {
    fn new(layout: &'a IndexLayout) -> Self {
        TimeIndex {
            layout,
            pieces: vec![Vec::new(); 4 * layout.leaves],
        }
    }

    /// Records address range `range` as occupied during `[start, end]`.
    fn insert(&mut self, start: usize, end: usize, range: (u64, u64)) {
        let pieces = &mut self.pieces;
        self.layout
            .keeping(start, end, |node| merge_piece(&mut pieces[node], range));
    }

    /// Appends the occupied pieces during `[start, end]` to `out`.
    fn occupied(&self, start: usize, end: usize, out: &mut Vec<(u64, u64)>) {
        self.layout
            .overlapping(start, end, |node| out.extend_from_slice(&self.pieces[node]));
    }
}

/// Adds `(lo, hi)` to sorted disjoint pieces, merging it with every piece it overlaps or
/// touches (`piece.lo <= hi && lo <= piece.hi`).
fn merge_piece(pieces: &mut Vec<(u64, u64)>, (lo, hi): (u64, u64)) {
    // Pieces are disjoint, apart and sorted, so both ends increase along the list.
    let first = pieces.partition_point(|p| p.1 < lo);
    let last = first + pieces[first..].partition_point(|p| p.0 <= hi);
    if first == last {
        pieces.insert(first, (lo, hi));
    } else {
        pieces[first] = (lo.min(pieces[first].0), hi.max(pieces[last - 1].1));
        pieces.drain(first + 1..last);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use castor_ir::Value;

    /// The placement before the interval index: every placed buffer scanned for overlaps.
    fn place_by_scan(buffers: &mut [Buffer], order: &[usize], reserve: &[u64]) -> u64 {
        // Placed buffers as parallel arrays, for a tight overlap scan.
        let mut p_start: Vec<usize> = Vec::with_capacity(order.len());
        let mut p_end: Vec<usize> = Vec::with_capacity(order.len());
        let mut p_lo: Vec<u64> = Vec::with_capacity(order.len());
        let mut p_hi: Vec<u64> = Vec::with_capacity(order.len());
        let mut overlap: Vec<(u64, u64)> = Vec::new();
        let mut arena = 0u64;
        for &i in order {
            let (start, end, size) = (buffers[i].start, buffers[i].end, reserve[i]);
            if size == 0 {
                buffers[i].offset = 0;
                continue;
            }
            overlap.clear();
            for j in 0..p_start.len() {
                if p_start[j] <= end && start <= p_end[j] {
                    overlap.push((p_lo[j], p_hi[j]));
                }
            }
            overlap.sort_unstable();
            let mut prev_end = 0u64;
            let mut best: Option<(u64, u64)> = None; // (gap, offset)
            for &(lo, hi) in &overlap {
                if lo >= prev_end {
                    let gap = lo - prev_end;
                    if gap >= size && best.is_none_or(|(g, _)| gap < g) {
                        best = Some((gap, prev_end));
                    }
                }
                prev_end = prev_end.max(hi);
            }
            let offset = best.map_or(prev_end, |(_, o)| o);
            buffers[i].offset = offset;
            arena = arena.max(offset + buffers[i].size);
            p_start.push(start);
            p_end.push(end);
            p_lo.push(offset);
            p_hi.push(offset + size);
        }
        arena
    }

    /// Deterministic pseudo-random numbers (xorshift), so the test needs no dependency.
    fn rng(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    /// The index finds exactly the intervals a scan finds, and placement gives the same
    /// offsets as the scan did, in every order, on random schedules (empty buffers, touching
    /// and nested ranges included).
    #[test]
    fn the_index_places_exactly_as_the_scan() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for round in 0..200 {
            let len = 1 + (rng(&mut seed) % 300) as usize;
            let n = (rng(&mut seed) % 400) as usize;
            let buffers: Vec<Buffer> = (0..n)
                .map(|i| {
                    let start = (rng(&mut seed) % len as u64) as usize;
                    let span = if rng(&mut seed).is_multiple_of(4) {
                        len
                    } else {
                        12
                    };
                    let end = (start + (rng(&mut seed) % span as u64) as usize).min(len - 1);
                    Buffer {
                        graph: 0,
                        value: Value(i as u32),
                        // Empty buffers too: best fit weighs the zero gaps they leave.
                        size: 256 * (rng(&mut seed) % 64),
                        start,
                        end,
                        offset: 0,
                    }
                })
                .collect();
            // Every range kept at the nodes a query visits exactly once.
            let layout = IndexLayout::new(&buffers);
            let mut at: Vec<Vec<usize>> = vec![Vec::new(); 4 * layout.leaves];
            for (i, b) in buffers.iter().enumerate().step_by(2) {
                layout.keeping(b.start, b.end, |node| at[node].push(i));
            }
            for q in buffers.iter().take(50) {
                let mut found = Vec::new();
                layout.overlapping(q.start, q.end, |node| found.extend_from_slice(&at[node]));
                found.sort_unstable();
                let expected: Vec<usize> = (0..n)
                    .step_by(2)
                    .filter(|&i| buffers[i].start <= q.end && q.start <= buffers[i].end)
                    .collect();
                assert_eq!(found, expected, "round {round}");
            }
            for order in PlacementOrder::ALL {
                let (idx, reserve) = order.indices(&buffers);
                let (mut a, mut b) = (buffers.clone(), buffers.clone());
                let arena = place(&layout, &mut a, &idx, &reserve);
                assert_eq!(
                    arena,
                    place_by_scan(&mut b, &idx, &reserve),
                    "round {round}"
                );
                assert_eq!(a, b, "round {round} {order:?}");
            }
        }
    }
}
