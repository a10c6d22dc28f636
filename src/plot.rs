//! Pictures: the loss curve of a run and the memory anatomy of a plan, as SVG (plotters).
//!
//! SVG needs no fonts on the machine that draws it (text stays text), so the pictures work on
//! any machine; browsers and image viewers render them.

use castor_models::write_atomically;
use plotters::prelude::*;
use std::path::Path;

/// Points of a run, by 1-based step: the training loss of each step, the validation loss of
/// each evaluation, and each step's learning rate and loss scale.
#[derive(Clone, Debug, Default)]
pub struct LossHistory {
    pub train: Vec<(u64, f64)>,
    pub validation: Vec<(u64, f64)>,
    pub lr: Vec<(u64, f64)>,
    pub loss_scale: Vec<(u64, f64)>,
}

/// One stacked bar of a memory anatomy: bytes by what they hold.
#[derive(Clone, Debug)]
pub struct AnatomyBar {
    pub label: String,
    /// (what, bytes), drawn bottom to top.
    pub segments: Vec<(String, u64)>,
}

const WIDTH: u32 = 960;
const HEIGHT: u32 = 540;

fn draw_error<E: std::fmt::Display>(path: &Path) -> impl Fn(E) -> anyhow::Error + '_ {
    move |e| anyhow::anyhow!("cannot draw `{}`: {e}", path.display())
}

/// Checks that a picture path is one this build can write.
pub fn check_picture_path(path: &Path) -> anyhow::Result<()> {
    match path.extension().and_then(|e| e.to_str()) {
        Some("svg") => Ok(()),
        _ => Err(crate::CliError::InvalidInput(format!(
            "`{}`: pictures are written as SVG; give a path ending in .svg (convert with any \
             SVG tool, e.g. `rsvg-convert -o loss.png loss.svg`)",
            path.display()
        ))
        .into()),
    }
}

/// An exponential moving average, as the smoothed curve TensorBoard draws.
pub fn smooth(points: &[(u64, f64)], weight: f64) -> Vec<(f64, f64)> {
    let mut out = Vec::with_capacity(points.len());
    let mut avg: Option<f64> = None;
    for &(s, y) in points.iter().filter(|(_, y)| y.is_finite()) {
        let a = match avg {
            Some(a) => weight * a + (1.0 - weight) * y,
            None => y,
        };
        avg = Some(a);
        out.push((s as f64, a));
    }
    out
}

/// Writes the loss curve of `history` to `path` (SVG), atomically.
pub fn write_loss_curve(path: &Path, title: &str, history: &LossHistory) -> anyhow::Result<()> {
    check_picture_path(path)?;
    let err = draw_error(path);
    let finite = |v: &[(u64, f64)]| -> Vec<(u64, f64)> {
        v.iter().copied().filter(|(_, y)| y.is_finite()).collect()
    };
    let (train, val) = (finite(&history.train), finite(&history.validation));
    let all = || train.iter().chain(val.iter());
    let x_max = all().map(|p| p.0).max().unwrap_or(1).max(1) as f64;
    let x_min = all().map(|p| p.0).min().unwrap_or(0) as f64;
    let y_max = all().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
    let y_min = all().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let (y_min, y_max) = if y_max.is_finite() {
        let pad = ((y_max - y_min) * 0.05).max(0.05);
        ((y_min - pad).max(0.0), y_max + pad)
    } else {
        (0.0, 1.0)
    };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(&err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 24))
            .margin(20)
            .x_label_area_size(50)
            .y_label_area_size(70)
            .build_cartesian_2d(x_min..x_max.max(x_min + 1.0), y_min..y_max)
            .map_err(&err)?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc("loss (cross-entropy, nats per token)")
            .axis_desc_style(("sans-serif", 16))
            .label_style(("sans-serif", 14))
            .light_line_style(RGBColor(235, 235, 235))
            .bold_line_style(RGBColor(215, 215, 215))
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.2}"))
            .draw()
            .map_err(&err)?;
        let raw = RGBColor(31, 119, 180).mix(0.3);
        let smooth_colour = RGBColor(31, 119, 180);
        let val_colour = RGBColor(214, 39, 40);
        if !train.is_empty() {
            chart
                .draw_series(LineSeries::new(
                    train.iter().map(|&(s, y)| (s as f64, y)),
                    raw.stroke_width(1),
                ))
                .map_err(&err)?
                .label("training loss (each step)")
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 24, y)], raw.stroke_width(2))
                });
            chart
                .draw_series(LineSeries::new(
                    smooth(&train, 0.9),
                    smooth_colour.stroke_width(3),
                ))
                .map_err(&err)?
                .label("training loss (smoothed)")
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 24, y)], smooth_colour.stroke_width(3))
                });
        }
        if !val.is_empty() {
            chart
                .draw_series(LineSeries::new(
                    val.iter().map(|&(s, y)| (s as f64, y)),
                    val_colour.stroke_width(2),
                ))
                .map_err(&err)?
                .label("validation loss")
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 24, y)], val_colour.stroke_width(2))
                });
            chart
                .draw_series(
                    val.iter()
                        .map(|&(s, y)| Circle::new((s as f64, y), 4, val_colour.filled())),
                )
                .map_err(&err)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .label_font(("sans-serif", 15))
            .background_style(WHITE.mix(0.9))
            .border_style(RGBColor(160, 160, 160))
            .draw()
            .map_err(&err)?;
        root.present().map_err(&err)?;
    }
    write_atomically(path, svg.as_bytes())?;
    Ok(())
}

