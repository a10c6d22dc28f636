//! Collectives on the CPU: the ranks of a data-parallel group as threads of one process, or as
//! processes a launcher started, meeting over TCP.
//!
//! Each rank runs its own [`super::CpuExecutor`] holding a [`Member`]: of one [`RankGroup`]
//! (threads), or of a launched group's [`Rendezvous`] (processes). A collective is an
//! exchange: every rank contributes its values, receives every rank's and combines them in
//! rank order, so every rank computes the same bits, whichever way the ranks meet. Ranks must
//! call the same collectives in the same order (they run the same graph), as with NCCL.
//!
//! A flat shard of a value is its elements in row-major order, padded with zeros to
//! `world * ceil(n / world)`, cut in `world` pieces; rank r holds piece r (the IR's contract,
//! `castor_ir::Op::Shard`).

use crate::rendezvous::Rendezvous;
use crate::RuntimeError;
use castor_ir::{CollectiveOp, Op, Tensor, TensorType};
use std::sync::{Arc, Condvar, Mutex};

/// What a rank's collective reports when another rank broke the group: not the cause, which
/// the failing rank reports ([`crate::ranks::RankRunners`] tells the two apart by it).
pub const PEER_FAILED: &str = "another rank of the group failed";

/// The meeting point of `world` ranks.
pub struct RankGroup {
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
            slots: Mutex::new(vec![Vec::new(); world]),
            barrier: AbortableBarrier {
                world,
                state: Mutex::new((0, 0, false)),
                wake: Condvar::new(),
            },
        });
        (0..world)
            .map(|rank| Member {
                meeting: Meeting::Threads(group.clone()),
                rank,
                world,
            })
            .collect()
    }
}

/// One rank of a data-parallel group.
#[derive(Clone)]
pub struct Member {
    meeting: Meeting,
    rank: usize,
    world: usize,
}

/// Where a group's ranks meet.
#[derive(Clone)]
enum Meeting {
    /// Threads of this process.
    Threads(Arc<RankGroup>),
    /// Processes of a launched group, through rank 0's connections.
    Network(Arc<Mutex<Rendezvous>>),
}

impl std::fmt::Debug for Member {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {} of {}", self.rank, self.world)
    }
}

impl Member {
    /// This process's rank of the launched group `group` has joined.
    pub fn of_launched_group(group: Arc<Mutex<Rendezvous>>) -> Result<Member, RuntimeError> {
        let (rank, world) = {
            let g = group
                .lock()
                .map_err(|_| RuntimeError::Plan(PEER_FAILED.into()))?;
            (g.rank(), g.world())
        };
        Ok(Member {
            meeting: Meeting::Network(group),
            rank,
            world,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// Breaks the group: every rank waiting in a collective, now or later, gets an error. (A
    /// launched group's peers see this process's connections close when it exits.)
    pub fn abort(&self) {
        if let Meeting::Threads(group) = &self.meeting {
            group.barrier.abort();
        }
    }

    /// Every rank's `mine`, in rank order.
    pub fn exchange(&self, mine: Vec<f32>) -> Result<Vec<Vec<f32>>, RuntimeError> {
        match &self.meeting {
            Meeting::Threads(group) => {
                let poisoned = || RuntimeError::Plan(PEER_FAILED.into());
                group.slots.lock().map_err(|_| poisoned())?[self.rank] = mine;
                group.barrier.wait()?;
                let all = group.slots.lock().map_err(|_| poisoned())?.clone();
                // Nobody writes again before everybody has read.
                group.barrier.wait()?;
                Ok(all)
            }
            Meeting::Network(group) => {
                let mut g = group
                    .lock()
                    .map_err(|_| RuntimeError::Plan(PEER_FAILED.into()))?;
                let failed = |e| RuntimeError::Plan(format!("a collective between processes: {e}"));
                let bytes: Vec<u8> = mine.iter().flat_map(|v| v.to_le_bytes()).collect();
                // Rank 0 collects every rank's values and sends them all back: one frame of
                // [count: u64, values...] per rank.
                let all = g.gather(&bytes).map_err(failed)?.map(|all| {
                    let mut joined = Vec::new();
                    for b in all {
                        joined.extend_from_slice(&(b.len() as u64 / 4).to_le_bytes());
                        joined.extend_from_slice(&b);
                    }
                    joined
                });
                let joined = g.broadcast(all.as_deref()).map_err(failed)?;
                decode_ranks(&joined, self.world).ok_or_else(|| {
                    RuntimeError::Plan("a collective between processes: a malformed frame".into())
                })
            }
        }
    }
}

/// `world` runs of [count: u64, count f32 values], little-endian.
fn decode_ranks(mut bytes: &[u8], world: usize) -> Option<Vec<Vec<f32>>> {
    let mut out = Vec::with_capacity(world);
    for _ in 0..world {
        let (count, rest) = bytes.split_at_checked(8)?;
        let n = u64::from_le_bytes(count.try_into().ok()?) as usize;
        let (values, rest) = rest.split_at_checked(n.checked_mul(4)?)?;
        out.push(
            values
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        );
        bytes = rest;
    }
    bytes.is_empty().then_some(out)
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
