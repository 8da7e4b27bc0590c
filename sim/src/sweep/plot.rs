//! The sweep's charts, drawn with `plotters` as SVG and PNG (same drawing, two backends):
//!
//! - `hit_rate`: decode hit rate vs budget, one line per policy (× predictor), with the
//!   bootstrap interval as whiskers. One panel per group of lanes/overlap settings whose hit
//!   rates are identical (so one panel without a predictor, whose hits never depend on them),
//!   titled with the settings it stands for — as `pivot.md` groups its hit tables, so no
//!   setting is silently left out and none repeated.
//! - `tok_s`: predicted tok/s vs budget, one panel per lanes/overlap setting.
//! - `per_layer`: a heat map of decode hit rate per MoE layer (rows) and budget (columns), one
//!   panel per policy (× predictor), at the first lanes/overlap setting.
//!
//! Every series has its own colour and marker (20 colours × 7 markers; Belady is black, the
//! bound), and the legend is drawn below the panels in columns, never over the data. Text is
//! set in DejaVu Sans, embedded (the `dejavu` crate), so a PNG looks the same on any machine.

use super::report::{distinct, setting_name, CellStats, XAxis};
use super::{Row, BELADY};
use crate::error::SimError;
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::Path;

/// Series colours: Tableau's ten, then their lighter pairs (Tableau 20), so up to 20 series
/// get 20 distinct colours (a sweep of every core policy × two predictors has 15); past 20 the
/// markers (7) still tell them apart. Use `series_colour`.
const PALETTE: [RGBColor; 20] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
    RGBColor(0xbc, 0xbd, 0x22),
    RGBColor(0x17, 0xbe, 0xcf),
    RGBColor(0xae, 0xc7, 0xe8),
    RGBColor(0xff, 0xbb, 0x78),
    RGBColor(0x98, 0xdf, 0x8a),
    RGBColor(0xff, 0x98, 0x96),
    RGBColor(0xc5, 0xb0, 0xd5),
    RGBColor(0xc4, 0x9c, 0x94),
    RGBColor(0xf7, 0xb6, 0xd2),
    RGBColor(0xc7, 0xc7, 0xc7),
    RGBColor(0xdb, 0xdb, 0x8d),
    RGBColor(0x9e, 0xda, 0xe5),
];

/// The colour of series `i` (it repeats only past `PALETTE.len()`).
pub(crate) fn series_colour(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

pub(crate) const FONT: &str = "sans-serif";

pub(crate) fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // DejaVu Sans parses; a failure would only leave text undrawn.
        let _ = plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular());
    });
}

/// A marker shape as a polygon in pixels around the point.
fn marker_points(kind: usize, r: i32) -> Vec<(i32, i32)> {
    let poly = |n: usize, phase: f64, rr: f64| -> Vec<(i32, i32)> {
        (0..n)
            .map(|i| {
                let a = phase + std::f64::consts::TAU * i as f64 / n as f64;
                ((rr * a.cos()).round() as i32, (rr * a.sin()).round() as i32)
            })
            .collect()
    };
    let rf = f64::from(r);
    match kind % 7 {
        0 => poly(12, 0.0, rf),                                      // circle
        1 => vec![(-r, -r), (r, -r), (r, r), (-r, r)],               // square
        2 => poly(3, -std::f64::consts::FRAC_PI_2, rf * 1.25),       // triangle up
        3 => vec![(0, -r - 1), (r + 1, 0), (0, r + 1), (-r - 1, 0)], // diamond
        4 => poly(3, std::f64::consts::FRAC_PI_2, rf * 1.25),        // triangle down
        5 => poly(5, -std::f64::consts::FRAC_PI_2, rf * 1.15),       // pentagon
        _ => {
            // plus
            let t = (r / 3).max(1);
            vec![
                (-t, -r),
                (t, -r),
                (t, -t),
                (r, -t),
                (r, t),
                (t, t),
                (t, r),
                (-t, r),
                (-t, t),
                (-r, t),
                (-r, -t),
                (-t, -t),
            ]
        }
    }
}

/// A point of a line: (x, y, optional interval).
pub type LinePoint = (f64, f64, Option<(f64, f64)>);

