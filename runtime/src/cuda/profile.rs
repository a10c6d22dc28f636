//! What each command of a profiled training step took on the GPU (`castor train
//! --profile-kernels`): every command with its device time, a table of the kinds of command
//! that took the most, and a CSV of the whole step. The step is issued command by command
//! with a CUDA event between commands (not as a graph), so the times add up to a little more
//! than a graph replay takes: the launch gaps a graph closes are inside them.

use super::program::{Command, Epilogue};
use super::roofline::UnitTimes;
use std::collections::HashMap;
use std::fmt::Write;

/// One command of a profiled step.
#[derive(Clone, Debug, PartialEq)]
pub struct CommandTime {
    /// The run it belongs to (`zero_grads`, `micro_step`, `optimizer_step`).
    pub run: String,
    /// Its index in the run.
    pub index: usize,
    /// What ran: a kernel's entry point, `cublas <A>x<B>-><C>` (with the epilogue) for a
    /// product, `copy` or `memset`.
    pub what: String,
    /// The node it belongs to (empty for copies and fills).
    pub node: String,
    /// Its size: a launch's grid and block, a product's `m x n x k` (and batch), a copy's or
    /// fill's bytes.
    pub size: String,
    /// Device time, milliseconds.
    pub ms: f32,
    /// The commands the program roofline counts a launch gap for in this row: 1, and a
    /// cuDNN attention pass's prelude, which is issued and timed with it.
    pub launches: usize,
}

impl CommandTime {
    /// The row of command `index` of run `run`, which took `ms`; a fused attention pass is
    /// named by what ran it: cuDNN (`on_cudnn`), or castor's kernels where cuDNN built no plan.
    pub fn of(run: &str, index: usize, command: &Command, on_cudnn: bool, ms: f32) -> CommandTime {
        let (what, node, size) = match command {
            Command::Launch(l) => (
                l.entry.clone(),
                l.node.clone(),
                format!(
                    "grid {}x{}x{} block {}x{}x{}",
                    l.grid.0, l.grid.1, l.grid.2, l.block.0, l.block.1, l.block.2
                ),
            ),
            Command::Gemm(g) => {
                let mut what = format!("cublas {}x{}->{}", g.a_dtype, g.b_dtype, g.c_dtype);
                if g.epilogue != Epilogue::None {
                    what.push_str(&format!(" {}", g.epilogue.name()));
                }
                let batch = if g.batch > 1 {
                    format!(" batch {}", g.batch)
                } else {
                    String::new()
                };
                (
                    what,
                    g.node.clone(),
                    format!("{} x {} x {}{batch}", g.m, g.n, g.k),
                )
            }
            Command::Copy { bytes, .. } => ("copy".into(), String::new(), format!("{bytes} bytes")),
            Command::Memset { bytes, .. } => {
                ("memset".into(), String::new(), format!("{bytes} bytes"))
            }
            Command::Collective {
                node,
                op,
                dst_bytes,
                ..
            } => (
                format!("nccl {}", op.mnemonic()),
                node.clone(),
                format!("{dst_bytes} bytes"),
            ),
            Command::Join { events } => (
                "join".into(),
                String::new(),
                format!("{} side event(s)", events.len()),
            ),
            Command::Sdpa(c) => (
                format!(
                    "{} attention {}",
                    if on_cudnn { "cudnn" } else { "castor" },
                    match c.pass {
                        crate::cuda::sdpa::SdpaPass::Forward => "forward",
                        crate::cuda::sdpa::SdpaPass::Backward => "backward",
                    }
                ),
                c.node.clone(),
                format!(
                    "heads {}/{} rows {}x{} dim {}",
                    c.problem.heads_q,
                    c.problem.heads_kv,
                    c.problem.rows_q,
                    c.problem.rows_kv,
                    c.problem.head_dim
                ),
            ),
        };
        let launches = 1 + match command {
            Command::Sdpa(c) => c.prelude.len(),
            _ => 0,
        };
        CommandTime {
            run: run.to_string(),
            index,
            what,
            node,
            size,
            ms,
            launches,
        }
    }
}

