//! Plots of a matrix (PNG and SVG): the memory-time trade-off per model, each model's step
//! timelines, and peak activation memory against depth.

use crate::measure::Record;
use crate::measure::Status;
use crate::results::{depth_of, Matrix};
use anyhow::{anyhow, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use remat::memory::Phase;
use std::path::Path;

static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

const MIB: f64 = 1024.0 * 1024.0;
const COLORS: [RGBColor; 6] =
    [RGBColor(31, 119, 180), RGBColor(255, 127, 14), RGBColor(44, 160, 44), RGBColor(214, 39, 40), RGBColor(148, 103, 189), RGBColor(140, 86, 75)];

fn color(i: usize) -> RGBColor {
    COLORS[i % COLORS.len()]
}

fn plot_err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("plotting: {e:?}")
}

/// Draws one figure twice: `<stem>.png` and `<stem>.svg`.
fn both(dir: &Path, stem: &str, size: (u32, u32), draw: impl Fn(&mut dyn FnMut(Figure) -> Result<()>) -> Result<()>) -> Result<()> {
    let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    let png = dir.join(format!("{stem}.png"));
    let svg = dir.join(format!("{stem}.svg"));
    draw(&mut |fig| fig.render(BitMapBackend::new(&png, size).into_drawing_area()))?;
    draw(&mut |fig| fig.render(SVGBackend::new(&svg, size).into_drawing_area()))
}

/// What a figure shows, independent of the backend it is drawn on.
pub enum Figure<'a> {
    Tradeoff(&'a Matrix),
    Timelines(&'a Matrix),
    Depth { matrix: &'a Matrix, fits: &'a [(String, f64)] },
    Gpt2Memory(&'a Matrix),
}

impl Figure<'_> {
    fn render<DB: DrawingBackend>(&self, root: DrawingArea<DB, Shift>) -> Result<()> {
        root.fill(&WHITE).map_err(plot_err)?;
        match self {
            Figure::Tradeoff(m) => tradeoff(&root, m)?,
            Figure::Timelines(m) => timelines(&root, m)?,
            Figure::Depth { matrix, fits } => depth(&root, matrix, fits)?,
            Figure::Gpt2Memory(m) => gpt2_memory(&root, m)?,
        }
        root.present().map_err(plot_err)
    }
}

/// Writes every figure of the matrix into `dir`.
pub fn all(dir: &Path, m: &Matrix, fits: &[(String, f64)]) -> Result<()> {
    let models = m.models(false).len().max(1) as u32;
    let rows = models.div_ceil(2);
    both(dir, "tradeoff", (1200, 420 * rows), |out| out(Figure::Tradeoff(m)))?;
    both(dir, "timelines", (1200, 420 * rows), |out| out(Figure::Timelines(m)))?;
    if !m.models(true).is_empty() {
        both(dir, "depth", (900, 600), |out| out(Figure::Depth { matrix: m, fits }))?;
    }
    Ok(())
}

/// The figure of `--matrix gpt2-24gb`: `memory.png` and `.svg`.
pub fn gpt2_24gb(dir: &Path, m: &Matrix) -> Result<()> {
    both(dir, "memory", (1100, 120 + 22 * m.records.len() as u32), |out| out(Figure::Gpt2Memory(m)))
}

/// Peak memory of every configuration as a bar (measured where it ran, predicted and pale where
/// it did not), smallest model at the top, against a line at 24 GiB.
fn gpt2_memory<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, m: &Matrix) -> Result<()> {
    // Bottom up: the largest model's last configuration first.
    let bars: Vec<(String, f64, bool)> = crate::table24::in_size_order(m)
        .into_iter()
        .rev()
        .filter_map(|r| match r.status {
            Status::Ok => Some((format!("{} {}", r.model, r.policy), crate::report::gib(crate::table24::measured_total(r)), true)),
            _ => Some((format!("{} {} ({})", r.model, r.policy, r.status), crate::report::gib(r.predicted_total_bytes?), false)),
        })
        .collect();
    let max = bars.iter().map(|b| b.1).fold(26.0, f64::max) * 1.05;
    let n = bars.len().max(1) as i32;
    let mut chart = ChartBuilder::on(root)
        .caption("GPT-2, batch 1 (8 micro-batches): peak memory by configuration", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(360)
        .build_cartesian_2d(0.0..max, (0..n).into_segmented())
        .map_err(plot_err)?;
    let label = |y: &SegmentValue<i32>| match y {
        SegmentValue::CenterOf(i) => bars.get(*i as usize).map_or(String::new(), |b| b.0.clone()),
        _ => String::new(),
    };
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(n as usize)
        .y_label_formatter(&label)
        .x_desc("GiB at the step's peak (measured; pale: predicted, not run)")
        .draw()
        .map_err(plot_err)?;
    for (i, (_, v, measured)) in bars.iter().enumerate() {
        let c = if *measured { color(0).filled() } else { color(0).mix(0.3).filled() };
        let (lo, hi) = (SegmentValue::Exact(i as i32), SegmentValue::Exact(i as i32 + 1));
        chart.draw_series([Rectangle::new([(0.0, lo), (*v, hi)], c)]).map_err(plot_err)?;
    }
    chart
        .draw_series(LineSeries::new([(24.0, SegmentValue::Exact(0)), (24.0, SegmentValue::Exact(n))], color(3).stroke_width(2)))
        .map_err(plot_err)?
        .label("24 GiB")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], color(3).stroke_width(2)));
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).position(SeriesLabelPosition::LowerRight).draw().map_err(plot_err)?;
    Ok(())
}

