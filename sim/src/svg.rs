//! A small hand-written SVG line chart: the sweep's "hit rate / tok/s vs budget" and the
//! diff's per-token overlay. No dependency, deterministic output (fixed precision, series in
//! the order given), readable in any browser.

use std::fmt::Write as _;

/// One line of a chart.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub name: String,
    /// (x, y) points in drawing order; non-finite points are skipped.
    pub points: Vec<(f64, f64)>,
    /// Draw a dot on every point (for sparse series).
    pub dots: bool,
}

/// A line chart.
#[derive(Clone, Debug, PartialEq)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
}

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 460.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 200.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 55.0;
const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A "nice" tick step for a span: 1, 2 or 5 times a power of ten, about `n` ticks.
fn tick_step(span: f64, n: f64) -> f64 {
    if !(span.is_finite() && span > 0.0) {
        return 1.0;
    }
    let raw = span / n;
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let nice = if f < 1.5 {
        1.0
    } else if f < 3.5 {
        2.0
    } else if f < 7.5 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

fn label(v: f64, step: f64) -> String {
    let decimals = if step >= 1.0 {
        0
    } else {
        (-step.log10().floor()) as usize
    };
    format!("{v:.decimals$}")
}

/// Render `chart` as a complete SVG document. The y axis starts at 0 (or the smallest value
/// when negative); the x axis spans the data.
pub fn render(chart: &Chart) -> String {
    let pts = || {
        chart
            .series
            .iter()
            .flat_map(|s| s.points.iter())
            .filter(|(x, y)| x.is_finite() && y.is_finite())
    };
    let (mut x0, mut x1, mut y0, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, 0.0f64, 0.0f64);
    for &(x, y) in pts() {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if !x0.is_finite() {
        (x0, x1) = (0.0, 1.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if y1 <= y0 {
        y1 = y0 + 1.0;
    }
    let ystep = tick_step(y1 - y0, 5.0);
    y1 = (y1 / ystep).ceil() * ystep;
    let xstep = tick_step(x1 - x0, 6.0);
    let pw = WIDTH - LEFT - RIGHT;
    let ph = HEIGHT - TOP - BOTTOM;
    let sx = |x: f64| LEFT + (x - x0) / (x1 - x0) * pw;
    let sy = |y: f64| TOP + ph - (y - y0) / (y1 - y0) * ph;

    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
        LEFT + pw / 2.0,
        escape(&chart.title)
    );
    // Grid and ticks.
    let mut y = (y0 / ystep).ceil() * ystep;
    while y <= y1 + ystep * 1e-9 {
        let py = sy(y);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT:.1}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT + pw,
            LEFT - 6.0,
            py + 4.0,
            label(y, ystep)
        );
        y += ystep;
    }
    let mut x = (x0 / xstep).ceil() * xstep;
    while x <= x1 + xstep * 1e-9 {
        let px = sx(x);
        let _ = writeln!(
            s,
            r##"<line x1="{px:.1}" y1="{:.1}" x2="{px:.1}" y2="{:.1}" stroke="#999"/><text x="{px:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            TOP + ph,
            TOP + ph + 5.0,
            TOP + ph + 18.0,
            label(x, xstep)
        );
        x += xstep;
    }
    let _ = writeln!(
        s,
        r##"<rect x="{LEFT:.1}" y="{TOP:.1}" width="{pw:.1}" height="{ph:.1}" fill="none" stroke="#333"/>"##
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
        LEFT + pw / 2.0,
        HEIGHT - 15.0,
        escape(&chart.x_label)
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate(18,{:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
        TOP + ph / 2.0,
        escape(&chart.y_label)
    );
    // Series and legend.
    for (i, series) in chart.series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let points: Vec<String> = series
            .points
            .iter()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        if !points.is_empty() {
            let _ = writeln!(
                s,
                r#"<polyline fill="none" stroke="{color}" stroke-width="1.6" points="{}"/>"#,
                points.join(" ")
            );
        }
        if series.dots {
            for p in &points {
                if let Some((cx, cy)) = p.split_once(',') {
                    let _ = writeln!(s, r#"<circle cx="{cx}" cy="{cy}" r="3" fill="{color}"/>"#);
                }
            }
        }
        let ly = TOP + 10.0 + i as f64 * 18.0;
        let lx = LEFT + pw + 14.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="3"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            lx + 22.0,
            lx + 28.0,
            ly + 4.0,
            escape(&series.name)
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_nice() {
        assert_eq!(tick_step(100.0, 5.0), 20.0);
        assert_eq!(tick_step(1.0, 5.0), 0.2);
        assert_eq!(tick_step(7.0, 6.0), 1.0);
        assert_eq!(tick_step(0.0, 5.0), 1.0);
        assert_eq!(label(0.4, 0.2), "0.4");
        assert_eq!(label(40.0, 20.0), "40");
    }

    #[test]
    fn renders_a_well_formed_deterministic_document() {
        let chart = Chart {
            title: "hit rate <LRU & Belady>".into(),
            x_label: "budget (MiB)".into(),
            y_label: "hit rate".into(),
            series: vec![
                Series {
                    name: "lru".into(),
                    points: vec![(100.0, 0.3), (200.0, 0.5), (f64::NAN, 1.0)],
                    dots: true,
                },
                Series {
                    name: "belady".into(),
                    points: vec![(100.0, 0.6), (200.0, 0.8)],
                    dots: false,
                },
            ],
        };
        let a = render(&chart);
        assert_eq!(a, render(&chart));
        assert!(a.starts_with("<svg ") && a.ends_with("</svg>\n"));
        assert!(a.contains("&lt;LRU &amp; Belady&gt;"));
        assert_eq!(a.matches("<polyline").count(), 2);
        assert_eq!(a.matches("<circle").count(), 2, "the NaN point is skipped");
        let empty = render(&Chart {
            title: String::new(),
            x_label: String::new(),
            y_label: String::new(),
            series: vec![],
        });
        assert!(empty.contains("</svg>"));
    }
}
