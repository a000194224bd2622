"""``qkv serve``: a causal LM behind an OpenAI-compatible HTTP API, many clients at once.

- :mod:`.pages`: the key/value pages of every request in one pool, shared
  prefixes by reference count;
- :mod:`.engine`: one step of the model over the tokens of many requests,
  the same bits whatever the batch;
- :mod:`.scheduler`: continuous batching (admission, chunked prefill,
  preemption, sampling) on an engine thread;
- :mod:`.api`: the HTTP routes (Starlette, pydantic, server-sent events).

Needs the ``serve`` extra.
"""
