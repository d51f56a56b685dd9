//! Plots (PNG and SVG): how a figure is written ([`Chart`], [`both`]), and the figures of the
//! models and depth matrices: the memory-time trade-off per model, each model's step timelines,
//! and peak activation memory against depth.
//!
//! The matrices' other layers: [`crate::run::matrix`] (the run) and [`crate::measure::one`] (each
//! configuration measured, its timeline).

use super::record::{Baseline, Record, Status};
use super::results::{depth_of, Matrix, Models};
use anyhow::{anyhow, Context, Result};
use plotters::coord::{CoordTranslate, Shift};
use plotters::prelude::*;
use remat::memory::{mib, Phase};
use std::path::Path;

static FONT: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

pub fn color(i: usize) -> RGBColor {
    COLORS[i % COLORS.len()]
}

pub fn plot_err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("plotting: {e:?}")
}

/// A figure, drawn the same on any backend.
pub trait Chart {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()>;
}

/// Draws `chart` twice, `<stem>.png` and `<stem>.svg`, each drawn in memory and then written
/// whole ([`super::write_file`]).
pub fn both(dir: &Path, stem: &str, (w, h): (u32, u32), chart: &impl Chart) -> Result<()> {
    let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    let mut rgb = vec![0; w as usize * h as usize * 3];
    render(BitMapBackend::with_buffer(&mut rgb, (w, h)).into_drawing_area(), chart)?;
    let mut png = std::io::Cursor::new(Vec::new());
    image::RgbImage::from_raw(w, h, rgb)
        .context("a bitmap of 3 bytes a pixel")?
        .write_to(&mut png, image::ImageOutputFormat::Png)?;
    super::write_file(&dir.join(format!("{stem}.png")), png.into_inner())?;
    let mut svg = String::new();
    render(SVGBackend::with_string(&mut svg, (w, h)).into_drawing_area(), chart)?;
    super::write_file(&dir.join(format!("{stem}.svg")), svg)
}

/// Draws the legend of `chart`'s labelled series at `position`, in a white box.
pub fn legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    position: SeriesLabelPosition,
) -> Result<()> {
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(position)
        .draw()
        .map_err(plot_err)
}

fn render<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, chart: &impl Chart) -> Result<()> {
    root.fill(&WHITE).map_err(plot_err)?;
    chart.draw(&root)?;
    root.present().map_err(plot_err)
}

/// The figures of a models and depth matrix.
enum Figure<'a> {
    Tradeoff(&'a Matrix),
    Timelines(&'a Matrix),
    Depth { matrix: &'a Matrix, fits: &'a [(String, f64)] },
}

impl Chart for Figure<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        match self {
            Figure::Tradeoff(m) => tradeoff(root, m),
            Figure::Timelines(m) => timelines(root, m),
            Figure::Depth { matrix, fits } => depth(root, matrix, fits),
        }
    }
}

/// Writes every figure of the matrix into `dir`.
pub fn all(dir: &Path, m: &Matrix, fits: &[(String, f64)]) -> Result<()> {
    let models = m.models(Models::Profile).len().max(1) as u32;
    let rows = models.div_ceil(2);
    both(dir, "tradeoff", (1200, 420 * rows), &Figure::Tradeoff(m))?;
    both(dir, "timelines", (1200, 420 * rows), &Figure::Timelines(m))?;
    if !m.models(Models::DepthSweep).is_empty() {
        both(dir, "depth", (900, 600), &Figure::Depth { matrix: m, fits })?;
    }
    Ok(())
}

fn panels<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    n: usize,
) -> Vec<DrawingArea<DB, Shift>> {
    root.split_evenly((n.div_ceil(2).max(1), 2))
}

/// The share of a trade-off panel's plot, (width, height), its legend box covers (the longest
/// label, torch.compile's, and up to seven entries).
const LEGEND_SHARE: (f64, f64) = (0.45, 0.55);

