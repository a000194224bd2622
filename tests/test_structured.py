"""Output following a JSON schema (qkv.models.engines.structured): the tokens taken are the ones
llguidance's grammar allows, chosen as without a schema among them, and the text is the schema's JSON."""

import json
import subprocess
import sys

import numpy as np
import pytest

from qkv.models import load_causal_lm

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "city": {"enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PROMPT = "A person described as JSON:\n"


@pytest.fixture(scope="module")
def lm():
    return load_causal_lm()


def _follows(value, schema=PERSON):
    """The schema's rules, checked here by hand (not by the library that built the grammar)."""
    assert isinstance(value, dict) and set(value) == set(schema["required"])
    assert isinstance(value["name"], str) and len(value["name"]) <= 20
    assert type(value["age"]) is int and 0 <= value["age"] <= 120
    assert value["city"] in ("Paris", "Rome", "Oslo")


def test_greedy_json_takes_the_likeliest_token_the_schema_allows_and_follows_it(lm):
    import llguidance as llg

    out = lm.generate(PROMPT, max_new_tokens=60, json_schema=PERSON)
    assert out.stop_reason == "eos"
    _follows(json.loads(out.text))
    free = lm.generate(PROMPT, max_new_tokens=len(out.token_ids))
    assert free.token_ids != out.token_ids  # the schema changed the answer
    # Every token: allowed by a grammar matcher stepped here, and no allowed token had a higher logit in a
    # full forward pass over the prompt and the answer (not the cached decode that chose them).
    prompt = lm.tokenizer.encode(PROMPT)
    logits = lm(prompt + out.token_ids[:-1])[len(prompt) - 1 :]  # (T, V): the logits each token was chosen from
    tok = llg.LLTokenizer(lm.tokenizer.backend.to_str(), n_vocab=lm.config.vocab_size, eos_token=list(lm.tokenizer.eos_ids))
    matcher = llg.LLMatcher(tok, llg.LLMatcher.grammar_from_json_schema(PERSON, overrides={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}))
    for t, row in zip(out.token_ids, logits):
        allowed = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")[: lm.config.vocab_size].astype(bool)
        assert allowed[t]
        better = np.nonzero(row > row[t])[0]
        assert not allowed[better].any(), (t, better[allowed[better]][:5])
        assert matcher.consume_token(t)
    assert matcher.is_stopped() and out.token_ids[-1] in lm.tokenizer.eos_ids


def test_samples_follow_the_schema_and_a_batch_answers_each_prompt_as_alone(lm):
    prompts = [PROMPT, "Here is one more person, as JSON:\n"]
    outs = lm.generate(prompts, max_new_tokens=60, json_schema=PERSON, temperature=1.0, seed=7)
    for prompt, out in zip(prompts, outs):
        assert out.stop_reason == "eos"
        _follows(json.loads(out.text))
    greedy = lm.generate(prompts, max_new_tokens=60, json_schema=PERSON)
    assert [g.token_ids for g in greedy] == [lm.generate(p, max_new_tokens=60, json_schema=PERSON).token_ids for p in prompts]


def test_any_object_and_a_cut_answer(lm):
    out = lm.generate("A JSON object describing a cat:", max_new_tokens=80, json_schema={"type": "object"})
    assert out.text.startswith("{")
    if out.stop_reason == "eos":
        assert isinstance(json.loads(out.text), dict)
    cut = lm.generate(PROMPT, max_new_tokens=3, json_schema=PERSON)
    assert cut.stop_reason == "length" and cut.text.startswith('{"')  # unfinished, as the length cut it


@pytest.mark.parametrize("schema, error, match", [
    ([1], TypeError, "json_schema should be a dict"),
    ({"type": "frobnicate"}, ValueError, "json_schema cannot be followed: .*frobnicate"),
    ({"type": "string", "format": "no-such-format"}, ValueError, "cannot be followed: .*no-such-format"),
    ({"type": "number", "minimum": float("nan")}, ValueError, "json_schema is not JSON"),
    ({"description": "x" * (1 << 20)}, ValueError, "the limit is 1,048,576"),
])  # fmt: skip
def test_a_schema_that_cannot_be_followed_is_refused_before_any_token(lm, schema, error, match):
    with pytest.raises(error, match=match):
        lm.generate(PROMPT, max_new_tokens=5, json_schema=schema)


def test_a_schema_needs_the_end_of_text_and_llguidance(lm, monkeypatch):
    with pytest.raises(ValueError, match="needs stop_at_eos=True"):
        lm.generate(PROMPT, max_new_tokens=5, json_schema=PERSON, stop_at_eos=False)
    from qkv.models.engines import structured

    monkeypatch.setitem(sys.modules, "llguidance", None)  # not installed
    monkeypatch.delattr(lm, "_llguidance_tokenizer", raising=False)
    with pytest.raises(ImportError, match=r"needs llguidance: pip install 'qkv\[structured\]'"):
        structured.JsonSchema(lm, PERSON)


def test_the_cli_writes_the_librarys_json(lm):
    r = subprocess.run([sys.executable, "-m", "qkv", "generate", PROMPT, "--json-schema", json.dumps(PERSON), "--max-new-tokens", "60", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_ids"] == lm.generate(PROMPT, max_new_tokens=60, json_schema=PERSON).token_ids
    r = subprocess.run([sys.executable, "-m", "qkv", "generate", "x", "--json-schema", "[1]"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == "qkv: error: --json-schema should be a JSON object (a schema), got list"
