//! Collectives on the CPU: the ranks of a data-parallel group as threads of one process.
//!
//! Each rank runs its own [`super::CpuExecutor`] holding a [`Member`] of one [`RankGroup`]. A
//! collective is an exchange: every rank puts its values in its slot, waits for all, reads every
//! slot and combines them in rank order, so every rank computes the same bits. Ranks must call
//! the same collectives in the same order (they run the same graph), as with NCCL.
//!
//! A flat shard of a value is its elements in row-major order, padded with zeros to
//! `world * ceil(n / world)`, cut in `world` pieces; rank r holds piece r (the IR's contract,
//! `castor_ir::Op::Shard`).

use crate::RuntimeError;
use castor_ir::{CollectiveOp, Op, Tensor, TensorType};
use std::sync::{Arc, Condvar, Mutex};

/// What a rank's collective reports when another rank broke the group: not the cause, which
/// the failing rank reports ([`crate::ranks::RankRunners`] tells the two apart by it).
pub const PEER_FAILED: &str = "another rank of the group failed";

/// The meeting point of `world` ranks.
pub struct RankGroup {
    world: usize,
    slots: Mutex<Vec<Vec<f32>>>,
    barrier: AbortableBarrier,
}

/// A barrier a failing rank can break, so the others stop waiting for it (with NCCL a rank
/// that fails aborts the communicator; here the waiting ranks get an error).
struct AbortableBarrier {
    world: usize,
    /// (ranks arrived, generation, aborted)
    state: Mutex<(usize, u64, bool)>,
    wake: Condvar,
}

impl AbortableBarrier {
    fn wait(&self) -> Result<(), RuntimeError> {
        let failed = || RuntimeError::Plan(PEER_FAILED.into());
        let mut s = self.state.lock().map_err(|_| failed())?;
        if s.2 {
            return Err(failed());
        }
        let generation = s.1;
        s.0 += 1;
        if s.0 == self.world {
            s.0 = 0;
            s.1 += 1;
            self.wake.notify_all();
            return Ok(());
        }
        while s.1 == generation && !s.2 {
            s = self.wake.wait(s).map_err(|_| failed())?;
        }
        if s.1 == generation {
            return Err(failed());
        }
        Ok(())
    }

    fn abort(&self) {
        if let Ok(mut s) = self.state.lock() {
            s.2 = true;
        }
        self.wake.notify_all();
    }
}

impl RankGroup {
    /// A group of `world` ranks and one member per rank, in rank order.
    pub fn members(world: usize) -> Vec<Member> {
        let group = Arc::new(RankGroup {
            world,
            slots: Mutex::new(vec![Vec::new(); world]),
            barrier: AbortableBarrier {
                world,
                state: Mutex::new((0, 0, false)),
                wake: Condvar::new(),
            },
        });
        (0..world)
            .map(|rank| Member {
                group: group.clone(),
                rank,
            })
            .collect()
    }
}

/// One rank of a [`RankGroup`].
#[derive(Clone)]
pub struct Member {
    group: Arc<RankGroup>,
    rank: usize,
}

impl std::fmt::Debug for Member {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {} of {}", self.rank, self.group.world)
    }
}

impl Member {
    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.group.world
    }

    /// Breaks the group: every rank waiting in a collective, now or later, gets an error.
    pub fn abort(&self) {
        self.group.barrier.abort();
    }

    /// Every rank's `mine`, in rank order.
    fn exchange(&self, mine: Vec<f32>) -> Result<Vec<Vec<f32>>, RuntimeError> {
        let poisoned = || RuntimeError::Plan(PEER_FAILED.into());
        self.group.slots.lock().map_err(|_| poisoned())?[self.rank] = mine;
        self.group.barrier.wait()?;
        let all = self.group.slots.lock().map_err(|_| poisoned())?.clone();
        // Nobody writes again before everybody has read.
        self.group.barrier.wait()?;
        Ok(all)
    }
}

/// This rank's piece of `values` cut into `world` shards of `len` (zeros past the end).
fn piece(values: &[f32], rank: usize, len: usize) -> Vec<f32> {
    (rank * len..(rank + 1) * len)
        .map(|i| values.get(i).copied().unwrap_or(0.0))
        .collect()
}

/// Runs a collective (or [`Op::Shard`]) on `x`; without a group (`member` none) the executor
/// is a group of one. `out` is the node's result type.
pub fn execute(
    op: &Op,
    member: Option<&Member>,
    x: &Tensor,
    out: &TensorType,
    node: &str,
) -> Result<Tensor, RuntimeError> {
    let (rank, world) = member.map_or((0, 1), |m| (m.rank(), m.world()));
    let wanted = match op {
        Op::AllReduce { world, .. }
        | Op::ReduceScatter { world, .. }
        | Op::AllGather { world, .. }
        | Op::Shard { world } => *world,
        _ => {
            return Err(RuntimeError::Internal {
                node: node.into(),
                message: format!("`{}` is not a collective", op.mnemonic()),
            })
        }
    };
    if wanted != world {
        return Err(RuntimeError::Plan(format!(
            "`%{node}` is a `{}` over {wanted} ranks, but this executor is one of {world} \
             (run the plan with --world-size {wanted})",
            op.mnemonic()
        )));
    }
    let values = x.as_f32().ok_or_else(|| RuntimeError::Internal {
        node: node.into(),
        message: "collectives move float tensors".into(),
    })?;
    let exchange = |mine: Vec<f32>| match member {
        Some(m) => m.exchange(mine),
        None => Ok(vec![mine]),
    };
    let n = out.shape.numel().unwrap_or(0);
    let result: Vec<f32> = match op {
        Op::AllReduce { reduce, .. } => {
            let all = exchange(values.to_vec())?;
            let mut sum = vec![0f32; values.len()];
            for r in &all {
                for (s, v) in sum.iter_mut().zip(r) {
                    *s += v;
                }
            }
            if *reduce == CollectiveOp::Mean {
                sum.iter_mut().for_each(|s| *s /= world as f32);
            }
            sum
        }
        Op::ReduceScatter { average, .. } => {
            let all = exchange(values.to_vec())?;
            let mut mine = vec![0f32; n];
            for r in &all {
                for (s, v) in mine.iter_mut().zip(piece(r, rank, n)) {
                    *s += v;
                }
            }
            if *average {
                mine.iter_mut().for_each(|s| *s /= world as f32);
            }
            mine
        }
        Op::AllGather { .. } => {
            let all = exchange(values.to_vec())?;
            all.into_iter().flatten().take(n).collect()
        }
        _ => piece(values, rank, n),
    };
    Ok(Tensor::from_f32(out.dtype, out.shape.clone(), result))
}
