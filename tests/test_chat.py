"""Chat templates (rendered as transformers renders them, in the sandbox), chat and the sampling options
people expect (repetition penalty, min-p, stop strings), against transformers; the CLI's chat."""

import json
import subprocess
import sys

import numpy as np
import pytest

from qkv.models import ModelError, load_causal_lm
from qkv.models.formats.chat import GEMMA_TEMPLATE, ChatTemplate

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Llama 3's shape, with the features real templates use: namespace, tojson, loop controls, the generation tag
LLAMA3_LIKE = """{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = m['content'] %}{% continue %}{% endif %}{% endfor %}
{%- if ns.system %}<|start_header_id|>system<|end_header_id|>\n\n{{ ns.system | trim }}<|eot_id|>{% endif %}
{%- for m in messages %}
    {%- if m['role'] == 'system' %}{% continue %}{% endif %}
    {%- if m['role'] == 'assistant' %}<|start_header_id|>assistant<|end_header_id|>\n\n{% generation %}{{ m['content'] | trim }}<|eot_id|>{% endgeneration %}
    {%- else %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endif %}
    {%- if m.get('tools') %}{{ m['tools'] | tojson }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "  Capital of Italy?  "}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Tell me a joke about café & <tags> \"quotes\""}],
    [{"role": "user", "content": "héllo 日本語 😀", "tools": [{"name": "f", "note": "é <b>"}]}],
]


@pytest.mark.parametrize("template", [GEMMA_TEMPLATE, CHATML, LLAMA3_LIKE], ids=["gemma", "chatml", "llama3-like"])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_templates_render_as_transformers_renders_them(template, conversation, generation_prompt):
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = CONVERSATIONS[conversation]
    want, _ = render_jinja_template([messages], chat_template=template, add_generation_prompt=generation_prompt, bos_token="<bos>", eos_token="<eos>")
    got = ChatTemplate(template, "test", bos_token="<bos>", eos_token="<eos>").render(messages, add_generation_prompt=generation_prompt)
    assert got == want[0]


@pytest.mark.parametrize(
    "source, messages, match",
    [
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", [{"role": "user", "content": "x"}], "the sandbox forbids"),
        ("{{ messages.__class__.__base__ }}{{ cycler.__init__.__globals__.os }}", [{"role": "user", "content": "x"}], "the sandbox forbids|failed to render"),
        ("{{ raise_exception('only one turn, please') }}", [{"role": "user", "content": "x"}], "failed to render this conversation: only one turn, please"),
        ("{% for m in messages %}", [{"role": "user", "content": "x"}], "does not compile"),
        (GEMMA_TEMPLATE, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "roles must alternate"),
    ],
)
def test_a_hostile_or_broken_template_is_one_clear_error(source, messages, match):
    with pytest.raises(ModelError, match=match):
        ChatTemplate(source, "a test file").render(messages)


def test_bad_conversations():
    t = ChatTemplate(CHATML, "x")
    for messages, exc, match in (
        ("hi", TypeError, "messages should be a list"),
        ([], ValueError, "messages is empty"),
        ([{"role": "user"}], ValueError, r"messages\[0\]\['content'\] should be a string"),
        (["hi"], TypeError, r"messages\[0\] should be a dict"),
    ):
        with pytest.raises(exc, match=match):
            t.render(messages)


@pytest.fixture(scope="module")
def gemma():
    return load_causal_lm()


def test_the_packaged_model_is_a_base_model_that_chats_in_gemmas_format(gemma):
    assert gemma.instruction_tuned is False and "no chat template" in gemma.chat_template.origin
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    text = gemma.apply_chat_template(messages)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
    ids = gemma.tokenizer.encode(text, add_bos=False)
    assert ids[0] == gemma.tokenizer.bos_id and ids.count(gemma.tokenizer.bos_id) == 1  # BOS once: the template's
    turn, end = gemma.tokenizer.backend.token_to_id("<start_of_turn>"), gemma.tokenizer.backend.token_to_id("<end_of_turn>")
    assert ids.count(turn) == 2 and ids.count(end) == 1 and end in gemma.tokenizer.eos_ids  # whole special tokens; a turn's end stops
    out = gemma.chat(messages, max_new_tokens=6)
    assert out.prompt_ids == ids and len(out.token_ids) <= 6


def test_stop_strings_cut_the_text_before_them(gemma):
    full = gemma.generate("The capital of France is", max_new_tokens=24)
    assert "." in full.text
    out = gemma.generate("The capital of France is", max_new_tokens=24, stop=["."])
    assert out.stop_reason == "stop" and out.text == full.text[: full.text.index(".")]
    assert gemma.tokenizer.decode(out.token_ids).startswith(out.text + ".")  # the tokens that made the stop string stay
    with pytest.raises(ValueError, match="stop should be non-empty strings"):
        gemma.generate("x", stop=[""])


def test_a_stop_string_longer_than_many_tokens_still_stops(gemma):
    """Looked for in the whole new text: a window of the last 64 tokens had let a long stop string pass."""
    full = gemma.generate("1, 2, 3, 4,", max_new_tokens=100)
    stop = full.text[5:-5]  # about 90 tokens of counting
    assert len(gemma.tokenizer.encode(stop, add_bos=False)) > 64
    out = gemma.generate("1, 2, 3, 4,", max_new_tokens=100, stop=["never said", stop])
    assert out.stop_reason == "stop" and out.text == full.text[:5]
    assert len(out.token_ids) < len(full.token_ids)  # it stopped as the string ended, not at the length


def test_repetition_penalty_and_min_p_follow_transformers(torch):
    """The logits processors against transformers' own, on random logits and histories."""
    from transformers.generation.logits_process import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

    from qkv.models.engines.sampling import next_token, penalize

    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = rng.standard_normal(50).astype(np.float32) * 3
        seen = rng.integers(0, 50, size=rng.integers(1, 30))
        penalty = float(rng.uniform(0.5, 2.0))
        want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor(seen)[None], torch.tensor(logits)[None])[0].numpy()
        np.testing.assert_array_equal(penalize(logits, seen, penalty), want)
        min_p = float(rng.uniform(0.01, 0.9))
        kept = np.isfinite(MinPLogitsWarper(min_p)(None, torch.tensor(logits, dtype=torch.float64)[None])[0].numpy())
        draws = {next_token(logits, temperature=1.0, min_p=min_p, rng=np.random.default_rng(i)) for i in range(200)}
        assert draws <= set(np.nonzero(kept)[0]) and np.argmax(logits) in draws