fn panels<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, n: usize) -> Vec<DrawingArea<DB, Shift>> {
    root.split_evenly((n.div_ceil(2).max(1), 2))
}

/// Peak memory against step time: one point per policy (filled: whole step, hollow: activations).
fn tradeoff<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, m: &Matrix) -> Result<()> {
    let models = m.models(false);
    for (area, model) in panels(root, models.len()).iter().zip(&models) {
        let rows: Vec<&Record> = m.ok_rows(model);
        if rows.is_empty() {
            continue;
        }
        // The planner's frontier: every budget= plan, predicted (time from off's measured step).
        let frontier: Vec<(f64, f64)> = rows
            .iter()
            .find(|r| r.policy == "off")
            .map(|off| off.frontier.iter().map(|p| (off.step_ms_median * p.time_ratio, p.peak_bytes as f64 / MIB)).collect())
            .unwrap_or_default();
        let times = rows.iter().map(|r| r.step_ms_median).chain(frontier.iter().map(|p| p.0));
        let max_t = times.clone().fold(0.0, f64::max) * 1.1;
        let min_t = times.fold(f64::MAX, f64::min) * 0.9;
        let max_m = rows.iter().map(|r| r.step_peak_bytes as f64 / MIB).chain(frontier.iter().map(|p| p.1)).fold(0.0, f64::max) * 1.15;
        let mut chart = ChartBuilder::on(area)
            .caption(format!("{model}: peak memory vs step time"), ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(min_t..max_t, 0.0..max_m)
            .map_err(plot_err)?;
        chart.configure_mesh().x_desc("step time (ms, median)").y_desc("peak above model state (MiB)").draw().map_err(plot_err)?;
        if !frontier.is_empty() {
            chart
                .draw_series(LineSeries::new(frontier.iter().copied(), BLACK.stroke_width(1)).point_size(3))
                .map_err(plot_err)?
                .label("budget= plans (predicted)")
                .legend(|(x, y)| PathElement::new([(x - 8, y), (x + 8, y)], BLACK));
        }
        for (i, r) in rows.iter().enumerate() {
            let (t, step, act) = (r.step_ms_median, r.step_peak_bytes as f64 / MIB, r.activation_peak_bytes as f64 / MIB);
            let c = color(i);
            chart
                .draw_series([Circle::new((t, step), 6, c.filled()), Circle::new((t, act), 6, c.stroke_width(2))])
                .map_err(plot_err)?
                .label(r.policy.clone())
                .legend(move |(x, y)| Circle::new((x, y), 5, c.filled()));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::LowerRight)
            .draw()
            .map_err(plot_err)?;
    }
    Ok(())
}

/// Heap above the step's start at every stage boundary; forward solid, recompute and backward dashed.
fn timelines<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, m: &Matrix) -> Result<()> {
    let models = m.models(false);
    for (area, model) in panels(root, models.len()).iter().zip(&models) {
        let rows: Vec<&Record> = m.ok_rows(model).into_iter().filter(|r| !r.timeline.is_empty()).collect();
        if rows.is_empty() {
            continue;
        }
        let above = |r: &Record, e: &remat::memory::Event| e.window_peak.saturating_sub(r.timeline_base_bytes) as f64 / MIB;
        let max_t = rows.iter().flat_map(|r| r.timeline.iter().map(|e| e.at_ms)).fold(0.0, f64::max) * 1.05;
        let max_m = rows.iter().flat_map(|r| r.timeline.iter().map(move |e| above(r, e))).fold(0.0, f64::max) * 1.15;
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
                let (y, seg) = (above(r, e), if e.phase == Phase::Forward { &mut forward } else { &mut backward });
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
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
            chart.draw_series(DashedLineSeries::new(backward, 6, 4, c.stroke_width(2))).map_err(plot_err)?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(plot_err)?;
    }
    Ok(())
}

/// Peak activation memory against depth, log-log, with the fitted exponents.
fn depth<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, m: &Matrix, fits: &[(String, f64)]) -> Result<()> {
    let points = |policy: &str| -> Vec<(f64, f64)> {
        m.models(true)
            .iter()
            .filter_map(|model| {
                m.find(model, policy).filter(|r| r.status == Status::Ok).map(|r| (depth_of(model) as f64, r.activation_peak_bytes as f64 / MIB))
            })
            .collect()
    };
    let all: Vec<(f64, f64)> = fits.iter().flat_map(|(p, _)| points(p)).collect();
    if all.is_empty() {
        return Ok(());
    }
    let (x0, x1) = (all.iter().map(|p| p.0).fold(f64::MAX, f64::min) / 1.5, all.iter().map(|p| p.0).fold(0.0, f64::max) * 1.5);
    let (y0, y1) = (all.iter().map(|p| p.1).fold(f64::MAX, f64::min) / 2.0, all.iter().map(|p| p.1).fold(0.0, f64::max) * 2.0);
    let mut chart = ChartBuilder::on(root)
        .caption("Activation peak against depth (GPT-2 blocks, fixed width)", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())
        .map_err(plot_err)?;
    chart.configure_mesh().x_desc("blocks L").y_desc("activation peak (MiB)").x_label_formatter(&|x| format!("{x:.0}")).draw().map_err(plot_err)?;
    for (i, (policy, exponent)) in fits.iter().enumerate() {
        let c = color(i);
        let pts = points(policy);
        chart
            .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
            .map_err(plot_err)?
            .label(format!("{policy}: ~ L^{exponent:.2}"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 5, c.filled()))).map_err(plot_err)?;
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).position(SeriesLabelPosition::UpperLeft).draw().map_err(plot_err)?;
    Ok(())
}
