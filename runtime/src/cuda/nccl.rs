//! NCCL, through cudarc's bindings: one rank's communicator, and each collective command of
//! a data-parallel program as the NCCL calls that perform it.
//!
//! The IR's collectives work on flat shards of `ceil(n / world)` elements, the last padded
//! with zeros; NCCL's reduce-scatter and all-gather need `n` divisible by the world size. An
//! even split is one NCCL call; an uneven one is a group of per-rank calls (a reduce into
//! each rank's shard, or a broadcast from each rank's shard) over the real elements, with the
//! padding zeroed, as PyTorch does for uneven shards. [`call_for`] decides which, and is
//! plain arithmetic the tests check without a GPU.
//!
//! cudarc's bindings load the library as `libnccl.so` (or `libnccl.so.13`, after the CUDA
//! version) and abort the process when it is missing, so [`probe`] looks first; NCCL's own
//! packages install `libnccl.so.2`, which [`probe`] recognizes to say what to link.

use super::device::CudaError;
use castor_ir::{CollectiveOp, DType, Op};
use cudarc::driver::sys as cu_sys;
use cudarc::nccl::{result as nccl, sys};

/// The size of NCCL's unique id, which rank 0 makes and every rank needs.
pub const UNIQUE_ID_BYTES: usize = 128;

/// Whether cudarc's bindings can load NCCL, or why not.
pub fn probe() -> Result<(), CudaError> {
    // SAFETY: only tries to open the library; no symbol is called.
    if unsafe { sys::is_culib_present() } {
        return Ok(());
    }
    // SAFETY: as above.
    let versioned = unsafe { libloading::Library::new("libnccl.so.2") }.is_ok();
    Err(CudaError::NoNccl(if versioned {
        "libnccl.so.2 loads, but the CUDA bindings open NCCL as `libnccl.so`: add the link \
         (`ln -s libnccl.so.2 libnccl.so` in its lib folder, e.g. the `nvidia/nccl/lib` folder \
         of `pip install nvidia-nccl-cu13`) and keep that folder on LD_LIBRARY_PATH"
            .into()
    } else {
        "libnccl.so was not found: install NCCL (`pip install nvidia-nccl-cu13`, or the \
         libnccl2 and libnccl-dev packages) and put its lib folder on LD_LIBRARY_PATH"
            .into()
    }))
}

/// A fresh unique id (rank 0's, to share with the others before [`Communicator::init`]).
pub fn unique_id() -> Result<[u8; UNIQUE_ID_BYTES], CudaError> {
    probe()?;
    let id = nccl::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", e))?;
    Ok(id.internal.map(|c| c as u8))
}

fn nccl_error(call: &str, e: nccl::NcclError) -> CudaError {
    CudaError::Nccl(format!("{call} returned {:?}", e.0))
}

/// Where one process of a launched group runs: its rank, the group's size, the GPU it uses
/// (its local rank on the machine) and the group's NCCL unique id.
#[derive(Clone, Debug)]
pub struct NcclRank {
    pub rank: usize,
    pub world: usize,
    pub local_rank: usize,
    pub id: [u8; UNIQUE_ID_BYTES],
}

/// A contiguous run of elements that one rank roots: `count` elements from element `offset`
/// of the whole value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub root: usize,
    pub offset: usize,
    pub count: usize,
}

/// The NCCL work of one collective command, in elements.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NcclCall {
    /// `ncclAllReduce` of `count` elements, summed or averaged.
    AllReduce { count: usize, average: bool },
    /// `ncclReduceScatter`: `count` elements to each rank (an even split).
    ReduceScatter { count: usize, average: bool },
    /// `ncclAllGather`: `count` elements from each rank (an even split).
    AllGather { count: usize },
    /// An uneven reduce-scatter: the destination (`shard` elements) zeroed, then in one group
    /// an `ncclReduce` of each piece to its root's destination.
    Reduces {
        pieces: Vec<Piece>,
        shard: usize,
        average: bool,
    },
    /// An uneven all-gather: in one group an `ncclBroadcast` of each rank's piece (from its
    /// shard's start) to its place in every rank's destination.
    Broadcasts { pieces: Vec<Piece> },
    /// This rank's own shard (`shard`): a device copy of `piece`, the rest zeroed. No
    /// communication.
    LocalShard { piece: Piece, shard: usize },
}

