//! What a distributed launcher (torchrun, or any that sets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`) says about this process, and joining its group.
//!
//! A launched group trains one data-parallel plan with one process per rank: the process is
//! the plan's rank `RANK` of `WORLD_SIZE`. On GPUs (`--device cuda`) it runs on GPU
//! `LOCAL_RANK` with NCCL; on the CPU its collectives go over TCP to the other processes
//! (slow, but the same arithmetic: how the launched path is tested without GPUs). The ranks
//! meet at the rendezvous address ([`Launch::rendezvous`]), where rank 0 also hands out
//! NCCL's unique id.

use crate::CliError;
use castor_runtime::cuda::nccl::{self, NcclRank, UNIQUE_ID_BYTES};
use castor_runtime::rendezvous::{GroupAddress, Rendezvous};
use castor_runtime::ExecutorKind;
use std::time::Duration;

/// Overrides the rendezvous port (default: `MASTER_PORT`, or the port after it under
/// torchrun, whose agent holds `MASTER_PORT` for its own store).
pub const PORT_VAR: &str = "CASTOR_RENDEZVOUS_PORT";
/// How long joining may take, in seconds (default 300).
pub const TIMEOUT_VAR: &str = "CASTOR_RENDEZVOUS_TIMEOUT";

/// One process's place in a launched group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    /// `MASTER_ADDR:MASTER_PORT`, the launcher's own rendezvous.
    pub master: String,
    /// `host:port` where rank 0 listens for the other ranks (see [`PORT_VAR`]).
    pub rendezvous: String,
    /// How long joining the group may take.
    pub timeout: Duration,
}

/// The launch the environment describes, read through `var`; none when no launcher set
/// `WORLD_SIZE` (a plain `castor train`). A variable that is set but malformed, a rank out of
/// range or a missing rendezvous address is an error naming the variable.
pub fn from_env(var: &dyn Fn(&str) -> Option<String>) -> Result<Option<Launch>, CliError> {
    let Some(world) = var("WORLD_SIZE") else {
        return Ok(None);
    };
    let number = |name: &str, text: &str| {
        text.trim().parse::<usize>().map_err(|_| {
            CliError::InvalidInput(format!(
                "the launcher's {name}={text:?} is not a non-negative integer"
            ))
        })
    };
    let world_size = number("WORLD_SIZE", &world)?;
    if world_size == 0 {
        return Err(CliError::InvalidInput(
            "the launcher's WORLD_SIZE=0: a group has at least one rank".into(),
        ));
    }
    let get = |name: &str| {
        var(name).ok_or_else(|| {
            CliError::InvalidInput(format!(
                "the launcher set WORLD_SIZE={world} but not {name}"
            ))
        })
    };
    let rank = number("RANK", &get("RANK")?)?;
    if rank >= world_size {
        return Err(CliError::InvalidInput(format!(
            "the launcher's RANK={rank} is outside WORLD_SIZE={world_size}"
        )));
    }
    let local_rank = match var("LOCAL_RANK") {
        Some(v) => number("LOCAL_RANK", &v)?,
        None => rank,
    };
    let port_of = |name: &str, text: &str| match text.trim().parse::<u16>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(CliError::InvalidInput(format!(
            "the launcher's {name}={text:?} is not a TCP port"
        ))),
    };
    let (master, rendezvous) = if world_size > 1 {
        let addr = get("MASTER_ADDR")?;
        let port = port_of("MASTER_PORT", &get("MASTER_PORT")?)?;
        let ours = match var(PORT_VAR) {
            Some(p) => port_of(PORT_VAR, &p)?,
            // torchrun's agent serves its store at MASTER_PORT and tells the workers so.
            None if var("TORCHELASTIC_USE_AGENT_STORE").as_deref() == Some("True") => {
                port.checked_add(1).ok_or_else(|| {
                    CliError::InvalidInput(format!(
                        "MASTER_PORT={port} leaves no port after it for castor's rendezvous: \
                         set {PORT_VAR}"
                    ))
                })?
            }
            None => port,
        };
        (format!("{addr}:{port}"), format!("{addr}:{ours}"))
    } else {
        (String::new(), String::new())
    };
    let timeout = match var(TIMEOUT_VAR) {
        Some(t) => Duration::from_secs(number(TIMEOUT_VAR, &t)? as u64),
        None => Duration::from_secs(300),
    };
    Ok(Some(Launch {
        rank,
        world_size,
        local_rank,
        master,
        rendezvous,
        timeout,
    }))
}