/// One line of a chart.
#[derive(Clone, Debug)]
pub struct Line {
    pub name: String,
    /// Index into the palette / marker list (stable across panels and charts).
    pub style: usize,
    pub black: bool,
    /// A marker at every point (off for a curve of many points, such as `mrc`'s staircase,
    /// whose touching markers would only thicken the line; the legend shows it either way).
    pub markers: bool,
    /// (x, y, optional interval).
    pub points: Vec<LinePoint>,
}

/// One panel.
#[derive(Clone, Debug)]
pub struct Panel {
    pub title: String,
    pub lines: Vec<Line>,
}

/// A figure of line panels sharing one legend.
#[derive(Clone, Debug)]
pub struct LineFigure {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    /// Fix y to [0, 1] and label it in percent.
    pub fraction: bool,
    /// The x values are log2 of the quantity: label ticks at whole powers of two as 2^x.
    pub x_log2: bool,
    pub panels: Vec<Panel>,
}

fn colour(l: &Line) -> RGBColor {
    if l.black {
        BLACK
    } else {
        series_colour(l.style)
    }
}

fn grid_shape(n: usize) -> (usize, usize) {
    match n {
        0 | 1 => (1, 1),
        2 => (1, 2),
        3 | 4 => (2, 2),
        5 | 6 => (2, 3),
        _ => (n.div_ceil(3), 3),
    }
}

fn size_of(fig_panels: usize, legend_entries: usize) -> (u32, u32, u32) {
    let (rows, cols) = grid_shape(fig_panels);
    let width = if cols == 1 { 960 } else { 560 * cols as u32 };
    let legend_cols = (width / 240).max(1) as usize;
    let legend_rows = legend_entries.div_ceil(legend_cols) as u32;
    let legend_h = 24 + 22 * legend_rows;
    let height = 50 + 420 * rows as u32 + legend_h;
    (width, height, legend_h)
}

fn err<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

fn draw_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    lines: &[Line],
) -> Result<(), String> {
    let (w, _) = area.dim_in_pixel();
    let cols = (w / 240).max(1) as usize;
    let col_w = (w as usize / cols) as i32;
    let font = (FONT, 15).into_font().color(&BLACK);
    for (i, l) in lines.iter().enumerate() {
        let x = 16 + col_w * (i % cols) as i32;
        let y = 14 + 22 * (i / cols) as i32;
        let c = colour(l);
        area.draw(&PathElement::new(
            vec![(x, y), (x + 34, y)],
            c.stroke_width(2),
        ))
        .map_err(err)?;
        area.draw(&Polygon::new(
            marker_points(l.style, 5)
                .into_iter()
                .map(|(dx, dy)| (x + 17 + dx, y + dy))
                .collect::<Vec<_>>(),
            c.filled(),
        ))
        .map_err(err)?;
        area.draw(&Text::new(l.name.clone(), (x + 42, y - 8), font.clone()))
            .map_err(err)?;
    }
    Ok(())
}

