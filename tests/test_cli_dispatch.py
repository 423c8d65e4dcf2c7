"""`woq bench dispatch` prints the shipped dispatch tables as they are stored (CPU: no GPU
needed to read them)."""
import json
import subprocess
import sys
from pathlib import Path

TUNED = Path(__file__).resolve().parents[1] / "kernels" / "tuned"


def test_bench_dispatch_prints_every_stored_choice(tmp_path):
    table_file = min(TUNED.glob("*.json"))
    table = json.loads(table_file.read_text())
    out = subprocess.run([sys.executable, "-m", "woq", "bench", "dispatch"], capture_output=True, text=True,
                         env={"WOQ_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}, check=True, timeout=120).stdout
    section = out.split(table_file.stem, 1)[1]
    header = next(line for line in section.splitlines() if line.startswith("| weight"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    for key, entry in table.items():
        row = next(line for line in section.splitlines() if line.startswith(f"| {key} |"))
        cells = dict(zip(columns, (c.strip() for c in row.strip("|").split("|"))))
        for m, grid in entry["grids"].items():
            assert cells[f"GEMV M<={m}"] == "x".join(map(str, grid)), (key, m)
        for m, (config, splits) in entry["gemm"].items():
            assert cells[f"GEMM M<={m}"] == f"c{config}x{splits}", (key, m)
        assert cells["GEMV up to M"] == str(entry["gemv_max_m"]) and cells["kernels up to M"] == str(entry["max_kernel_m"])
