"""Token sampling for one decode step of a batch.

`Sampler()(logits, params, seeds, sample_indices, prompt_token_ids, output_token_ids)`
turns the last-position logits of B sequences into B token ids, plus optional logprobs.

Per row, in this order:

    penalties (repetition, presence, frequency)       -- greedy rows too
    greedy rows: argmax                                -- ties: lowest index
    sampled rows: temperature -> top_k -> top_p -> min_p -> exponential race

Batch-invariant randomness
--------------------------
A sampled row's token is a pure function of (its logits row, its params, its seed, its
sample_index, its token history): no torch.Generator and no global RNG is touched, and
no value depends on which other rows share the batch. The noise comes from a
counter-based hash of (seed, sample_index, token id):

* per row, in Python: ``key = splitmix64(splitmix64(seed) + sample_index)`` (64 bits,
  exact Python integer arithmetic), split into two 32-bit halves ``a`` and ``b``;
* per (row, token), in torch int64: ``h = fmix32(fmix32(token ^ a) + b)`` with MurmurHash3's
  32-bit finalizer. Every intermediate value is kept below 2**49 (32-bit multiplications
  are split into 16-bit halves of the constant), so there is no signed overflow and no
  reliance on wrap-around: CPU and CUDA produce the same bits;
* ``u = (h + 0.5) / 2**32`` in (0, 1), ``E = -log(u)`` ~ Exp(1), and the token is
  ``argmax(p / E) = argmax(logit / T - log(E))`` (the exponential race, equivalent to the
  Gumbel-max trick), evaluated in float64.

The race is done in the logit domain, so it needs no softmax reduction; the remaining
places where rounding may differ between devices are the top-p softmax/cumsum (only a
token sitting exactly on the nucleus boundary can be affected) and a 1-ulp float64
difference in ``log`` (only an exact float64 tie in the race can be affected).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from omniwalk.engine.host_to_device import to_device
from omniwalk.kernels.sampling import _uniform, race_argmax, race_reference
from omniwalk.kernels.triton_support import use_triton

__all__ = ["SamplingParams", "SamplerOutput", "Sampler", "SamplingPlan", "RowValues", "sample_rows", "MAX_LOGPROBS"]

MAX_LOGPROBS = 20

# Temperatures are floored at this value for the division, so that logit / T cannot
# overflow float32 (T == 0 exactly is greedy and never divides).
_MIN_TEMPERATURE = 1e-6

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its next token."""

    temperature: float = 1.0          # 0 means greedy
    top_k: int = 0                    # 0 or -1: disabled
    top_p: float = 1.0                # in (0, 1]; 1: disabled
    min_p: float = 0.0                # in [0, 1]; 0: disabled
    repetition_penalty: float = 1.0   # HF semantics over prompt + output tokens
    presence_penalty: float = 0.0     # OpenAI semantics over output tokens
    frequency_penalty: float = 0.0    # OpenAI semantics over output tokens
    seed: int | None = None
    logprobs: int | None = None       # None: none; k >= 0: chosen-token logprob + top-k

    def __post_init__(self) -> None:
        def _num(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value!r}")
            return float(value)

        def _int(name: str, value: object) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
            return value

        if _num("temperature") < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if _int("top_k", self.top_k) < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        top_p = _num("top_p")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        min_p = _num("min_p")
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if _num("repetition_penalty") <= 0:
            raise ValueError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= _num(name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.seed is not None:
            _int("seed", self.seed)
        if self.logprobs is not None:
            k = _int("logprobs", self.logprobs)
            if not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] or None, got {k}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor             # [B] int64
    logprobs: torch.Tensor | None       # [B] float32, raw log_softmax at the chosen token
    top_ids: torch.Tensor | None        # [B, K] int64, K = max requested logprobs
    top_logprobs: torch.Tensor | None   # [B, K] float32, descending


# ----------------------------------------------------------------------------- hashing


