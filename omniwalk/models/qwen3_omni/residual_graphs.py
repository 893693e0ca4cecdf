"""The code predictor's loop of a Talker step, replayed as one CUDA graph per batch bucket.

Eagerly, a step's frames are G-1 code-predictor passes and G-1 sampler calls: ~1,000 kernel
launches and their Python per Talker step, whatever the batch. The loop's shapes depend on
the batch alone (`code_predictor.py`), and `sample_rows` samples without host work, so the
whole loop is captured once per (plan, batch bucket):

    inputs (static):  last_hidden [B, hidden], first codes [B], the rows' sampling values
                      (`RowValues`), and each group's key halves [G-1, B] (low, high)
    outputs (static): codes [B, G], summed embeddings [B, hidden]

Two plans: every row greedy, or some row sampled (top-k 50, top-p 0.8 at temperature 1, the
code predictor's settings; greedy rows take the argmax inside it, as `sample_rows` does).
Padded rows are greedy from zeros; their outputs are dropped. The ids equal the eager
path's: the same stage functions with the same values and keys (`Sampler` picks code g of
a frame with key (seed, step * G + g)). On a CPU nothing is captured and `run` calls the
same function on the same buffers, so CI runs it.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from omniwalk.engine.cuda_graphs import BucketGraphs, batch_buckets
from omniwalk.engine.sampler import RowSettings, RowValues, SamplingParams, SamplingPlan, row_keys, sample_rows
from omniwalk.models.qwen3_omni.code_predictor import FrameCodes
from omniwalk.models.qwen3_omni.talker import Talker

#: the code predictor's sampling when the Talker samples (transformers' generate)
RESIDUAL_TOP_K, RESIDUAL_TOP_P = 50, 0.8
logger = logging.getLogger(__name__)
GREEDY = SamplingPlan(repetition=False, top_k=False, top_p=False, min_p=False, any_greedy=True, all_greedy=True)
SAMPLED = SamplingPlan(repetition=False, top_k=True, top_p=True, min_p=False, any_greedy=True, all_greedy=False)


def residual_settings(talker_params: list[SamplingParams]) -> list[SamplingParams]:
    """The code predictor's settings for each row: greedy where the Talker is greedy, else
    top-k 50 / top-p 0.8 at temperature 1."""
    return [SamplingParams(temperature=0.0) if p.temperature == 0 else
            SamplingParams(temperature=1.0, top_k=RESIDUAL_TOP_K, top_p=RESIDUAL_TOP_P) for p in talker_params]


class ResidualGraphs(BucketGraphs):
    def __init__(self, talker: Talker, max_batch_size: int, device: torch.device, dtype: torch.dtype,
                 capture: bool = True):
        self.talker = talker
        self.device = device
        self.on_cuda = device.type == "cuda" and capture   # else: the loop runs eagerly over the buffers
        self.groups = talker.config.num_code_groups
        self.vocab = talker.code_predictor.config.decoder.vocab_size
        sizes = batch_buckets(max_batch_size)
        self.sizes = sizes
        self.buckets = [(plan, size) for plan in (GREEDY, SAMPLED) for size in sizes]
        size, hidden = sizes[-1], talker.config.text.hidden_size
        on = dict(device=device)
        self.last_hidden = torch.zeros(size, hidden, dtype=dtype, **on)
        self.first_code = torch.zeros(size, dtype=torch.long, **on)
        self.key_halves = torch.zeros(2, self.groups - 1, size, dtype=torch.int64, **on)
        self.values = RowValues(**{name: torch.zeros(size, 1, dtype=dt, **on) for name, dt in RowValues.DTYPES.items()})
        self.codes = torch.zeros(size, self.groups, dtype=torch.long, **on)
        self.summed_embeds = torch.zeros(size, hidden, dtype=dtype, **on)
        self.kv = {b: talker.code_predictor.new_kv(b, dtype, device) for b in sizes}
        self._init_graphs()
        if not self.on_cuda:
            return
        started = time.perf_counter()
        try:
            self._capture()
        except Exception:   # speak eagerly (slower, the same codes) rather than not at all
            logger.exception("could not capture the code predictor's loop: it runs eagerly")
            self.graphs, self.on_cuda = {}, False
            return
        logger.info("captured the code predictor's loop for batch sizes %s (greedy, sampled) in %.1f s", sizes,
                    time.perf_counter() - started)

    def _forward(self, bucket) -> torch.Tensor:
        plan, size = bucket
        values = RowValues(**{name: getattr(self.values, name)[:size] for name in RowValues.DTYPES})
        low, high = self.key_halves[0, :, :size], self.key_halves[1, :, :size]

        def pick(logits: torch.Tensor, group: int) -> torch.Tensor:
            return sample_rows(logits, plan, values, low[group - 1], high[group - 1])

        frame = self.talker.predict_frame(self.last_hidden[:size], self.first_code[:size], pick, self.kv[size])
        self.codes[:size].copy_(frame.codes)
        self.summed_embeds[:size].copy_(frame.summed_embeds)
        return self.codes

    def run(self, last_hidden: torch.Tensor, first_code: torch.Tensor, talker_params: list[SamplingParams],
            seeds: list[int], steps: list[int]) -> FrameCodes:
        """The frames of n rows: last_hidden [n, hidden], first_code [n]; each row's Talker
        sampling params, seed and step (its frames so far)."""
        n = len(seeds)
        size = next(b for b in self.sizes if b >= n)
        settings = RowSettings(residual_settings(talker_params), self.device)
        plan = GREEDY if settings.all_greedy else SAMPLED
        self._fill(last_hidden, first_code, settings, seeds, steps, size)
        self._replay((plan, size), n)
        # copies: the buffers are the next step's; a frame's embeddings wait for its text
        return FrameCodes(codes=self.codes[:n].clone(), summed_embeds=self.summed_embeds[:n].clone())

    def _fill(self, last_hidden, first_code, settings: RowSettings, seeds, steps, size: int) -> None:
        n = len(seeds)
        self.last_hidden[:n].copy_(last_hidden)
        self.first_code[:n].copy_(first_code)
        self.last_hidden[n:size].zero_()
        self.first_code[n:size].zero_()
        values, pad = settings.values(self.vocab), size - n
        neutral = {"temperature": 1.0, "top_k": self.vocab, "top_k_active": False, "top_p": 1.0, "top_p_active": False,
                   "log_min_p": -float("inf"), "repetition_penalty": 1.0, "greedy": True}
        # from pinned memory, not waiting for the GPU: a copy from pageable memory waits for
        # the stream, i.e. for the Talker's step, and the GPU idles while the host goes on
        for name, dtype in RowValues.DTYPES.items():
            row = torch.tensor(list(values[name]) + [neutral[name]] * pad, dtype=dtype)
            getattr(self.values, name)[:size, 0].copy_(self._pinned(row), non_blocking=True)
        # code g of a frame: key (seed, step * G + g), as the eager picker's
        groups = np.arange(1, self.groups, dtype=np.int64)[:, None]
        indices = np.asarray(steps, dtype=np.int64)[None, :] * self.groups + groups          # [G-1, n]
        keys = row_keys(np.broadcast_to(np.asarray(seeds, dtype=np.int64), indices.shape).ravel(), indices.ravel())
        halves = np.zeros((2, self.groups - 1, size), dtype=np.int64)
        halves[0, :, :n] = (keys & np.uint64(0xFFFFFFFF)).reshape(self.groups - 1, n)
        halves[1, :, :n] = (keys >> np.uint64(32)).reshape(self.groups - 1, n)
        self.key_halves[:, :, :size].copy_(self._pinned(torch.from_numpy(halves)), non_blocking=True)

    def _pinned(self, host: torch.Tensor) -> torch.Tensor:
        return host.pin_memory() if self.device.type == "cuda" else host


__all__ = ["ResidualGraphs", "residual_settings"]