/// Where a panel over times `t` and memory `0..max_m` draws its legend, and the top of its
/// memory axis: the corner where the legend hides none of `points` (they gather where the
/// policies fall, which differs by model; ties go to the lower right, then the upper right,
/// upper left, lower left), or where every corner would hide some, the upper right over a memory
/// axis raised until the box is above every point.
fn legend_place(
    points: impl Iterator<Item = (f64, f64)>,
    (min_t, max_t): (f64, f64),
    max_m: f64,
) -> (SeriesLabelPosition, f64) {
    let (w, h) = LEGEND_SHARE;
    // (left edge of the box, right edge) and (bottom, top) in shares of the plot, per corner.
    let corners = [
        (SeriesLabelPosition::LowerRight, (1.0 - w, 1.0), (0.0, h)),
        (SeriesLabelPosition::UpperRight, (1.0 - w, 1.0), (1.0 - h, 1.0)),
        (SeriesLabelPosition::UpperLeft, (0.0, w), (1.0 - h, 1.0)),
        (SeriesLabelPosition::LowerLeft, (0.0, w), (0.0, h)),
    ];
    let span = (max_t - min_t).max(f64::MIN_POSITIVE);
    let shares: Vec<(f64, f64)> =
        points.map(|(t, m)| ((t - min_t) / span, m / max_m.max(f64::MIN_POSITIVE))).collect();
    let hidden = |(u0, u1): (f64, f64), (v0, v1): (f64, f64)| {
        shares.iter().filter(|(u, v)| (u0..=u1).contains(u) && (v0..=v1).contains(v)).count()
    };
    match corners.into_iter().find(|(_, u, v)| hidden(*u, *v) == 0) {
        Some((corner, _, _)) => (corner, max_m),
        None => {
            // The highest point a marker's height (about 5 % of the plot) below the box.
            let highest = shares.iter().map(|p| p.1).fold(0.0, f64::max) * max_m;
            (SeriesLabelPosition::UpperRight, highest / (1.0 - h - 0.05))
        }
    }
}

