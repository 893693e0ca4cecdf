"""The check every tensor-parallel test makes of its ranks' answers against one device's."""

import pytest


def assert_same_generations(got, expected) -> None:
    """(ids, finish reason, usage, logprobs) per request: equal ids, reasons and usage, and
    the same distributions up to summation order (the same top ids, the sampled and the top
    logprobs within 1e-4)."""
    for (ids, reason, usage, logprobs), (ids1, reason1, usage1, logprobs1) in zip(got, expected, strict=True):
        assert (ids, reason, usage) == (ids1, reason1, usage1)
        for step, step1 in zip(logprobs or [], logprobs1 or []):
            if step1 is None:
                assert step is None
                continue
            assert [t for t, _ in step.top] == [t for t, _ in step1.top]
            assert [p for _, p in step.top] == pytest.approx([p for _, p in step1.top], abs=1e-4)
            assert step.logprob == pytest.approx(step1.logprob, abs=1e-4)