impl Launch {
    /// Whether this process is one of several.
    pub fn is_group(&self) -> bool {
        self.world_size > 1
    }

    /// Refuses a group launched on the emulator, which runs one program alone.
    pub fn check_device(&self, device: ExecutorKind) -> Result<(), CliError> {
        if !self.is_group() || !matches!(device, ExecutorKind::Emulate) {
            return Ok(());
        }
        Err(CliError::DeviceUnavailable(format!(
            "started as rank {} of {} by a launcher (WORLD_SIZE, RANK, rendezvous {}): a \
             launched group runs on GPUs with NCCL (--device cuda) or on the CPU (--device \
             cpu); the emulator runs one program alone",
            self.rank, self.world_size, self.master
        )))
    }

    /// The plan's world size: the launcher's, which `--world-size` may repeat but not
    /// contradict.
    pub fn world_size(&self, given: usize) -> Result<usize, CliError> {
        match given {
            1 => Ok(self.world_size),
            n if n == self.world_size => Ok(n),
            n => Err(CliError::InvalidInput(format!(
                "--world-size {n}, but the launcher started {} ranks (WORLD_SIZE): leave \
                 --world-size out under a launcher",
                self.world_size
            ))),
        }
    }

    /// Joins the group: the ranks meet at the rendezvous address.
    pub fn join(&self) -> anyhow::Result<Rendezvous> {
        Ok(Rendezvous::join(&GroupAddress {
            rank: self.rank,
            world: self.world_size,
            addr: self.rendezvous.clone(),
            timeout: self.timeout,
        })?)
    }