fn draw_lines<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    fig: &LineFigure,
    legend: &[Line],
    legend_h: u32,
) -> Result<(), String> {
    root.fill(&WHITE).map_err(err)?;
    let root = root
        .titled(&fig.title, (FONT, 22).into_font())
        .map_err(err)?;
    let (h, _) = (root.dim_in_pixel().1, ());
    let (plots, legend_area) = root.split_vertically(h.saturating_sub(legend_h));
    let (rows, cols) = grid_shape(fig.panels.len());
    let areas = plots.split_evenly((rows, cols));
    let all = fig
        .panels
        .iter()
        .flat_map(|p| p.lines.iter().flat_map(|l| l.points.iter()));
    let (mut x0, mut x1, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, 0f64);
    for &(x, y, ci) in all {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y1 = y1.max(ci.map_or(y, |c| c.1.max(y)));
    }
    if !x0.is_finite() {
        (x0, x1) = (0.0, 1.0);
    }
    let pad = ((x1 - x0) * 0.04).max(1e-9);
    let (x0, x1) = (x0 - pad, x1 + pad);
    let (y0, y1) = if fig.fraction {
        (0.0, 1.0)
    } else {
        (0.0, (y1 * 1.08).max(1e-9))
    };
    for (panel, area) in fig.panels.iter().zip(&areas) {
        let mut chart = ChartBuilder::on(area)
            .caption(&panel.title, (FONT, 17).into_font())
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(62)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(err)?;
        let fraction = fig.fraction;
        let log2 = fig.x_log2;
        // Enough decimals to tell the y ticks apart, no more.
        let y_places = if y1 >= 20.0 {
            0
        } else if y1 >= 2.0 {
            1
        } else {
            2
        };
        chart
            .configure_mesh()
            .x_desc(fig.x_label.as_str())
            .y_desc(fig.y_label.as_str())
            .label_style((FONT, 14).into_font())
            .axis_desc_style((FONT, 15).into_font())
            .light_line_style(RGBColor(240, 240, 240))
            .max_light_lines(2)
            .y_label_formatter(&|v: &f64| {
                if fraction {
                    format!("{:.0} %", 100.0 * v)
                } else {
                    format!("{v:.y_places$}")
                }
            })
            .x_label_formatter(&|v: &f64| {
                let a = v.abs();
                if log2 {
                    if (v - v.round()).abs() < 1e-6 {
                        format!("{}", 2f64.powi(v.round() as i32))
                    } else {
                        String::new()
                    }
                } else if a >= 100.0 || (a - a.round()).abs() < 1e-9 {
                    format!("{v:.0}")
                } else {
                    format!("{v:.1}")
                }
            })
            .draw()
            .map_err(err)?;
        for l in &panel.lines {
            let c = colour(l);
            chart
                .draw_series(LineSeries::new(
                    l.points.iter().map(|&(x, y, _)| (x, y)),
                    c.stroke_width(2),
                ))
                .map_err(err)?;
            chart
                .draw_series(l.points.iter().filter_map(|&(x, _, ci)| {
                    ci.map(|(lo, hi)| PathElement::new(vec![(x, lo), (x, hi)], c.stroke_width(1)))
                }))
                .map_err(err)?;
            if !l.markers {
                continue;
            }
            let shape = marker_points(l.style, 5);
            chart
                .draw_series(l.points.iter().map(|&(x, y, _)| {
                    EmptyElement::at((x, y)) + Polygon::new(shape.clone(), c.filled())
                }))
                .map_err(err)?;
        }
    }
    draw_legend(&legend_area, legend)?;
    Ok(())
}

/// Write `fig` as `<stem>.svg` and `<stem>.png` in `dir`.
pub fn write_line_figure(dir: &Path, stem: &str, fig: &LineFigure) -> Result<(), SimError> {
    register_font();
    let mut legend: Vec<Line> = Vec::new();
    for l in fig.panels.iter().flat_map(|p| &p.lines) {
        if !legend.iter().any(|m| m.name == l.name) {
            legend.push(l.clone());
        }
    }
    let (w, h, legend_h) = size_of(fig.panels.len(), legend.len());
    let fail = |e: String| SimError::invalid(format!("plot {stem}"), e);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (w, h)).into_drawing_area();
        draw_lines(root, fig, &legend, legend_h).map_err(fail)?;
    }
    let svg_path = dir.join(format!("{stem}.svg"));
    std::fs::write(&svg_path, svg).map_err(|e| SimError::io(&svg_path, e))?;
    let png_path = dir.join(format!("{stem}.png"));
    {
        let root = BitMapBackend::new(&png_path, (w, h)).into_drawing_area();
        draw_lines(root.clone(), fig, &legend, legend_h).map_err(fail)?;
        root.present().map_err(|e| fail(e.to_string()))?;
    }
    Ok(())
}

fn series_name(r: &Row, several_predictors: bool) -> String {
    if several_predictors {
        format!("{} · {}", r.policy, r.predictor)
    } else {
        r.policy.clone()
    }
}

/// The series of a sweep, in a stable order (policy-major), each with its style index.
fn series_styles(rows: &[Row]) -> Vec<(String, String, usize)> {
    let mut v = Vec::new();
    let mut next = 0;
    for policy in distinct(rows, |r| r.policy.clone()) {
        for predictor in distinct(rows, |r| r.predictor.clone()) {
            if rows
                .iter()
                .any(|r| r.policy == policy && r.predictor == predictor)
            {
                v.push((policy.clone(), predictor, next));
                next += 1;
            }
        }
    }
    v
}