/// Colours of the anatomy's segments, in order (matplotlib's tab10).
const PALETTE: [RGBColor; 8] = [
    RGBColor(255, 127, 14),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(127, 127, 127),
    RGBColor(214, 39, 40),
    RGBColor(140, 86, 75),
    RGBColor(23, 190, 207),
];

/// The unit that shows `max` bytes best: (bytes per unit, its name).
pub fn unit_for(max: u64) -> (f64, &'static str) {
    if max >= 1 << 30 {
        ((1u64 << 30) as f64, "GiB")
    } else if max >= 1 << 20 {
        ((1u64 << 20) as f64, "MiB")
    } else {
        (1024.0, "KiB")
    }
}

/// Writes a stacked bar chart of memory by what it holds, one bar per configuration.
pub fn write_anatomy(
    path: &Path,
    title: &str,
    bars: &[AnatomyBar],
    note: &str,
) -> anyhow::Result<()> {
    check_picture_path(path)?;
    let err = draw_error(path);
    let totals: Vec<u64> = bars
        .iter()
        .map(|b| b.segments.iter().map(|s| s.1).sum())
        .collect();
    let max = totals.iter().copied().max().unwrap_or(1).max(1);
    let (unit, unit_name) = unit_for(max);
    let y_max = max as f64 / unit * 1.18;
    let mut names: Vec<String> = Vec::new();
    for b in bars {
        for (what, _) in &b.segments {
            if !names.contains(what) {
                names.push(what.clone());
            }
        }
    }
    let colour = |what: &str| {
        let i = names.iter().position(|n| n == what).unwrap_or(0);
        PALETTE[i % PALETTE.len()]
    };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(&err)?;
        let (main, footer) = root.split_vertically(HEIGHT - 30);
        footer
            .draw(&Text::new(
                note.to_string(),
                (20, 8),
                ("sans-serif", 13).into_font().color(&RGBColor(90, 90, 90)),
            ))
            .map_err(&err)?;
        let n = bars.len().max(1) as f64;
        let mut chart = ChartBuilder::on(&main)
            .caption(title, ("sans-serif", 24))
            .margin(20)
            .x_label_area_size(40)
            .y_label_area_size(80)
            .build_cartesian_2d(0.0..n * 1.6 + 2.6, 0.0..y_max)
            .map_err(&err)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .x_desc("training step plan (precision)")
            .y_desc(format!("memory ({unit_name})"))
            .axis_desc_style(("sans-serif", 16))
            .label_style(("sans-serif", 14))
            .light_line_style(RGBColor(235, 235, 235))
            .bold_line_style(RGBColor(215, 215, 215))
            .y_label_formatter(&|y| format!("{y:.1}"))
            .draw()
            .map_err(&err)?;
        let mut labelled: Vec<String> = Vec::new();
        for (i, bar) in bars.iter().enumerate() {
            let (x0, x1) = (0.4 + i as f64 * 1.6, 1.4 + i as f64 * 1.6);
            let mut y = 0.0;
            for (what, bytes) in &bar.segments {
                let h = *bytes as f64 / unit;
                let c = colour(what);
                let rect = Rectangle::new([(x0, y), (x1, y + h)], c.filled());
                let series = chart.draw_series(std::iter::once(rect)).map_err(&err)?;
                if !labelled.contains(what) {
                    labelled.push(what.clone());
                    series.label(what.as_str()).legend(move |(x, y)| {
                        Rectangle::new([(x, y - 6), (x + 14, y + 6)], c.filled())
                    });
                }
                y += h;
            }
            let total = totals[i];
            let label_style = ("sans-serif", 15).into_font().color(&BLACK);
            chart
                .draw_series(std::iter::once(Text::new(
                    bar.label.clone(),
                    (x0, y + y_max * 0.075),
                    label_style.clone(),
                )))
                .map_err(&err)?;
            chart
                .draw_series(std::iter::once(Text::new(
                    format!("{:.2} {unit_name}", total as f64 / unit),
                    (x0, y + y_max * 0.035),
                    ("sans-serif", 13).into_font().color(&RGBColor(60, 60, 60)),
                )))
                .map_err(&err)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .label_font(("sans-serif", 14))
            .background_style(WHITE.mix(0.9))
            .border_style(RGBColor(160, 160, 160))
            .draw()
            .map_err(&err)?;
        root.present().map_err(&err)?;
    }
    write_atomically(path, svg.as_bytes())?;
    Ok(())
}
