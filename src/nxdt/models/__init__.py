"""Models: nxdt's own Llama (model_source megatron) and transformers models (model_source hf).

Both share transformers' LlamaForCausalLM module tree and parameter names.
"""

from nxdt.models.builder import build_model, count_parameters, init_model_weights, logits_of, padded_vocab_size
from nxdt.models.llama import LlamaArgs, NxdtLlamaForCausalLM

__all__ = [
    "LlamaArgs",
    "NxdtLlamaForCausalLM",
    "build_model",
    "count_parameters",
    "init_model_weights",
    "logits_of",
    "padded_vocab_size",
]
