//! The host side of a launched group: one process per rank, meeting over TCP.
//!
//! Rank 0 listens at the launcher's rendezvous address; every other rank connects to it,
//! says which group it belongs to, and keeps the connection for the whole run. Over these
//! connections rank 0 hands out NCCL's unique id ([`Rendezvous::broadcast`]) and collects
//! the ranks' shards when a checkpoint is saved ([`Rendezvous::gather`]); the device data
//! moves through NCCL, never through here.
//!
//! A rank that never arrives, a rank of another group (a different world size, or a rank
//! already taken) and a peer that exits mid-run are errors that name the rank and the
//! address; nothing waits forever: joining has a deadline, and a closed connection is seen at
//! the next exchange.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// What a joining rank sends first: this protocol's name and version.
const HELLO: &[u8; 8] = b"castor\x00\x01";
/// How often a rank retries reaching rank 0 (which may start later) while joining.
const RETRY: Duration = Duration::from_millis(100);
/// The longest exchange after joining (rank 0 saving a checkpoint while the others wait).
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(3600);

#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    #[error("rank 0 cannot listen at {addr}: {source}")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "rank {rank} of {world} could not reach rank 0 at {addr} within {} s: {last}",
        .waited.as_secs()
    )]
    Unreachable {
        rank: usize,
        world: usize,
        addr: String,
        waited: Duration,
        last: String,
    },
    #[error(
        "rank 0 at {addr}: rank(s) {missing:?} of {world} did not join within {} s",
        .waited.as_secs()
    )]
    Missing {
        addr: String,
        world: usize,
        missing: Vec<usize>,
        waited: Duration,
    },
    #[error("rank {rank} was turned away by rank 0 at {addr}: {reason}")]
    Refused {
        rank: usize,
        addr: String,
        reason: String,
    },
    #[error("the connection {what} failed: {source} (has that rank exited?)")]
    Peer {
        /// Which connection: "to rank 0", "from rank 3".
        what: String,
        #[source]
        source: std::io::Error,
    },
}

/// One rank's place in a launched group, and where rank 0 listens.
#[derive(Clone, Debug)]
pub struct GroupAddress {
    pub rank: usize,
    pub world: usize,
    /// `host:port`.
    pub addr: String,
    /// How long joining may take: rank 0 waits this long for every peer, a peer this long for
    /// rank 0 to listen.
    pub timeout: Duration,
}

/// A joined group's connections: rank 0 holds one to every other rank (in rank order), every
/// other rank one to rank 0.
pub struct Rendezvous {
    rank: usize,
    world: usize,
    /// Rank 0: the connection from rank r at index r - 1. Others: the one to rank 0.
    links: Vec<TcpStream>,
}

