"""`omniwalk` with the look-ahead kept one step ahead (no step launched two ahead): the A
side of an A/B on one machine.

    python benchmarks/scripts/one_step_ahead.py bench --tts ...
"""
import sys

from omniwalk.cli import main
from omniwalk.engine.causal_lm_executor import CausalLMExecutor

CausalLMExecutor._launch_early = lambda self, calls, sequences: None
sys.exit(main(sys.argv[1:]))