/// Peak memory against step time: one point per policy (filled: whole step, hollow: activations),
/// the planner's `budget=` frontier (predicted), and where they ran, eager PyTorch on the same
/// policies (squares) and torch.compile's activation memory budgets (triangles, joined), so that
/// at each memory level the faster step reads off the figure.
fn tradeoff<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, m: &Matrix) -> Result<()> {
    let models = m.models(Models::Profile);
    for (area, model) in panels(root, models.len()).iter().zip(&models) {
        let rows: Vec<&Record> = m.ok_rows(model);
        if rows.is_empty() {
            continue;
        }
        // The planner's frontier: every budget= plan, predicted (time from off's measured step).
        let frontier: Vec<(f64, f64)> = rows
            .iter()
            .find(|r| r.policy == "off")
            .map(|off| {
                off.frontier
                    .iter()
                    .map(|p| (off.step_ms_median * p.time_ratio, mib(p.peak_bytes)))
                    .collect()
            })
            .unwrap_or_default();
        let measured = |runs: &[Baseline]| -> Vec<(f64, f64)> {
            runs.iter()
                .filter(|b| &b.model == model && b.status == Status::Ok)
                .map(|b| (b.step_ms_median, mib(b.step_peak_bytes)))
                .collect()
        };
        let eager = measured(&m.baselines);
        let mut compiled = measured(&m.compiled);
        compiled.sort_by(|a, b| a.1.total_cmp(&b.1));
        let points = || {
            rows.iter()
                .map(|r| (r.step_ms_median, mib(r.step_peak_bytes)))
                .chain(frontier.iter().copied())
                .chain(eager.iter().copied())
                .chain(compiled.iter().copied())
        };
        let max_t = points().map(|p| p.0).fold(0.0, f64::max) * 1.1;
        let min_t = points().map(|p| p.0).fold(f64::MAX, f64::min) * 0.9;
        let max_m = points().map(|p| p.1).fold(0.0, f64::max) * 1.15;
        let hollow = rows.iter().map(|r| (r.step_ms_median, mib(r.activation_peak_bytes)));
        let (corner, max_m) = legend_place(points().chain(hollow), (min_t, max_t), max_m);
        let mut chart = ChartBuilder::on(area)
            .caption(format!("{model}: peak memory vs step time"), ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(min_t..max_t, 0.0..max_m)
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .x_desc("step time (ms, median)")
            .y_desc("peak above model state (MiB)")
            .draw()
            .map_err(plot_err)?;
        if !frontier.is_empty() {
            chart
                .draw_series(
                    LineSeries::new(frontier.iter().copied(), BLACK.stroke_width(1)).point_size(3),
                )
                .map_err(plot_err)?
                .label("budget= plans (predicted)")
                .legend(|(x, y)| PathElement::new([(x - 8, y), (x + 8, y)], BLACK));
        }
        for (i, r) in rows.iter().enumerate() {
            let (t, step, act) =
                (r.step_ms_median, mib(r.step_peak_bytes), mib(r.activation_peak_bytes));
            let c = color(i);
            chart
                .draw_series([
                    Circle::new((t, step), 6, c.filled()),
                    Circle::new((t, act), 6, c.stroke_width(2)),
                ])
                .map_err(plot_err)?
                .label(r.policy.clone())
                .legend(move |(x, y)| Circle::new((x, y), 5, c.filled()));
        }
        let grey = RGBColor(110, 110, 110);
        if !eager.is_empty() {
            let square = move |(x, y): (i32, i32)| {
                Rectangle::new([(x - 5, y - 5), (x + 5, y + 5)], grey.stroke_width(2))
            };
            chart
                .draw_series(eager.iter().map(|&(t, peak)| {
                    EmptyElement::at((t, peak))
                        + Rectangle::new([(-5, -5), (5, 5)], grey.stroke_width(2))
                }))
                .map_err(plot_err)?
                .label("PyTorch eager, same policies")
                .legend(move |(x, y)| square((x, y)));
        }
        if !compiled.is_empty() {
            let red = RGBColor(200, 30, 30);
            chart
                .draw_series(LineSeries::new(compiled.iter().copied(), red.stroke_width(1)))
                .map_err(plot_err)?;
            chart
                .draw_series(compiled.iter().map(|&p| TriangleMarker::new(p, 7, red.filled())))
                .map_err(plot_err)?
                .label("torch.compile, memory budgets 1.0-0.1")
                .legend(move |(x, y)| TriangleMarker::new((x, y), 6, red.filled()));
        }
        legend(&mut chart, corner)?;
    }
    Ok(())
}

/// Heap above the step's start at every stage boundary; forward solid, recompute and backward
/// dashed.
fn timelines<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, m: &Matrix) -> Result<()> {
    let models = m.models(Models::Profile);
    for (area, model) in panels(root, models.len()).iter().zip(&models) {
        let rows: Vec<&Record> =
            m.ok_rows(model).into_iter().filter(|r| !r.timeline.is_empty()).collect();
        if rows.is_empty() {
            continue;
        }
        let above = |r: &Record, e: &remat::memory::Event| {
            mib(e.window_peak.saturating_sub(r.timeline_base_bytes))
        };
        let max_t =
            rows.iter().flat_map(|r| r.timeline.iter().map(|e| e.at_ms)).fold(0.0, f64::max) * 1.05;
        let max_m = rows
            .iter()
            .flat_map(|r| r.timeline.iter().map(move |e| above(r, e)))
            .fold(0.0, f64::max)
            * 1.15;
        let mut chart = ChartBuilder::on(area)
            .caption(format!("{model}: memory during one step"), ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..max_t, 0.0..max_m)
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .x_desc("time in step (ms): forward solid, recompute and backward dashed")
            .y_desc("peak heap above step start (MiB)")
            .draw()
            .map_err(plot_err)?;
        for (i, r) in rows.iter().enumerate() {
            let c = color(i);
            // Each event closes an interval; its height is the peak within that interval.
            let mut forward = Vec::new();
            let mut backward = Vec::new();
            let mut t0 = 0.0;
            for e in &r.timeline {
                let (y, seg) = (
                    above(r, e),
                    if e.phase == Phase::Forward { &mut forward } else { &mut backward },
                );
                seg.push((t0, y));
                seg.push((e.at_ms, y));
                t0 = e.at_ms;
            }
            if let Some(&last) = forward.last() {
                backward.insert(0, last); // join the two halves
            }
            chart
                .draw_series(LineSeries::new(forward, c.stroke_width(2)))
                .map_err(plot_err)?
                .label(r.policy.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                });
            chart
                .draw_series(DashedLineSeries::new(backward, 6, 4, c.stroke_width(2)))
                .map_err(plot_err)?;
        }
        legend(&mut chart, SeriesLabelPosition::UpperRight)?;
    }
    Ok(())
}

