"""A user's mistake at the command line or at start-up ends in one line on stderr and exit
status 2, with no traceback; --debug shows the traceback. The real `woq` command, in a
subprocess."""
import socket
import subprocess
import sys

import pytest
import torch


def woq(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "woq", *args], capture_output=True, text=True, timeout=120, **kw)


def assert_one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("woq: error: "), r.stderr[-2000:]
    assert "Traceback" not in r.stderr and all(n in lines[0] for n in needles), lines


def test_a_model_path_that_does_not_exist():
    assert_one_line_error(woq("serve", "--model", "/nonexistent/model"), "/nonexistent/model")


BAD_FLAGS = [("--quant", "int3"), ("--port", "99999"), ("--device", "gpu"), ("--group-size", "48")]


@pytest.mark.parametrize("flag, value", BAD_FLAGS)
def test_a_bad_flag_value_names_the_flag(flag, value):
    assert_one_line_error(woq("serve", flag, value), flag, value)


def test_a_bad_flag_is_answered_without_loading_torch():
    """Flags are checked before anything imports torch (seconds that a typo's answer need
    not wait for): each bad flag ends with status 2 and its one line, torch never loaded."""
    code = ("import sys\nfrom woq.cli import app\n"
            f"for flag, value in {BAD_FLAGS!r}:\n"
            "    try:\n        app(['serve', flag, value])\n    except SystemExit as exc:\n"
            "        assert exc.code == 2, exc.code\n"
            "print('torch loaded' if 'torch' in sys.modules else 'no torch')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "no torch", r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == len(BAD_FLAGS), r.stderr
    for line, (flag, value) in zip(lines, BAD_FLAGS):
        assert line.startswith(f"woq: error: {flag}: ") and value in line, line


def test_a_file_that_is_not_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("not a model")
    assert_one_line_error(woq("serve", "--model", str(bad)), str(bad), "not a GGUF file")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_asked_for_without_a_gpu():
    assert_one_line_error(woq("generate", "hi", "--device", "cuda"), "--device cuda", "no CUDA GPU")


def test_a_busy_port_is_reported_before_the_model_loads():
    """The port is bound first: with a busy port and a model that does not exist, the port
    is what fails."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = woq("serve", "--port", str(port), "--model", "/nonexistent/model")
    assert_one_line_error(r, f"127.0.0.1:{port}", "in use")


def test_debug_shows_the_traceback():
    r = woq("serve", "--model", "/nonexistent/model", "--debug")
    assert r.returncode != 0 and "Traceback" in r.stderr and "ModelSourceError" in r.stderr


def test_the_server_loads_without_torchs_compiler_stack():
    """``torch._dynamo`` (imported by ``torch.nn.attention.bias``) adds ~1.5 s to every CPU
    process that starts a server; nothing the server imports should pull it in."""
    code = "import sys, woq.service.server\nprint('dynamo' if 'torch._dynamo' in sys.modules else 'no dynamo')\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "no dynamo", r.stdout + r.stderr


def test_help_describes_every_subcommand_without_loading_torch():
    """`woq --help` and `woq serve --help` import neither torch nor the model code (they answer
    in a fraction of a second), list each subcommand with its description, and show
    optional flags without a `{...,null}` type."""
    code = ("import sys\nfrom woq.cli import app\n"
            "for args in (['--help'], ['serve', '--help']):\n"
            "    try:\n        app(args)\n    except SystemExit:\n        pass\n"
            "print('torch loaded' if 'torch' in sys.modules else 'no torch')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("no torch"), r.stdout + r.stderr
    top, serve = r.stdout.split("usage: woq serve", 1)
    for command in ("serve", "generate", "quantize", "eval"):
        line = next(x for x in top.splitlines() if x.strip().startswith(command + " "))
        assert len(line.split()) > 3, line  # the name and a description
    assert "null}" not in serve and "--group-size int" in serve
