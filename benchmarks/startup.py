"""Start-up time of ``woq serve``, with and without the quantized-model cache.

Each run times a server from its spawn until ``/health`` answers 200: first with the
cache's ``quantized/`` folder emptied (the model is quantized, then stored), then again
(the stored checkpoint is read). The kernels' build and tuning caches are kept, so the
difference is the quantization and the reading of the weights.

    python benchmarks/startup.py --model smollm2-135m-instruct --device cpu --out docs/bench
    python benchmarks/startup.py --random-config llama3-8b --workdir /tmp/llama3-8b --device cuda --out $OUT

``--random-config`` first writes a Hugging Face directory of random fp16 weights with that
config's shapes (benchmarks/engine.py) and the default model's tokenizer.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import write_json  # noqa: E402
from serving import free_port  # noqa: E402


def write_random_model(name: str, directory: Path, tokenizer: Path | None = None) -> Path:
    """An HF directory with ``name``'s config, random fp16 weights in 2 GB shards, and the
    tokenizer files in ``tokenizer`` (default: the default model's; its ids fit any of these
    vocabularies)."""
    import torch
    from safetensors.torch import save_file

    from engine import configs, random_state
    from woq.models.fetch import fetch_default_model
    from woq.kernels.options import default_cache_dir

    if (directory / "config.json").exists():
        return directory
    # (checked before the minutes of writing weights: without it every server fails to start)
    if tokenizer is not None and not (tokenizer / "tokenizer.json").exists():
        raise SystemExit(f"no tokenizer.json in {tokenizer}/: carry a tokenizer's files there (tokenizer.json, "
                         f"tokenizer_config.json, chat_template.jinja)")
    directory.mkdir(parents=True, exist_ok=True)
    config = configs()[name]
    state = random_state(config)
    shard, size, index = {}, 0, {}
    for k, v in state.items():
        shard[k] = v.cpu()
        size += v.numel() * 2
        if size >= 2 << 30 or k == list(state)[-1]:
            f = f"model-{len(set(index.values())) + 1:05d}.safetensors"
            save_file(shard, str(directory / f), metadata={"format": "pt"})
            index.update({n: f for n in shard})
            shard, size = {}, 0
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    config.torch_dtype = torch.float16
    config.save_pretrained(directory)
    tokenizer = tokenizer or fetch_default_model(default_cache_dir())
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tokenizer / f).exists():
            shutil.copy(tokenizer / f, directory / f)
    del state
    torch.cuda.empty_cache()
    return directory


def time_start(args: list[str], log_path: Path) -> float:
    """Seconds from spawning ``woq serve`` until /health answers 200 (the server is then stopped)."""
    port = free_port()
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "woq", "serve", "--port", str(port), "--log-format", "text", *args],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            while True:
                if proc.poll() is not None:
                    log.flush()
                    raise RuntimeError("the server exited during start-up:\n" + log_path.read_text()[-3000:])
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        return time.perf_counter() - t0
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        finally:
            proc.terminate()
            proc.wait(60)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    values = [result["without_cache_s"], result["with_cache_s"]]
    ax.barh(["cache empty", "cache filled"], values, color=["tab:gray", "tab:blue"])
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.1f} s", va="center")
    ax.set_xlabel("seconds until /health answers")
    ax.set_title(f"woq serve start-up: {result['model']} {result['quant']}, {result['device']}", fontsize=9)
    ax.set_xlim(0, max(values) * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model name or path (default: --random-config's directory)")
    p.add_argument("--random-config", choices=["llama3-8b", "smollm2-135m"])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/woq-startup-model"))
    p.add_argument("--quant", default="int4")
    p.add_argument("--device", default="auto")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--name", default="startup")
    a = p.parse_args()
    from woq.kernels.options import default_cache_dir

    model = a.model or str(write_random_model(a.random_config, a.workdir))
    quantized = default_cache_dir() / "quantized"
    args = ["--model", model, "--quant", a.quant, "--device", a.device, "--max-seq-len", "2048"]
    a.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="woq-startup-"))  # the servers' logs, read back here
    runs = []
    for i in range(a.runs):
        shutil.rmtree(quantized, ignore_errors=True)
        cold = time_start(args, logs / "cold.log")
        warm = time_start(args, logs / "cached.log")
        used = "from the quantized-model cache" in (logs / "cached.log").read_text()
        runs.append({"without_cache_s": cold, "with_cache_s": warm, "cache_read": used})
        print(f"run {i}: without the cache {cold:.1f} s, with it {warm:.1f} s (cache read: {used})", flush=True)
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() and a.device != "cpu" else "CPU"
    result = {"model": a.random_config or model, "quant": a.quant, "device": gpu, "runs": runs,
              "without_cache_s": statistics.median(r["without_cache_s"] for r in runs),
              "with_cache_s": statistics.median(r["with_cache_s"] for r in runs)}
    shutil.rmtree(logs, ignore_errors=True)
    write_json(a.out / f"{a.name}.json", result)
    plot(result, a.out / f"{a.name}.png")
    (a.out / f"{a.name}.md").write_text(
        f"`woq serve` start-up until /health answers, {result['model']} {a.quant} on {gpu}, median of {a.runs} runs "
        f"(kernel build and tuning caches warm):\n\n| quantized-model cache | seconds |\n|---|---|\n"
        f"| empty (quantize, then store) | {result['without_cache_s']:.1f} |\n"
        f"| filled (read the stored checkpoint) | {result['with_cache_s']:.1f} |\n\n"
        f"`python benchmarks/startup.py {' '.join(sys.argv[1:])}`\n")
    print((a.out / f"{a.name}.md").read_text())


if __name__ == "__main__":
    main()
