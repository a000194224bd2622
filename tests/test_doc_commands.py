"""Every ``qkv ...`` command the README and the guides print runs as written.

A command counts when it is a line of a fenced block, or an inline code span
that parses as a whole command (arguments, no placeholder such as TEXT or
FILE). Each runs in a shell, in a folder holding what it names: the models a
user would download are tiny stand-ins of the same family and format written
here (``flan-t5-small/`` a T5 v1.1 directory, ``qwen2.5-0.5b-instruct-q4_k_m.gguf``
a Qwen 2 GGUF with a ChatML template, ...), the packaged Gemma 3 270M stands
for the Gemma GGUF, and the one Dask scheduler address of the docs is
replaced by a real local one. Installing (``pip install ...``) before the
command is left to CI's own run of the README's second command.
"""

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

import gguf_writer
import test_training

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z_.]{2,}\b|\[|\.\.\.(?!\")")  # TEXT, FILE.npy, [PROMPT], TEXT... (not a quoted "...")
INSTALL = re.compile(r"^.*\bpip install [^&]*&&\s*")  # "python3 -m venv ... && pip install -e '.[viz]' && " before the command
SCHEDULER = "tcp://10.0.0.5:8786"


def _is_command(line: str) -> bool:
    return bool(re.search(r"(^|[|&]\s*)qkv\s", line))


def _whole(span: str) -> bool:
    """An inline span is a command, not a mention: it has arguments, no placeholder, and parses."""
    from qkv.cli import build_parser

    if PLACEHOLDER.search(span):
        return False
    words = shlex.split(span.split("|")[-1])
    if len(words) < 3:  # "qkv demo" names the command in a sentence
        return False
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # a mention's usage message is not news
            build_parser().parse_args(words[1:])
    except SystemExit:
        return False
    return True


def _commands():
    found = {}
    for path in DOCS:
        text = path.read_text()
        for block in re.findall(r"```\w*\n(.*?)```", text, flags=re.S):
            for line in block.splitlines():
                if _is_command(line) and not line.lstrip().startswith(">>>"):
                    found.setdefault(INSTALL.sub("", line.strip()), path.name)
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for span in re.findall(r"`([^`\n]+)`", prose):
            if _is_command(span) and _whole(span):
                found.setdefault(INSTALL.sub("", span.strip()), path.name)
    return sorted(found.items())


FOUND = _commands()
#: Documented commands another test runs as written, with more checks: not run twice.
RUN_ELSEWHERE = {test_training.DOCUMENTED_RUN: "test_training.py::test_default_induction_run_learns_an_induction_head"}
COMMANDS = [(c, doc) for c, doc in FOUND if c.split("#")[0].strip() not in RUN_ELSEWHERE]
#: What a command reads on standard input.
STDIN = {"chat": "What is the capital of France?\n"}


def test_the_docs_print_commands_and_this_file_finds_them():
    names = {c.split("#")[0].strip() for c, _ in COMMANDS}
    assert 'qkv generate "The capital of France is" --max-new-tokens 30' in names
    assert any(c.startswith("qkv chat --model qwen2.5") for c in names)
    assert len(COMMANDS) >= 20
    assert set(RUN_ELSEWHERE) <= {c.split("#")[0].strip() for c, _ in FOUND}  # what another test runs is still documented


@pytest.fixture(scope="module")
def workdir(torch, tmp_path_factory):
    """A folder holding every file and model the documented commands name."""
    from test_gguf_families import _model
    from test_seq2seq import V, _audio, _tiny_bart, _tiny_t5, _tiny_whisper
    from tokenizers import Tokenizer, models, pre_tokenizers

    from qkv.models.load import default_causal_lm_path

    d = tmp_path_factory.mktemp("docs")
    build = tmp_path_factory.mktemp("build")
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    bpe = gguf_writer.byte_level_vocab()
    gguf_writer.write(_model("qwen2", torch, len(bpe[0])), d / "qwen2.5-0.5b-instruct-q4_k_m.gguf", arch="qwen2", outtype="Q8_0", vocab=bpe, chat_template=chatml)
    spm = gguf_writer.sentencepiece_vocab()
    gguf_writer.write(_model("llama", torch, len(spm[0])), d / "tinyllama-1.1b-chat-v1.0.Q4_K_M.gguf", arch="llama", vocab=spm, spm=True)
    os.symlink(default_causal_lm_path(), d / "gemma-3-270m-it-Q8_0.gguf")  # the packaged Gemma 3 270M (a base model: chat says so)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w2"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    for name, (_, src) in {"flan-t5-small": _tiny_t5(torch, build, "flan"), "opus-mt-en-de": _tiny_bart("marian", torch, build), "whisper-tiny": _tiny_whisper(torch, build)}.items():
        shutil.copytree(src, d / name)
        words.save(str(d / name / "tokenizer.json"))
    with wave.open(str(d / "recording.wav"), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(16_000)
        f.writeframes(np.round(_audio()["sweep"] * 32767).astype("<i2").tobytes())
    lines = ["I opened an account at the bank.", "The river bank was muddy.", "", "She paid the money into her savings.", "We walked along the shore."] * 4
    (d / "corpus.txt").write_text("\n".join(lines) + "\n")
    return d


@pytest.fixture(scope="module")
def scheduler():
    from dask.distributed import LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        yield cluster.scheduler_address


@pytest.mark.parametrize("command, doc", COMMANDS, ids=[c for c, _ in COMMANDS])
def test_a_documented_command_runs_as_written(command, doc, workdir, request):
    if SCHEDULER in command:
        command = command.replace(SCHEDULER, request.getfixturevalue("scheduler"))
    bin_dir = str(Path(sys.executable).parent)  # where pip put the qkv script
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "MPLBACKEND": "Agg"}
    sub = shlex.split(command.split("|")[-1].split("#")[0])[1]
    if "--index corpus.npy" in command and not (workdir / "corpus.npy").exists():  # search reads what embed --input wrote
        subprocess.run("qkv embed --input corpus.txt --output corpus.npy", shell=True, cwd=workdir, env=env, check=True, capture_output=True)
    if sub == "serve":  # a server runs until stopped: it counts once it answers /health
        return _serve_answers(command, doc, workdir, env)
    r = subprocess.run(command, shell=True, cwd=workdir, env=env, input=STDIN.get(sub, ""), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{doc}: {command}\n{r.stderr[-2000:]}"
    assert "Traceback" not in r.stderr and "error" not in r.stderr.lower(), f"{doc}: {command}\n{r.stderr[-2000:]}"


def _serve_answers(command, doc, workdir, env):
    """``qkv serve ...`` as written, on a free port (the last --port wins): up, /health answers, stopped."""
    import http.client
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(shlex.split(command.split("#")[0]) + ["--port", str(port)], cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        status = None
        while time.monotonic() < deadline and proc.poll() is None and status is None:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("GET", "/health")
                status = c.getresponse().status
                c.close()
            except OSError:
                time.sleep(0.3)
        assert status == 200, f"{doc}: {command} did not answer /health (exit {proc.poll()})"
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert "Traceback" not in err, f"{doc}: {command}\n{err[-2000:]}"