def test_the_sampled_distribution_is_transformers_warpers_distribution(torch):
    """temperature, top-k, top-p and min-p, alone and together, against transformers' warpers run in
    generate's order: the same tokens kept and the same probabilities (random logits, with ties)."""
    from transformers.generation.logits_process import LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from qkv.models.engines.sampling import token_probabilities

    rng = np.random.default_rng(1)
    checked = ties = 0
    for trial in range(300):
        V = int(rng.integers(2, 80))
        logits = (rng.standard_normal(V) * rng.uniform(0.3, 4)).astype(np.float32)
        if trial % 3 == 0:  # ties: a few distinct values
            logits = np.round(logits).astype(np.float32)
        t = float(rng.choice([1.0, rng.uniform(0.2, 2.0)]))
        k = int(rng.integers(1, V + 1)) if rng.random() < 0.6 else None
        top_p = float(rng.uniform(0.05, 1.0)) if rng.random() < 0.6 else None
        min_p = float(rng.uniform(0.01, 0.6)) if rng.random() < 0.4 else None
        warpers = LogitsProcessorList([TemperatureLogitsWarper(t)] + ([TopKLogitsWarper(k)] if k else []) + ([TopPLogitsWarper(top_p)] if top_p and top_p < 1 else []) + ([MinPLogitsWarper(min_p)] if min_p else []))
        scores = warpers(None, torch.tensor(logits, dtype=torch.float64)[None])
        want = torch.softmax(scores, -1)[0].numpy()
        got = token_probabilities(logits, temperature=t, top_k=k, top_p=top_p, min_p=min_p)
        assert got.dtype == np.float64
        # a token at a cut's very edge (its cumulative mass equal to top_p in the last bits) may fall either way
        if top_p:
            before = LogitsProcessorList([TemperatureLogitsWarper(t)] + ([TopKLogitsWarper(k)] if k else []))(None, torch.tensor(logits, dtype=torch.float64)[None])
            if np.min(np.abs(np.cumsum(np.sort(torch.softmax(before, -1)[0].numpy())[::-1]) - top_p)) < 1e-9:
                continue
        np.testing.assert_allclose(np.sort(got), np.sort(want), rtol=1e-9, atol=1e-12)  # the same probabilities
        cut = want[want > 0].min()
        if top_p and np.any(np.isclose(got, cut, rtol=1e-12, atol=0) & (want == 0)):
            # tokens tied at top-p's cut: transformers keeps those torch's unstable sort puts last; qkv the
            # lower ids, as greedy picks the lowest
            ties += 1
            continue
        np.testing.assert_array_equal(got > 0, want > 0, err_msg=f"trial {trial}: t={t} k={k} top_p={top_p} min_p={min_p}")
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
        checked += 1
    assert checked >= 250 and ties > 0


