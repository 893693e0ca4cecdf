"""A placement on CUDA (run on the device machine with `-m gpu`; passed on one H200 at
31f317b, both groups on its one GPU): Orpheus' SNAC in a worker process of its own on the
last GPU, its PCM, copied to the host in the worker, equal to one process's up to 1 LSB."""

import numpy as np
import pytest
import torch

from omniwalk import Engine, EngineArgs
from omniwalk.capabilities.speech import SpeechRequest, synthesize
from omniwalk.placement import parse_placement

pytestmark = pytest.mark.gpu


def test_snac_in_a_worker_on_cuda_gives_the_samples_of_one_process():
    codec_gpu = torch.cuda.device_count() - 1
    placement = parse_placement(f"groups:\n  - name: backbone\n    nodes: [backbone]\n    devices: [0]\n"
                                f"  - name: codec\n    nodes: [snac_decoder]\n    devices: [{codec_gpu}]\n")
    requests = [SpeechRequest("Hello there, how are you?", voice="tara", max_output_tokens=n, ignore_eos=True,
                              seed=7) for n in (7, 29, 70)]
    results = []
    for extra in ({}, {"engine_process": True, "placement": placement}):
        args = EngineArgs("tiny-orpheus", device="cuda:0", dtype="float32", kv_cache_tokens=32768, max_num_seqs=16,
                          **extra)
        with Engine(args) as engine:
            results.append([synthesize(engine, request) for request in requests])
            if extra:
                assert engine.stats.node_batches["snac_decoder"] > 0 and len(engine.worker_pids) == 1
    for a, b in zip(*results):
        assert a.token_ids == b.token_ids and len(a.pcm) == len(b.pcm) > 0
        diff = np.abs(np.frombuffer(a.pcm, "<i2").astype(int) - np.frombuffer(b.pcm, "<i2").astype(int))
        assert diff.max() <= 1
