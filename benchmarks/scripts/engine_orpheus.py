"""Host time of an Orpheus wave through the whole `Engine` (CPU, no GPU needed): the loop
thread, the output thread and an asyncio client sharing the interpreter lock, as the
in-process bench runs them. tiny-orpheus on the GPU's code path with zeros for the models'
compute (as `host_orpheus.py`); each wave is 256 speech requests of 70 codes:

    PYTHONPATH=. python benchmarks/scripts/engine_orpheus.py [WAVES]

Prints, per wave, the mean of decode steps 3-26 (no audio yet) and when the first audio
reached the client after the step that completed the first windows (step 28), with the
output thread's hand-over to the event loop. Compare versions on one machine, interleaved.
"""
import asyncio, importlib.util, os, sys, time

from omniwalk import api, loading
from omniwalk.api import Engine
from omniwalk.engine import sampler
from omniwalk.layers.transformer import CausalLM
from omniwalk.loading import EngineArgs
from omniwalk.models.orpheus import loading as orpheus_loading, snac
from omniwalk.models.orpheus.speech import SpeechRequest, submit_speech
from omniwalk.runtime import runtime as runtime_module

spec = importlib.util.spec_from_file_location("host_orpheus", os.path.join(os.path.dirname(__file__), "host_orpheus.py"))
host_orpheus = importlib.util.module_from_spec(spec)
spec.loader.exec_module(host_orpheus)
CausalLM.forward = host_orpheus.zeros_forward
snac.SnacDecoder.forward = host_orpheus.zeros_audio
orpheus_loading.uses_decode_graphs = loading.uses_decode_graphs = lambda args, device: True
sampler.use_triton = lambda x: True
sampler.race_argmax = lambda scaled, low, high, token_ids=None: scaled.argmax(dim=-1)

step_ends: list[float] = []
handed_over: list[float] = []   # the output thread handing a step's chunks to the event loop
original_step, original_send = runtime_module.Runtime.step, api._AsyncBatch.send


def step(self):
    outputs = original_step(self)
    step_ends.append(time.perf_counter())
    return outputs


def send(self):
    if self.by_loop:
        handed_over.append(time.perf_counter())
    return original_send(self)


runtime_module.Runtime.step, api._AsyncBatch.send = step, send
TEXT = "Hey there, my name is Tara, and I'm a speech generation model that can sound like a person."


async def main(waves: int, engine: Engine) -> None:
    loop = asyncio.get_running_loop()
    first_audio: dict[int, float] = {}

    async def one(index: int) -> None:
        stream = submit_speech(engine, SpeechRequest(TEXT, voice="tara", max_output_tokens=70, ignore_eos=True,
                                                     seed=index), loop=loop)
        async for chunk in stream:
            if chunk.pcm and index not in first_audio:
                first_audio[index] = time.perf_counter()

    for _ in range(waves):
        step_ends.clear(), handed_over.clear(), first_audio.clear()
        await asyncio.gather(*(one(i) for i in range(256)))
        base = step_ends[27]   # the end of step 28: the first windows are planned
        audio = sorted((t - base) * 1e3 for t in first_audio.values())
        hand_over = next((t - base) * 1e3 for t in handed_over if t > base)
        print(f"decode steps 3-26: {(step_ends[26] - step_ends[2]) / 24 * 1e3:.2f} ms a step; after step 28: "
              f"steps end at {', '.join(f'{(t - base) * 1e3:.1f}' for t in step_ends[28:31])} ms, chunks handed "
              f"over at {hand_over:.1f}, first audio p50 {audio[len(audio) // 2]:.1f} p90 "
              f"{audio[int(len(audio) * 0.9)]:.1f} ms")


if __name__ == "__main__":
    engine = Engine(EngineArgs("tiny-orpheus", device="cpu", max_num_seqs=256, kv_cache_tokens=1 << 18,
                               max_num_batched_tokens=16384))
    try:
        asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 5, engine))
    finally:
        engine.shutdown()
