"""`--client-processes`: how requests, concurrency and the arrival schedule are split between
the load generator processes, the flag's checks, and a failing process (the parent must
report it, not wait). The end-to-end run against a real server: test_bench_http.py."""

from __future__ import annotations

import functools
import itertools

import pytest

from omniwalk.bench.backends import OpenAICompletionsBackend
from omniwalk.bench.client_processes import (
    ClientProcessError, LoadGenerator, effective_processes, run_phases, split_concurrency, split_gaps,
    split_requests,
)
from omniwalk.cli import main


def test_request_i_goes_to_process_i_mod_n():
    assert split_requests(list(range(7)), 3) == [[0, 3, 6], [1, 4], [2, 5]]
    assert split_requests([], 2) == [[], []]


def test_concurrency_is_split_with_the_remainder_first():
    assert split_concurrency(4, 2) == [2, 2]
    assert split_concurrency(7, 3) == [3, 2, 2]
    assert split_concurrency(None, 2) == [None, None]   # Poisson without a cap stays without one
    assert sum(split_concurrency(128, 5)) == 128


def test_processes_are_capped_at_the_concurrency_and_the_requests():
    assert effective_processes(4, 2, 100) == 2
    assert effective_processes(4, None, 100) == 4
    assert effective_processes(4, 16, 3) == 3
    assert effective_processes(1, 16, 100) == 1


def test_each_process_keeps_its_requests_due_times_of_the_global_schedule():
    gaps = [0.5, 0.25, 1.0, 0.125, 0.0, 2.0]
    due = list(itertools.accumulate(gaps))          # 0.5, 0.75, 1.75, 1.875, 1.875, 3.875
    parts = split_gaps(gaps, 2)
    assert parts == [[0.5, 1.25, 0.125], [0.75, 1.125, 2.0]]
    for k, mine in enumerate(parts):
        assert list(itertools.accumulate(mine)) == due[k::2]
    assert split_gaps([0.0] * 5, 2) == [[0.0] * 3, [0.0] * 2]   # a closed loop: every gap 0


def test_load_generator_line_warns_when_busy():
    assert LoadGenerator(2, 0.97).lines()[0] == "  load generator        2 processes, busiest at 97% of a core"
    assert "--client-processes" in LoadGenerator(1, 0.95).lines()[1]
    assert LoadGenerator(1, 0.5).lines() == ["  load generator        1 process, busiest at 50% of a core"]
    assert LoadGenerator(3, 0.25).to_dict() == {"processes": 3, "cpu_fraction": 0.25}


@pytest.mark.parametrize("flags", [["--client-processes", "2"], ["--url", "http://x", "--client-processes", "0"],
                                   ["--url", "http://x", "--asr", "--client-processes", "2"]])
def test_bad_client_processes_is_an_argparse_error(flags, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", *flags])
    assert exit_.value.code == 2 and "--client-processes" in capsys.readouterr().err


def test_a_failing_process_is_reported_not_waited_for():
    # a backend that cannot be built (no URL) fails in each process before its first request
    make_backend = functools.partial(OpenAICompletionsBackend, None, "m", True)
    with pytest.raises(ClientProcessError, match="AttributeError"):
        run_phases(make_backend, [], [object()] * 4, [0.0] * 4, 2, "test", False, processes=2)