/// Splits `n` elements into `world` shards of `ceil(n / world)`: each rank's real elements.
fn pieces(n: usize, world: usize) -> Vec<Piece> {
    let shard = n.div_ceil(world.max(1));
    (0..world)
        .map(|root| {
            let offset = (root * shard).min(n);
            Piece {
                root,
                offset,
                count: shard.min(n - offset),
            }
        })
        .collect()
}

/// The NCCL work of collective `op` on rank `rank`, reading `src` elements and writing `dst`.
pub fn call_for(op: &Op, src: usize, dst: usize, rank: usize) -> Result<NcclCall, String> {
    let world = match op {
        Op::AllReduce { world, .. }
        | Op::ReduceScatter { world, .. }
        | Op::AllGather { world, .. }
        | Op::Shard { world } => *world,
        other => return Err(format!("`{}` is not a collective", other.mnemonic())),
    };
    if rank >= world {
        return Err(format!("rank {rank} in a group of {world}"));
    }
    let sizes = |whole: usize, shard: usize| -> Result<(), String> {
        match whole.div_ceil(world) == shard {
            true => Ok(()),
            false => Err(format!(
                "{whole} elements do not make shards of {shard} on {world} ranks"
            )),
        }
    };
    Ok(match op {
        Op::AllReduce { reduce, .. } => {
            if src != dst {
                return Err(format!("an all-reduce of {src} elements into {dst}"));
            }
            NcclCall::AllReduce {
                count: src,
                average: *reduce == CollectiveOp::Mean,
            }
        }
        Op::ReduceScatter { average, .. } => {
            sizes(src, dst)?;
            match src % world {
                0 => NcclCall::ReduceScatter {
                    count: dst,
                    average: *average,
                },
                _ => NcclCall::Reduces {
                    pieces: pieces(src, world)
                        .into_iter()
                        .filter(|p| p.count > 0)
                        .collect(),
                    shard: dst,
                    average: *average,
                },
            }
        }
        Op::AllGather { .. } => {
            sizes(dst, src)?;
            match dst % world {
                0 => NcclCall::AllGather { count: src },
                _ => NcclCall::Broadcasts {
                    pieces: pieces(dst, world)
                        .into_iter()
                        .filter(|p| p.count > 0)
                        .collect(),
                },
            }
        }
        _ => {
            sizes(src, dst)?;
            NcclCall::LocalShard {
                piece: pieces(src, world)[rank],
                shard: dst,
            }
        }
    })
}

fn nccl_type(dtype: DType) -> Result<sys::ncclDataType_t, CudaError> {
    Ok(match dtype {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        other => {
            return Err(CudaError::Unsupported(format!(
                "a collective of {other} values (NCCL runs F32, F16 and BF16 ones here)"
            )))
        }
    })
}

/// One rank's NCCL communicator, bound to the device that was current at [`Self::init`].
pub struct Communicator {
    comm: sys::ncclComm_t,
    rank: usize,
    world: usize,
}

