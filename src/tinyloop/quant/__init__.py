"""Weight and KV-cache formats: packing, quantized linear modules, KV quantizers, Hadamard transform.

The formats only; the offline procedures that run a model to quantize it live in `tinyloop.tools`.
"""
