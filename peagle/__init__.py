"""peagle: lossless speculative decoding with EAGLE-3 and P-EAGLE (parallel drafting) drafters."""
from .llm import LLM, CompletionOutput, RequestOutput  # noqa: F401
from .sampling import SamplingParams  # noqa: F401
from .errors import PeagleError  # noqa: F401

__version__ = "0.1.0"