fn panel_lines(
    rows: &[Row],
    stats: &[CellStats],
    x: XAxis,
    pick: impl Fn(&Row) -> bool,
    y: impl Fn(&Row, &CellStats) -> (f64, Option<(f64, f64)>),
) -> Vec<Line> {
    let several = distinct(rows, |r| r.predictor.clone()).len() > 1;
    series_styles(rows)
        .into_iter()
        .filter_map(|(policy, predictor, style)| {
            let mut points: Vec<LinePoint> = rows
                .iter()
                .zip(stats)
                .filter(|(r, _)| r.policy == policy && r.predictor == predictor && pick(r))
                .map(|(r, s)| {
                    let (v, ci) = y(r, s);
                    (x.value(r), v, ci)
                })
                .collect();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            let first = rows
                .iter()
                .find(|r| r.policy == policy && r.predictor == predictor)?;
            (!points.is_empty()).then(|| Line {
                name: series_name(first, several),
                style,
                black: policy == BELADY,
                markers: true,
                points,
            })
        })
        .collect()
}

/// What a hit-rate panel draws from the cells of one lanes/overlap setting, in row order:
/// per cell its predictor, policy, budget, hits, and per-turn decode routings and hits (what
/// the line and its bootstrap whiskers are computed from).
type HitKey = Vec<(String, String, u64, u64, Vec<(u64, u64)>)>;

fn hit_key(rows: &[Row], (lanes, overlap): (u32, bool)) -> HitKey {
    rows.iter()
        .filter(|r| r.lanes == lanes && r.overlap == overlap)
        .map(|r| {
            (
                r.predictor.clone(),
                r.policy.clone(),
                r.budget_bytes,
                r.hits,
                r.per_turn.iter().map(|t| (t.routings, t.hits)).collect(),
            )
        })
        .collect()
}

/// The hit-rate and tok/s figures of a sweep.
pub fn sweep_figures(
    rows: &[Row],
    stats: &[CellStats],
    x: XAxis,
    trace_name: &str,
) -> (LineFigure, LineFigure) {
    let settings = distinct(rows, |r| (r.lanes, r.overlap));
    // Settings whose hit-rate lines are identical share a panel, as they share a table in
    // `pivot.md` (hits depend on lanes and overlap only through a predictor's timing): one
    // panel when every setting agrees, else one per group of agreeing settings.
    let mut groups: Vec<(HitKey, Vec<(u32, bool)>)> = Vec::new();
    for &setting in &settings {
        let key = hit_key(rows, setting);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, of)) => of.push(setting),
            None => groups.push((key, vec![setting])),
        }
    }
    let hit_panels: Vec<Panel> = groups
        .iter()
        .map(|(_, of)| {
            let (l0, o0) = of[0];
            Panel {
                title: if groups.len() == 1 && settings.len() > 1 {
                    "identical under every lanes/overlap setting".into()
                } else {
                    of.iter()
                        .map(|&(l, o)| setting_name(l, o))
                        .collect::<Vec<_>>()
                        .join("; ")
                },
                lines: panel_lines(
                    rows,
                    stats,
                    x,
                    |r| r.lanes == l0 && r.overlap == o0,
                    |_, s| (s.hit, s.hit_ci),
                ),
            }
        })
        .collect();
    let tps_panels = settings
        .iter()
        .map(|&(l, o)| Panel {
            title: setting_name(l, o),
            lines: panel_lines(
                rows,
                stats,
                x,
                |r| r.lanes == l && r.overlap == o,
                |r, s| (r.tok_s().unwrap_or(0.0), s.tok_s_ci),
            ),
        })
        .collect();
    (
        LineFigure {
            title: format!("decode hit rate vs cache budget — {trace_name}"),
            x_label: x.label().into(),
            y_label: "decode hit rate".into(),
            fraction: true,
            x_log2: false,
            panels: hit_panels,
        },
        LineFigure {
            title: format!("predicted decode tok/s vs cache budget — {trace_name}"),
            x_label: x.label().into(),
            y_label: "tok/s".into(),
            fraction: false,
            x_log2: false,
            panels: tps_panels,
        },
    )
}

