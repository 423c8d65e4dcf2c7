"""The README's configuration table lists exactly the settings `woq serve` accepts."""
import re
from pathlib import Path

from woq.service.config import ServeSettings

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_config_table_matches_settings():
    text = README.read_text()
    rows = re.findall(r"^\| `--([a-z0-9-]+)` \| `WOQ_([A-Z0-9_]+)` \|", text, flags=re.M)
    flags = {flag for flag, _ in rows}
    assert all(env == flag.upper().replace("-", "_") for flag, env in rows)
    assert flags == {name.replace("_", "-") for name in ServeSettings.model_fields}


def test_readme_metrics_table_matches_exported_metrics(tmp_path):
    """Every documented metric is exported by a server's registry (engine-bound gauges
    included, on a tiny random model); the CUDA-only ones are documented as such."""
    import torch
    from transformers import AutoModelForCausalLM

    from conftest import tiny_hf_checkpoint
    from woq.engine.engine import Engine
    from woq.models.builder import build_model
    from woq.models.loader import read_safetensors
    from woq.models.quant_config import QuantConfig
    from woq.service.metrics import Metrics

    path = tiny_hf_checkpoint(tmp_path)
    config = AutoModelForCausalLM.from_pretrained(path).config
    model = build_model(config, read_safetensors(path), QuantConfig("int8"), torch.float32, "cpu", 64, progress=False)
    metrics = Metrics()
    metrics.bind_engine(Engine(model, None, set(), max_num_seqs=2, max_seq_len=64))
    text = README.read_text()
    rows = re.findall(r"^\| `(woq_[a-z_]+)` \|.*$", text, flags=re.M)
    documented = set(rows)
    cuda_only = {m for m in documented if "gpu_memory" in m}
    assert all("CUDA only" in line for line in re.findall(r"^\| `woq_gpu_memory.*$", text, flags=re.M))
    exported = {m.name + ("_total" if m.type == "counter" else "") for m in metrics.registry.collect()
                if m.name.startswith("woq_")}
    assert documented - cuda_only == exported
