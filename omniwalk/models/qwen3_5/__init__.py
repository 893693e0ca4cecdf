"""Qwen3.5 text models: hybrid Gated DeltaNet + gated attention (`model.Qwen3_5ForCausalLM`),
served with a recurrent-state slot per request beside the paged KV cache (`loading.py`).
The vision tower of Qwen3_5ForConditionalGeneration checkpoints is not served yet: their
language model loads alone.

Kernels: `omniwalk.kernels.gated_delta_rule` (chunked prefill, recurrent decode; chosen by
`omniwalk.layers.gated_delta_rule`) and `omniwalk.kernels.causal_conv` (short convolution
with state), torch on CPU.

Tensor parallel: both kinds of layer split by heads, the MLP by rows, the vocabulary by
rows (see `model.py`); each rank's state slots hold its heads only.
"""

from omniwalk.models.decoder_lm.model import text_frontends, text_nodes, text_warmup
from omniwalk.models.family import ModelFamily
from omniwalk.models.qwen3_5.config import Qwen3_5Config, check_tensor_parallel_split, config_from_hf, tiny_config
from omniwalk.models.qwen3_5.loading import QWEN3_5_LOADER

FAMILY = ModelFamily("qwen3_5", ("qwen3_5", "qwen3_5_text"), config_from_hf, tiny_config, QWEN3_5_LOADER,
                     frontends=text_frontends, warmup=text_warmup, tensor_parallel=check_tensor_parallel_split,
                     nodes=text_nodes)

__all__ = ["FAMILY", "Qwen3_5Config", "config_from_hf", "tiny_config"]
