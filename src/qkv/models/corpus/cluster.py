"""Embed a corpus on a Dask cluster (the ``qkv[dask]`` extra): one machine's cores, or many machines.

The corpus is cut into partitions of lines, in order; each partition is a
Dask task that embeds its lines on a worker (the model is loaded once per
worker process and kept there) and returns its rows. The client writes each
partition's rows at its own place in one ``.npy`` (file writes) as the
results come back, so row ``i`` is line ``i`` whatever order the tasks
finish in. A worker that dies mid-task takes nothing with it: the scheduler
runs the task again elsewhere (``retries``), and its rows are written once,
when it succeeds.

A partition is embedded exactly as :func:`qkv.models.corpus.embed_file`
embeds a chunk of the same size (sorted by length, the same batches), so
the two agree to float rounding (bit for bit where BLAS does the same sums).
"""

from __future__ import annotations

import logging
import os
import uuid
import warnings
from pathlib import Path

import numpy as np

from ..._checks import check_int
from ..._files import NpyRows
from ..engines.encoder import check_batch_size
from .index import _count_lines, _chunks, encode_lines, iter_texts, truncated_lines, warn_truncated

__all__ = ["embed_corpus"]

_MODELS: dict = {}  # in each worker process: model path -> SentenceEncoder, loaded on its first task


def __dir__():
    return sorted(__all__)


class _ClosingHeartbeat(logging.Filter):
    """Drops the heartbeat failure a worker of our own cluster logs while it closes.

    A worker that closes while a heartbeat is in flight closes the connection
    pool under it and logs the failure as an error with its traceback
    (dask/distributed#7192); on a cluster qkv closes itself that is
    shutdown noise, not a fault. Any other record, and this one while the
    worker runs, passes.
    """

    def __init__(self, worker):
        super().__init__()
        self.worker = worker

    def filter(self, record):
        from distributed.core import Status

        closing = self.worker.status in (Status.closing, Status.closing_gracefully, Status.closed)
        return not (closing and record.getMessage().startswith("Failed to communicate with scheduler during heartbeat"))


def _quiet_close_plugin():
    """A worker plugin (survives worker restarts) that installs :class:`_ClosingHeartbeat`."""
    from dask.distributed import WorkerPlugin

    class QuietClose(WorkerPlugin):
        name = "qkv-quiet-close"

        def setup(self, worker):
            logging.getLogger("distributed.worker").addFilter(_ClosingHeartbeat(worker))

    return QuietClose()


def _encoder(model):
    if model not in _MODELS:
        from ..engines.encoder import load_model

        _MODELS[model] = load_model(model)
    return _MODELS[model]


def _model_shape(model) -> tuple[int, int]:  # runs on a worker: the embedding dim and max_seq_length
    enc = _encoder(model)
    return enc.model.config.hidden_size, enc.max_seq_length


