"""Host time of an Orpheus runtime step, without the models' compute (CPU, no GPU needed).

tiny-orpheus on the GPU's code path (decode graphs, run eagerly on a CPU, hence the
look-ahead step; SNAC graphs), with the backbone's forward and the codec replaced by zeros
of the right shapes and the sampler's race by an argmax (on a GPU: one kernel each). What
a step costs is then the runtime's per-stream work, the executors' bookkeeping, the
sampler's Python and small kernels, and the SNAC executor's window handling:

    PYTHONPATH=. python benchmarks/scripts/host_orpheus.py [C] [--profile] [--steps]

The absolute times are this machine's; compare before/after on one machine.
"""
import cProfile, pstats, sys, time

import torch

from omniwalk import loading
from omniwalk.engine import sampler
from omniwalk.layers.transformer import CausalLM
from omniwalk.loading import EngineArgs, load_model
from omniwalk.models.orpheus import loading as orpheus_loading, snac
from omniwalk.models.orpheus.model import AUDIO_STREAM, CODES_STREAM, OrpheusPrompt
from omniwalk.models.orpheus.speech import SpeechRequest
from omniwalk.runtime import Request, Runtime, SchedulerConfig, StopConfig, StreamParams


def zeros_forward(self, input_ids, positions, attention, *extra):
    return torch.zeros(input_ids.shape[0], self.config.hidden_size)


def zeros_audio(self, codes, noise=None, keep=None):
    samples = codes[-1].shape[1] * self.config.hop_length if keep is None else keep[1] - keep[0]
    return torch.zeros(codes[-1].shape[0], 1, samples)


def main():
    streams = int(next((a for a in sys.argv[1:] if a.isdigit()), 256))
    CausalLM.forward = zeros_forward
    snac.SnacDecoder.forward = zeros_audio
    orpheus_loading.uses_decode_graphs = loading.uses_decode_graphs = lambda args, device: True
    sampler.use_triton = lambda x: True
    sampler.race_argmax = lambda scaled, low, high, token_ids=None: scaled.argmax(dim=-1)
    loaded = load_model(EngineArgs("tiny-orpheus", device="cpu", max_num_seqs=streams, kv_cache_tokens=1 << 18))
    model = loaded.served
    runtime = Runtime(model, SchedulerConfig(streams, 8192))
    for i in range(streams):
        runtime.add_request(Request(f"r{i}", OrpheusPrompt(list(range(300, 330))), {
            CODES_STREAM: StreamParams(1400, StopConfig(eos_ids=frozenset({model.tokens.end_of_speech}),
                                                        ignore_eos=True), SpeechRequest("x").sampling(i), i),
            AUDIO_STREAM: StreamParams(seed=i)}))
    first_steps = []
    for _ in range(35):
        start = time.perf_counter()
        runtime.step()
        first_steps.append((time.perf_counter() - start) * 1e3)
    if "--steps" in sys.argv:   # the wave's first steps: prefill, decode, the first windows (~28)
        print("first steps (ms):", " ".join(f"{t:.1f}" for t in first_steps))
    steps = 70   # ten frames: every phase of the 7-step window cycle equally
    blocks = []   # two frames each; the fastest is the least disturbed by the machine's other work
    for _ in range(steps // 14):
        start = time.perf_counter()
        for _ in range(14):
            runtime.step()
        blocks.append((time.perf_counter() - start) / 14 * 1e3)
    print(f"{streams} streams: {sum(blocks) / len(blocks):.2f} ms of host time a step "
          f"(fastest two frames: {min(blocks):.2f})")
    if "--profile" in sys.argv:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(steps):
            runtime.step()
        profile.disable()
        pstats.Stats(profile).sort_stats(sys.argv[-1] if sys.argv[-1] in ("cumtime", "tottime") else "tottime").print_stats(45)


if __name__ == "__main__":
    main()