def test_greedy_with_a_repetition_penalty_equals_transformers(torch, tmp_path):
    from test_decoder import _tiny

    model, d = _tiny("llama", torch, tmp_path)
    lm = load_causal_lm(d)
    prompt = [5, 9, 13, 5, 9]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, repetition_penalty=1.4, eos_token_id=None, pad_token_id=0)[0, 5:].tolist()
    assert lm.generate(prompt, max_new_tokens=20, repetition_penalty=1.4, stop_at_eos=False).token_ids == want
    plain = lm.generate(prompt, max_new_tokens=20, stop_at_eos=False).token_ids
    assert plain != want  # the penalty changed something here


class _OpenAIPenalties:
    """OpenAI's frequency and presence penalties as a transformers logits processor, in torch: a logit
    lowered by ``frequency`` per time its token was generated and by ``presence`` once it was (the
    formula of OpenAI's documentation, vLLM's ``_apply_penalties``); the prompt's tokens are not counted."""

    def __init__(self, torch, prompt_len, frequency, presence):
        self.torch, self.prompt_len, self.frequency, self.presence = torch, prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        new = input_ids[:, self.prompt_len :]
        counts = self.torch.zeros_like(scores).scatter_add_(1, new, self.torch.ones_like(new, dtype=scores.dtype))
        scores = scores - self.frequency * counts
        return scores - self.presence * (counts > 0).to(scores.dtype)


