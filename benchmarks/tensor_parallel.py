"""Tensor parallelism over HTTP: ``woq serve --tensor-parallel-size N`` against N = 1.

For each server (``--server NAME=ARGS``, each added to ``--common``), started in turn on
this machine's GPUs:

* **greedy tokens**: ``--check-prompts`` completions of ``--check-tokens`` tokens each at
  temperature 0 with log-probabilities; each server's tokens are compared with the first
  server's, and the largest difference of the chosen tokens' log-probabilities over the
  common prefix is reported, with the first server's lead of its token over the runner-up
  where they part (a near-tie, which another valid rounding may break the other way). A
  second TP 1 server through a kernel per op (``--decode-step off``: the check's batch-1
  steps skip the persistent step) gives that comparison's noise floor;
* **throughput**: streamed completions (128-token prompts, 128 tokens out, ``ignore_eos``)
  at each ``--concurrency``, as ``serving.py`` sends them: output tokens/s, inter-token
  latency p50/p99, TTFT p50; the speed-up over the first server, and the scaling
  efficiency (speed-up / N).
* at concurrency 1, the fraction of the per-GPU weight roofline: tokens/s x the weight
  bytes one GPU reads a token (int4 g128 codes, fp16 scales and zero points of the linear
  layers, the fp16 LM head; each split N ways) / the copy bandwidth (measured here).

    python benchmarks/tensor_parallel.py --common "--model /tmp/llama3-8b --quant int4" \\
        --server tp1="--tensor-parallel-size 1" --server tp2="--tensor-parallel-size 2" --out docs/bench
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import subprocess
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, save_results  # noqa: E402
from serving import run_level, start_server  # noqa: E402

CHECK_PROMPTS = ["The history of the printing press", "def fibonacci(n):", "Photosynthesis is the process",
                 "Once upon a time in a small village", "The three laws of thermodynamics state"]


def start(args: str, log: Path) -> tuple[subprocess.Popen, str]:
    return start_server(["--log-level", "info", *shlex.split(args)], log)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def greedy_tokens(url: str, model: str, tokens: int, prompts: int) -> list[dict]:
    out = []
    for prompt in CHECK_PROMPTS[:prompts]:
        r = httpx.post(url + "/v1/completions", timeout=300, json={
            "model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 2})
        r.raise_for_status()
        lp = r.json()["choices"][0]["logprobs"]
        # (the chosen token's lead over the runner-up; 0 where both decode to one string:
        # the top log-probabilities are keyed by text)
        margins = [chosen - max((v for t, v in top.items() if t != token), default=chosen)
                   for token, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])]
        out.append({"tokens": lp["tokens"], "logprobs": lp["token_logprobs"], "margins": margins})
    return out


def compare(ref: list[dict], got: list[dict]) -> dict:
    """Equal greedy tokens per prompt, the first step they part, the reference's lead of its
    token over the runner-up there (a near-tie: another valid rounding may pick the other),
    and the largest log-probability difference over the steps before it."""
    equal, first_diff, margins, worst = 0, [], [], 0.0
    for a, b in zip(ref, got):
        n = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), len(a["tokens"]))
        equal += n == len(a["tokens"])
        first_diff.append(n)
        if n < len(a["tokens"]):
            margins.append(round(a["margins"][n], 4))
        worst = max([worst] + [abs(x - y) for x, y in zip(a["logprobs"][:n], b["logprobs"][:n])])
    return {"prompts_equal": equal, "prompts": len(ref), "first_difference": first_diff,
            "margin_at_difference": margins, "max_logprob_diff": worst}


def weight_bytes(model_dir: Path, group: int = 128) -> int:
    """Bytes of the linear layers (int4 codes, fp16 scales and zero points per ``group``) and
    the fp16 LM head, read once a token at batch 1."""
    c = json.loads((model_dir / "config.json").read_text())
    h, inter, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    shapes = [((c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * hd, h), (h, c["num_attention_heads"] * hd),
              (2 * inter, h), (h, inter)]
    per_layer = sum(n * k // 2 + 2 * 2 * n * (k // group) for n, k in shapes)
    return layers * per_layer + vocab * h * 2


def tp_size(args: str) -> int:
    """The ``--tensor-parallel-size`` of a server's arguments (``N`` or ``=N``), else 1."""
    a = shlex.split(args)
    for i, x in enumerate(a):
        if x == "--tensor-parallel-size":
            return int(a[i + 1])
        if x.startswith("--tensor-parallel-size="):
            return int(x.partition("=")[2])
    return 1


