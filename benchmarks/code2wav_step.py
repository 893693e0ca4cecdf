"""One Code2Wav step of 32 chunks (streams spread over a 660-frame answer: first chunks,
chunks whose left context still grows, full-context ones, final ones), random weights:
forward passes (transformer, conv stack) and wall time, each chunk decoded alone against
`Code2Wav.decode_chunks`, interleaved.

    PYTHONPATH=. python benchmarks/code2wav_step.py [tiny|mid|released] [--device cuda] [--repeat N]
"""

from __future__ import annotations

import argparse
import time

import torch

from omniwalk.models.qwen3_omni.code2wav import Code2Wav, exact_left_context
from omniwalk.models.qwen3_omni.code2wav_config import Code2WavConfig

CONFIGS = {
    "tiny": Code2WavConfig.tiny(),
    # the released layout (8 layers, window 72, U = 1920, left context 578) at a fraction of the width
    "mid": Code2WavConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, intermediate_size=384,
                          decoder_dim=64),
    "released": Code2WavConfig(),
}


def step_chunks(config: Code2WavConfig, streams: int, first: int = 4, size: int = 16, frames: int = 660):
    """(codes [Q, frames], start, context) of one chunk per stream, streams spread over a 660-frame answer."""
    gen = torch.Generator().manual_seed(0)
    L, chunks = exact_left_context(config), []
    num_chunks = 1 + (frames - first + size - 1) // size
    for i in range(streams):
        k = (i * 7) % num_chunks
        start = 0 if k == 0 else first + size * (k - 1)
        n = min(first if k == 0 else size, frames - start)
        context = min(start, L)
        codes = torch.randint(0, config.codebook_size, (config.num_quantizers, context + n), generator=gen)
        chunks.append((codes, start, context))
    return chunks


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("config", nargs="?", default="mid", choices=CONFIGS)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    config = CONFIGS[args.config]
    model = Code2Wav(config).eval().to(args.device)
    passes = {"transformer": 0, "conv stack": 0}
    model.pre_transformer.register_forward_hook(lambda *_: passes.__setitem__("transformer", passes["transformer"] + 1))
    model.upsample[0][0].register_forward_hook(lambda *_: passes.__setitem__("conv stack", passes["conv stack"] + 1))
    chunks = [(c.to(args.device), s, n) for c, s, n in step_chunks(config, args.streams)]
    modes = ["per chunk"] + (["batched"] if hasattr(model, "decode_chunks") else [])

    def step(mode):
        with torch.inference_mode():
            if mode == "batched":
                return model.decode_chunks(chunks)
            return [model.decode_chunk(c[None], s, n)[0, 0] for c, s, n in chunks]

    results = {mode: (step(mode), []) for mode in modes}   # warm-up, outputs
    for _ in range(args.repeat):   # the modes interleaved: a shared machine's load hits both alike
        for mode in modes:
            passes.update({"transformer": 0, "conv stack": 0})
            if args.device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(mode)
            if args.device != "cpu":
                torch.cuda.synchronize()
            results[mode][1].append(time.perf_counter() - t0)
            results[mode] = (results[mode][0], results[mode][1], dict(passes))
    wavs = results["per chunk"][0]
    audio = sum(w.shape[-1] for w in wavs) / config.sample_rate
    print(f"{args.config}: {len(chunks)} chunks (contexts {sorted({n for _, _, n in chunks})[:4]}..., "
          f"{audio:.2f} audio s), threads {torch.get_num_threads()}, device {args.device}")
    for mode in modes:
        out, times, counted = results[mode]
        differ = max((a - b).abs().max().item() for a, b in zip(out, wavs))
        print(f"  {mode:9}: passes {counted}, wall min {min(times) * 1e3:.1f} ms, median "
              f"{sorted(times)[len(times) // 2] * 1e3:.1f} ms; max |diff| from per chunk {differ:.2e}")


if __name__ == "__main__":
    main()