def _splitmix64(x: int) -> int:
    """splitmix64 step on a Python int (exact 64-bit arithmetic)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_key(seed: int, sample_index: int) -> int:
    """The 64-bit key of one sampling event."""
    return _splitmix64((_splitmix64(seed & _MASK64) + (sample_index & _MASK64)) & _MASK64)


def _as_uint64(values) -> np.ndarray:
    """Integers as uint64 modulo 2**64 (`value & _MASK64`, as `row_key` takes them)."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu":
        return values.astype(np.uint64)   # two's complement: the same bits as & _MASK64
    if isinstance(values, (int, np.integer)):
        return np.uint64(int(values) & _MASK64)
    try:   # what fits in int64 (seeds, indices): two's complement again
        return np.asarray(values, dtype=np.int64).astype(np.uint64)
    except OverflowError:
        return np.fromiter((int(v) & _MASK64 for v in values), dtype=np.uint64, count=len(values))


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """`_splitmix64` elementwise on uint64 (numpy's uint64 arithmetic wraps modulo 2**64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def row_keys(seeds, sample_indices) -> np.ndarray:
    """`row_key` of each (seed, sample index) pair, uint64 [n] (either may be one integer):
    a row's key costs no Python work (256 rows of a step, SNAC's windows times blocks)."""
    with np.errstate(over="ignore"):
        return _splitmix64_array(_splitmix64_array(_as_uint64(seeds)) + _as_uint64(sample_indices))


def _key_halves(keys, device) -> tuple[torch.Tensor, torch.Tensor]:
    """64-bit keys (ints or uint64) -> their (low, high) 32-bit halves as int64 tensors, one copy."""
    keys = np.asarray(keys, dtype=np.uint64)
    rows = len(keys)
    # an even row length keeps `high` 16-byte aligned like `low`: Triton specializes a
    # kernel on its pointers' alignment, and an odd batch compiled the race again (~0.4 s
    # in the middle of serving, on the H200)
    halves = np.zeros((2, rows + rows % 2), dtype=np.int64)
    halves[0, :rows] = keys & np.uint64(_MASK32)
    halves[1, :rows] = keys >> np.uint64(32)
    low, high = to_device(halves, dtype=torch.int64, device=device)
    return low[:rows], high[:rows]


def hash_uniform(keys, vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[len(keys), vocab_size] float64 uniforms in (0, 1): u[r, t] = f(keys[r], t)."""
    low, high = _key_halves(keys, device)
    tok = torch.arange(vocab_size, dtype=torch.int64, device=device)
    return _uniform(tok.unsqueeze(0), low.unsqueeze(1), high.unsqueeze(1))


# ----------------------------------------------------------------------------- sampler


