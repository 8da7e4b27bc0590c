//! `bmoe-sim bars`: a grouped bar chart from a small JSON description, drawn with `plotters` as
//! SVG and PNG (the same drawing on both backends, text in the embedded DejaVu Sans). It is the
//! benchmark suite's plot (`scripts/bench-suite.py`), so the suite needs no Python plotting
//! library on the user's machine.
//!
//! ```json
//! {"title": "...", "y_label": "tok/s", "log_y": true,
//!  "groups": [{"name": "small\ndecode in RAM",
//!              "bars": [{"series": "bmoe", "value": 41.2}, {"series": "llama.cpp", "value": null}]}]}
//! ```
//!
//! Every series keeps one slot in every group, in the order series first appear, so a missing
//! measurement (`null`) leaves a gap instead of shifting the others. Each bar carries its value.

use crate::error::SimError;
use crate::sweep::plot::{register_font, series_colour, FONT};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// The whole chart.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BarChart {
    pub title: String,
    pub y_label: String,
    /// A logarithmic y axis (every value must then be above 0).
    #[serde(default)]
    pub log_y: bool,
    pub groups: Vec<Group>,
}

/// One group of bars along the x axis.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Group {
    /// The label under the group; `\n` breaks it into lines.
    pub name: String,
    pub bars: Vec<Bar>,
}

/// One bar.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Bar {
    pub series: String,
    /// `None`: not measured; the slot stays empty.
    pub value: Option<f64>,
}

impl BarChart {
    /// Parse and check a chart description; the error names the group and series at fault.
    pub fn parse(text: &str, what: &str) -> Result<BarChart, SimError> {
        let c: BarChart = serde_json::from_str(text)
            .map_err(|e| SimError::invalid(what.to_string(), e.to_string()))?;
        if c.groups.is_empty() {
            return Err(SimError::invalid(what.to_string(), "no groups to draw"));
        }
        for g in &c.groups {
            for b in &g.bars {
                let Some(v) = b.value else { continue };
                let bad = if !v.is_finite() {
                    Some("is not a finite number")
                } else if v < 0.0 {
                    Some("is negative")
                } else if c.log_y && v == 0.0 {
                    Some("is 0, which a logarithmic axis cannot show (use null for no value)")
                } else {
                    None
                };
                if let Some(why) = bad {
                    return Err(SimError::invalid(
                        what.to_string(),
                        format!("group {:?}, series {:?}: value {v} {why}", g.name, b.series),
                    ));
                }
            }
        }
        Ok(c)
    }

    /// The series in the order they first appear.
    pub fn series(&self) -> Vec<String> {
        let mut s: Vec<String> = Vec::new();
        for b in self.groups.iter().flat_map(|g| &g.bars) {
            if !s.contains(&b.series) {
                s.push(b.series.clone());
            }
        }
        s
    }

    fn values(&self) -> impl Iterator<Item = f64> + '_ {
        self.groups
            .iter()
            .flat_map(|g| g.bars.iter().filter_map(|b| b.value))
    }

    /// The y range drawn, in axis units (log10 of the value on a log axis), with room above
    /// the tallest bar for its label.
    fn y_range(&self) -> (f64, f64) {
        let max = self.values().fold(0f64, f64::max);
        if self.log_y {
            let min = self.values().fold(f64::INFINITY, f64::min);
            if !min.is_finite() {
                return (0.0, 1.0);
            }
            let lo = (min / 1.5).log10().floor();
            let hi = (max * 2.5).log10();
            (lo, hi.max(lo + 1.0))
        } else {
            (0.0, (max * 1.15).max(1e-9))
        }
    }

    fn to_axis(&self, v: f64) -> f64 {
        if self.log_y {
            v.log10()
        } else {
            v
        }
    }
}

