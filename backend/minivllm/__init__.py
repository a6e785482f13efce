"""mini-vllm: a from-scratch LLM inference engine with a live dashboard."""

from minivllm.cache import route_compiler_cache

route_compiler_cache()  # first: importing the engine already asks torch where its compiler cache is

from minivllm.engine.outputs import CompletionOutput, RequestOutput
from minivllm.llm import LLM
from minivllm.sampling.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
