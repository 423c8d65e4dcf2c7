"""The fixed-tile GEMM benchmark's A/B report: each cell's runs gathered per version from
the run files, their medians and ratio (against statistics over the same values), and
cells one version lacks left out."""
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from gemm_tiles import configs_at, report, summary  # noqa: E402


def _runs(rng: random.Random, tag: str, ms: list[int]) -> list[dict]:
    return [dict(tree=tag, N=4096, K=14336, fmt="int4_g128", M=m, cublas=rng.uniform(10, 90),
                 **{f"c{c}": rng.uniform(10, 300) for c in configs_at(m)}) for m in ms]


def test_report_takes_each_versions_median_and_their_ratio(tmp_path):
    rng = random.Random(3)
    files = {}
    for name, ms in [("a1", [16, 64, 512]), ("a2", [16, 512]), ("b1", [16, 64, 512]), ("b2", [16, 512]),
                     ("b3", [512, 1024])]:
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(_runs(rng, name, ms)))
    sides = {"a": [files["a1"], files["a2"]], "b": [files["b1"], files["b2"], files["b3"]]}
    result = report(sides)

    def values(side: str, m: int, impl: str) -> list[float]:
        return [r[impl] for p in sides[side] for r in json.loads(p.read_text()) if r["M"] == m and impl in r]

    cells = {(c["M"], c["impl"]): c for c in result["cells"]}
    expected = {(m, impl) for m in (16, 64, 512) for impl in [f"c{c}" for c in configs_at(m)] + ["cublas"]}
    assert set(cells) == expected  # M = 1024: measured by b alone, left out
    for (m, impl), cell in cells.items():
        a, b = values("a", m, impl), values("b", m, impl)
        assert cell["runs"] == {"a": a, "b": b}
        assert cell["median"] == {"a": statistics.median(a), "b": statistics.median(b)}
        assert abs(cell["ratio"] - statistics.median(a) / statistics.median(b)) < 1e-12
    text = summary(result)
    assert text.count("\n| 4096x14336 |") == len(expected)