/// Peak activation memory against depth, log-log, with the fitted exponents.
fn depth<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    m: &Matrix,
    fits: &[(String, f64)],
) -> Result<()> {
    let points = |policy: &str| -> Vec<(f64, f64)> {
        m.models(Models::DepthSweep)
            .iter()
            .filter_map(|model| {
                m.find(model, policy)
                    .filter(|r| r.status == Status::Ok)
                    .map(|r| (depth_of(model) as f64, mib(r.activation_peak_bytes)))
            })
            .collect()
    };
    let all: Vec<(f64, f64)> = fits.iter().flat_map(|(p, _)| points(p)).collect();
    if all.is_empty() {
        return Ok(());
    }
    let (x0, x1) = (
        all.iter().map(|p| p.0).fold(f64::MAX, f64::min) / 1.5,
        all.iter().map(|p| p.0).fold(0.0, f64::max) * 1.5,
    );
    let (y0, y1) = (
        all.iter().map(|p| p.1).fold(f64::MAX, f64::min) / 2.0,
        all.iter().map(|p| p.1).fold(0.0, f64::max) * 2.0,
    );
    let mut chart = ChartBuilder::on(root)
        .caption("Activation peak against depth (GPT-2 blocks, fixed width)", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("blocks L")
        .y_desc("activation peak (MiB)")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()
        .map_err(plot_err)?;
    for (i, (policy, exponent)) in fits.iter().enumerate() {
        let c = color(i);
        let pts = points(policy);
        chart
            .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
            .map_err(plot_err)?
            .label(format!("{policy}: ~ L^{exponent:.2}"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 5, c.filled())))
            .map_err(plot_err)?;
    }
    legend(&mut chart, SeriesLabelPosition::UpperLeft)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_legend_goes_where_no_point_is() {
        let place =
            |points: &[(f64, f64)]| legend_place(points.iter().copied(), (500.0, 1000.0), 400.0);
        // Checkpointing's points: less memory for more time, the lower right.
        assert_eq!(
            place(&[(900.0, 50.0), (950.0, 80.0), (1000.0, 30.0)]).0,
            SeriesLabelPosition::UpperRight
        );
        // Points in every corner but the upper left.
        assert_eq!(
            place(&[(510.0, 10.0), (990.0, 10.0), (990.0, 390.0)]).0,
            SeriesLabelPosition::UpperLeft
        );
        assert_eq!(place(&[]), (SeriesLabelPosition::LowerRight, 400.0));
        // A point in every corner: the axis rises until the highest point is below the box.
        let (corner, top) = place(&[(510.0, 10.0), (990.0, 10.0), (990.0, 340.0), (510.0, 340.0)]);
        assert_eq!(corner, SeriesLabelPosition::UpperRight);
        assert!(340.0 / top < 1.0 - LEGEND_SHARE.1, "the highest point at 340 of {top}");
    }
}
