"""The SVG chart layer (report/svg.py) and a run's figures drawn with it (report/figures.py)."""

from __future__ import annotations

import io
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from mismatch_probe.report.svg import Scale, _viridis, density_rgba, png


def test_scales_map_like_matplotlibs_transforms():
    from matplotlib.scale import SymmetricalLogTransform

    values = np.array([-1e3, -1.0, -1e-4, -1e-7, -3e-8, 0.0, 5e-8, 1e-7, 2e-6, 1e-2, 7.0, 1e3])
    scale = Scale("symlog", -1e3, 1e3, linthresh=1e-7, linscale=0.6)
    mpl = SymmetricalLogTransform(10, 1e-7, 0.6).transform(values)
    lo, hi = mpl[0], mpl[-1]
    np.testing.assert_allclose(scale(values), (mpl - lo) / (hi - lo), rtol=1e-12, atol=1e-12)
    log = Scale("log", 1e-3, 10.0)
    np.testing.assert_allclose(log([1e-3, 1e-2, 10.0]), [0.0, 0.25, 1.0])
    assert Scale("linear", -1, 1)(0.0) == pytest.approx(0.5)


def test_ticks_are_round_numbers_inside_the_range():
    assert Scale("linear", 0, 1).ticks() == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert Scale("linear", 0.012, 0.158).ticks() == [0.025, 0.05, 0.075, 0.1, 0.125, 0.15]
    assert Scale("log", 1e-8, 1.0).ticks() == [10.0**k for k in range(-8, 1)]
    assert Scale("log", 0.003, 0.06).ticks() == pytest.approx([0.005, 0.01, 0.02, 0.05])  # 1-2-5 when narrow
    assert len(Scale("log", 1e-30, 1.0).ticks()) <= 9


def test_png_decodes_to_the_pixels_written():
    from PIL import Image

    rng = np.random.default_rng(0)
    rgba = rng.integers(0, 256, (7, 5, 4), dtype=np.uint8)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(png(rgba)))), rgba)


def test_density_image_is_log_coloured_and_transparent_where_empty():
    counts = np.array([[0, 1], [10, 100]])  # [x, y]
    rgba = density_rgba(counts, vmax=100)
    assert rgba.shape == (2, 2, 4)
    # rows run from high y to low: x = 0 at y = 1 is 1 (the lowest colour), at y = 0 empty
    assert rgba[1, 0, 3] == 0 and rgba[0, 0, 3] == 255
    assert np.array_equal(rgba[0, 0, :3], _viridis(np.array(0.0))) and np.array_equal(
        rgba[0, 1, :3], _viridis(np.array(1.0))
    )
    assert np.array_equal(rgba[1, 1, :3], _viridis(np.array(0.5)))  # 10 is half way from 1 to 100 in log


def _record_and_dist(n_tokens: int):
    from mismatch_probe.analysis.distributions import DistributionAccumulator, with_sequences
    from mismatch_probe.analysis.metrics import MetricsAccumulator, segment_starts
    from mismatch_probe.analysis.sequences import SCHEMA, SequenceIds, sequence_table
    from mismatch_probe.record import parse_record

    rng = np.random.default_rng(1)
    sample = np.repeat(np.arange(n_tokens // 50 + 1), 50)[:n_tokens]
    turn = (np.arange(n_tokens) % 50 >= 30).astype(np.int16)
    li = np.log(rng.beta(5, 0.3, n_tokens))
    lt = (li + rng.normal(0, 0.01, n_tokens)).clip(max=0)
    acc, dist, ids = (
        MetricsAccumulator(),
        DistributionAccumulator(),
        {g: SequenceIds() for g in ("all", "first", "later")},
    )
    shard = acc.add(lt, li, segment_starts(sample), np.arange(n_tokens) % 50, turn) if n_tokens else None
    if shard is not None:
        dist.add_terms(shard.terms, turn, sample[segment_starts(sample)], shard.sequences.max_mismatch)
        ids["all"].add(sample, None, segment_starts(sample))
        for g, keep in (("first", shard.segment_turn == 0), ("later", shard.segment_turn >= 1)):
            ids[g].add(sample, turn, shard.segments[keep])
    table = sequence_table({g: (ids[g], acc.sequences(g)) for g in ids}) if n_tokens else SCHEMA.empty_table()
    record = parse_record(
        {
            "status": "complete",
            "metrics": acc.metrics(),
            "metrics_by_turn": {g: acc.metrics(g) for g in ("first", "later")},
            "corrections": acc.corrections(),
            "breakdowns": acc.breakdowns(),
            "spec": {"name": "svg"},
        }
    )
    return record, with_sequences(dist.finish(), table)


@pytest.mark.parametrize("n_tokens", [0, 5000])
def test_every_run_figure_is_well_formed_svg_and_draws_nothing_active(n_tokens):
    from mismatch_probe.report.figures import run_figures

    record, dist = _record_and_dist(n_tokens)
    figures = run_figures(record, dist)
    assert [f["id"] for f in figures] == [
        "prob_density",
        "log_ppl_by_turn",
        "abs_delta_by_p_infer",
        "seq_max_mismatch_hist",
        "max_mismatch_vs_length",
        "mismatch_by_position",
        "importance_ratio",
    ]
    for f in figures:
        root = ET.fromstring(f["svg"])  # parses: every text is escaped
        assert root.tag.endswith("svg") and int(root.get("width")) > 300
        tags = {el.tag.split("}")[1] for el in root.iter()}
        assert not tags & {"script", "foreignObject", "a"}, f["id"]
        hrefs = [v for el in root.iter() for k, v in el.attrib.items() if k.endswith("href")]
        assert all(h.startswith("data:image/png;base64,") for h in hrefs), f["id"]
        assert len(f["svg"]) < 400_000, f["id"]
