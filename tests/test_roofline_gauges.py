"""The live roofline gauges' arithmetic (``service/metrics.py``), fed the samples a timed
twin reports, against the definition worked out here in exact fractions."""
import random
from fractions import Fraction

from woq.kernels.observe import KernelCall, KernelTiming
from woq.service.metrics import ROOFLINE_WINDOW, Metrics

BANDWIDTH = 3.0e12  # bytes/s
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


def call(layer: str, m: int = 4, path: str = "gemv") -> KernelCall:
    n, k = SHAPES[layer]
    return KernelCall(path, layer, 4, m, n, k, group_size=128, zeros=True)


def metrics() -> Metrics:
    m = Metrics()
    m.bind_timing(KernelTiming(m), BANDWIDTH)
    return m


def gauge(m: Metrics, name: str, **labels) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_each_kind_and_the_layer_against_exact_fractions():
    rng = random.Random(0)
    m = metrics()
    samples: dict[str, list[tuple[int, float]]] = {k: [] for k in SHAPES}
    # kinds sampled at different rates, in random order, past the window for some
    for layer in rng.choices(list(SHAPES), weights=[3, 1, 2, 1, 1], k=400):
        c = call(layer, m=rng.randint(2, 16))
        seconds = rng.uniform(2e-6, 4e-5)
        m.time(c, seconds)
        samples[layer].append((c.m * (c.n + c.k) * 2 + c.weight_bytes(), seconds))
    window = {k: s[-ROOFLINE_WINDOW:] for k, s in samples.items()}
    for layer, w in window.items():
        want = Fraction(sum(b for b, _ in w)) / sum(Fraction(t) for _, t in w) / Fraction(BANDWIDTH)
        assert abs(gauge(m, "woq_kernel_roofline_ratio", path="gemv", layer=layer) - float(want)) < 1e-12 * float(want)
    kinds = [w for k, w in window.items() if k != "lm_head"]
    want = (sum(Fraction(sum(b for b, _ in w), len(w)) for w in kinds)
            / sum(sum(Fraction(t) for _, t in w) / len(w) for w in kinds) / Fraction(BANDWIDTH))
    assert abs(gauge(m, "woq_decoder_layer_roofline_ratio", path="gemv") - float(want)) < 1e-12 * float(want)


def test_time_moved_between_kinds_moves_their_gauges_not_the_layers():
    """What programmatic launches do: down's first weight loads run in gate_up's time. Every
    call moves its bytes at 0.8 of the bandwidth; then the same with a quarter of down's
    time charged to gate_up."""
    even, shifted = metrics(), metrics()
    t = {layer: call(layer).bytes_moved() / (0.8 * BANDWIDTH) for layer in ("qkv", "o", "gate_up", "down")}
    moved = 0.25 * t["down"]
    for layer, seconds in t.items():
        even.time(call(layer), seconds)
        shifted.time(call(layer), seconds + {"gate_up": moved, "down": -moved}.get(layer, 0.0))
    for layer in t:
        assert abs(gauge(even, "woq_kernel_roofline_ratio", path="gemv", layer=layer) - 0.8) < 1e-12
    assert abs(gauge(shifted, "woq_kernel_roofline_ratio", path="gemv", layer="down") - 0.8 / 0.75) < 1e-12
    assert gauge(shifted, "woq_kernel_roofline_ratio", path="gemv", layer="gate_up") < 0.8 - 0.05
    for m in (even, shifted):
        assert abs(gauge(m, "woq_decoder_layer_roofline_ratio", path="gemv") - 0.8) < 1e-12


def test_the_lm_head_and_attention_stay_out_of_the_layer_gauge():
    m = metrics()
    m.time(call("lm_head", path="dense_gemv"), 1e-4)
    m.time(KernelCall("decode_step", "attention", 4, 1, 4096, 4096), 5e-6)
    assert gauge(m, "woq_decoder_layer_roofline_ratio", path="dense_gemv") is None
    assert gauge(m, "woq_decoder_layer_roofline_ratio", path="decode_step") is None
    assert gauge(m, "woq_kernel_roofline_ratio", path="dense_gemv", layer="lm_head") is not None
    c = call("qkv", m=1, path="decode_step")
    m.time(c, 1e-5)
    assert abs(gauge(m, "woq_decoder_layer_roofline_ratio", path="decode_step")
               - c.bytes_moved() / 1e-5 / BANDWIDTH) < 1e-12


def test_a_paired_call_is_timed_from_its_leaders_last_end():
    """A timed twin's block stamps (``BlockStampRows``, filled here as the kernels would):
    a call stamped in place runs from its first block's start to its last block's end; a
    paired call from its leader's last block's end (the interval a chain's call takes) to
    its own; blocks that never stamped (zeros) are left out, and a leader that never stamped
    leaves its call timed in place."""
    import torch

    from woq.kernels.observe import BlockStampRows

    rows = BlockStampRows(torch.device("cpu"), layers=3)
    rng = random.Random(1)

    def fill(row: torch.Tensor, t0: int, blocks: int) -> tuple[int, int]:
        starts = [t0 + rng.randint(0, 900) for _ in range(blocks)]
        ends = [s + rng.randint(1, 5000) for s in starts]
        for b, (s, e) in enumerate(zip(starts, ends)):
            row[2 * b], row[2 * b + 1] = s, e
        return min(starts), max(ends)

    in_place = call("o")
    first, last = fill(rows.take(in_place), 10_000, 7)
    paired = call("gate_up")
    leader_row, row = rows.take_paired(paired)
    _, leader_end = fill(leader_row, 20_000, 5)
    _, end = fill(row, 26_000, 9)
    silent = call("down")  # (its leader never stamped)
    leader_row, row = rows.take_paired(silent)
    s_first, s_end = fill(row, 40_000, 3)
    rows.take(call("qkv"))  # (no block stamped: not reported)
    rows.copy_out()
    assert rows.every_call() == [(in_place, (last - first) / 1e9), (paired, (end - leader_end) / 1e9),
                                 (silent, (s_end - s_first) / 1e9)]
    # 16 rows (4 kinds x (3 layers + a leader)), 6 taken: a paired call takes two
    assert all(rows.take_paired(call(kind, m=8)) is not None for kind in ("qkv", "o", "gate_up", "down"))
    assert rows.take(call("o", m=16)) is not None and rows.take_paired(call("qkv", m=16)) is None
    assert rows.take(call("qkv", m=16)) is not None and rows.take(call("qkv", m=32)) is None