/// Viridis, by linear interpolation between 9 of its anchor colours.
fn viridis(t: f64) -> RGBColor {
    const A: [(u8, u8, u8); 9] = [
        (68, 1, 84),
        (71, 44, 122),
        (59, 81, 139),
        (44, 113, 142),
        (33, 144, 141),
        (39, 173, 129),
        (92, 200, 99),
        (170, 220, 50),
        (253, 231, 37),
    ];
    let t = t.clamp(0.0, 1.0) * (A.len() - 1) as f64;
    let i = (t.floor() as usize).min(A.len() - 2);
    let f = t - i as f64;
    let mix = |a: u8, b: u8| (f64::from(a) + (f64::from(b) - f64::from(a)) * f).round() as u8;
    RGBColor(
        mix(A[i].0, A[i + 1].0),
        mix(A[i].1, A[i + 1].1),
        mix(A[i].2, A[i + 1].2),
    )
}

/// One heat-map panel: `cells[x][y]` in [0, 1].
#[derive(Clone, Debug)]
pub struct HeatPanel {
    pub title: String,
    pub cells: Vec<Vec<f64>>,
}

/// Heat-map panels sharing axes labels and one colour scale.
#[derive(Clone, Debug)]
pub struct HeatFigure {
    pub title: String,
    pub x_desc: String,
    pub y_desc: String,
    pub scale_label: String,
    /// One label per column / row (sparse labels are thinned to about 16 per axis).
    pub x_labels: Vec<String>,
    pub y_labels: Vec<String>,
    pub panels: Vec<HeatPanel>,
}

const SCALE_H: u32 = 50;

fn draw_heat<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    f: &HeatFigure,
) -> Result<(), String> {
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(&f.title, (FONT, 22).into_font()).map_err(err)?;
    let h = root.dim_in_pixel().1;
    let (plots, scale) = root.split_vertically(h.saturating_sub(SCALE_H));
    let (rows, cols) = grid_shape(f.panels.len());
    let areas = plots.split_evenly((rows, cols));
    let nx = f.x_labels.len().max(1);
    let ny = f.y_labels.len().max(1);
    let x_every = nx.div_ceil(16).max(1);
    let y_every = ny.div_ceil(14).max(1);
    for (p, area) in f.panels.iter().zip(&areas) {
        let mut builder = ChartBuilder::on(area);
        if !p.title.is_empty() {
            builder.caption(&p.title, (FONT, 17).into_font());
        }
        let mut chart = builder
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(52)
            .build_cartesian_2d(0f64..nx as f64, 0f64..ny as f64)
            .map_err(err)?;
        let label = |labels: &[String], every: usize, v: f64| {
            let i = v - 0.5;
            let k = i.round() as usize;
            if (i - i.round()).abs() < 1e-6 && i >= 0.0 && k.is_multiple_of(every) {
                labels.get(k).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        };
        chart
            .configure_mesh()
            .disable_mesh()
            .x_desc(f.x_desc.as_str())
            .y_desc(f.y_desc.as_str())
            .label_style((FONT, 13).into_font())
            .axis_desc_style((FONT, 15).into_font())
            .x_labels(nx * 2 + 1)
            .y_labels(ny * 2 + 1)
            .x_label_formatter(&|v: &f64| label(&f.x_labels, x_every, *v))
            .y_label_formatter(&|v: &f64| label(&f.y_labels, y_every, *v))
            .draw()
            .map_err(err)?;
        chart
            .draw_series(p.cells.iter().enumerate().flat_map(|(x, col)| {
                col.iter().enumerate().map(move |(y, &v)| {
                    Rectangle::new(
                        [(x as f64, y as f64), (x as f64 + 1.0, y as f64 + 1.0)],
                        viridis(v).filled(),
                    )
                })
            }))
            .map_err(err)?;
    }
    // The colour scale.
    let (w, _) = scale.dim_in_pixel();
    let (x0, x1, y) = (80i32, (w as i32 - 320).clamp(200, 700), 10i32);
    let steps = 100;
    for i in 0..steps {
        let a = x0 + (x1 - x0) * i / steps;
        let b = x0 + (x1 - x0) * (i + 1) / steps;
        scale
            .draw(&Rectangle::new(
                [(a, y), (b + 1, y + 16)],
                viridis(f64::from(i) / f64::from(steps)).filled(),
            ))
            .map_err(err)?;
    }
    let font = (FONT, 14).into_font().color(&BLACK);
    for k in 0..=4 {
        let x = x0 + (x1 - x0) * k / 4;
        scale
            .draw(&Text::new(
                format!("{} %", 25 * k),
                (x - 12, y + 20),
                font.clone(),
            ))
            .map_err(err)?;
    }
    scale
        .draw(&Text::new(f.scale_label.clone(), (x1 + 16, y), font))
        .map_err(err)?;
    Ok(())
}

/// Write `f` as `<stem>.svg` and `<stem>.png` in `dir`.
pub fn write_heat_figure(dir: &Path, stem: &str, f: &HeatFigure) -> Result<(), SimError> {
    register_font();
    let (rows, cols) = grid_shape(f.panels.len());
    let w = if cols == 1 { 900 } else { 460 * cols as u32 };
    let h = 50 + 400 * rows as u32 + SCALE_H;
    let fail = |e: String| SimError::invalid(format!("plot {stem}"), e);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (w, h)).into_drawing_area();
        draw_heat(root, f).map_err(fail)?;
    }
    let svg_path = dir.join(format!("{stem}.svg"));
    std::fs::write(&svg_path, svg).map_err(|e| SimError::io(&svg_path, e))?;
    let png_path = dir.join(format!("{stem}.png"));
    let root = BitMapBackend::new(&png_path, (w, h)).into_drawing_area();
    draw_heat(root.clone(), f).map_err(fail)?;
    root.present().map_err(|e| fail(e.to_string()))?;
    Ok(())
}

