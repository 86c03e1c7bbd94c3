"""epp-extproc: a KV-cache-aware endpoint picker that runs as an Envoy external processor."""

__version__ = "0.1.0"