impl Communicator {
    /// Joins the group of `world` ranks that `id` names, as `rank`, on the current device.
    /// Blocks until every rank has called it.
    pub fn init(id: &[u8; UNIQUE_ID_BYTES], rank: usize, world: usize) -> Result<Self, CudaError> {
        probe()?;
        let id = sys::ncclUniqueId {
            internal: id.map(|b| b as ::core::ffi::c_char),
        };
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; the rank and count are checked by NCCL.
        unsafe { nccl::comm_init_rank(&mut comm, world as i32, id, rank as i32) }
            .map_err(|e| nccl_error(&format!("ncclCommInitRank (rank {rank} of {world})"), e))?;
        Ok(Communicator { comm, rank, world })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// Issues collective `op` of `dtype` values on `stream`: `src_bytes` at `src`, `dst_bytes`
    /// written at `dst`.
    ///
    /// # Safety
    /// `src` and `dst` must span their byte counts of live device memory of the
    /// communicator's device, and `stream` must belong to its context.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn issue(
        &self,
        op: &Op,
        dtype: DType,
        src: u64,
        src_bytes: u64,
        dst: u64,
        dst_bytes: u64,
        stream: cu_sys::CUstream,
    ) -> Result<(), CudaError> {
        let size = dtype.size_bytes() as u64;
        let elems = |bytes: u64| (bytes / size) as usize;
        let call = call_for(op, elems(src_bytes), elems(dst_bytes), self.rank)
            .map_err(|m| CudaError::Data(format!("`{}`: {m}", op.mnemonic())))?;
        let ty = nccl_type(dtype)?;
        let s = stream as sys::cudaStream_t;
        let at = |base: u64, elem: usize| (base + elem as u64 * size) as *mut std::ffi::c_void;
        let op_of = |average: bool| match average {
            true => sys::ncclRedOp_t::ncclAvg,
            false => sys::ncclRedOp_t::ncclSum,
        };
        let check = |r: Result<nccl::NcclStatus, nccl::NcclError>, call: &str| {
            r.map(|_| ()).map_err(|e| nccl_error(call, e))
        };
        let zero = |base: u64, from: usize, to: usize| -> Result<(), CudaError> {
            if to <= from {
                return Ok(());
            }
            let bytes = (to - from) * size as usize;
            cudarc::driver::result::memset_d8_async(at(base, from) as u64, 0, bytes, stream)
                .map_err(|source| CudaError::Driver {
                    what: format!("cuMemsetD8Async of a shard's padding ({bytes} bytes)"),
                    source,
                })
        };
        match call {
            NcclCall::AllReduce { count, average } => check(
                nccl::all_reduce(
                    at(src, 0),
                    at(dst, 0),
                    count,
                    ty,
                    op_of(average),
                    self.comm,
                    s,
                ),
                "ncclAllReduce",
            ),
            NcclCall::ReduceScatter { count, average } => check(
                nccl::reduce_scatter(
                    at(src, 0),
                    at(dst, 0),
                    count,
                    ty,
                    op_of(average),
                    self.comm,
                    s,
                ),
                "ncclReduceScatter",
            ),
            NcclCall::AllGather { count } => check(
                nccl::all_gather(at(src, 0), at(dst, 0), count, ty, self.comm, s),
                "ncclAllGather",
            ),
            NcclCall::Reduces {
                pieces,
                shard,
                average,
            } => {
                zero(dst, 0, shard)?;
                check(nccl::group_start(), "ncclGroupStart")?;
                for p in &pieces {
                    check(
                        nccl::reduce(
                            at(src, p.offset),
                            at(dst, 0),
                            p.count,
                            ty,
                            op_of(average),
                            p.root as i32,
                            self.comm,
                            s,
                        ),
                        "ncclReduce",
                    )?;
                }
                check(nccl::group_end(), "ncclGroupEnd")
            }
            NcclCall::Broadcasts { pieces } => {
                check(nccl::group_start(), "ncclGroupStart")?;
                for p in &pieces {
                    check(
                        nccl::broadcast(
                            at(src, 0),
                            at(dst, p.offset),
                            p.count,
                            ty,
                            p.root as i32,
                            self.comm,
                            s,
                        ),
                        "ncclBroadcast",
                    )?;
                }
                check(nccl::group_end(), "ncclGroupEnd")
            }
            NcclCall::LocalShard { piece, shard } => {
                if piece.count > 0 {
                    let bytes = piece.count * size as usize;
                    cudarc::driver::result::memcpy_dtod_async(
                        dst,
                        at(src, piece.offset) as u64,
                        bytes,
                        stream,
                    )
                    .map_err(|source| CudaError::Driver {
                        what: format!("cuMemcpyDtoDAsync of rank {}'s shard", self.rank),
                        source,
                    })?;
                }
                zero(dst, piece.count, shard)
            }
        }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // SAFETY: the communicator is live and dropped once. Destroy waits for its pending
        // work; on error there is nothing more to do at drop.
        let _ = unsafe { nccl::comm_destroy(self.comm) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reduce_scatter(world: usize) -> Op {
        Op::ReduceScatter {
            world,
            average: true,
        }
    }

    #[test]
    fn an_even_split_is_one_nccl_call() {
        assert_eq!(
            call_for(&reduce_scatter(4), 4096, 1024, 2).unwrap(),
            NcclCall::ReduceScatter {
                count: 1024,
                average: true
            }
        );
        let gather = Op::AllGather {
            world: 4,
            shape: vec![64, 64],
        };
        assert_eq!(
            call_for(&gather, 1024, 4096, 0).unwrap(),
            NcclCall::AllGather { count: 1024 }
        );
        let mean = Op::AllReduce {
            reduce: CollectiveOp::Mean,
            world: 8,
        };
        assert_eq!(
            call_for(&mean, 10, 10, 7).unwrap(),
            NcclCall::AllReduce {
                count: 10,
                average: true
            }
        );
    }

    /// 10 elements on 4 ranks: shards of 3, the last holding one real element and two zeros
    /// (the IR's `shard` layout).
    #[test]
    fn an_uneven_split_is_grouped_per_rank_calls_over_the_real_elements() {
        let want = vec![
            Piece {
                root: 0,
                offset: 0,
                count: 3,
            },
            Piece {
                root: 1,
                offset: 3,
                count: 3,
            },
            Piece {
                root: 2,
                offset: 6,
                count: 3,
            },
            Piece {
                root: 3,
                offset: 9,
                count: 1,
            },
        ];
        assert_eq!(
            call_for(&reduce_scatter(4), 10, 3, 1).unwrap(),
            NcclCall::Reduces {
                pieces: want.clone(),
                shard: 3,
                average: true
            }
        );
        let gather = Op::AllGather {
            world: 4,
            shape: vec![10],
        };
        assert_eq!(
            call_for(&gather, 3, 10, 3).unwrap(),
            NcclCall::Broadcasts { pieces: want }
        );
        // 5 elements on 4 ranks: shards of 2, rank 3 holds only padding and roots nothing.
        match call_for(&reduce_scatter(4), 5, 2, 0).unwrap() {
            NcclCall::Reduces { pieces, .. } => {
                assert_eq!(
                    pieces.iter().map(|p| p.count).collect::<Vec<_>>(),
                    [2, 2, 1]
                )
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_local_shard_copies_this_ranks_piece() {
        let shard = Op::Shard { world: 4 };
        assert_eq!(
            call_for(&shard, 10, 3, 3).unwrap(),
            NcclCall::LocalShard {
                piece: Piece {
                    root: 3,
                    offset: 9,
                    count: 1
                },
                shard: 3
            }
        );
    }

    #[test]
    fn inconsistent_sizes_are_refused() {
        assert!(call_for(&reduce_scatter(4), 10, 2, 0)
            .unwrap_err()
            .contains("do not make shards of 2"));
        assert!(call_for(&reduce_scatter(2), 4, 2, 2)
            .unwrap_err()
            .contains("rank 2 in a group of 2"));
        let sum = Op::AllReduce {
            reduce: CollectiveOp::Sum,
            world: 2,
        };
        assert!(call_for(&sum, 4, 2, 0).is_err());
        assert!(call_for(&Op::Param, 4, 4, 0).is_err());
    }

    /// Without NCCL installed, the probe says what to install rather than letting the
    /// bindings abort the process; with it, a unique id is 128 bytes.
    #[test]
    fn a_missing_nccl_is_a_clear_error() {
        match probe() {
            Ok(()) => assert_eq!(unique_id().map(|id| id.len()).ok(), Some(UNIQUE_ID_BYTES)),
            Err(e) => {
                let e = e.to_string();
                assert!(e.contains("NCCL") && e.contains("libnccl"), "{e}");
                assert!(unique_id().is_err());
            }
        }
    }
}