/// A value as its bar label: three significant digits, no exponent.
fn label(v: f64) -> String {
    let a = v.abs();
    if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn err<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// Pixel sizes: (width, height, legend height, x label height).
fn size_of(c: &BarChart, n_series: usize) -> (u32, u32, u32, u32) {
    let width = (150 * c.groups.len() as u32 + 160).clamp(760, 2400);
    let lines = c
        .groups
        .iter()
        .map(|g| g.name.lines().count().max(1))
        .max()
        .unwrap_or(1) as u32;
    let label_h = 16 + 18 * lines;
    let legend_cols = (width / 260).max(1) as usize;
    let legend_h = 20 + 22 * n_series.div_ceil(legend_cols) as u32;
    (width, 520 + label_h + legend_h, legend_h, label_h)
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    c: &BarChart,
    series: &[String],
    legend_h: u32,
    label_h: u32,
) -> Result<(), String> {
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(&c.title, (FONT, 22).into_font()).map_err(err)?;
    let h = root.dim_in_pixel().1;
    let (plot, legend) = root.split_vertically(h.saturating_sub(legend_h));
    let n = c.groups.len() as f64;
    let (y0, y1) = c.y_range();
    let mut chart = ChartBuilder::on(&plot)
        .margin(12)
        .x_label_area_size(label_h)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..n, y0..y1)
        .map_err(err)?;
    let log = c.log_y;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc(c.y_label.as_str())
        .label_style((FONT, 14).into_font())
        .axis_desc_style((FONT, 15).into_font())
        .light_line_style(RGBColor(240, 240, 240))
        .y_label_formatter(&|t: &f64| {
            if log {
                // Label whole powers of ten only: 0.1, 1, 10, 100.
                if (t - t.round()).abs() < 1e-6 {
                    // 10^k: "0.01", "0.1", "1", "10", "100".
                    let k = t.round() as i32;
                    format!("{:.*}", (-k).max(0) as usize, 10f64.powi(k))
                } else {
                    String::new()
                }
            } else {
                label(*t)
            }
        })
        .draw()
        .map_err(err)?;
    let slot = 0.8 / series.len().max(1) as f64;
    let value_font = (FONT, 11)
        .into_font()
        .color(&BLACK)
        .pos(Pos::new(HPos::Center, VPos::Bottom));
    for (gi, g) in c.groups.iter().enumerate() {
        for b in &g.bars {
            let Some(v) = b.value else { continue };
            let si = series.iter().position(|s| *s == b.series).unwrap_or(0);
            let x0 = gi as f64 + 0.1 + slot * si as f64;
            let top = c.to_axis(v).max(y0);
            let colour = series_colour(si);
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(x0 + slot * 0.06, y0), (x0 + slot * 0.94, top)],
                    colour.filled(),
                )))
                .map_err(err)?;
            chart
                .draw_series(std::iter::once(Text::new(
                    label(v),
                    (x0 + slot / 2.0, top),
                    value_font.clone(),
                )))
                .map_err(err)?;
        }
    }
    // The group names, centred under each group, line by line.
    let base = plot.get_base_pixel();
    let name_font = (FONT, 14)
        .into_font()
        .color(&BLACK)
        .pos(Pos::new(HPos::Center, VPos::Top));
    for (gi, g) in c.groups.iter().enumerate() {
        let (px, py) = chart.backend_coord(&(gi as f64 + 0.5, y0));
        for (li, line) in g.name.lines().enumerate() {
            plot.draw(&Text::new(
                line.to_string(),
                (px - base.0, py - base.1 + 8 + 18 * li as i32),
                name_font.clone(),
            ))
            .map_err(err)?;
        }
    }
    let w = legend.dim_in_pixel().0;
    let cols = (w / 260).max(1) as usize;
    let col_w = (w as usize / cols) as i32;
    let font = (FONT, 15).into_font().color(&BLACK);
    for (i, s) in series.iter().enumerate() {
        let x = 16 + col_w * (i % cols) as i32;
        let y = 12 + 22 * (i / cols) as i32;
        legend
            .draw(&Rectangle::new(
                [(x, y - 6), (x + 24, y + 6)],
                series_colour(i).filled(),
            ))
            .map_err(err)?;
        legend
            .draw(&Text::new(s.clone(), (x + 32, y - 8), font.clone()))
            .map_err(err)?;
    }
    Ok(())
}

/// Draw `c` into `<stem>.svg` and `<stem>.png`; returns both paths.
pub fn write_bars(stem: &Path, c: &BarChart) -> Result<(PathBuf, PathBuf), SimError> {
    register_font();
    let series = c.series();
    let (w, h, legend_h, label_h) = size_of(c, series.len());
    let fail = |e: String| SimError::invalid(format!("plot {}", stem.display()), e);
    let with_ext = |ext: &str| {
        let mut p = stem.as_os_str().to_owned();
        p.push(ext);
        PathBuf::from(p)
    };
    let (svg_path, png_path) = (with_ext(".svg"), with_ext(".png"));
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (w, h)).into_drawing_area();
        draw(root, c, &series, legend_h, label_h).map_err(fail)?;
    }
    std::fs::write(&svg_path, svg).map_err(|e| SimError::io(&svg_path, e))?;
    {
        let root = BitMapBackend::new(&png_path, (w, h)).into_drawing_area();
        draw(root.clone(), c, &series, legend_h, label_h).map_err(fail)?;
        root.present().map_err(|e| fail(e.to_string()))?;
    }
    Ok((svg_path, png_path))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"title": "t", "y_label": "tok/s", "log_y": true, "groups": [
        {"name": "small\ndecode", "bars": [{"series": "bmoe", "value": 40.5},
                                           {"series": "llama.cpp", "value": null}]},
        {"name": "capped", "bars": [{"series": "llama.cpp", "value": 0.37},
                                    {"series": "sim", "value": 1.5}]}]}"#;

    #[test]
    fn series_keep_their_first_order_and_bad_values_are_named() {
        let c = BarChart::parse(GOOD, "chart.json").expect("parses");
        assert_eq!(c.series(), ["bmoe", "llama.cpp", "sim"]);
        let (lo, hi) = c.y_range();
        assert!(lo <= 0.37f64.log10() && hi >= 40.5f64.log10(), "{lo} {hi}");
        let zero = GOOD.replace("0.37", "0");
        let e = BarChart::parse(&zero, "chart.json")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"capped\"") && e.contains("\"llama.cpp\"") && e.contains("is 0"),
            "{e}"
        );
        let neg = GOOD.replace("1.5", "-1.5");
        let e = BarChart::parse(&neg, "chart.json").unwrap_err().to_string();
        assert!(e.contains("negative") && e.contains("\"sim\""), "{e}");
        let e = BarChart::parse(r#"{"title": "t", "y_label": "y", "groups": []}"#, "c.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("no groups"), "{e}");
        let e = BarChart::parse(r#"{"title": "t", "y_label": "y", "grups": []}"#, "c.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("c.json") && e.contains("grups"), "{e}");
    }

    #[test]
    fn writes_an_svg_and_a_png_naming_every_group_and_series() {
        let c = BarChart::parse(GOOD, "chart.json").expect("parses");
        let dir = std::env::temp_dir().join(format!("bmoe-bars-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (svg, png) = write_bars(&dir.join("suite"), &c).expect("draws");
        let text = std::fs::read_to_string(&svg).unwrap();
        for want in [
            "small",
            "decode",
            "capped",
            "bmoe",
            "llama.cpp",
            "sim",
            "40.5",
            "0.370",
        ] {
            assert!(text.contains(want), "{want} missing from the SVG");
        }
        let bytes = std::fs::read(&png).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        std::fs::remove_dir_all(&dir).ok();
    }
}
