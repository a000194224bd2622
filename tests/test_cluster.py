"""Embedding a corpus on Dask: a real LocalCluster (2 worker processes), one of them killed mid-run."""

import os
import signal
import subprocess
import sys
import warnings

import numpy as np
import pytest

from qkv.models import embed_file, load_model
from qkv.models.corpus.cluster import embed_corpus

from test_corpus import blank_rows_zero, corpus_lines, write


@pytest.fixture(scope="module")
def client():
    from dask.distributed import Client, LocalCluster

    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None)
    c = Client(cluster)
    yield c
    c.close()
    cluster.close()


@pytest.mark.filterwarnings("ignore:.* texts were longer than")
def test_dask_rows_equal_the_single_machine_run(client, tmp_path):
    src = write(tmp_path, corpus_lines())
    res = embed_corpus(src, tmp_path / "dask.npy", client=client, batch_size=4, partition_lines=8)
    assert res["rows"] == 70 and res["partitions"] == 9 and res["truncated"] == 7
    assert len(res["worker_pids"]) == 2  # both workers took partitions
    embed_file(load_model(), src, tmp_path / "one.npy", batch_size=4, chunk_batches=2)  # the same chunks as partitions
    np.testing.assert_allclose(np.load(tmp_path / "dask.npy"), np.load(tmp_path / "one.npy"), rtol=0, atol=1e-6)
    texts = corpus_lines()[:20]
    res = embed_corpus(texts, tmp_path / "texts.npy", client=client, batch_size=4, partition_lines=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        np.testing.assert_allclose(np.load(tmp_path / "texts.npy"), blank_rows_zero(texts, load_model().encode(texts, batch_size=4)), atol=1e-6)


@pytest.mark.filterwarnings("ignore:.* texts were longer than")
def test_a_worker_killed_mid_run_loses_no_row(client, tmp_path):
    lines = [f"sentence number {i} about {'rivers' if i % 3 else 'money'}" for i in range(400)]
    src = write(tmp_path, lines)
    killed = []

    def kill_one(c, done):
        if not killed and done >= 20:  # after the first partitions: kill a worker process with tasks in flight
            pids = c.run(os.getpid)
            victim = sorted(pids.values())[0]
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)

    res = embed_corpus(src, tmp_path / "k.npy", client=client, batch_size=4, partition_lines=10, on_partition=kill_one)
    assert killed and res["rows"] == 400
    got = np.load(tmp_path / "k.npy")
    want = load_model().encode(lines, batch_size=4)
    np.testing.assert_allclose(got, want, atol=1e-5)  # every row present, in order, none twice
    assert len(set(map(bytes, got))) == 400


def test_a_closing_worker_s_heartbeat_failure_is_not_printed():
    """A worker of qkv's own cluster that closes under an in-flight heartbeat logs a traceback (dask/distributed#7192): dropped, and only then."""
    import inspect
    import logging

    from distributed.core import Status
    from distributed.worker import Worker

    from qkv.models.corpus.cluster import _ClosingHeartbeat, _quiet_close_plugin

    message = "Failed to communicate with scheduler during heartbeat."
    assert message in inspect.getsource(Worker.heartbeat)  # the record distributed logs is the one filtered

    class Stub:
        status = Status.running

    worker = Stub()
    quiet = _ClosingHeartbeat(worker)
    record = logging.LogRecord("distributed.worker", logging.ERROR, "worker.py", 1, message, None, None)
    other = logging.LogRecord("distributed.worker", logging.ERROR, "worker.py", 1, "Compute Failed", None, None)
    assert quiet.filter(record) and quiet.filter(other)  # a running worker's failed heartbeat is news
    for status in (Status.closing, Status.closing_gracefully, Status.closed):
        worker.status = status
        assert not quiet.filter(record) and quiet.filter(other)
    assert _quiet_close_plugin().name == "qkv-quiet-close"


def test_qkv_s_own_cluster_installs_the_filter_on_its_workers(client, tmp_path):
    # `client`'s cluster holds the scheduler's default HTTP port (8787): qkv's own cluster must not warn about it
    seen = []
    embed_corpus(["a short line"] * 12, tmp_path / "q.npy", workers=1, partition_lines=6, on_partition=lambda c, done: seen.append(c.run(lambda dask_worker: sorted(dask_worker.plugins))))
    assert seen and all("qkv-quiet-close" in plugins for run in seen for plugins in run.values())


def test_embed_command_on_a_local_cluster(tmp_path):
    lines = ["The river bank was steep.", "I deposited cash at the bank.", "", "Dogs bark at night."]
    src = write(tmp_path, lines)
    r = subprocess.run([sys.executable, "-m", "qkv", "embed", "--input", str(src), "--output", "d.npy", "--workers", "2"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "wrote d.npy: 4 x 384 float32 embeddings" in r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    np.testing.assert_allclose(np.load(tmp_path / "d.npy"), blank_rows_zero(lines, load_model().encode(lines)), atol=1e-6)
    r = subprocess.run([sys.executable, "-m", "qkv", "embed", "--input", str(src), "--output", "d.npy", "--scheduler", "tcp://127.0.0.1:1"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and "cannot reach the Dask scheduler at --scheduler 'tcp://127.0.0.1:1'" in r.stderr


def test_bad_sizes_are_refused_before_any_cluster_starts(tmp_path):
    src = write(tmp_path, ["a", "b"])
    for kwargs, error, match in (({"batch_size": 10**20}, ValueError, "batch_size should be at most 4096"), ({"batch_size": 0}, ValueError, "batch_size should be >= 1"),
                                 ({"partition_lines": 1.5}, TypeError, "partition_lines should be an integer, got float")):  # fmt: skip
        with pytest.raises(error, match=match):
            embed_corpus(src, tmp_path / "x.npy", client=None, **kwargs)
