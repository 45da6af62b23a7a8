"""Corral's embedded engine: a separate process serving vLLM's HTTP surface (docs/engines.md) with a
small torch policy doing real forward passes on pinned CPUs. See docs/embedded-engine.md.

Importing this package does not import torch; `model`, `weights`, `batching` and `server` do.
"""
