"""File formats and what they hold: what qkv reads from disk, checked, before any model runs.

- :mod:`.gguf`: llama.cpp's GGUF container (metadata and tensor table; every count and offset checked).
- :mod:`.quants`: GGUF's quantized blocks (Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K) kept packed, with
  their reference unpacking and products; :mod:`.quant_kernels` the compiled kernel of each type.
- :mod:`.files`: JSON configs and safetensors (sizes bounded, fields typed, tensors checked by name).
- :mod:`.metadata`: one reader of llama-like hyperparameters for Hugging Face configs and GGUF keys.
- :mod:`.tokenizer`: a file's vocabulary as a ``tokenizers`` tokenizer (GGUF or ``tokenizer.json``).
- :mod:`.chat`: chat templates, rendered in a bounded jinja2 sandbox.

A new quant type goes in :mod:`.quants` (its block layout) and :mod:`.quant_kernels` (its kernel).
"""