impl Rendezvous {
    /// Joins the group: rank 0 listens until every other rank has arrived, the others
    /// connect to it. A group of one needs no connection.
    pub fn join(group: &GroupAddress) -> Result<Rendezvous, RendezvousError> {
        let links = match (group.world, group.rank) {
            (0 | 1, _) => Vec::new(),
            (_, 0) => accept_all(group)?,
            _ => vec![connect(group)?],
        };
        Ok(Rendezvous {
            rank: group.rank,
            world: group.world.max(1),
            links,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// Rank 0's `bytes` on every rank (the others pass `None`, or anything: it is ignored).
    pub fn broadcast(&mut self, bytes: Option<&[u8]>) -> Result<Vec<u8>, RendezvousError> {
        if self.rank == 0 {
            let bytes = bytes.unwrap_or_default();
            for (i, link) in self.links.iter_mut().enumerate() {
                send(link, bytes).map_err(|e| peer(format!("to rank {}", i + 1), e))?;
            }
            Ok(bytes.to_vec())
        } else {
            receive(&mut self.links[0]).map_err(|e| peer("to rank 0".into(), e))
        }
    }

    /// Every rank's `bytes`, in rank order, on rank 0 (`None` on the others).
    pub fn gather(&mut self, bytes: &[u8]) -> Result<Option<Vec<Vec<u8>>>, RendezvousError> {
        if self.rank == 0 {
            let mut all = vec![bytes.to_vec()];
            for (i, link) in self.links.iter_mut().enumerate() {
                all.push(receive(link).map_err(|e| peer(format!("from rank {}", i + 1), e))?);
            }
            Ok(Some(all))
        } else {
            send(&mut self.links[0], bytes).map_err(|e| peer("to rank 0".into(), e))?;
            Ok(None)
        }
    }

    /// Returns on every rank once every rank has called it.
    pub fn barrier(&mut self) -> Result<(), RendezvousError> {
        self.gather(&[])?;
        self.broadcast(Some(&[]))?;
        Ok(())
    }
}

fn peer(what: String, source: std::io::Error) -> RendezvousError {
    RendezvousError::Peer { what, source }
}

/// Rank 0: listens at the group's port on every interface until each other rank has said
/// hello, or the deadline passes.
fn accept_all(group: &GroupAddress) -> Result<Vec<TcpStream>, RendezvousError> {
    let port = group.addr.rsplit(':').next().unwrap_or_default();
    let listen_at = format!("0.0.0.0:{port}");
    let listen_err = |source| RendezvousError::Listen {
        addr: listen_at.clone(),
        source,
    };
    let listener = TcpListener::bind(&listen_at).map_err(listen_err)?;
    listener.set_nonblocking(true).map_err(listen_err)?;
    let start = Instant::now();
    let mut links: Vec<Option<TcpStream>> = (1..group.world).map(|_| None).collect();
    while links.iter().any(Option::is_none) {
        if start.elapsed() > group.timeout {
            return Err(RendezvousError::Missing {
                addr: group.addr.clone(),
                world: group.world,
                missing: (1..group.world)
                    .filter(|r| links[r - 1].is_none())
                    .collect(),
                waited: group.timeout,
            });
        }
        match listener.accept() {
            Ok((stream, _)) => {
                // A stranger (a port scan, a rank of another group) is turned away; the
                // group keeps waiting for its own ranks.
                if let Ok(rank) = admit(stream.try_clone(), group, &links) {
                    links[rank - 1] = Some(stream);
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(RETRY / 10),
            Err(e) => return Err(listen_err(e)),
        }
    }
    Ok(links.into_iter().flatten().collect())
}

/// Reads a joining rank's hello and answers it: its rank when it belongs to this group.
fn admit(
    stream: std::io::Result<TcpStream>,
    group: &GroupAddress,
    links: &[Option<TcpStream>],
) -> std::io::Result<usize> {
    let mut stream = stream?;
    stream.set_nonblocking(false)?;
    // Exchanges are small and answered at once: no waiting to coalesce them.
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let (mut magic, mut world, mut rank) = ([0u8; 8], [0u8; 8], [0u8; 8]);
    for part in [&mut magic, &mut world, &mut rank] {
        stream.read_exact(part)?;
    }
    let (world, rank) = (
        u64::from_le_bytes(world) as usize,
        u64::from_le_bytes(rank) as usize,
    );
    let refusal = if &magic != HELLO {
        Some("not a castor rank (or another version of castor)".to_string())
    } else if world != group.world {
        Some(format!(
            "it says WORLD_SIZE={world}, rank 0's group has {}",
            group.world
        ))
    } else if rank == 0 || rank >= world {
        Some(format!("rank {rank} cannot join as a peer of rank 0"))
    } else if links[rank - 1].is_some() {
        Some(format!(
            "rank {rank} has already joined (two processes with RANK={rank}?)"
        ))
    } else {
        None
    };
    match refusal {
        None => {
            send(&mut stream, &[])?;
            stream.set_read_timeout(Some(EXCHANGE_TIMEOUT))?;
            Ok(rank)
        }
        Some(reason) => {
            let _ = send(&mut stream, reason.as_bytes());
            Err(std::io::Error::new(ErrorKind::InvalidData, reason))
        }
    }
}

/// A rank other than 0: connects to rank 0 (retrying until the deadline, as rank 0 may start
/// later) and says hello.
fn connect(group: &GroupAddress) -> Result<TcpStream, RendezvousError> {
    let start = Instant::now();
    let mut last = String::from("no attempt");
    while start.elapsed() <= group.timeout {
        match try_connect(group) {
            Ok(Ok(stream)) => return Ok(stream),
            Ok(Err(reason)) => {
                return Err(RendezvousError::Refused {
                    rank: group.rank,
                    addr: group.addr.clone(),
                    reason,
                })
            }
            Err(e) => last = e.to_string(),
        }
        std::thread::sleep(RETRY);
    }
    Err(RendezvousError::Unreachable {
        rank: group.rank,
        world: group.world,
        addr: group.addr.clone(),
        waited: group.timeout,
        last,
    })
}

/// One attempt: the stream once rank 0 admits it, rank 0's refusal, or why it failed.
fn try_connect(group: &GroupAddress) -> std::io::Result<Result<TcpStream, String>> {
    let addr = group
        .addr
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| std::io::Error::new(ErrorKind::NotFound, "the name has no address"))?;
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut hello = HELLO.to_vec();
    hello.extend_from_slice(&(group.world as u64).to_le_bytes());
    hello.extend_from_slice(&(group.rank as u64).to_le_bytes());
    stream.write_all(&hello)?;
    let answer = receive(&mut stream)?;
    if !answer.is_empty() {
        return Ok(Err(String::from_utf8_lossy(&answer).into_owned()));
    }
    stream.set_read_timeout(Some(EXCHANGE_TIMEOUT))?;
    Ok(Ok(stream))
}

/// A frame: its length (u64, little-endian), then its bytes.
fn send(stream: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    let mut frame = Vec::with_capacity(8 + bytes.len());
    frame.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    frame.extend_from_slice(bytes);
    stream.write_all(&frame)?;
    stream.flush()
}

fn receive(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 8];
    stream.read_exact(&mut len)?;
    let mut bytes = vec![0u8; u64::from_le_bytes(len) as usize];
    stream.read_exact(&mut bytes)?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A port no one listens on now.
    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn address(rank: usize, world: usize, port: u16, timeout: Duration) -> GroupAddress {
        GroupAddress {
            rank,
            world,
            addr: format!("127.0.0.1:{port}"),
            timeout,
        }
    }

    #[test]
    fn ranks_share_rank_zeros_bytes_and_gather_theirs() {
        let port = free_port();
        let world = 4;
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    s.spawn(move || {
                        let mut g =
                            Rendezvous::join(&address(rank, world, port, Duration::from_secs(20)))
                                .unwrap();
                        let id = g.broadcast((rank == 0).then_some(&[7u8; 128][..])).unwrap();
                        let all = g.gather(&[rank as u8; 3]).unwrap();
                        g.barrier().unwrap();
                        (id, all)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, (id, all)) in results.into_iter().enumerate() {
            assert_eq!(id, vec![7u8; 128], "rank {rank}");
            match rank {
                0 => assert_eq!(
                    all.unwrap(),
                    (0..world as u8).map(|r| vec![r; 3]).collect::<Vec<_>>()
                ),
                _ => assert!(all.is_none()),
            }
        }
    }

    #[test]
    fn a_group_of_one_needs_no_network() {
        let mut g = Rendezvous::join(&address(0, 1, 1, Duration::ZERO)).unwrap();
        assert_eq!(g.broadcast(Some(b"id")).unwrap(), b"id");
        assert_eq!(g.gather(b"x").unwrap(), Some(vec![b"x".to_vec()]));
    }

    #[test]
    fn a_rank_zero_that_never_listens_is_named_with_its_address() {
        let port = free_port();
        let e = Rendezvous::join(&address(2, 4, port, Duration::from_millis(300)))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("rank 2 of 4 could not reach rank 0")
                && e.contains(&format!("127.0.0.1:{port}")),
            "{e}"
        );
    }

    #[test]
    fn missing_ranks_are_named_by_rank_zero() {
        let port = free_port();
        let e = std::thread::scope(|s| {
            let root = s.spawn(|| {
                Rendezvous::join(&address(0, 3, port, Duration::from_secs(2)))
                    .err()
                    .unwrap()
            });
            // Rank 1 arrives; rank 2 never does.
            let _one = Rendezvous::join(&address(1, 3, port, Duration::from_secs(2))).unwrap();
            root.join().unwrap().to_string()
        });
        assert!(e.contains("rank(s) [2] of 3 did not join"), "{e}");
    }

    #[test]
    fn a_rank_of_another_group_is_turned_away() {
        let port = free_port();
        std::thread::scope(|s| {
            let root = s.spawn(|| {
                Rendezvous::join(&address(0, 2, port, Duration::from_secs(2)))
                    .err()
                    .unwrap()
                    .to_string()
            });
            let stranger = Rendezvous::join(&address(1, 3, port, Duration::from_secs(2)))
                .err()
                .unwrap()
                .to_string();
            assert!(
                stranger.contains("turned away") && stranger.contains("WORLD_SIZE=3"),
                "{stranger}"
            );
            let root = root.join().unwrap();
            assert!(root.contains("rank(s) [1] of 2 did not join"), "{root}");
        });
    }

    #[test]
    fn a_peer_that_exits_is_an_error_at_the_next_exchange() {
        let port = free_port();
        std::thread::scope(|s| {
            let root = s.spawn(|| {
                let mut g =
                    Rendezvous::join(&address(0, 2, port, Duration::from_secs(10))).unwrap();
                g.gather(b"mine").err().unwrap().to_string()
            });
            let one = Rendezvous::join(&address(1, 2, port, Duration::from_secs(10))).unwrap();
            drop(one);
            let e = root.join().unwrap();
            assert!(e.contains("from rank 1") && e.contains("exited"), "{e}");
        });
    }
}