def _embed_partition(texts, model, batch_size):  # runs on a worker: (rows, E) float32, lines cut (from 1), pid
    from threadpoolctl import threadpool_limits

    try:
        from distributed import get_worker

        threads = get_worker().state.nthreads
    except (ImportError, ValueError):  # called outside a worker (tests, a local fallback)
        threads = 1
    enc = _encoder(model)
    enc.model.workers = threads  # qkv's own pool: the worker's share of the cores
    with threadpool_limits(1, "blas"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vectors = encode_lines(enc, texts, batch_size)
    return vectors, truncated_lines(caught, 0), os.getpid()  # cut lines counted from 1 in the partition


def _sources(paths_or_texts, format, field, errors):
    """(number of texts, an iterator over them) for a path, a list of paths, or texts."""
    if isinstance(paths_or_texts, (str, os.PathLike)):
        paths_or_texts = [Path(paths_or_texts)]
    items = list(paths_or_texts)
    if items and all(isinstance(p, os.PathLike) for p in items):
        n = sum(_count_lines(p) for p in items)
        return n, (t for p in items for t in iter_texts(p, format=format, field=field, errors=errors))
    bad = [t for t in items if not isinstance(t, str)]
    if bad:
        raise TypeError(f"paths_or_texts should be a path, a list of pathlib.Path, or texts (str), got {type(bad[0]).__name__}")
    return len(items), iter(items)


def embed_corpus(paths_or_texts, output, *, client=None, workers: int | None = None, model=None, format: str = "text", field: str = "text", errors: str = "strict", batch_size: int = 32, partition_lines: int | None = None, retries: int = 3, on_partition=None) -> dict:
    """Embed a corpus on Dask into ``output`` (.npy, row i = text i).

    Parameters
    ----------
    paths_or_texts : str or Path, list of Path, or iterable of str
        A file (one text per line, or JSON Lines), files in order, or the texts.
    output : str or Path
        The ``.npy`` to write, (N, E) float32.
    client : dask.distributed.Client, optional
        A cluster's client (``Client("tcp://scheduler:8786")``). Default: a
        ``LocalCluster`` of ``workers`` processes on this machine, closed after.
    workers : int, optional
        Processes of that local cluster (default 2).
    model : str or Path, optional
        The model directory each worker loads (default: the installed
        all-MiniLM-L6-v2); it must exist on every worker.
    partition_lines : int, optional
        Lines per task (default ``batch_size * 16``, as ``embed_file``'s chunks).
    retries : int
        How often a task lost with its worker is run again.
    on_partition : callable, optional
        ``on_partition(client, done)`` after each partition is written (tests kill a worker there).

    Returns
    -------
    dict
        ``rows``, ``dim``, ``output``, ``partitions``, ``truncated`` and
        ``truncated_lines`` (as :func:`qkv.models.embed_file`), ``worker_pids``
        (the worker processes that returned results).
    """
    from dask.distributed import Client, LocalCluster, as_completed

    output = Path(output)
    if output.suffix != ".npy":
        raise ValueError(f"output should end in .npy, got {str(output)!r}")
    batch_size = check_batch_size(batch_size)
    size = batch_size * 16 if partition_lines is None else check_int(partition_lines, "partition_lines", minimum=1)
    n, texts = _sources(paths_or_texts, format, field, errors)
    if n == 0:
        raise ValueError("the corpus is empty: nothing to embed")
    model = None if model is None else str(model)
    own = client is None
    if own:
        workers = 2 if workers is None else workers
        if workers < 1:
            raise ValueError(f"workers should be >= 1, got {workers}")
        # No dashboard; the scheduler's HTTP routes on a free loopback port (its default, 8787,
        # would be taken by any other cluster on the machine, with a warning to say so).
        threads = max(1, (os.cpu_count() or 1) // workers)
        cluster = LocalCluster(n_workers=workers, threads_per_worker=threads, processes=True, dashboard_address=None, scheduler_kwargs={"dashboard_address": "127.0.0.1:0"})
        client = Client(cluster)
        client.register_plugin(_quiet_close_plugin())
    out = None
    try:
        dim, max_seq_length = client.submit(_model_shape, model, pure=False).result()
        out = NpyRows(output, shape=(n, dim))
        # A bounded number of partitions in flight: the client never holds the whole corpus.
        in_flight = 2 * max(1, len(client.scheduler_info()["workers"]))
        parts = enumerate(_chunks(texts, size))
        run = uuid.uuid4().hex[:12]  # this call's task keys
        pending, starts, sizes = as_completed(), {}, {}

        def submit_next():
            for i, part in parts:
                fut = client.submit(_embed_partition, part, model, batch_size, pure=False, retries=retries, key=f"qkv-embed-{run}-{i}")
                starts[fut.key], sizes[fut.key] = i * size, len(part)
                pending.add(fut)
                return True
            return False

        for _ in range(in_flight):
            if not submit_next():
                break
        done, truncated, pids = 0, [], set()
        for fut in pending:
            vectors, cut, pid = fut.result()
            start = starts.pop(fut.key)
            if vectors.shape != (sizes.pop(fut.key), dim):
                raise RuntimeError(f"partition at row {start} came back with shape {vectors.shape}")
            out.write(start, vectors)
            truncated += [start + line for line in cut]
            done += len(vectors)
            pids.add(pid)
            submit_next()
            if on_partition is not None:
                on_partition(client, done)
        out.flush()
        if done != n:
            raise RuntimeError(f"{done} rows written, expected {n}")
    finally:
        if out is not None:
            out.close()
        if own:
            client.close()
            cluster.close()
    warn_truncated(truncated, max_seq_length)
    return {"rows": n, "dim": int(dim), "output": str(output), "partitions": -(-n // size), "truncated": len(truncated), "truncated_lines": sorted(truncated), "worker_pids": sorted(pids)}