def test_logit_bias_and_openais_penalties_follow_transformers_and_their_formula(torch, tmp_path):
    """logit_bias against transformers' SequenceBiasLogitsProcessor (single tokens), the frequency and
    presence penalties against their formula in torch, run after transformers' repetition penalty (vLLM's
    order): on random logits and histories, then greedy decoding of a tiny Llama."""
    from transformers.generation.logits_process import LogitsProcessorList, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    from test_decoder import _tiny

    from qkv.models.engines.sampling import adjust, check_logit_bias

    rng = np.random.default_rng(3)
    for _ in range(30):
        V, P = 50, int(rng.integers(1, 10))
        logits = rng.standard_normal(V).astype(np.float32) * 3
        history = rng.integers(0, V, size=P + int(rng.integers(0, 30)))
        bias = {int(t): float(rng.uniform(-100, 100)) for t in rng.choice(V, size=int(rng.integers(1, 8)), replace=False)}
        rep, freq, pres = float(rng.uniform(0.5, 2)), float(rng.uniform(-2, 2)), float(rng.uniform(-2, 2))
        ids = torch.tensor(history)[None]
        steps = LogitsProcessorList([SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()}), RepetitionPenaltyLogitsProcessor(rep), _OpenAIPenalties(torch, P, freq, pres)])
        want = steps(ids, torch.tensor(logits)[None])[0].numpy()
        got = adjust(logits, history[:P].tolist(), history[P:].tolist(), repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres, logit_bias=check_logit_bias(bias, V))
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want)
    model, d = _tiny("llama", torch, tmp_path)
    lm = load_causal_lm(d)
    prompt = [5, 9, 13, 5, 9]
    plain = lm.generate(prompt, max_new_tokens=20, stop_at_eos=False).token_ids
    options = dict(frequency_penalty=0.9, presence_penalty=0.6, logit_bias={plain[0]: -100.0, 17: 4.0})
    for rep in (1.0, 1.3):
        steps = LogitsProcessorList([_OpenAIPenalties(torch, len(prompt), options["frequency_penalty"], options["presence_penalty"])])
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, repetition_penalty=rep, sequence_bias={(t,): b for t, b in options["logit_bias"].items()},
                                  logits_processor=steps, eos_token_id=None, pad_token_id=0)[0, len(prompt) :].tolist()  # fmt: skip
        got = lm.generate(prompt, max_new_tokens=20, repetition_penalty=rep, stop_at_eos=False, **options).token_ids
        assert got == want
        assert plain[0] not in got  # banned
        for name in options:  # each option changes the answer here
            assert lm.generate(prompt, max_new_tokens=20, repetition_penalty=rep, stop_at_eos=False, **{**options, name: None if name == "logit_bias" else 0.0}).token_ids != got, name


@pytest.mark.parametrize("options, match", [
    ({"frequency_penalty": 2.5}, r"frequency_penalty should be a number in \[-2, 2\]"),
    ({"presence_penalty": float("nan")}, r"presence_penalty should be a number in \[-2, 2\]"),
    ({"presence_penalty": True}, "presence_penalty should be a number"),
    ({"logit_bias": {-1: 5.0}}, r"logit_bias: a token id should be an integer in \[0, 97\)"),  # never the last token by wrapping
    ({"logit_bias": {97: 5.0}}, r"\[0, 97\)"),
    ({"logit_bias": {3.0: 5.0}}, "a token id should be an integer"),
    ({"logit_bias": {3: 100.5}}, r"logit_bias\[3\] should be a number in \[-100, 100\]"),
    ({"logit_bias": {3: float("inf")}}, r"logit_bias\[3\] should be a number"),
    ({"logit_bias": [(3, 1.0)]}, "logit_bias should be a dict"),
])  # fmt: skip
def test_bad_penalties_and_biases_are_refused_before_any_work(options, match, torch, tmp_path):
    from test_decoder import _tiny

    _, d = _tiny("llama", torch, tmp_path)
    with pytest.raises((TypeError, ValueError), match=match):
        load_causal_lm(d).generate([5, 9], max_new_tokens=2, **options)


def test_a_hugging_face_directory_chats_with_its_own_template(torch, tmp_path):
    from test_decoder import _tiny

    _, d = _tiny("qwen2", torch, tmp_path)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    lm = load_causal_lm(d)
    assert lm.instruction_tuned is True
    assert lm.apply_chat_template([{"role": "user", "content": "w5 w7"}]) == "<|im_start|>user\nw5 w7<|im_end|>\n<|im_start|>assistant\n"
    (d / "tokenizer_config.json").unlink()
    assert load_causal_lm(d).chat_template is None  # no template, not a Gemma: no chat
    with pytest.raises(ValueError, match="has no chat template"):
        load_causal_lm(d).chat([{"role": "user", "content": "x"}])


