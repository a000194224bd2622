"""The engines: the forward passes every family shares, written once on qkv's attention.

- :mod:`.functional`: norms and activations.
- :mod:`.bert` and :mod:`.encoder`: the BERT encoder and the sentence encoder around it (pooling).
- :mod:`.decoder`: the decoder-only language model (its config, layers, KV cache, generation).
- :mod:`.seq2seq`: the encoder-decoder (cross-attention cache, greedy and beam search).
- :mod:`.sampling`: temperature, top-k, top-p, min-p and repetition penalty.
- :mod:`.moe`: a mixture of experts (gpt-oss).

A family never holds a forward pass: it maps its files onto one of these.
"""
