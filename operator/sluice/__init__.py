"""sluice: weights LLM inference traffic in an Istio mesh from live per-pod signals."""

__version__ = "0.1.0"
