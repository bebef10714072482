"""peagle: lossless speculative decoding with EAGLE-3 and P-EAGLE (parallel drafting) drafters."""
from . import vml_init  # noqa: F401 - first: MKL's first vector-math call on one thread (its docstring)
from .errors import PeagleError  # noqa: F401 - the public API
from .llm import LLM, CompletionOutput, RequestOutput  # noqa: F401 - the public API
from .sampling import SamplingParams  # noqa: F401 - the public API

__version__ = "0.1.0"
