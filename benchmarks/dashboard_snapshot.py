"""Run the Grafana dashboard's queries against a real Prometheus scraping a live woq server.

Starts `woq serve` and Debian's `prometheus` (scraping every second) on loopback, drives a
bounded streaming load, then evaluates every PromQL expression of
docker/grafana/dashboards/woq.json through Prometheus' HTTP API. As a script it also
renders each panel's range query to a PNG (docs/dashboard.png): what the dashboard shows,
without Grafana. The test suite (tests/test_dashboard.py) uses the same harness.

    python benchmarks/dashboard_snapshot.py --serve-args "--quant int4" --seconds 40
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "woq.json"
sys.path.insert(0, str(Path(__file__).parent))


def panels() -> list[dict]:
    return json.loads(DASHBOARD.read_text())["panels"]


def expressions(cuda: bool = True) -> list[str]:
    """Every panel's PromQL (``cuda=False``: not the panels described as "CUDA only", which a
    CPU server leaves without data)."""
    return [t["expr"] for p in panels() if cuda or "CUDA only" not in p.get("description", "") for t in p["targets"]]


class Prometheus:
    """A throwaway Prometheus scraping ``target`` (host:port) every second."""

    def __init__(self, target: str, port: int):
        self.dir = Path(tempfile.mkdtemp(prefix="woq-prom-"))
        (self.dir / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"scrape_configs:\n  - job_name: woq\n    static_configs:\n      - targets: ['{target}']\n")
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [shutil.which("prometheus") or "prometheus", f"--config.file={self.dir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.dir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            try:
                if httpx.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("prometheus did not start")

    def query(self, expr: str) -> list:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10).json()
        if r["status"] != "success":
            raise ValueError(f"{expr}: {r.get('error')}")
        return r["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list:
        r = httpx.get(self.url + "/api/v1/query_range",
                      params={"query": expr, "start": start, "end": end, "step": step}, timeout=10).json()
        if r["status"] != "success":
            raise ValueError(f"{expr}: {r.get('error')}")
        return r["data"]["result"]

    def scraped(self) -> bool:
        return bool(self.query("up{job='woq'} == 1"))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


FILLER = "the quick brown fox jumps over the lazy dog while a small cat watches from the old wall".split()


async def load(url: str, model: str, seconds: float, clients: int = 4, max_tokens: int = 24,
               prompt_words: int = 0) -> int:
    """Streaming chat requests from ``clients`` concurrent clients for ``seconds``; each
    question follows ``prompt_words`` words of filler (about a token each), which sets the
    contexts the decode steps run at (the attention's tiles, and the o projection after it,
    depend on them: docs/design/metrics.md)."""
    deadline = time.monotonic() + seconds
    done = 0
    context = " ".join(FILLER[j % len(FILLER)] for j in range(prompt_words))

    async def client(i: int):
        nonlocal done
        async with httpx.AsyncClient(timeout=120) as c:
            n = 0
            while time.monotonic() < deadline:
                body = {"model": model, "max_tokens": max_tokens, "stream": True, "temperature": 0.7, "seed": n,
                        "messages": [{"role": "user",
                                      "content": f"{context} Tell me a fact about the number {i * 100 + n}."}]}
                async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass
                n += 1
                done += 1

    await asyncio.gather(*(client(i) for i in range(clients)))
    return done


def fixed_load(url: str, model: str, requests: int, max_tokens: int) -> None:
    """The same requests every time, one after another: greedy, ``max_tokens`` each (EOS
    ignored), so that two servers run the same steps at the same batch sizes."""
    with httpx.Client(timeout=120) as c:
        for n in range(requests):
            body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"Tell me a fact about the number {n}."}]}
            c.post(url + "/v1/chat/completions", json=body).raise_for_status()


CALLS = "sum by (path, layer, m_bucket) (woq_kernel_calls_total)"


def scraped_calls(prom: Prometheus, url: str) -> dict[str, float]:
    """``CALLS`` as Prometheus holds it once it has scraped what the server counts now."""
    text = httpx.get(url + "/metrics").text
    want = sum(float(v) for v in re.findall(r"^woq_kernel_calls_total\{[^}]*\} (\S+)$", text, re.M))
    for _ in range(100):
        got = {json.dumps(r["metric"], sort_keys=True): float(r["value"][1]) for r in prom.query(CALLS)}
        if sum(got.values()) == want:
            return got
        time.sleep(0.2)
    raise RuntimeError("Prometheus did not catch up with the server's counters")


def eager_check(serve_args: str, requests: int, max_tokens: int) -> dict:
    """The fixed load against a graph server (prefill graphs off: a graph prefill pads its
    prompt, so its M differs) and an eager one, each scraped by its own Prometheus: the
    calls counted by path, layer kind and M bucket, and whether they are equal."""
    from serving import free_port, spawn

    out = {}
    for name, flags in (("graphs", " --no-prefill-graphs"), ("eager", " --no-cuda-graphs")):
        server, url = spawn(serve_args + flags)
        prom = Prometheus(url.removeprefix("http://"), free_port())
        try:
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            fixed_load(url, model, requests, max_tokens)
            out[name] = scraped_calls(prom, url)
        finally:
            prom.stop()
            server.terminate()
            server.wait(30)
    out["equal"] = out["graphs"] == out["eager"]
    return out


def render(prom: Prometheus, start: float, end: float, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = panels()
    cols = 3
    rows = -(-len(ps) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(15, 3.2 * rows), squeeze=False)
    for ax, p in zip(axes.flat, ps):
        if p["type"] == "heatmap":  # cumulative "le" buckets -> per-bucket rates, as Grafana draws them
            import numpy as np

            series = prom.query_range(p["targets"][0]["expr"], start, end)
            series = sorted(series, key=lambda x: float(x["metric"]["le"]))
            if series:
                grid = np.array([[float(v[1]) for v in x["values"]] for x in series])
                per_bucket = np.diff(np.vstack([np.zeros(grid.shape[1]), grid]), axis=0)
                ax.imshow(per_bucket, aspect="auto", origin="lower", cmap="viridis")
                les = [x["metric"]["le"] for x in series]
                ax.set_yticks(range(0, len(les), 3), [les[i] for i in range(0, len(les), 3)], fontsize=6)
                ax.set_ylabel("latency bucket ≤ (s)", fontsize=7)
            ax.set_title(p["title"], fontsize=9)
            continue
        for t in p["targets"]:
            for series in prom.query_range(t["expr"], start, end):
                xs = [float(v[0]) - start for v in series["values"]]
                ys = [float(v[1]) for v in series["values"]]
                label = t["legendFormat"]
                for k, v in series["metric"].items():
                    label = label.replace("{{" + k + "}}", v)
                ax.plot(xs, ys, label=label[:28])
        ax.set_title(p["title"], fontsize=9)
        ax.set_xlabel("s", fontsize=7)
        ax.tick_params(labelsize=7)
        handles, labels = ax.get_legend_handles_labels()
        if 0 < len(labels) <= 8:
            ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(ps):]:
        ax.axis("off")
    fig.suptitle("woq dashboard (docker/grafana/dashboards/woq.json) evaluated by Prometheus during a load run")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    from serving import free_port, spawn

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve-args", default="--quant int4 --max-seq-len 512")
    ap.add_argument("--seconds", type=float, default=40)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--prompt-words", type=int, default=0, help="filler words before each question (longer contexts)")
    ap.add_argument("--timing-every", type=int, default=1, help="the server's --kernel-timing-every")
    ap.add_argument("--eager-check", type=int, default=0, metavar="REQUESTS",
                    help="also count the calls of REQUESTS fixed requests on a graph and an eager server")
    a = ap.parse_args()
    server, url = spawn(a.serve_args + f" --kernel-timing-every {a.timing_every}")
    prom = Prometheus(url.removeprefix("http://"), free_port())
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        start = time.time()
        n = asyncio.run(load(url, model, a.seconds, a.clients, a.max_tokens, a.prompt_words))
        time.sleep(3)
        end = time.time()
        # what Prometheus holds at the end, beside the picture: calls, timed samples and their
        # summed seconds by path, layer kind and M bucket (a mean latency at one M, to set
        # beside the kernel benchmark's at that M), the roofline gauges
        snapshot = {e: [(r["metric"], float(r["value"][1])) for r in prom.query(e)] for e in (
            CALLS, "sum by (path, layer, m_bucket) (woq_kernel_latency_seconds_count)",
            "sum by (path, layer, m_bucket) (woq_kernel_latency_seconds_sum)",
            "woq_kernel_roofline_ratio", "woq_decoder_layer_roofline_ratio", "woq_decode_step_roofline_ratio",
            "woq_build_info")}
        result = dict(requests=n, seconds=a.seconds, clients=a.clients, prompt_words=a.prompt_words,
                      serve_args=a.serve_args, queries=snapshot)
        empty = [e for e in expressions() if not prom.query(e)]
        print(f"{n} requests; {len(expressions()) - len(empty)}/{len(expressions())} dashboard queries returned data")
        for e in empty:
            print("  no data:", e)
        render(prom, start, end, a.out)
        print("wrote", a.out)
    finally:
        prom.stop()
        server.terminate()
        server.wait(30)
    if a.eager_check:
        check = eager_check(a.serve_args + f" --kernel-timing-every {a.timing_every}", a.eager_check, a.max_tokens)
        result["eager_check"] = {k: v if k == "equal" else [[json.loads(s), c] for s, c in sorted(v.items())]
                                 for k, v in check.items()}
        print("calls by path, layer kind and M bucket: graphs", "==" if check["equal"] else "!=", "eager")
        for key in sorted(set(check["graphs"]) | set(check["eager"])):
            print(f"  {key}: graphs {check['graphs'].get(key, 0):.0f} eager {check['eager'].get(key, 0):.0f}")
    a.out.with_suffix(".json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
