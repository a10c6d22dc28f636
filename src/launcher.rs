//! What a distributed launcher (torchrun, or any that sets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`) says about this process.
//!
//! castor does not drive NCCL yet, so a process started as one rank of several must not train
//! as if it were alone: each would run the whole single-GPU job on the same data, and their
//! checkpoints would overwrite each other. `castor train` reads the launcher's variables,
//! checks them, and refuses such a launch with what to do instead.

use crate::CliError;

/// One process's place in a launched group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    /// `MASTER_ADDR:MASTER_PORT`, where rank 0 would share the NCCL unique id.
    pub master: String,
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
    let master = if world_size > 1 {
        let addr = get("MASTER_ADDR")?;
        let port = get("MASTER_PORT")?;
        match port.trim().parse::<u16>() {
            Ok(p) if p > 0 => format!("{addr}:{p}"),
            _ => {
                return Err(CliError::InvalidInput(format!(
                    "the launcher's MASTER_PORT={port:?} is not a TCP port"
                )))
            }
        }
    } else {
        String::new()
    };
    Ok(Some(Launch {
        rank,
        world_size,
        local_rank,
        master,
    }))
}

/// Refuses a launch of several processes, which castor cannot serve yet; a launch of one is
/// an ordinary run.
pub fn refuse_multi_process(launch: Option<&Launch>) -> Result<(), CliError> {
    match launch {
        Some(l) if l.world_size > 1 => Err(CliError::DeviceUnavailable(format!(
            "started as rank {} of {} by a launcher (WORLD_SIZE, RANK, rendezvous {}): castor does \
             not drive NCCL yet, so its ranks cannot run as separate processes; run one process \
             with --world-size {} --device cpu (CPU ranks), or plan the GPUs' memory and time \
             with `castor compile --train --world-size {}`",
            l.rank, l.world_size, l.master, l.world_size, l.world_size
        ))),
        _ => Ok(()),
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

    #[test]
    fn no_launcher_is_a_plain_run() {
        assert_eq!(from_env(&env(&[])).unwrap(), None);
        assert!(refuse_multi_process(None).is_ok());
    }

    #[test]
    fn torchruns_variables_are_read_and_a_group_is_refused() {
        let launch = from_env(&env(&[
            ("WORLD_SIZE", "8"),
            ("RANK", "3"),
            ("LOCAL_RANK", "3"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            launch,
            Launch {
                rank: 3,
                world_size: 8,
                local_rank: 3,
                master: "10.0.0.1:29500".into()
            }
        );
        let e = refuse_multi_process(Some(&launch)).unwrap_err().to_string();
        assert!(
            e.contains("rank 3 of 8") && e.contains("--world-size 8 --device cpu"),
            "{e}"
        );
        // One process launched alone trains as usual.
        let one = from_env(&env(&[("WORLD_SIZE", "1"), ("RANK", "0")])).unwrap();
        assert!(refuse_multi_process(one.as_ref()).is_ok());
    }

    #[test]
    fn malformed_launches_name_the_variable() {
        for (vars, words) in [
            (&[("WORLD_SIZE", "eight")][..], "WORLD_SIZE=\"eight\""),
            (&[("WORLD_SIZE", "0")][..], "WORLD_SIZE=0"),
            (&[("WORLD_SIZE", "2")][..], "not RANK"),
            (
                &[("WORLD_SIZE", "2"), ("RANK", "2")][..],
                "RANK=2 is outside",
            ),
            (
                &[("WORLD_SIZE", "2"), ("RANK", "1"), ("MASTER_ADDR", "h")][..],
                "not MASTER_PORT",
            ),
            (
                &[
                    ("WORLD_SIZE", "2"),
                    ("RANK", "1"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "99999"),
                ][..],
                "MASTER_PORT=\"99999\" is not a TCP port",
            ),
        ] {
            let e = from_env(&env(vars)).unwrap_err().to_string();
            assert!(e.contains(words), "{vars:?}: {e}");
        }
    }
}
