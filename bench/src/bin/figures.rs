//! The paper's Figures 5 and 6 from `mem-bench`'s CSV files: `fig5.png`, MGS's execution time
//! (× the run without checkpoints) against K, memory against persistent checkpoints; and
//! `fig6.png`, the same with `auto` checkpoints in a small memory, one line per cleaning
//! policy.
//!
//! Usage: figures --fig5 mem-bench.csv [--fig6 policies.csv] [--out DIR]
//! Text is drawn with DejaVu Sans (`/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf`, the
//! `fonts-dejavu-core` package the setup script installs; `--font FILE` for another).

use anyhow::{bail, Context, Result};
use plotters::prelude::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Draws the paper's Figures 5 and 6 from `mem-bench`'s CSVs, as PNG.
#[derive(clap::Parser)]
#[command(name = "figures", version, about)]
struct Args {
    /// Figure 5's CSV (memory against persistent checkpoints per K).
    #[arg(long, value_name = "CSV", default_value = "mem-bench.csv")]
    fig5: PathBuf,
    /// Figure 6's CSV (the cleaning policies), if drawn.
    #[arg(long, value_name = "CSV")]
    fig6: Option<PathBuf>,
    /// Where the PNG files go.
    #[arg(long, value_name = "DIR", default_value = ".")]
    out: PathBuf,
    /// The font the text is drawn with.
    #[arg(
        long,
        value_name = "FILE",
        default_value = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"
    )]
    font: PathBuf,
}

fn args() -> Result<Args> {
    Ok(<Args as clap::Parser>::parse())
}

/// A CSV's lines as maps from its header's names to the values.
fn read_csv(path: &Path) -> Result<Vec<BTreeMap<String, String>>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().context("an empty CSV")?.split(',').collect();
    let mut rows = Vec::new();
    for (n, l) in lines.enumerate() {
        let cells: Vec<&str> = l.split(',').collect();
        if cells.len() != header.len() {
            bail!(
                "{} line {}: {} cells, the header has {}",
                path.display(),
                n + 2,
                cells.len(),
                header.len()
            );
        }
        rows.push(
            header
                .iter()
                .map(|h| h.to_string())
                .zip(cells.iter().map(|c| c.to_string()))
                .collect(),
        );
    }
    Ok(rows)
}

/// Per series (the value of `series`), the points (K, ratio), sorted by K.
fn series(rows: &[BTreeMap<String, String>], series: &str) -> Result<BTreeMap<String, Vec<(f64, f64)>>> {
    let mut out: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for r in rows {
        let name = r.get(series).with_context(|| format!("no column {series}"))?;
        let k: f64 = r.get("k").context("no column k")?.parse().context("k")?;
        let ratio: f64 = r.get("ratio").context("no column ratio")?.parse().context("ratio")?;
        if k > 0.0 {
            out.entry(name.clone()).or_default().push((k, ratio));
        }
    }
    for v in out.values_mut() {
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    Ok(out)
}

/// One figure: a line per series, overhead against K.
fn draw(path: &Path, title: &str, lines: &BTreeMap<String, Vec<(f64, f64)>>) -> Result<()> {
    let pts = lines.values().flatten();
    let k_max = pts.clone().map(|p| p.0).fold(0.0, f64::max) * 1.05;
    let y_max = pts.map(|p| p.1).fold(1.0, f64::max) * 1.1;
    let root = BitMapBackend::new(path, (900, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 24))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..k_max, 0.9..y_max)?;
    chart
        .configure_mesh()
        .x_desc("K (vectors between safe points)")
        .y_desc("execution time / without checkpoints")
        .label_style(("sans-serif", 16))
        .draw()?;
    for (i, (name, points)) in lines.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 16))
        .draw()?;
    root.present()?;
    Ok(())
}

fn main() -> Result<()> {
    let a = args()?;
    let font = std::fs::read(&a.font).with_context(|| {
        format!(
            "reading the font {} (install fonts-dejavu-core, or give --font FILE)",
            a.font.display()
        )
    })?;
    // plotters keeps registered fonts for the whole process.
    let font: &'static [u8] = Box::leak(font.into_boxed_slice());
    if plotters::style::register_font("sans-serif", FontStyle::Normal, font).is_err() {
        bail!("{} is not a font plotters can use", a.font.display());
    }
    std::fs::create_dir_all(&a.out)?;
    // (The run without checkpoints, K = 0, is each ratio's baseline, not a point.)
    let rows = read_csv(&a.fig5)?;
    let fig5 = a.out.join("fig5.png");
    draw(
        &fig5,
        "MGS 1024x1024, 4 nodes: memory against persistent checkpoints",
        &series(&rows, "level")?,
    )?;
    println!("{}", fig5.display());
    if let Some(p) = &a.fig6 {
        let fig6 = a.out.join("fig6.png");
        draw(
            &fig6,
            "MGS 1024x1024, 4 nodes, small memory: cleaning policies",
            &series(&read_csv(p)?, "policy")?,
        )?;
        println!("{}", fig6.display());
    }
    Ok(())
}
