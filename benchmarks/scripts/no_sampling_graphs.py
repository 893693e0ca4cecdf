"""`omniwalk` with the sampling graphs turned off (every step samples eagerly): the A side
of an A/B on one machine.

    python benchmarks/scripts/no_sampling_graphs.py bench --tts ...
"""
import sys

from omniwalk.cli import main
from omniwalk.engine.causal_lm_executor import CausalLMExecutor

CausalLMExecutor._sampling_graphs = lambda self: None
sys.exit(main(sys.argv[1:]))
