"""The Grafana dashboard against a live server: every metric it queries is exported, and a
real Prometheus (Debian's package) scraping the server during a load run returns data for
every one of its PromQL expressions."""
import asyncio
import re
import shutil
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import LiveServer, free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from dashboard_snapshot import Prometheus, expressions, load  # noqa: E402

pytestmark = pytest.mark.slow
MODEL = "smollm2"


@pytest.fixture(scope="module")
def server(smollm2_dir):
    s = LiveServer("--model", str(smollm2_dir), "--served-model-name", MODEL, "--quant", "int4", "--max-seq-len", "512",
                   "--kernel-timing-every", "1")
    yield s
    s.stop()


def test_every_metric_a_panel_queries_is_exported(server):
    httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3}, timeout=60)
    exported = {line.split("{")[0].split(" ")[0] for line in httpx.get(server.url + "/metrics").text.splitlines()
                if line and not line.startswith("#")}
    for expr in expressions(cuda=False):  # (a CPU server: the CUDA-only panels' gauges have no series)
        names = set(re.findall(r"\b((?:woq|process)_[a-z_]+)", expr)) - {"woq_gpu_memory_allocated_bytes"}
        assert names, expr
        assert names <= exported, f"{expr}: {names - exported} not exported"


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs Debian's prometheus (installed by .ci/run)")
def test_prometheus_evaluates_every_dashboard_query_with_data(server):
    prom = Prometheus(server.url.removeprefix("http://"), free_port())
    try:
        asyncio.run(load(server.url, MODEL, seconds=12, clients=3, max_tokens=12))
        time.sleep(3)  # a couple more scrapes after the load
        assert prom.scraped()
        empty = [e for e in expressions(cuda=False) if not prom.query(e)]
        assert not empty, f"no data for: {empty}"
    finally:
        prom.stop()