def test_named_chat_templates_are_taken_as_transformers_takes_them(torch, tmp_path):
    """tokenizer_config.json may list templates by name: a chat takes the one named "default"; with none of
    that name, transformers' apply_chat_template refuses the chat, and so does qkv (the model still generates)."""
    from test_decoder import _tiny
    from transformers import AutoTokenizer

    _, d = _tiny("qwen2", torch, tmp_path)
    messages = [{"role": "user", "content": "w5 w7"}]
    tool_use = CHATML.replace("<|im_start|>", "<|tool|>")
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": tool_use}, {"name": "default", "template": CHATML}]}))
    want = AutoTokenizer.from_pretrained(d).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert load_causal_lm(d).apply_chat_template(messages) == want and want.startswith("<|im_start|>user")
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": tool_use}, {"name": "rag", "template": CHATML}]}))
    with pytest.raises(ValueError, match="no default"):
        AutoTokenizer.from_pretrained(d).apply_chat_template(messages, tokenize=False)
    lm = load_causal_lm(d)
    with pytest.raises(ValueError, match=r"has no chat template \(its named templates \('rag', 'tool_use'\) include none named 'default'"):
        lm.chat(messages)
    assert lm.instruction_tuned is True and len(lm.generate("w5", max_new_tokens=2).token_ids) == 2
    for bad in ([{"name": "default"}], ["{{ messages }}"], [{"name": 3, "template": CHATML}]):
        (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": bad}))
        with pytest.raises(ModelError, match=rf"tokenizer_config.json: chat_template\[0\] should be an object with a string 'name' and 'template', got "):
            load_causal_lm(d)


def qkv_cli(*args, input=None):
    return subprocess.run([sys.executable, "-m", "qkv", *args], capture_output=True, text=True, input=input, timeout=300)


def test_chat_command_takes_turns_from_its_input():
    r = qkv_cli("chat", "--max-new-tokens", "5", input="What is the capital of France?\n\n/reset\nHello\n")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip("\n").splitlines()) >= 2  # two replies (blank lines are no turns)
    err = r.stderr
    assert "it is a base (pretrained) model, not instruction-tuned" in err and "conversation cleared" in err
    assert err.count("tokens/s]") == 2 and "decode" in err
    r = qkv_cli("generate", "--chat", "--system", "Be brief.", "What is the capital of France?", "--max-new-tokens", "3", "--json")
    got = json.loads(r.stdout)
    assert got["chat"] is True and len(got["token_ids"]) == 3 and got["prompt_ids"][0] == 2
    for args, match in (
        (["generate", "hi", "--system", "x"], "--system has no effect without --chat"),
        (["generate", "hi", "--min-p", "0", "--temperature", "1"], "--min-p should be in (0, 1]"),
        (["generate", "hi", "--min-p", "0.1"], "--min-p has no effect with --temperature 0"),
        (["generate", "hi", "--stop", ""], "--stop should be a non-empty string"),
        (["generate", "hi", "--repetition-penalty", "0"], "--repetition-penalty should be a number in [1e-6, 1e6]"),
        (["generate", "hi", "--repetition-penalty", "1e-50"], "--repetition-penalty should be a number in [1e-6, 1e6]"),  # (0 in float32: had divided by zero)
        (["generate", "--prompt-file", "/nonexistent/p.txt"], "cannot read --prompt-file"),
        (["generate", "hi", "--prompt-file", "p.txt"], "give PROMPT or --prompt-file, not both"),
    ):
        r = qkv_cli(*args)
        assert r.returncode == 2 and match in r.stderr.strip().splitlines()[-1], (args, r.stderr)


def test_generate_reads_a_prompt_file_and_hides_stop_strings(tmp_path):
    (tmp_path / "p.txt").write_text("The capital of France is\n", encoding="utf-8")
    a = json.loads(qkv_cli("generate", "--prompt-file", str(tmp_path / "p.txt"), "--max-new-tokens", "4", "--json").stdout)
    b = json.loads(qkv_cli("generate", "The capital of France is\n", "--max-new-tokens", "4", "--json").stdout)
    assert a["prompt_ids"] == b["prompt_ids"] and a["token_ids"] == b["token_ids"]
    r = qkv_cli("generate", "The capital of France is", "--max-new-tokens", "24", "--stop", ".")
    assert r.returncode == 0 and "." not in r.stdout and "stop: stop" in r.stderr
