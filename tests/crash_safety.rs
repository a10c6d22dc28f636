//! Checkpoints survive a killed process: `castor train --save-every 1` is killed (SIGKILL) at
//! pseudo-random points, each time resuming from where the last run got to. After every kill,
//! every visible step folder is a complete checkpoint that loads, and no progress is lost.
//! Ctrl-C finishes the step, saves and exits with 130.

use crate::common;

use castor_models::{Model, SafetensorsFile};
use common::*;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A fixed-seed generator for the kill delays (SplitMix64).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) % n
    }
}

fn step_folders(root: &Path) -> Vec<(u64, PathBuf)> {
    let mut v: Vec<(u64, PathBuf)> = std::fs::read_dir(root)
        .map(|r| {
            r.filter_map(Result::ok)
                .filter_map(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    let step = name.strip_prefix("step-")?.parse().ok()?;
                    Some((step, e.path()))
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Loads everything a resumed run reads; returns the checkpoint's step.
fn check_checkpoint(dir: &Path) -> u64 {
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("trainer_state.json"))
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display())),
    )
    .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let model = Model::load(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let params = model.load_params().unwrap();
    assert!(!params.is_empty());
    let opt = SafetensorsFile::open(dir.join("optimizer.safetensors")).unwrap();
    for name in opt.names() {
        opt.read_f32(name).unwrap();
    }
    state["step"].as_u64().unwrap()
}

fn train_args(save: &Path, resume: bool) -> Vec<String> {
    let mut v: Vec<String> = [
        "train",
        path_str(&root().join("assets").join("tiny-gpt2.json")),
        "--data",
        path_str(&root().join("assets").join("corpus.txt")),
        "--steps",
        "100000",
        "--batch",
        "2",
        "--seq",
        "8",
        "--save-every",
        "1",
        "--keep",
        "3",
        "--save",
        path_str(save),
        "--print-every",
        "1",
        "--device",
        "cpu",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if resume {
        v.push("--resume".into());
        v.push(path_str(save).into());
    }
    v
}

#[test]
fn killed_runs_leave_only_complete_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let save = tmp.path().join("run");
    let mut rng = Rng(0x00c0_ffee);
    let (mut best, mut count) = (0u64, 0usize);
    let start = Instant::now();
    let trials = 30;
    for trial in 0..trials {
        let mut child = Command::new(env!("CARGO_BIN_EXE_castor"))
            .args(train_args(&save, best > 0))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(100 + rng.below(400)));
        child.kill().unwrap();
        child.wait().unwrap();

        let folders = step_folders(&save);
        for (step, dir) in &folders {
            assert_eq!(
                check_checkpoint(dir),
                *step,
                "trial {trial}: {}",
                dir.display()
            );
        }
        let latest = folders.last().map_or(0, |f| f.0);
        assert!(
            latest >= best,
            "trial {trial}: the newest checkpoint went back from step {best} to {latest}"
        );
        assert!(
            folders.len() >= count.min(3),
            "trial {trial}: {} step folders, {count} before",
            folders.len()
        );
        assert!(
            folders.len() <= 4,
            "trial {trial}: --keep 3 kept {}",
            folders.len()
        );
        best = latest;
        count = folders.len();
    }
    assert!(best >= 10, "the runs made little progress: step {best}");
    println!(
        "{trials} kills in {:.1} s; training reached step {best}",
        start.elapsed().as_secs_f64()
    );
    // The newest checkpoint resumes, for one more step (--steps is the total).
    let mut args = train_args(&save, true);
    let i = args.iter().position(|a| a == "100000").unwrap();
    args[i] = (best + 1).to_string();
    let o = Command::new(env!("CARGO_BIN_EXE_castor"))
        .args(&args)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(check_checkpoint(&save), best + 1);
}

#[test]
fn ctrl_c_finishes_the_step_saves_and_exits_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let save = tmp.path().join("run");
    let mut args = train_args(&save, false);
    let i = args.iter().position(|a| a == "--save-every").unwrap();
    args[i + 1] = "1000".into();
    let mut child = Command::new(env!("CARGO_BIN_EXE_castor"))
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // Wait for a few steps.
    let mut seen = 0;
    for line in lines.by_ref() {
        if line.unwrap().starts_with("step ") {
            seen += 1;
            if seen == 3 {
                break;
            }
        }
    }
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let rest: Vec<String> = lines.map(Result::unwrap).collect();
    let exit = child.wait().unwrap();
    // As a shell reports SIGINT, so a script tells an interrupted run from a finished one.
    assert_eq!(exit.code(), Some(130), "{exit:?}: {rest:?}");
    let message = rest
        .iter()
        .find(|l| l.starts_with("interrupted after step"))
        .unwrap_or_else(|| panic!("{rest:?}"));
    let step: u64 = message
        .trim_start_matches("interrupted after step ")
        .split(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(step >= 3);
    assert_eq!(check_checkpoint(&save), step);
    let folders = step_folders(&save);
    assert_eq!(folders.last().map(|f| f.0), Some(step));
}

/// Saving streams tensor by tensor: GPT-2 124M's checkpoint (498 MB of weights, 996 MB of
/// optimizer state) is written without the process holding either file whole. A run that
/// saves peaks no more than 64 MB above the same run without saving; a whole-file buffer would
/// add the 996 MB file.
#[test]
fn saving_a_large_checkpoint_streams_it() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("tokens.bin");
    let tokens: Vec<u8> = (0..4096u32)
        .flat_map(|i| ((i * 7 % 50_000) as u16).to_le_bytes())
        .collect();
    std::fs::write(&data, tokens).unwrap();
    let config = root().join("assets").join("configs").join("gpt2-124m.json");
    let save = tmp.path().join("saved");
    let args = [
        "train",
        path_str(&config),
        "--data",
        path_str(&data),
        "--steps",
        "1",
        "--batch",
        "1",
        "--seq",
        "8",
        "--device",
        "cpu",
    ];
    let peak = |args: &[&str]| {
        let (o, kib) = castor_peak_rss(args);
        assert!(o.status.success(), "castor {args:?}: {}", stderr(&o));
        kib
    };
    let without = peak(&args);
    let mut saving = args.to_vec();
    saving.extend(["--save", path_str(&save)]);
    let with = peak(&saving);
    let optimizer = std::fs::metadata(save.join("optimizer.safetensors"))
        .unwrap()
        .len();
    assert!(
        optimizer > 900_000_000,
        "{optimizer} bytes of optimizer state"
    );
    assert!(
        with <= without + 64 * 1024,
        "saving raised the peak from {without} KiB to {with} KiB"
    );
}