/// Write the per-layer heat map of a sweep (`per_layer.svg`, `per_layer.png`): MoE layer ×
/// budget, one panel per policy (× predictor), at the first lanes/overlap setting.
pub fn write_heat_map(
    dir: &Path,
    rows: &[Row],
    layer_ids: &[u32],
    x: XAxis,
    trace_name: &str,
) -> Result<(), SimError> {
    let Some(first) = rows.first() else {
        return Ok(());
    };
    let (l0, o0) = (first.lanes, first.overlap);
    let sel: Vec<&Row> = rows
        .iter()
        .filter(|r| r.lanes == l0 && r.overlap == o0)
        .collect();
    let budgets: Vec<u64> = distinct(rows, |r| r.budget_bytes);
    let x_labels: Vec<String> = budgets
        .iter()
        .map(|&b| {
            sel.iter()
                .find(|r| r.budget_bytes == b)
                .map_or(String::new(), |r| super::report::trim(x.value(r), 1))
        })
        .collect();
    let several = distinct(rows, |r| r.predictor.clone()).len() > 1;
    let panels: Vec<HeatPanel> = series_styles(rows)
        .into_iter()
        .map(|(policy, predictor, _)| {
            let cells = budgets
                .iter()
                .map(|&b| {
                    sel.iter()
                        .find(|r| {
                            r.policy == policy && r.predictor == predictor && r.budget_bytes == b
                        })
                        .map_or_else(
                            || vec![0.0; layer_ids.len()],
                            |r| {
                                r.per_layer
                                    .iter()
                                    .map(|&(n, h)| super::ratio(h, n))
                                    .collect()
                            },
                        )
                })
                .collect();
            HeatPanel {
                title: if several {
                    format!("{policy} · {predictor}")
                } else {
                    policy
                },
                cells,
            }
        })
        .collect();
    write_heat_figure(
        dir,
        "per_layer",
        &HeatFigure {
            title: format!(
                "decode hit rate per MoE layer — {trace_name} ({})",
                setting_name(l0, o0)
            ),
            x_desc: x.label().into(),
            y_desc: "MoE layer".into(),
            scale_label: "decode hit rate".into(),
            x_labels,
            y_labels: layer_ids.iter().map(u32::to_string).collect(),
            panels,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cell of `policy` at `budget` under (`lanes`, `overlap`) with `hits` of 10 decode
    /// routings in one turn.
    fn cell(policy: &str, budget: u64, lanes: u32, overlap: bool, hits: u64) -> Row {
        Row {
            predictor: "pred1".into(),
            budget_bytes: budget,
            experts_per_layer: budget as f64,
            bank_frac: 0.5,
            policy: policy.into(),
            lanes,
            overlap,
            lookups: 10,
            hits,
            misses: 10 - hits,
            evictions: 0,
            rereads: 0,
            inserts: 10 - hits,
            bypasses: 0,
            timing: Some(super::super::Timing {
                tokens: 1,
                tok_s: 1.0,
                s_per_tok: 1.0,
                ..Default::default()
            }),
            per_layer: vec![(10, hits)],
            per_turn: vec![super::super::TurnStat {
                routings: 10,
                hits,
                time: Some(super::super::TurnTime {
                    tokens: 1,
                    decode_s: 1.0,
                }),
            }],
        }
    }

    fn titles(rows: &[Row]) -> Vec<String> {
        let stats = super::super::report::analyse(rows, 0, 0);
        let (hit, _) = sweep_figures(rows, &stats, XAxis::Experts, "t");
        hit.panels.into_iter().map(|p| p.title).collect()
    }

    #[test]
    fn hit_rate_panels_group_the_settings_whose_hits_agree() {
        // A predictor's timing makes overlap matter but not lanes: two panels, each naming the
        // two settings it stands for (the pivot's grouping). The old rule drew four.
        let mut rows = Vec::new();
        for budget in [2, 4] {
            for (lanes, overlap) in [(1, false), (1, true), (4, false), (4, true)] {
                for policy in ["lru", "lfu"] {
                    rows.push(cell(
                        policy,
                        budget,
                        lanes,
                        overlap,
                        budget + u64::from(overlap),
                    ));
                }
            }
        }
        assert_eq!(
            titles(&rows),
            [
                "1 lane, overlap off; 4 lanes, overlap off",
                "1 lane, overlap on; 4 lanes, overlap on"
            ]
        );
        // Every setting agrees: one panel, said so.
        for r in &mut rows {
            r.overlap = false;
        }
        rows.retain(|r| r.lanes == 1);
        for r in rows.clone() {
            rows.push(Row { lanes: 4, ..r });
        }
        assert_eq!(
            titles(&rows),
            ["identical under every lanes/overlap setting"]
        );
        // One setting only: its name.
        rows.retain(|r| r.lanes == 1);
        assert_eq!(titles(&rows), ["1 lane, overlap off"]);
        // Every setting differs: one panel each.
        let rows: Vec<Row> = [(1, false, 1), (4, false, 2), (4, true, 3)]
            .into_iter()
            .map(|(l, o, h)| cell("lru", 2, l, o, h))
            .collect();
        assert_eq!(titles(&rows).len(), 3);
    }

    #[test]
    fn markers_and_colours_are_distinct_for_seventy_series() {
        let mut seen = std::collections::HashSet::new();
        for i in 0..70 {
            let l = Line {
                name: String::new(),
                style: i,
                black: false,
                markers: true,
                points: vec![],
            };
            let c = colour(&l);
            assert!(seen.insert((c.0, c.1, c.2, i % 7)), "series {i}");
        }
        assert_eq!(viridis(0.0), RGBColor(68, 1, 84));
        assert_eq!(viridis(1.0), RGBColor(253, 231, 37));
    }

    #[test]
    fn the_first_twenty_series_colours_are_pairwise_distinct() {
        let colours: Vec<(u8, u8, u8)> = (0..20)
            .map(|i| {
                let c = series_colour(i);
                (c.0, c.1, c.2)
            })
            .collect();
        for (i, a) in colours.iter().enumerate() {
            assert_ne!(*a, (0, 0, 0), "series {i} is Belady's black");
            for (j, b) in colours.iter().enumerate().skip(i + 1) {
                assert_ne!(a, b, "series {i} and {j} share a colour");
            }
        }
    }
}
