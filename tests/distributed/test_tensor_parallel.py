"""Tensor parallel on the CPU over gloo (issue 27): the sharded layers against the
unsharded ops, two ranks through `Engine` giving the ids one device gives, no process
left behind, and the sizes and families it refuses. Qwen3.5: test_tensor_parallel_qwen3_5.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pids import alive
from same_generations import assert_same_generations

from omniwalk.api import Engine, GenerationRequest
from omniwalk.engine.sampler import SamplingParams
from omniwalk.loading import EngineArgs, read_model
from omniwalk.layers.parallel import check_decoder_split
from omniwalk.tensor_parallel_ranks import CHECK_OUTPUTS_ENV, Ranks

RANK_SCRIPT = Path(__file__).with_name("tp_layer_rank.py")


def test_parallel_layers_compute_what_the_unsharded_ones_do(run_rank_script):
    run_rank_script(RANK_SCRIPT, timeout=60)


def requests() -> list[GenerationRequest]:
    """Prompts of different lengths, budgets from 1 to 14, logprobs, one seeded sampled request."""
    sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    return [GenerationRequest(prompt="Hello there", max_tokens=9, ignore_eos=True,
                              sampling=SamplingParams(temperature=0.0, logprobs=3)),
            GenerationRequest(prompt="A much longer prompt about the weather in spring and the rain in April",
                              max_tokens=14, ignore_eos=True),
            GenerationRequest(prompt="Hi", max_tokens=1, ignore_eos=True),
            GenerationRequest(prompt_token_ids=list(range(3, 40)), max_tokens=5, ignore_eos=True),
            GenerationRequest(prompt="Sampled, seeded", max_tokens=6, ignore_eos=True, sampling=sampled)]


def generate(engine: Engine) -> list:
    return [(r.token_ids, r.finish_reason, r.usage, r.logprobs) for r in engine.generate(requests())]


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-llama"])
def test_two_ranks_give_the_ids_of_one(model, monkeypatch):
    with Engine(EngineArgs(model)) as one:
        expected = generate(one)
    monkeypatch.setenv(CHECK_OUTPUTS_ENV, "1")   # rank 1 must emit what rank 0 emits, step by step
    with Engine(EngineArgs(model, engine_process=True, tensor_parallel_size=2)) as engine:
        rank_pids = engine.rank_pids
        assert len(rank_pids) == 1 and alive(rank_pids[0])
        got = generate(engine)
        # an abort mid-way reaches every rank between the same two steps (else the output
        # check or a collective fails the loop), and the ranks go on in step
        stream = engine.stream("A request aborted mid-way", max_tokens=500, ignore_eos=True)
        next(iter(stream))
        stream.abort()
        assert stream.result().finish_reason == "abort"
        assert [ids for ids, *_ in generate(engine)] == [ids for ids, *_ in got]
        assert engine.stats.num_running == 0
    assert_same_generations(got, expected)
    assert [len(g[0]) for g in got] == [9, 14, 1, 5, 6]   # exact budgets
    assert not any(alive(pid) for pid in (engine.engine_pid, *rank_pids))


def test_sizes_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match=r"tensor parallel size 3 does not divide num_heads \(4\), "
                                         r"num_kv_heads \(2\), intermediate_size \(128\), vocab_size \(512\)"):
        Engine(EngineArgs("tiny-qwen3", engine_process=True, tensor_parallel_size=3))   # before any process starts
    config = read_model(EngineArgs("tiny-llama")).config
    with pytest.raises(ValueError, match=r"does not divide num_kv_heads \(2\)"):   # KV heads are not replicated
        check_decoder_split(config, 4)
    check_decoder_split(config, 2)


def test_families_without_tensor_parallel_are_refused():
    with pytest.raises(ValueError, match=r"orpheus models run on one device only \(tensor parallel: "
                                         r"llama, qwen3, qwen3-omni, qwen3_5\)"):
        Engine(EngineArgs("tiny-orpheus", engine_process=True, tensor_parallel_size=2))


def test_tensor_parallel_needs_the_engine_process():
    with pytest.raises(ValueError, match="needs the engine process"):
        EngineArgs("tiny-qwen3", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineArgs("tiny-qwen3", tensor_parallel_size=0)


def test_a_dead_rank_fails_the_engine_instead_of_hanging():
    """Rank 1 killed: rank 0's next step fails with the reason (no restart yet), the engine
    refuses more, and nothing is left running."""
    with Engine(EngineArgs("tiny-llama", engine_process=True, tensor_parallel_size=2)) as engine:
        (rank_pid,) = engine.rank_pids
        os.kill(rank_pid, signal.SIGKILL)
        result = engine.generate(["Hi"], max_tokens=5)[0]
        assert result.finish_reason == "error" and "tensor-parallel rank 1" in result.error
        assert "killed by SIGKILL" in result.error
        assert not engine.is_alive
    assert not alive(engine.engine_pid) and not alive(rank_pid)


def test_the_other_ranks_exit_when_rank_0_is_killed():
    engine = Engine(EngineArgs("tiny-qwen3", engine_process=True, tensor_parallel_size=2))
    try:
        (rank_pid,) = engine.rank_pids
        os.kill(engine.engine_pid, signal.SIGKILL)   # rank 1 reads end of file on its socket
        deadline = time.monotonic() + 10
        while alive(rank_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(rank_pid)
    finally:
        engine.shutdown()


def test_a_rank_that_dies_before_joining_fails_the_start_at_once():
    """Not after the rendezvous's timeout: rank 0 watches the ranks while it waits."""
    dead = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    ranks = Ranks([dead], [])
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 \(pid \d+\) exited with status 3 before it joined"):
        ranks._join(lambda: time.sleep(30))   # a rendezvous that would wait for it
    assert time.monotonic() - started < 10


def test_the_flag_is_vllms():
    from omniwalk.cli import _engine_args, build_parser

    for flags in (["-tp", "2"], ["--tensor-parallel-size", "2"]):
        args = _engine_args(build_parser().parse_args(["serve", *flags]))
        assert (args.tensor_parallel_size, args.engine_process) == (2, True)
    assert _engine_args(build_parser().parse_args(["serve"])).tensor_parallel_size == 1
