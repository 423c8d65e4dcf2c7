"""woq: weight-only int8/int4 LLM inference server."""

__version__ = "0.1.0"