/// Every command of one training step, in issue order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KernelProfile {
    pub commands: Vec<CommandTime>,
}

/// One kind of command in the profile's table.
#[derive(Clone, Debug, PartialEq)]
pub struct KindTime {
    pub what: String,
    pub count: usize,
    pub ms: f64,
    /// The program roofline's time for these commands, when the table was given one: their
    /// share of their kernel units' times at peak plus the launch gap of every command.
    pub roofline_ms: Option<f64>,
}

impl KernelProfile {
    /// Device time of the whole step, milliseconds.
    pub fn total_ms(&self) -> f64 {
        self.commands.iter().map(|c| f64::from(c.ms)).sum()
    }

    /// The commands grouped by what ran, the most time first (ties by name).
    pub fn by_kind(&self) -> Vec<KindTime> {
        self.by_kind_against(None)
    }

    /// [`Self::by_kind`], each kind beside its roofline time from `units` (the roofline's
    /// kernel units of the plan: `roofline::unit_times`).
    pub fn by_kind_against(&self, units: Option<&UnitTimes>) -> Vec<KindTime> {
        let roofline = units.map(|u| self.roofline_ms(u));
        let mut kinds: HashMap<&str, KindTime> = HashMap::new();
        for (i, c) in self.commands.iter().enumerate() {
            let k = kinds.entry(&c.what).or_insert_with(|| KindTime {
                what: c.what.clone(),
                count: 0,
                ms: 0.0,
                roofline_ms: roofline.as_ref().map(|_| 0.0),
            });
            k.count += 1;
            k.ms += f64::from(c.ms);
            if let (Some(per_command), Some(r)) = (&roofline, k.roofline_ms.as_mut()) {
                *r += per_command[i];
            }
        }
        let mut out: Vec<KindTime> = kinds.into_values().collect();
        out.sort_by(|a, b| b.ms.total_cmp(&a.ms).then_with(|| a.what.cmp(&b.what)));
        out
    }

    /// The roofline's milliseconds for each command, in issue order: the launch gaps of
    /// every command, plus its share of its kernel unit's time. A unit lowered to several
    /// commands (a fused attention's backward and its `delta` kernel, a norm's backward and
    /// its weight gradient, a chunked classifier's products and row kernels), under one node
    /// name or several, has its time split among them in proportion to their measured times,
    /// so that each of them stands at the unit's own ratio and the unit is counted once per
    /// replay of its run (a run replayed for each accumulated micro-batch counts it each
    /// time). A command of no working unit (a copy, a fill, a view's) has its launch gap only.
    pub fn roofline_ms(&self, units: &UnitTimes) -> Vec<f64> {
        let unit = |c: &CommandTime| units.unit(&c.run, &c.node);
        // Each replay of a run issues its first command once.
        let mut replays: HashMap<&str, usize> = HashMap::new();
        for c in self.commands.iter().filter(|c| c.index == 0) {
            *replays.entry(&c.run).or_default() += 1;
        }
        let mut measured: HashMap<usize, (f64, usize)> = HashMap::new();
        for c in &self.commands {
            if let Some(key) = unit(c) {
                let m = measured.entry(key).or_default();
                m.0 += f64::from(c.ms);
                m.1 += 1;
            }
        }
        self.commands
            .iter()
            .map(|c| {
                let launches = c.launches as f64 * super::roofline::LAUNCH_SECONDS;
                let Some(u) = unit(c) else {
                    return 1e3 * launches;
                };
                let (total, count) = measured[&u];
                // Commands too short to time share the unit evenly.
                let share = if total > 0.0 {
                    f64::from(c.ms) / total
                } else {
                    1.0 / count as f64
                };
                let replayed = replays.get(c.run.as_str()).copied().unwrap_or(1) as f64;
                1e3 * (units.seconds[u] * replayed * share + launches)
            })
            .collect()
    }