class RowSettings:
    """One batch's per-row sampling settings: which filters run on which rows, and their
    values as [B, 1] device tensors. A decode batch keeps its rows for many steps, so the
    sampler builds these once per batch (`Sampler.rows_for`), not per step: 256 rows
    cost ~1 ms of host time a step to re-read and copy."""

    def __init__(self, params: list[SamplingParams], device: torch.device | str):
        self.params = list(params)   # held: the cache compares these objects by identity
        self.device = device
        self.greedy = [p.is_greedy for p in params]
        self.all_greedy = all(self.greedy)
        self.any_greedy = any(self.greedy)
        self.sampled_rows = [i for i, g in enumerate(self.greedy) if not g]
        self.want_logprobs = any(p.logprobs is not None for p in params)
        self.max_logprobs = max((p.logprobs or 0 for p in params), default=0)
        self.has_penalties = any(p.has_penalties for p in params)
        self.rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        self.out_rows = [i for i, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
        self.use_top_p = [not g and p.top_p < 1.0 for p, g in zip(params, self.greedy)]
        self.use_min_p = [not g and p.min_p > 0.0 for p, g in zip(params, self.greedy)]
        self._top_k: dict[int, list[bool]] = {}
        self._tensors: dict = {}

    def tensor(self, name: str, values, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1] device tensor `name`, copied from `values()` the first time it is asked for."""
        found = self._tensors.get(name)
        if found is None:
            found = self._tensors[name] = to_device(values(), dtype=dtype, device=self.device).unsqueeze(1)
        return found

    def use_top_k(self, vocab: int) -> list[bool]:
        found = self._top_k.get(vocab)
        if found is None:
            found = self._top_k[vocab] = [not g and 0 < p.top_k < vocab for p, g in zip(self.params, self.greedy)]
        return found

    def matches(self, params: list[SamplingParams], device) -> bool:
        return (len(params) == len(self.params) and self.device == device
                and all(map(operator.is_, params, self.params)))

    def plan(self, columns: int) -> "SamplingPlan":
        """The stages these rows run over `columns` logits (penalties other than the
        repetition penalty and logprobs are outside any plan: `Sampler` alone does them)."""
        return SamplingPlan(repetition=bool(self.rep_rows), top_k=any(self.use_top_k(columns)),
                            top_p=any(self.use_top_p), min_p=any(self.use_min_p),
                            any_greedy=self.any_greedy, all_greedy=self.all_greedy)

    def values(self, columns: int) -> dict[str, list]:
        """Each row's value for every stage, neutral where the row does not use the stage
        (`RowValues`' fields; the numbers `Sampler` uses for the same rows)."""
        params, use_top_k = self.params, self.use_top_k(columns)
        return {
            "temperature": [1.0 if p.is_greedy else max(p.temperature, _MIN_TEMPERATURE) for p in params],
            "top_k": [p.top_k if u else columns for p, u in zip(params, use_top_k)],
            "top_k_active": use_top_k,
            "top_p": [p.top_p if u else 1.0 for p, u in zip(params, self.use_top_p)],
            "top_p_active": self.use_top_p,
            "log_min_p": [math.log(p.min_p) if m else -math.inf for p, m in zip(params, self.use_min_p)],
            "repetition_penalty": [p.repetition_penalty for p in params],
            "greedy": self.greedy,
        }


@dataclass(frozen=True)
class SamplingPlan:
    """Which stages a batch's sampling runs; `sample_rows` runs them on every row, each
    row with its own values (neutral where it does not use a stage)."""

    repetition: bool
    top_k: bool
    top_p: bool
    min_p: bool
    any_greedy: bool
    all_greedy: bool


@dataclass
class RowValues:
    """Per-row stage values as [B, 1] tensors (the fields of `RowSettings.values`)."""

    temperature: torch.Tensor          # float32
    top_k: torch.Tensor                # int64, the column count where unused
    top_k_active: torch.Tensor         # bool
    top_p: torch.Tensor                # float32
    top_p_active: torch.Tensor         # bool
    log_min_p: torch.Tensor            # float32, -inf where unused
    repetition_penalty: torch.Tensor   # float32
    greedy: torch.Tensor               # bool

    DTYPES = {"temperature": torch.float32, "top_k": torch.int64, "top_k_active": torch.bool,
              "top_p": torch.float32, "top_p_active": torch.bool, "log_min_p": torch.float32,
              "repetition_penalty": torch.float32, "greedy": torch.bool}


def sample_rows(x: torch.Tensor, plan: SamplingPlan, values: RowValues, low: torch.Tensor, high: torch.Tensor,
                candidate_ids: torch.Tensor | None = None, seen: torch.Tensor | None = None) -> torch.Tensor:
    """`Sampler`'s ids for every row of `x` [B, C] float32 (a logits mask already applied),
    all rows through every stage of `plan`: no subsets, no host work, no host sync on CUDA,
    so a CUDA graph can hold it (`omniwalk.engine.sampling_graphs`). Each stage is the
    function `Sampler` calls, row by row the same values: the same ids.

    `low`, `high` [B]: the halves of each row's key (`row_keys`); `candidate_ids` [B, C]:
    the vocabulary id of each column, if not the column itself; `seen` [B, C] bool: the
    ids each row has seen (read when `plan.repetition`)."""
    if plan.repetition:
        x = penalize_repetition(x, seen, values.repetition_penalty)
    won = x.argmax(dim=-1) if plan.any_greedy else None
    if not plan.all_greedy:
        scaled = x / values.temperature
        if plan.top_k or plan.top_p:
            scaled = filter_top_k_top_p(scaled, values.top_k if plan.top_k else None, values.top_k_active,
                                        values.top_p if plan.top_p else None, values.top_p_active)
        if plan.min_p:
            scaled = filter_min_p(scaled, values.log_min_p)
        raced = race(scaled, low, high, candidate_ids)
        won = raced if won is None else torch.where(values.greedy.squeeze(1), won, raced)
    return won if candidate_ids is None else candidate_ids.gather(1, won.unsqueeze(1)).squeeze(1)


# ----------------------------------------------------------------------------- stages


def penalize_repetition(x: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF's repetition penalty on the seen ids: a logit below 0 times `penalty`, else divided."""
    return torch.where(seen, torch.where(x < 0, x * penalty, x / penalty), x)


def filter_top_k_top_p(scaled: torch.Tensor, k: torch.Tensor | None, k_active: torch.Tensor,
                       top_p: torch.Tensor | None, p_active: torch.Tensor) -> torch.Tensor:
    """`scaled` with the ids outside each active row's top-k / nucleus at -inf (k or top_p
    None: that filter is off for every row). One stable descending sort serves both; an
    inactive row keeps everything, so its values do not depend on its batch-mates."""
    sorted_vals, sorted_idx = torch.sort(scaled, dim=-1, descending=True, stable=True)
    keep = torch.ones_like(sorted_vals, dtype=torch.bool)
    if k is not None:
        # clamped: an inactive row's k (0 in a graph's idle rows) and a k over the vocabulary
        # must not index outside the row; an inactive row ignores its k-th value anyway
        kth = sorted_vals.gather(1, (k - 1).clamp(0, sorted_vals.shape[1] - 1))
        keep = keep & ((sorted_vals >= kth) | ~k_active)   # HF semantics: ties with the k-th value are kept
    if top_p is not None:
        probs = torch.softmax(sorted_vals.masked_fill(~keep, -math.inf), dim=-1)
        cum = probs.cumsum(dim=-1)
        exclusive = F.pad(cum[:, :-1], (1, 0))  # mass strictly before each token
        # keep a token while the mass before it is below top_p (the first always)
        keep = keep & ((exclusive < top_p) | ~p_active)
    keep_orig = torch.empty_like(keep).scatter_(1, sorted_idx, keep)
    return scaled.masked_fill(~keep_orig, -math.inf)


def filter_min_p(scaled: torch.Tensor, log_min_p: torch.Tensor) -> torch.Tensor:
    # p_i < min_p * p_max  <=>  l_i < l_max + log(min_p)   (l: scaled logits)
    row_max = scaled.amax(dim=-1, keepdim=True)
    return scaled.masked_fill(scaled < row_max + log_min_p, -math.inf)


def race(scaled: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
         token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """argmax(softmax(scaled) / E) with E ~ Exp(1) from the counter-based hash of (row key,
    token id): the winning column. Column t is token t, or `token_ids[row, t]` (what is hashed).
    One Triton kernel on CUDA, its torch reference elsewhere (`omniwalk.kernels.sampling`)."""
    if use_triton(scaled):   # one kernel, no host sync
        return race_argmax(scaled, low, high, token_ids)
    return race_reference(scaled, low, high, token_ids)


class Sampler:
    """No state but a cache of recent batches' `RowSettings`; see the module docstring for
    the semantics."""

    def __init__(self, cached_batches: int = 4):
        self._recent: list[RowSettings] = []
        self._cached_batches = cached_batches

    def rows_for(self, params: list[SamplingParams], device: torch.device | str) -> RowSettings:
        """The settings of a batch with these params objects (in this order), built once."""
        for rows in self._recent:
            if rows.matches(params, device):
                return rows
        rows = RowSettings(params, device)
        self._recent = [rows] + self._recent[: self._cached_batches - 1]
        return rows

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seeds: list[int],
        sample_indices: list[int],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        candidate_ids: torch.Tensor | None = None,
        vocab_size: int | None = None,
        seen: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """`candidate_ids` [B, C] (with the full `vocab_size`): `logits` [B, C] are only the
        columns of those ids, the only ones a row may sample (a model's logits mask that
        names them, e.g. Orpheus' next audio codes). The samples are the full-vocabulary
        ones with every other id at -inf: penalties count ids, the race hashes ids, and the
        returned token ids are vocabulary ids. No logprobs in this mode.

        `seen` [B, vocab] bool: the ids in each row's prompt or outputs, if the caller keeps
        them on the device (`SeenTokens`); the repetition penalty then reads it instead
        of the histories (same results)."""
        batch = self._check(logits, params, prompt_token_ids, output_token_ids)
        if len(seeds) != batch or len(sample_indices) != batch:
            raise ValueError(
                f"seeds ({len(seeds)}) and sample_indices ({len(sample_indices)}) "
                f"must have one entry per row ({batch})"
            )

        rows = self.rows_for(params, logits.device)
        want_logprobs = rows.want_logprobs
        if candidate_ids is not None and want_logprobs:
            raise ValueError("logprobs need the full vocabulary: no candidate_ids with them")
        if rows.all_greedy and not want_logprobs and not rows.has_penalties:
            return SamplerOutput(self._vocabulary_ids(logits.argmax(dim=-1), candidate_ids), None, None, None)

        processed = self.process_logits(logits, params, prompt_token_ids, output_token_ids, candidate_ids, vocab_size,
                                        seen)
        sampled_rows = rows.sampled_rows

        if len(sampled_rows) == batch:
            token_ids = self._race(processed, seeds, sample_indices, candidate_ids)
        else:
            token_ids = processed.argmax(dim=-1)
            if sampled_rows:
                idx = to_device(sampled_rows, dtype=torch.int64, device=logits.device)
                chosen = self._race(
                    processed.index_select(0, idx),
                    [seeds[i] for i in sampled_rows],
                    [sample_indices[i] for i in sampled_rows],
                    candidate_ids.index_select(0, idx) if candidate_ids is not None else None,
                )
                token_ids = token_ids.index_copy(0, idx, chosen)

        if not want_logprobs:
            return SamplerOutput(self._vocabulary_ids(token_ids, candidate_ids), None, None, None)

        raw_logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
        chosen_lp = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        k = min(rows.max_logprobs, logits.shape[1])
        top_ids = top_lp = None
        if k > 0:
            top_lp, top_ids = torch.topk(raw_logprobs, k, dim=-1, largest=True, sorted=True)
        return SamplerOutput(token_ids, chosen_lp, top_ids, top_lp)

    @staticmethod
    def _vocabulary_ids(columns: torch.Tensor, candidate_ids: torch.Tensor | None) -> torch.Tensor:
        if candidate_ids is None:
            return columns
        return candidate_ids.gather(1, columns.unsqueeze(1)).squeeze(1)

    # ------------------------------------------------------------------ logits pipeline

    def process_logits(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        candidate_ids: torch.Tensor | None = None,
        vocab_size: int | None = None,
        seen: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B, V] float32 logits each row samples from (a new tensor; input untouched).

        Greedy rows: penalized logits. Sampled rows: penalized, divided by temperature,
        with tokens removed by top_k / top_p / min_p set to -inf.
        """
        self._check(logits, params, prompt_token_ids, output_token_ids)
        rows = self.rows_for(params, logits.device)
        x = logits.to(torch.float32)
        if rows.has_penalties:
            x = self._apply_penalties(x, rows, prompt_token_ids, output_token_ids, candidate_ids, vocab_size, seen)
        if rows.all_greedy:
            return x.clone() if x.data_ptr() == logits.data_ptr() else x

        # Greedy rows ride along with neutral settings (T=1, nothing masked); their
        # values are restored at the end.
        temps = rows.tensor("temperature", lambda: rows.values(x.shape[1])["temperature"], torch.float32)
        scaled = x / temps

        use_top_k, use_top_p, use_min_p = rows.use_top_k(x.shape[1]), rows.use_top_p, rows.use_min_p
        sort_rows = [i for i in range(len(params)) if use_top_k[i] or use_top_p[i]]
        if len(sort_rows) == len(params):
            scaled = self._top_k_top_p(scaled, rows)
        elif sort_rows:  # sort only the rows that need it
            idx = to_device(sort_rows, dtype=torch.int64, device=x.device)
            sub_rows = self.rows_for([params[i] for i in sort_rows], x.device)
            scaled = scaled.index_copy(0, idx, self._top_k_top_p(scaled.index_select(0, idx), sub_rows))
        if any(use_min_p):
            scaled = filter_min_p(scaled, rows.tensor("log_min_p", lambda: rows.values(x.shape[1])["log_min_p"],
                                                      torch.float32))

        if rows.any_greedy:
            greedy_mask = rows.tensor("greedy", lambda: rows.greedy, torch.bool)
            scaled = torch.where(greedy_mask, x, scaled)
        return scaled

    @staticmethod
    def _apply_penalties(
        x: torch.Tensor,
        rows: RowSettings,
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        candidate_ids: torch.Tensor | None = None,
        vocab_size: int | None = None,
        seen: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch, vocab = x.shape[0], vocab_size or x.shape[1]
        device = x.device
        params = rows.params

        def columns(table: torch.Tensor) -> torch.Tensor:
            # [batch, vocab] per-id values -> the columns of x (the candidates' ids, if any)
            return table if candidate_ids is None else table.gather(1, candidate_ids)

        def flat_index(rows: list[int], lists):
            # histories may be lists or 1-D numpy arrays (no per-token Python work for those)
            arrays = [np.asarray(tokens[r], dtype=np.int64) for r in rows for tokens in lists]
            lengths = np.array([len(a) for a in arrays], dtype=np.int64)
            row_of = np.repeat(np.repeat(np.asarray(rows, dtype=np.int64), len(lists)), lengths)
            tokens = np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)
            # ids outside the output vocabulary (placeholders, padded embeddings) are ignored;
            # filtered here, on the host: a boolean index on the device would wait for it
            ok = (tokens >= 0) & (tokens < vocab)
            return to_device(row_of[ok], device=device), to_device(tokens[ok], device=device)

        rep_rows = rows.rep_rows
        if rep_rows:
            if seen is None:
                r, t = flat_index(rep_rows, [prompt_token_ids, output_token_ids])
                seen = torch.zeros((batch, vocab), dtype=torch.bool, device=device)
                seen.view(-1).index_fill_(0, r * vocab + t, True)   # `seen[r, t] = True` would sync
            seen = columns(seen)
            penalty = rows.tensor("repetition_penalty", lambda: [p.repetition_penalty for p in params], torch.float32)
            x = penalize_repetition(x, seen, penalty)

        out_rows = rows.out_rows
        if out_rows:
            r, t = flat_index(out_rows, [output_token_ids])
            counts = torch.zeros((batch, vocab), dtype=torch.float32, device=device)
            counts.index_put_((r, t), torch.ones_like(t, dtype=torch.float32), accumulate=True)
            counts = columns(counts)
            freq = rows.tensor("frequency_penalty", lambda: [p.frequency_penalty for p in params], torch.float32)
            pres = rows.tensor("presence_penalty", lambda: [p.presence_penalty for p in params], torch.float32)
            x = x - freq * counts
            x = x - pres * (counts > 0).to(torch.float32)
        return x

    @staticmethod
    def _top_k_top_p(scaled: torch.Tensor, rows: RowSettings) -> torch.Tensor:
        columns = scaled.shape[1]
        use_top_k, values = rows.use_top_k(columns), lambda: rows.values(columns)
        k = rows.tensor(f"top_k/{columns}", lambda: values()["top_k"], torch.int64) if any(use_top_k) else None
        k_active = rows.tensor(f"use_top_k/{columns}", lambda: use_top_k, torch.bool)
        top_p = rows.tensor("top_p", lambda: values()["top_p"], torch.float32) if any(rows.use_top_p) else None
        p_active = rows.tensor("use_top_p", lambda: rows.use_top_p, torch.bool)
        return filter_top_k_top_p(scaled, k, k_active, top_p, p_active)

    # ------------------------------------------------------------------ the race

    @staticmethod
    def _race(scaled: torch.Tensor, seeds: list[int], sample_indices: list[int],
              token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`race` with each row's key from its (seed, sample index)."""
        return race(scaled, *_key_halves(row_keys(seeds, sample_indices), scaled.device), token_ids)

    # ------------------------------------------------------------------ checks

    @staticmethod
    def _check(
        logits: torch.Tensor,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
    ) -> int:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        if not logits.is_floating_point():
            raise ValueError(f"logits must be a float tensor, got {logits.dtype}")
        batch = logits.shape[0]
        for name, seq in (
            ("params", params),
            ("prompt_token_ids", prompt_token_ids),
            ("output_token_ids", output_token_ids),
        ):
            if len(seq) != batch:
                raise ValueError(f"{name} has {len(seq)} entries for {batch} rows")
        return batch
