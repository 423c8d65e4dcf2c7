"""The tuning tables: how they are named and read, and the choices made from them (CPU:
no GPU needed to read them)."""
import json
import random
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TUNED = ROOT / "kernels" / "tuned"


def test_dispatch_table_prints_every_stored_choice(tmp_path):
    table_file = min(TUNED.glob("*.json"))
    table = json.loads(table_file.read_text())
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dispatch_table.py"), "--cache", str(tmp_path)],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    # on a machine that measured nothing, that is said first, and the table is called shipped
    assert out.splitlines()[0].startswith("measured on this machine: nothing yet")
    assert f"{table_file.stem}: shipped" in out
    section = out.split(table_file.stem, 1)[1]
    header = next(line for line in section.splitlines() if line.startswith("| weight"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    for key, entry in table.items():
        row = next(line for line in section.splitlines() if line.startswith(f"| {key} |"))
        cells = dict(zip(columns, (c.strip() for c in row.strip("|").split("|"))))
        for m, (k_warps, blocks, pipeline) in entry["grids"].items():
            assert cells[f"GEMV M<={m}"] == f"{'s' if pipeline == 1 else ''}{k_warps}x{blocks}", (key, m)
        for m, (config, splits) in entry["gemm"].items():
            assert cells[f"GEMM M<={m}"] == f"c{config}x{splits}", (key, m)
        assert cells["GEMV up to M"] == str(entry["gemv_max_m"]) and cells["kernels up to M"] == str(entry["max_kernel_m"])


def test_shipped_tables_are_keyed_by_the_kernel_version():
    """A table is used only by the kernels of the version it was measured with (the file
    name ends in -v<kTuningVersion of csrc/woq_kernels.h>): a change of a kernel's launch
    space or numerics bumps the version, and the shipped defaults must be re-measured
    (benchmarks/gpu_check.sh tune) -- else every user of that GPU re-tunes at first load."""
    header = (ROOT / "kernels" / "csrc" / "woq_kernels.h").read_text()
    version = int(re.search(r"kTuningVersion\s*=\s*(\d+)", header).group(1))
    stems = [f.stem for f in TUNED.glob("*.json")]
    assert stems and all(s.rsplit("-", 1)[1] == f"v{version}" for s in stems), (stems, version)
    for f in TUNED.glob("*.json"):  # every entry in the current format
        for entry in json.loads(f.read_text()).values():
            assert set(entry) == {"grids", "gemm", "gemv_max_m", "max_kernel_m"}
            assert all(len(g) == 3 for g in entry["grids"].values())


def test_gemv_launch_serves_each_m_from_its_measured_row_count_or_the_next():
    """Rows 17..32 run the GEMV with the launch measured at 17, 24 or 32; a table without a
    17-row launch serves 17 rows with the 24-row one; a register-stream launch never serves
    more rows than the stream takes."""
    from woq.kernels.limits import GEMV_RING, GEMV_STREAM
    from woq.kernels.plans import measured_gemv
    from woq.kernels.tuning import GEMV_TUNED_MS

    table = {m: (m % 3 + 1, 100 + m, GEMV_STREAM if m <= 8 else GEMV_RING) for m in GEMV_TUNED_MS}
    assert [measured_gemv(table, m, 8) for m in (1, 3, 16, 17, 18, 24, 25, 32)] == \
        [table[1], table[4], table[16], table[17], table[24], table[24], table[32], table[32]]
    without_17 = {m: g for m, g in table.items() if m != 17}
    assert measured_gemv(without_17, 17, 8) == table[24]
    assert measured_gemv({}, 5, 8) == (0, 0, GEMV_RING)
    assert measured_gemv({16: (8, 0, GEMV_STREAM), 17: (2, 50, GEMV_RING)}, 12, 8) == (2, 50, GEMV_RING)


def test_gemv_reach_serves_each_measured_m_closest_to_its_fastest_path():
    """The GEMV's reach (8, or a measured M from 16 up) from the tuner's timings, us: H100
    cases, then random ones against a brute force over every reach."""
    from woq.kernels.tuning import _gemv_reach

    dense = {m: 400.0 for m in (17, 24, 32)}
    # 28672 x 8192 int4: the 16-row GEMM tile wins from 16 rows on -> 9..16 leave the GEMV
    assert _gemv_reach({1: 43.8, 8: 51.5, 16: 58.7, 17: 61.7, 24: 64.6, 32: 75.3},
                       {16: 52.6, 17: 57.6, 24: 57.1, 32: 58.2}, dense, 16) == 8
    # 4096 x 14336 int8: the GEMM wins at 16 by 2 %, loses at 17 by 7 %, wins at 24
    assert _gemv_reach({1: 20.9, 8: 22.7, 16: 27.1, 17: 27.4, 24: 30.9, 32: 35.1},
                       {16: 26.6, 17: 29.4, 24: 29.8, 32: 30.1}, dense, 16) == 17
    # no mixed GEMM (e.g. a g32 weight): the GEMV keeps its 16 rows
    assert _gemv_reach({1: 5.0, 8: 6.0, 16: 8.0}, {}, {}, 16) == 16
    rng = random.Random(0)
    for _ in range(200):
        gemv = {m: rng.uniform(10, 20) for m in (1, 8, 16, 17, 24, 32)}
        gemm = {m: rng.uniform(10, 20) for m in (16, 17, 24, 32)}
        reach = _gemv_reach(gemv, gemm, {}, 16)

        def worst(r):
            return max((gemv[m] if m <= r else gemm[m]) / min(gemv[m], gemm[m]) for m in (16, 17, 24, 32))
        assert reach in (8, 16, 17, 24, 32) and worst(reach) == min(worst(r) for r in (8, 16, 17, 24, 32))


def test_tuner_measures_each_packed_step_size_the_mixed_gemm_serves():
    """The engine pads a packed step to one of its graphs' token counts, and past the GEMV's
    reach the mixed GEMM serves M rows with the launch of the smallest measured M at or
    above them: each count up to the default step budget is measured itself, not served
    with a launch chosen for more rows (docs/design/mixed_gemm.md)."""
    from woq.engine.cuda_graphs import prefill_buckets
    from woq.engine.engine import DEFAULT_PREFILL_TOKENS
    from woq.kernels.tuning import GEMM_MS

    served = [t for t in prefill_buckets(DEFAULT_PREFILL_TOKENS) if t >= 17]
    assert served and not [t for t in served if t not in GEMM_MS]