    /// A table of the `top` kinds of command by device time, the rest summed in one line,
    /// and the total.
    pub fn table(&self, top: usize) -> String {
        self.table_against(top, None)
    }

    /// [`Self::table`] with each kind's roofline time and its measured time over it, when
    /// `units` is given (see [`Self::by_kind_against`]).
    pub fn table_against(&self, top: usize, units: Option<&UnitTimes>) -> String {
        let total = self.total_ms();
        let share = |ms: f64| 100.0 * ms / total.max(f64::MIN_POSITIVE);
        let roofline = units.is_some();
        let mut s = format!(
            "{:<48} {:>6} {:>10} {:>6}{}\n",
            "what",
            "count",
            "ms",
            "share",
            if roofline {
                format!(" {:>12} {:>8}", "roofline ms", "x roof")
            } else {
                String::new()
            }
        );
        let kinds = self.by_kind_against(units);
        for k in kinds.iter().take(top) {
            let roof = match k.roofline_ms {
                Some(r) => format!(
                    " {r:>12.3} {:>8}",
                    if r > 0.0 {
                        format!("{:.2}", k.ms / r)
                    } else {
                        "-".into()
                    }
                ),
                None => String::new(),
            };
            let _ = writeln!(
                s,
                "{:<48} {:>6} {:>10.3} {:>5.1}%{roof}",
                k.what,
                k.count,
                k.ms,
                share(k.ms)
            );
        }
        if kinds.len() > top {
            let rest = &kinds[top..];
            let ms: f64 = rest.iter().map(|k| k.ms).sum();
            let count: usize = rest.iter().map(|k| k.count).sum();
            let label = format!("({} other kinds)", rest.len());
            let _ = writeln!(s, "{label:<48} {count:>6} {ms:>10.3} {:>5.1}%", share(ms));
        }
        let _ = write!(
            s,
            "{:<48} {:>6} {:>10.3} 100.0%",
            "total",
            self.commands.len(),
            total
        );
        s
    }