    /// This rank's NCCL rank: rank 0 shares NCCL's unique id over the joined `group` (or,
    /// when NCCL will not start there, why, so every rank stops with it).
    pub fn nccl_rank(&self, group: &mut Rendezvous) -> anyhow::Result<NcclRank> {
        let mine = (self.rank == 0).then(|| match nccl::unique_id() {
            Ok(id) => [&[0u8][..], &id].concat(),
            Err(e) => [&[1u8][..], e.to_string().as_bytes()].concat(),
        });
        let got = group.broadcast(mine.as_deref())?;
        let id: [u8; UNIQUE_ID_BYTES] = match got.split_first() {
            Some((0, id)) => id.try_into().map_err(|_| {
                CliError::DeviceUnavailable(format!(
                    "rank 0 sent an NCCL id of {} bytes, not {UNIQUE_ID_BYTES}",
                    id.len()
                ))
            })?,
            Some((_, why)) => {
                return Err(CliError::DeviceUnavailable(format!(
                    "rank 0 could not start NCCL: {}",
                    String::from_utf8_lossy(why)
                ))
                .into())
            }
            None => return Err(CliError::DeviceUnavailable("rank 0 sent no NCCL id".into()).into()),
        };
        Ok(NcclRank {
            rank: self.rank,
            world: self.world_size,
            local_rank: self.local_rank,
            id,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    const TORCHRUN: [(&str, &str); 6] = [
        ("WORLD_SIZE", "8"),
        ("RANK", "3"),
        ("LOCAL_RANK", "3"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "29500"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
    ];

    #[test]
    fn no_launcher_is_a_plain_run() {
        assert_eq!(from_env(&env(&[])).unwrap(), None);
    }

    #[test]
    fn torchruns_variables_are_read() {
        let launch = from_env(&env(&TORCHRUN)).unwrap().unwrap();
        assert_eq!(
            launch,
            Launch {
                rank: 3,
                world_size: 8,
                local_rank: 3,
                master: "10.0.0.1:29500".into(),
                // torchrun's agent holds MASTER_PORT for its store: castor takes the next.
                rendezvous: "10.0.0.1:29501".into(),
                timeout: Duration::from_secs(300),
            }
        );
        assert!(launch.is_group());
        // Another launcher's MASTER_PORT is free for castor; CASTOR_RENDEZVOUS_PORT and
        // CASTOR_RENDEZVOUS_TIMEOUT override.
        let plain = from_env(&env(&TORCHRUN[..5])).unwrap().unwrap();
        assert_eq!(plain.rendezvous, "10.0.0.1:29500");
        let mut vars = TORCHRUN.to_vec();
        vars.extend([(PORT_VAR, "31000"), (TIMEOUT_VAR, "20")]);
        let set = from_env(&env(&vars)).unwrap().unwrap();
        assert_eq!(
            (set.rendezvous.as_str(), set.timeout),
            ("10.0.0.1:31000", Duration::from_secs(20))
        );
        // LOCAL_RANK defaults to RANK; one process launched alone is an ordinary run.
        let one = from_env(&env(&[("WORLD_SIZE", "1"), ("RANK", "0")]))
            .unwrap()
            .unwrap();
        assert!(!one.is_group());
        assert!(one.check_device(ExecutorKind::Cpu).is_ok());
    }

    #[test]
    fn a_launched_group_runs_on_gpus_or_the_cpu() {
        let launch = from_env(&env(&TORCHRUN)).unwrap().unwrap();
        let e = launch
            .check_device(ExecutorKind::Emulate)
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 3 of 8") && e.contains("emulator"), "{e}");
        assert!(launch.check_device(ExecutorKind::Cuda).is_ok());
        assert!(launch.check_device(ExecutorKind::Cpu).is_ok());
    }

    #[test]
    fn the_launchers_world_size_is_the_plans() {
        let launch = from_env(&env(&TORCHRUN)).unwrap().unwrap();
        assert_eq!(launch.world_size(1).unwrap(), 8);
        assert_eq!(launch.world_size(8).unwrap(), 8);
        let e = launch.world_size(4).unwrap_err().to_string();
        assert!(e.contains("--world-size 4") && e.contains("8 ranks"), "{e}");
    }

    #[test]
    fn malformed_launches_name_the_variable() {
        let group = |extra: (&'static str, &'static str)| {
            let mut v = TORCHRUN.to_vec();
            v.push(extra);
            v
        };
        for (vars, words) in [
            (vec![("WORLD_SIZE", "eight")], "WORLD_SIZE=\"eight\""),
            (vec![("WORLD_SIZE", "0")], "WORLD_SIZE=0"),
            (vec![("WORLD_SIZE", "2")], "not RANK"),
            (
                vec![("WORLD_SIZE", "2"), ("RANK", "2")],
                "RANK=2 is outside",
            ),
            (
                vec![("WORLD_SIZE", "2"), ("RANK", "1"), ("MASTER_ADDR", "h")],
                "not MASTER_PORT",
            ),
            (
                vec![
                    ("WORLD_SIZE", "2"),
                    ("RANK", "1"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "99999"),
                ],
                "MASTER_PORT=\"99999\" is not a TCP port",
            ),
            (group((PORT_VAR, "x")), "CASTOR_RENDEZVOUS_PORT=\"x\""),
            (
                group((TIMEOUT_VAR, "soon")),
                "CASTOR_RENDEZVOUS_TIMEOUT=\"soon\"",
            ),
        ] {
            let e = from_env(&env(&vars)).unwrap_err().to_string();
            assert!(e.contains(words), "{vars:?}: {e}");
        }
    }

    /// Two ranks join on this machine: they share rank 0's NCCL id, or, where NCCL is not
    /// installed, both stop with rank 0's reason.
    #[test]
    fn ranks_join_and_share_rank_zeros_nccl_id_or_its_failure() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
            .to_string();
        let results: Vec<Result<[u8; UNIQUE_ID_BYTES], String>> = std::thread::scope(|s| {
            let handles: Vec<_> = ["0", "1"]
                .into_iter()
                .map(|rank| {
                    let port = port.clone();
                    s.spawn(move || {
                        let launch = from_env(&env(&[
                            ("WORLD_SIZE", "2"),
                            ("RANK", rank),
                            ("MASTER_ADDR", "127.0.0.1"),
                            ("MASTER_PORT", &port),
                            (TIMEOUT_VAR, "20"),
                        ]))
                        .unwrap()
                        .unwrap();
                        let mut group = launch.join().map_err(|e| e.to_string())?;
                        launch
                            .nccl_rank(&mut group)
                            .map(|r| r.id)
                            .map_err(|e| e.to_string())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        match &results[..] {
            [Ok(a), Ok(b)] => assert_eq!(a, b),
            [Err(a), Err(b)] => {
                for e in [a, b] {
                    assert!(
                        e.contains("rank 0 could not start NCCL") && e.contains("libnccl"),
                        "{e}"
                    );
                }
            }
            other => panic!("the ranks disagree: {other:?}"),
        }
    }
}