def run(a) -> dict:
    import torch

    from woq.kernels.timing import measure_copy_bandwidth

    bandwidth = measure_copy_bandwidth(0)
    torch.cuda.empty_cache()
    model_dir = Path(shlex.split(a.common)[shlex.split(a.common).index("--model") + 1])
    wbytes = weight_bytes(model_dir)
    levels = [int(c) for c in a.concurrency.split(",")]
    result = {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "copy_bandwidth": bandwidth,
              "weight_bytes": wbytes, "common": a.common, "servers": {},
              "command": "python benchmarks/tensor_parallel.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])}
    a.out.mkdir(parents=True, exist_ok=True)
    ref = None
    for spec in a.server:
        name, _, args = spec.partition("=")
        size = tp_size(args)
        proc, url = start(f"{a.common} {args}", a.out / f"tensor_parallel_{name}.log")
        try:
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            tokens = greedy_tokens(url, model, a.check_tokens, a.check_prompts)
            row = {"tp": size, "args": args, "levels": {}}
            row["greedy"] = compare(ref, tokens) if ref is not None else None
            row["greedy_tokens"] = tokens
            ref = ref or tokens
            for c in levels:
                row["levels"][str(c)] = asyncio.run(run_level(url, model, c, max(c * a.requests_per_client, 8),
                                                              128, 128))
                print(name, c, f"{row['levels'][str(c)]['output_tok_per_s']:.0f} tok/s", flush=True)
            result["servers"][name] = row
        finally:
            stop(proc)
        _derive(result)
        save_results(a.out, a.name, result, summary, plot)  # (after each server: a cut-off run keeps its rows)
    return result


def _derive(result: dict) -> None:
    """Speed-ups and efficiencies against the first server; the per-GPU roofline at one client."""
    first = next(iter(result["servers"].values()))
    for row in result["servers"].values():
        for c, lv in row["levels"].items():
            base = first["levels"][c]["output_tok_per_s"]
            lv["speedup"] = lv["output_tok_per_s"] / base
            lv["efficiency"] = lv["speedup"] / row["tp"] * first["tp"]
        if "1" in row["levels"]:
            per_token = row["levels"]["1"]["per_request_tok_per_s"]
            row["roofline_b1"] = per_token * (result["weight_bytes"] / row["tp"]) / result["copy_bandwidth"]


def summary(r: dict) -> str:
    lines = [f"# Tensor parallelism over HTTP, {r['gpus']} x {r['gpu']}", "",
             f"Common arguments `{r['common']}`; copy bandwidth {r['copy_bandwidth'] / 1e12:.2f} TB/s; "
             f"weight bytes a token {r['weight_bytes'] / 1e9:.2f} GB (split over the ranks). "
             f"Command: `{r['command']}`.", ""]
    rows = []
    for name, s in r["servers"].items():
        for c, lv in s["levels"].items():
            rows.append([name, s["tp"], c, f"{lv['output_tok_per_s']:.0f}", f"{lv['speedup']:.2f}",
                         f"{lv['efficiency']:.2f}", f"{lv['itl_p50_ms']:.2f} / {lv['itl_p99_ms']:.2f}",
                         f"{lv['ttft_p50_ms']:.0f}",
                         f"{100 * s['roofline_b1']:.0f} %" if c == "1" and "roofline_b1" in s else "",
                         lv["errors"]])
    lines += [markdown_table(["server", "TP", "clients", "output tok/s", "speed-up", "efficiency",
                              "ITL p50 / p99 ms", "TTFT p50 ms", "per-GPU weight roofline", "errors"], rows), ""]
    lines += ["Greedy tokens against the first server (temperature 0, log-probabilities of the chosen tokens):", ""]
    lines += [markdown_table(["server", "prompts equal", "first difference (step)",
                              "reference's lead there (logprob)", "max abs Δ logprob before it"],
                             [[n, f"{s['greedy']['prompts_equal']} / {s['greedy']['prompts']}",
                               str(s["greedy"]["first_difference"]), str(s["greedy"].get("margin_at_difference", "")),
                               f"{s['greedy']['max_logprob_diff']:.4f}"]
                              for n, s in r["servers"].items() if s["greedy"] is not None]), ""]
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, s in r["servers"].items():
        cs = [int(c) for c in s["levels"]]
        ax.plot(cs, [lv["output_tok_per_s"] for lv in s["levels"].values()], "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Tensor parallelism, {r['gpu']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--common", required=True, help="arguments of every server (with --model)")
    p.add_argument("--server", action="append", required=True, help="NAME=ARGS (the first is the reference)")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--check-tokens", type=int, default=32)
    p.add_argument("--check-prompts", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("docs/bench"))
    p.add_argument("--name", default="tensor_parallel")
    run(p.parse_args())


if __name__ == "__main__":
    main()