    /// Every command as CSV: `run,index,what,node,size,ms,roofline_ms` (the last column
    /// empty unless `units` is given: see [`Self::roofline_ms`]).
    pub fn to_csv(&self, units: Option<&UnitTimes>) -> String {
        let quote = |f: &str| {
            if f.contains([',', '"', '\n']) {
                format!("\"{}\"", f.replace('"', "\"\""))
            } else {
                f.to_string()
            }
        };
        let roofline = units.map(|u| self.roofline_ms(u));
        let mut s = String::from("run,index,what,node,size,ms,roofline_ms\n");
        for (i, c) in self.commands.iter().enumerate() {
            let _ = writeln!(
                s,
                "{},{},{},{},{},{},{}",
                quote(&c.run),
                c.index,
                quote(&c.what),
                quote(&c.node),
                quote(&c.size),
                c.ms,
                roofline
                    .as_ref()
                    .map_or(String::new(), |r| format!("{:.6}", r[i]))
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::program::{Gemm, GemmCompute, Launch, Place};
    use castor_ir::DType;

    fn launch(entry: &str, node: &str) -> Command {
        Command::Launch(Launch {
            node: node.into(),
            module: 0,
            kernel: None,
            entry: entry.into(),
            grid: (4, 1, 1),
            block: (256, 1, 1),
            shared_bytes: 0,
            args: vec![],
        })
    }

    fn gemm(epilogue: Epilogue) -> Command {
        let at = Place::Arena { offset: 0 };
        Command::Gemm(Gemm {
            node: "h.0.mlp.fc".into(),
            a: at,
            b: at,
            c: at,
            a_dtype: DType::BF16,
            b_dtype: DType::BF16,
            c_dtype: DType::BF16,
            transa: false,
            transb: false,
            m: 3072,
            n: 8192,
            k: 768,
            lda: 3072,
            ldb: 768,
            ldc: 3072,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
            batch: 1,
            compute: GemmCompute::F32,
            accumulate: false,
            alpha: 1.0,
            epilogue,
            fp8: None,
        })
    }

    fn profile() -> KernelProfile {
        let commands = [
            (launch("layer_norm_fwd", "h.0.ln_1"), 0.5),
            (gemm(Epilogue::None), 2.0),
            (launch("layer_norm_fwd", "h.1.ln_1"), 0.25),
            (
                gemm(Epilogue::Bias {
                    bias: Place::Arena { offset: 0 },
                }),
                1.0,
            ),
            (
                Command::Copy {
                    dst: Place::Arena { offset: 0 },
                    src: Place::Arena { offset: 256 },
                    bytes: 1024,
                },
                0.25,
            ),
        ];
        KernelProfile {
            commands: commands
                .iter()
                .enumerate()
                .map(|(i, (c, ms))| CommandTime::of("micro_step", i, c, false, *ms))
                .collect(),
        }
    }

    #[test]
    fn kinds_are_grouped_and_ranked_by_device_time() {
        let p = profile();
        assert_eq!(p.total_ms(), 4.0);
        let kinds: Vec<(String, usize, f64)> = p
            .by_kind()
            .into_iter()
            .map(|k| (k.what, k.count, k.ms))
            .collect();
        assert_eq!(
            kinds,
            vec![
                ("cublas bf16xbf16->bf16".to_string(), 1, 2.0),
                ("cublas bf16xbf16->bf16 bias".to_string(), 1, 1.0),
                ("layer_norm_fwd".to_string(), 2, 0.75),
                ("copy".to_string(), 1, 0.25),
            ]
        );
    }

    #[test]
    fn the_table_shows_the_top_kinds_the_rest_and_the_total() {
        let table = profile().table(2);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 5, "{table}");
        assert!(lines[1].starts_with("cublas bf16xbf16->bf16 ") && lines[1].ends_with("50.0%"));
        assert!(lines[3].starts_with("(2 other kinds)"), "{table}");
        assert!(
            lines[3].contains(" 3 ") && lines[3].ends_with("25.0%"),
            "{table}"
        );
        assert!(lines[4].starts_with("total") && lines[4].contains("4.000"));
    }

    /// One unit per command's node, unit `i` taking `(i + 1) x 0.1` ms.
    fn one_unit_per_node(p: &KernelProfile) -> UnitTimes {
        let mut units = UnitTimes::default();
        for c in &p.commands {
            let key = (c.run.clone(), c.node.clone());
            if !c.node.is_empty() && !units.unit_of.contains_key(&key) {
                units.unit_of.insert(key, units.seconds.len());
                units.seconds.push(1e-4 * (units.seconds.len() + 1) as f64);
            }
        }
        units
    }

    /// Against a roofline: each kind gets its units' times, shared by measured time among the
    /// unit's commands, plus a microsecond a command; a copy of no unit gets its microsecond.
    #[test]
    fn kinds_are_set_beside_their_roofline() {
        let p = profile();
        let units = one_unit_per_node(&p);
        let kinds = p.by_kind_against(Some(&units));
        let ms = |what: &str| {
            kinds
                .iter()
                .find(|k| k.what == what)
                .unwrap()
                .roofline_ms
                .unwrap()
        };
        // h.0.ln_1 (unit 0) and h.1.ln_1 (unit 2), one command each.
        assert!((ms("layer_norm_fwd") - (0.1 + 0.3 + 2e-3)).abs() < 1e-12);
        // Both products carry h.0.mlp.fc (unit 1): 2 and 1 ms measured share its 0.2 ms.
        assert!((ms("cublas bf16xbf16->bf16") - (0.2 * 2.0 / 3.0 + 1e-3)).abs() < 1e-12);
        assert!((ms("copy") - 1e-3).abs() < 1e-12);
        let table = p.table_against(4, Some(&units));
        assert!(
            table.lines().next().unwrap().contains("roofline ms"),
            "{table}"
        );
        assert!(p.by_kind().iter().all(|k| k.roofline_ms.is_none()));
    }

    /// A fused attention pass is named by what ran it: cuDNN, or castor's kernels where cuDNN
    /// built no plan (they once were all named cuDNN's, which hid that cuDNN refused them).
    #[test]
    fn an_attention_pass_is_named_by_what_ran_it() {
        use crate::cuda::sdpa::{tests::call, SdpaPass};
        let pass = |p| Command::Sdpa(Box::new(call(p, (12, 12), true, None, false)));
        let what = |p, on_cudnn| CommandTime::of("micro_step", 0, &pass(p), on_cudnn, 1.0).what;
        assert_eq!(what(SdpaPass::Forward, true), "cudnn attention forward");
        assert_eq!(what(SdpaPass::Backward, true), "cudnn attention backward");
        assert_eq!(what(SdpaPass::Forward, false), "castor attention forward");
        assert_eq!(what(SdpaPass::Backward, false), "castor attention backward");
    }

    /// A unit lowered to commands under two node names (a norm's backward and its weight
    /// gradient) splits its roofline time by their measured times: both stand at the unit's
    /// ratio, and the unit counts once per replay of its run (twice for two accumulated
    /// micro-batches).
    #[test]
    fn a_units_commands_share_its_roofline_by_measured_time() {
        let replay = || {
            [
                CommandTime::of(
                    "micro_step",
                    0,
                    &launch("layer_norm_bwd", "ln.x.grad"),
                    false,
                    1.0,
                ),
                CommandTime::of(
                    "micro_step",
                    1,
                    &launch("layer_norm_bwd_weight", "ln.weight.grad"),
                    false,
                    3.0,
                ),
            ]
        };
        let mut units = UnitTimes {
            seconds: vec![2e-3],
            ..UnitTimes::default()
        };
        for name in ["ln.x.grad", "ln.weight.grad"] {
            units
                .unit_of
                .insert(("micro_step".to_string(), name.to_string()), 0);
        }
        let once = KernelProfile {
            commands: replay().to_vec(),
        };
        let ms = once.roofline_ms(&units);
        assert!((ms[0] - (0.5 + 1e-3)).abs() < 1e-12, "{ms:?}");
        assert!((ms[1] - (1.5 + 1e-3)).abs() < 1e-12, "{ms:?}");
        let twice = KernelProfile {
            commands: [replay(), replay()].concat(),
        };
        let ms = twice.roofline_ms(&units);
        let total: f64 = ms.iter().sum();
        assert!((total - (4.0 + 4e-3)).abs() < 1e-12, "{ms:?}");
    }

    #[test]
    fn the_csv_has_every_command_and_quotes_what_needs_it() {
        let mut p = profile();
        p.commands[0].node = "a,b".into();
        let csv = p.to_csv(None);
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines[0], "run,index,what,node,size,ms,roofline_ms");
        assert_eq!(lines.len(), 6);
        assert_eq!(
            lines[1],
            "micro_step,0,layer_norm_fwd,\"a,b\",grid 4x1x1 block 256x1x1,0.5,"
        );
        assert_eq!(
            lines[2],
            "micro_step,1,cublas bf16xbf16->bf16,h.0.mlp.fc,3072 x 8192 x 768,2,"
        );
        assert_eq!(lines[5], "micro_step,4,copy,,1024 bytes,0.25,");
        // With the roofline, each command's share of it: the two products of the unit
        // `h.0.mlp.fc` (2 ms and 1 ms measured) split its 2 ms as 2:1, plus a launch each.
        let units = UnitTimes {
            seconds: vec![2e-3],
            unit_of: HashMap::from([(("micro_step".to_string(), "h.0.mlp.fc".to_string()), 0)]),
        };
        let csv = p.to_csv(Some(&units));
        let lines: Vec<&str> = csv.lines().collect();
        assert!(lines[2].ends_with(",2,1.334333"), "{}", lines[2]);
        assert!(lines[4].ends_with(",1,0.667667"), "{}", lines[4]);
        assert!(lines[5].ends_with(",0.25,0.001000"), "{}", lines[5]);
    }
}
