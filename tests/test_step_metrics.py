"""The engine's step metrics (``woq_prefill_tokens``, ``woq_step_prompt_tokens``,
``woq_batch_size``, ``woq_engine_iteration_seconds``) through the real ``Metrics``
registry, against the chunk arithmetic of a prompt prefilled alone."""
import threading
import time

import torch

from woq.engine.engine import Engine
from woq.engine.sampling import SamplingParams
from woq.service.metrics import Metrics

from conftest import random_llama


def test_a_lone_prompts_chunks_are_each_counted_as_a_step():
    """A 100-token prompt with nothing else running goes in chunks of at most 16 tokens:
    7 prefill steps whose tokens sum to 100, the first 6 with nothing to decode (not decode
    steps of batch 0), then 7 decode steps of one sequence for the 8 tokens asked."""
    metrics = Metrics()
    engine = Engine(random_llama(torch.float32, "cpu", 256), None, set(), max_num_seqs=2, max_seq_len=256,
                    max_prefill_tokens=16, observer=metrics).start()
    done = threading.Event()
    try:
        start = time.perf_counter()
        engine.submit(list(range(1, 101)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                      lambda ev: ev.finish_reason and done.set())
        assert done.wait(60)
        wall = time.perf_counter() - start
    finally:
        engine.shutdown()
    value = metrics.registry.get_sample_value
    assert value("woq_prefill_tokens_total") == 100
    assert value("woq_step_prompt_tokens_count") == -(-100 // 16) and value("woq_step_prompt_tokens_sum") == 100
    assert value("woq_step_prompt_tokens_bucket", {"le": "16.0"}) == -(-100 // 16)
    assert value("woq_batch_size_count") == 8 - 1 and value("woq_batch_size_bucket", {"le": "1.0"}) == 8 - 1
    # iterations: 6 chunks alone; the last chunk with the first decode step (its token is
    # the prefill's first); 6 decode steps alone. Their times lie within the request's.
    iterations = {kind: value("woq_engine_iteration_seconds_count", {"kind": kind})
                  for kind in ("prefill", "mixed", "decode")}
    assert iterations == {"prefill": 6, "mixed": 1, "decode": 8 - 2}
    seconds = [value("woq_engine_iteration_seconds_sum", {"kind": kind}) for kind in iterations]
    assert all(t > 0 for t in seconds) and sum(seconds) <= wall
