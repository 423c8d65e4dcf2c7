"""The README's first steps on a fresh clone with an empty cache, as a new user runs them:
serve the default model (fetched into the empty cache) and chat with it; quantize it once
with RTN and with GPTQ (a small calibration); serve the GPTQ checkpoint and chat with it
under the README's model name; the perplexity of the RTN checkpoint (its first 4 windows).
Each command is the real `woq` of the clone, installed into a virtual environment of its
own (which borrows this environment's installed dependencies, so nothing but the default
model is fetched)."""
import json
import site
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import LiveServer

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"  # the name the README's curl examples send

pytestmark = pytest.mark.slow


def _chat(server: LiveServer) -> str:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "temperature": 0, "max_tokens": 8,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing to clone")
    tmp = tmp_path_factory.mktemp("fresh")
    subprocess.run(["git", "clone", "-q", str(ROOT), str(tmp / "woq")], check=True, timeout=120)
    # a venv without packages of its own (pip, setuptools: this environment's are borrowed)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    inner = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                           capture_output=True, text=True).stdout.strip()
    (Path(inner) / "borrowed.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-build-isolation", str(tmp / "woq")], check=True, timeout=600)
    cache = tmp / "cache"  # empty
    return python, tmp, {"WOQ_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def _woq(clone, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    python, tmp, env = clone
    import os

    r = subprocess.run([str(python), "-m", "woq", *args], cwd=tmp, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **env})
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_the_readme_first_steps_on_a_fresh_clone(clone):
    python, tmp, env = clone
    # the installed package is the clone's, not this checkout's
    where = subprocess.run([str(python), "-c", "import woq.models, pathlib; print(pathlib.Path(woq.models.__file__))"],
                           capture_output=True, text=True, check=True, cwd=tmp).stdout.strip()
    assert not where.startswith(str(ROOT)), where
    server = LiveServer("--quant", "int4", env=env, python=str(python), cwd=tmp)
    try:
        assert "Paris" in _chat(server)
    finally:
        server.stop()
    _woq(clone, "quantize", MODEL, "smol-rtn", "--method", "rtn")
    _woq(clone, "quantize", MODEL, "smol-gptq", "--method", "gptq", "--samples", "4", "--seq-len", "128")
    server = LiveServer("--model", "smol-gptq", env=env, python=str(python), cwd=tmp)
    try:
        assert _chat(server)  # served under the README's model name
    finally:
        server.stop()
    result = json.loads(_woq(clone, "eval", "ppl", "smol-rtn", "--windows", "4").stdout.strip().splitlines()[-1])
    assert result["quant"] == "int4 g128 asym, rtn" and result["windows"] == 4, result
    assert 5 < result["perplexity"] < 100, result
