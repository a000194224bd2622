"""Whisper: an encoder-decoder that listens. What is peculiar to it.

- The source is audio: 30 s at 16 kHz become a log-mel spectrogram, (80, 3000) (128 mel bins in
  large-v3): a 400-sample Hann window every 160 samples, the power spectrum through Slaney-style mel
  filters, ``log10``, floored at 8 below its maximum, then ``(x + 4) / 4``
  (:func:`log_mel_spectrogram`, the same numbers as transformers' ``WhisperFeatureExtractor``).
- The encoder starts with two convolutions over time (kernel 3, GELU each; the second with stride 2:
  3,000 frames become 1,500 positions), then a stored position table, then pre-norm layers and a
  final LayerNorm. The decoder: token embeddings plus a learned position table, pre-norm layers with
  cross-attention, a final LayerNorm, the LM head tied to the embeddings.
- Keys have no bias (queries, values and outputs do). OpenAI's code scales queries and keys by
  D^-1/4 each; transformers scales the queries by D^-1/2: the same scores.
"""

from __future__ import annotations

import time

import numpy as np

from ...softmax import logsumexp
from ..errors import ModelError
from ..formats.files import FieldReader
from ..engines.functional import ACTIVATIONS
from . import bart
from ..engines.seq2seq import DEFAULT_MAX_NEW_TOKENS, Seq2SeqConfig, Seq2SeqGenerateOutput, Seq2SeqLM, Seq2SeqWeights

__all__ = ["SAMPLING_RATE", "CHUNK_SECONDS", "TIME_PRECISION", "MAX_SECONDS", "mel_filters", "log_mel_spectrogram", "read_wav", "WhisperLM", "config_from_hf", "weights_from_hf"]

SAMPLING_RATE = 16_000  #: samples a second Whisper was trained on
CHUNK_SECONDS = 30  #: the encoder hears 30 s at a time
TIME_PRECISION = 0.02  #: seconds from one timestamp token to the next (<|0.00|>, <|0.02|>, ...)
MAX_SECONDS = 2 * 3600  #: the longest audio transcribed at once (its samples 461 MB as float32, its features 230 MB)
N_FFT, HOP = 400, 160  #: 25 ms windows every 10 ms
FRAMES = CHUNK_SECONDS * SAMPLING_RATE // HOP  #: 3,000 spectrogram frames

#: Whisper's languages by name, as a generation config may give them (``"language": "hindi"``, as the
#: fine-tuning guides set it): the code of each, its token ``<|code|>``.
LANGUAGE_CODES = dict(
    pair.replace("_", " ").split(":")  # ("haitian_creole": a name of two words)
    for pair in (
        "english:en chinese:zh german:de spanish:es russian:ru korean:ko french:fr japanese:ja portuguese:pt turkish:tr "
        "polish:pl catalan:ca dutch:nl arabic:ar swedish:sv italian:it indonesian:id hindi:hi finnish:fi vietnamese:vi "
        "hebrew:he ukrainian:uk greek:el malay:ms czech:cs romanian:ro danish:da hungarian:hu tamil:ta norwegian:no "
        "thai:th urdu:ur croatian:hr bulgarian:bg lithuanian:lt latin:la maori:mi malayalam:ml welsh:cy slovak:sk "
        "telugu:te persian:fa latvian:lv bengali:bn serbian:sr azerbaijani:az slovenian:sl kannada:kn estonian:et "
        "macedonian:mk breton:br basque:eu icelandic:is armenian:hy nepali:ne mongolian:mn bosnian:bs kazakh:kk "
        "albanian:sq swahili:sw galician:gl marathi:mr punjabi:pa sinhala:si khmer:km shona:sn yoruba:yo somali:so "
        "afrikaans:af occitan:oc georgian:ka belarusian:be tajik:tg sindhi:sd gujarati:gu amharic:am yiddish:yi lao:lo "
        "uzbek:uz faroese:fo haitian_creole:ht pashto:ps turkmen:tk nynorsk:nn maltese:mt sanskrit:sa luxembourgish:lb "
        "myanmar:my tibetan:bo tagalog:tl malagasy:mg assamese:as tatar:tt hawaiian:haw lingala:ln hausa:ha bashkir:ba "
        "javanese:jw sundanese:su cantonese:yue "
        # other names of the same languages
        "burmese:my valencian:ca flemish:nl haitian:ht letzeburgesch:lb pushto:ps panjabi:pa moldavian:ro moldovan:ro "
        "sinhalese:si castilian:es mandarin:zh"
    ).split()
)


def _hz_to_mel(f):  # Slaney's scale: linear below 1 kHz, logarithmic above
    f = np.asarray(f, np.float64)
    return np.where(f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) * (27.0 / np.log(6.4)), 3.0 * f / 200.0)


def _mel_to_hz(m):
    m = np.asarray(m, np.float64)
    return np.where(m >= 15.0, 1000.0 * np.exp((m - 15.0) * (np.log(6.4) / 27.0)), 200.0 * m / 3.0)


def mel_filters(n_mels: int = 80, *, n_fft: int = N_FFT, sampling_rate: int = SAMPLING_RATE) -> np.ndarray:  # -> (n_fft // 2 + 1, n_mels)
    """Triangular filters at ``n_mels + 2`` points evenly spaced on Slaney's mel scale from 0 to 8 kHz,
    each scaled to unit area ("slaney" norm), over the FFT's frequency bins; float64.

    >>> w = mel_filters(80)
    >>> w.shape, bool((w >= 0).all()), int((w.sum(axis=0) > 0).sum())
    ((201, 80), True, 80)
    """
    bins = np.linspace(0, sampling_rate // 2, n_fft // 2 + 1)  # (F,) Hz
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(8000.0), n_mels + 2))  # (n_mels + 2,) Hz
    slopes = edges[None, :] - bins[:, None]  # (F, n_mels + 2)
    width = np.diff(edges)
    down = -slopes[:, :-2] / width[:-1]  # rising edge of each triangle
    up = slopes[:, 2:] / width[1:]  # falling edge
    return np.maximum(0.0, np.minimum(down, up)) * (2.0 / (edges[2:] - edges[:-2]))[None, :]


def log_mel_spectrogram(audio, *, sampling_rate: int, n_mels: int = 80) -> np.ndarray:  # (samples,) -> (n_mels, frames)
    """Whisper's input: the log-mel spectrogram of mono audio at 16 kHz, a frame every 10 ms.

    Up to 30 s, zero-padded to 30 s: (n_mels, 3000), as transformers' ``WhisperFeatureExtractor`` gives it
    by default. Longer audio (up to :data:`MAX_SECONDS`), whole: (n_mels, samples // 160), as the
    extractor gives it with ``truncation=False, padding="longest"`` for long-form transcription (the
    loudness is clipped at 80 dB below the loudest frame of the whole recording).

    Computed in float64 and returned as float32 (transformers' NumPy path stores the FFT in complex64;
    the two agree to about 1e-7).

    Raises
    ------
    ValueError
        Another sampling rate (Whisper hears 16 kHz: resample first), more than :data:`MAX_SECONDS`,
        audio that is not 1-D or not finite.

    Examples
    --------
    >>> t = np.arange(16_000) / 16_000
    >>> x = log_mel_spectrogram(np.sin(2 * np.pi * 440 * t), sampling_rate=16_000)
    >>> x.shape, x.dtype
    ((80, 3000), dtype('float32'))
    >>> log_mel_spectrogram(np.zeros(16_000 * 45), sampling_rate=16_000).shape  # 45 s: whole
    (80, 4500)
    """
    if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, (int, np.integer)):
        raise TypeError(f"sampling_rate should be an int (samples a second), got {type(sampling_rate).__name__}")
    if sampling_rate != SAMPLING_RATE:
        raise ValueError(f"sampling_rate should be {SAMPLING_RATE} (Whisper hears 16 kHz audio: resample it first), got {sampling_rate}")
    a = np.asarray(audio)
    if a.dtype.kind not in "fiu" or a.ndim != 1:
        raise ValueError(f"audio should be 1-D samples (mono), got dtype {a.dtype} and shape {a.shape}")
    if a.size > SAMPLING_RATE * MAX_SECONDS:  # bounded before anything is allocated for it
        raise ValueError(f"audio is {a.size / SAMPLING_RATE:,.1f} s, longer than the {MAX_SECONDS:,} s qkv transcribes at once: cut it into pieces")
    n = SAMPLING_RATE * CHUNK_SECONDS
    m, edge = max(n, a.size), N_FFT // 2
    # Up to 30 s: float64, padded to 30 s. Longer: float32, as transformers' extractor takes any audio, in one
    # buffer (2 h: 461 MB) with the reflected edges that centre the frames, rather than np.pad's copy of it.
    x = np.zeros(m + 2 * edge, np.float64 if a.size <= n else np.float32)
    x[edge : edge + a.size] = a
    if not np.isfinite(x).all():
        raise ValueError("audio should be finite (it has NaN or inf samples)")
    x[:edge] = x[2 * edge : edge : -1]  # centred frames: the signal reflected at both ends
    x[-edge:] = x[-edge - 2 : -2 * edge - 2 : -1]
    frames = np.lib.stride_tricks.sliding_window_view(x, N_FFT)[::HOP]  # (F + 1, 400): a view
    window = np.hanning(N_FFT + 1)[:-1]  # periodic Hann
    filters = mel_filters(n_mels).T  # (n_mels, 201)
    count = len(frames) - 1  # the last frame is dropped, as Whisper does
    log = np.empty((n_mels, count), np.float64 if count <= FRAMES else np.float32)
    for lo in range(0, count, FRAMES):  # 30 s of frames at a time: a long recording's spectra are never all in memory
        hi = min(lo + FRAMES, count)
        power = np.abs(np.fft.rfft(frames[lo:hi] * window, axis=-1)) ** 2  # (hi - lo, 201)
        log[:, lo:hi] = np.log10(np.maximum(filters @ power.T, 1e-10))  # (n_mels, hi - lo)
    np.maximum(log, log.max() - 8.0, out=log)  # in place: a long recording's features are not copied
    log += 4.0
    log /= 4.0
    return log.astype(np.float32, copy=False)


def read_wav(path) -> tuple[np.ndarray, int]:  # -> (samples,) float32 in [-1, 1], sampling rate
    """A PCM ``.wav`` file (8, 16, 24 or 32-bit integers) as mono float samples and its sampling rate, with
    Python's own ``wave`` module; channels are averaged. Compressed or float WAVs are a ValueError."""
    import wave

    try:
        with wave.open(str(path), "rb") as f:
            rate, channels, width, n = f.getframerate(), f.getnchannels(), f.getsampwidth(), f.getnframes()
            if n > SAMPLING_RATE * MAX_SECONDS or n * channels > 2 * SAMPLING_RATE * MAX_SECONDS:  # bound what is read before reading it
                raise ValueError(f"{path}: {n:,} frames of {channels} channels, past the {MAX_SECONDS:,} s of 16 kHz stereo qkv reads at once: cut it into pieces")
            data = f.readframes(n)
    except (wave.Error, EOFError) as exc:
        raise ValueError(f"{path}: not a PCM WAV file qkv can read ({exc or 'the file ends inside its header'})") from None
    except RuntimeError:  # the wave module's own, where a chunk's size points past the file
        raise ValueError(f"{path}: not a PCM WAV file qkv can read (a chunk's size points past the end of the file)") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(data) != n * width * channels:
        raise ValueError(f"{path}: truncated: its header says {n:,} frames, the file holds {len(data) // max(1, width * channels):,}")
    if width == 3:  # 24-bit: widen each sample to 32 bits
        b = np.frombuffer(data, np.uint8).reshape(-1, 3)
        ints = b[:, 0].astype(np.int32) | (b[:, 1].astype(np.int32) << 8) | (b[:, 2].astype(np.int8).astype(np.int32) << 16)
    elif width in (1, 2, 4):
        ints = np.frombuffer(data, {1: np.uint8, 2: "<i2", 4: "<i4"}[width])
    else:
        raise ValueError(f"{path}: {8 * width}-bit samples are not supported")
    # the channels' mean of each frame, scaled to [-1, 1], in float32 (as Whisper's front end takes audio):
    # one array of the frames, 4 bytes each (2 h: 461 MB), beside the file's bytes
    mono = ints.reshape(-1, channels).mean(axis=1, dtype=np.float32) if channels > 1 else ints.astype(np.float32)
    if width == 1:
        mono -= np.float32(128)
    mono /= np.float32(128 if width == 1 else 2 ** (8 * width - 1))
    return mono, rate


def _conv1d(x, w, b, stride: int):  # (B, C_in, T), (C_out, C_in, 3), (C_out,) -> (B, C_out, T')
    """A kernel-3 convolution over time, padding 1: each output frame is the sum of the three taps'
    matrix products (no im2col copy of the input)."""
    B, C, T = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1)))
    T_out = (T - 1) // stride + 1
    out = np.zeros((B, T_out, w.shape[0]), np.float32)
    for k in range(3):
        taps = xp[:, :, k : k + stride * (T_out - 1) + 1 : stride]  # (B, C_in, T')
        out += taps.swapaxes(1, 2) @ w[:, :, k].T  # (B, T', C_in) @ (C_in, C_out)
    out += b
    return out.swapaxes(1, 2)  # (B, C_out, T')


class WhisperLM(Seq2SeqLM):
    """Whisper on qkv's attention: :meth:`encode` takes log-mel features (B, n_mels, 3000) or audio."""

    def __init__(self, config: Seq2SeqConfig, conv: tuple, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.conv1_w, self.conv1_b, self.conv2_w, self.conv2_b = conv
        # what the generation config forces after the start token (read_generation): the tokens from
        # forced_decoder_ids or language/task (None where the language is to be detected), the language
        # tokens to detect it among, and <|notimestamps|>
        self.forced, self.lang_ids, self.no_timestamps = [], (), None
        self.timestamps = None  # the generation config's return_timestamps (None: it says nothing)
        self.max_initial_timestamp = None  # the generation config's max_initial_timestamp_index

    def read_generation(self, get, vocab_size: int) -> None:
        """The prompt rules of a Whisper generation config (``get``: a FieldReader over it), as
        transformers' Whisper ``generate`` applies them (``_retrieve_init_tokens``, with
        ``return_timestamps`` off): ``language`` and ``task`` where given, else ``forced_decoder_ids``;
        a language left open is detected from the first step's logits over ``lang_to_id``; then
        ``<|notimestamps|>``."""
        c, source = get.config, get.source
        lang_to_id, task_to_id = get.object("lang_to_id"), get.object("task_to_id")
        self.lang_ids = tuple(lang_to_id.token_id(k, vocab_size) for k in lang_to_id.config)
        self.timestamps = get("return_timestamps", bool, None)
        self.no_timestamps = get.token_id("no_timestamps_token_id", vocab_size)  # the timestamp tokens come after it
        if self.timestamps and self.no_timestamps is None:
            raise ModelError(f"{source}: return_timestamps needs no_timestamps_token_id (the timestamp tokens follow it)")
        initial = c.get("max_initial_timestamp_index")
        if initial is not None and (isinstance(initial, bool) or not isinstance(initial, int) or initial < 0):
            raise ModelError(f"{source}: field 'max_initial_timestamp_index' should be an integer >= 0, got {initial!r}")
        self.max_initial_timestamp = initial
        unsupported = [k for k in ("compression_ratio_threshold", "logprob_threshold", "no_speech_threshold", "condition_on_prev_tokens") if c.get(k) not in (None, False)]
        if unsupported:  # long-form decoding's fallbacks and conditioning: transformers would apply them, qkv has none
            raise ModelError(f"{source}: field {unsupported[0]!r} ({c[unsupported[0]]!r}) asks transformers' Whisper generate for a rule qkv does not apply; remove it to generate without it")
        language, task = get("language", str, None), get("task", str, None)
        forced = []
        if language is None and task is None:
            pairs = c.get("forced_decoder_ids") or []
            if not isinstance(pairs, list) or any(not isinstance(p, list) or len(p) != 2 for p in pairs):
                raise ModelError(f"{source}: forced_decoder_ids should be [position, token id] pairs, got {pairs!r}")
            for i, (at, tok) in enumerate(pairs, start=1):
                if at != i:
                    raise ModelError(f"{source}: forced_decoder_ids should force positions 1, 2, ... in turn, got {pairs!r}")
                if tok is None and (i != 1 or not self.lang_ids):  # only a language is left open, to be detected from lang_to_id
                    raise ModelError(f"{source}: forced_decoder_ids leaves position {i} open (null), which only the language (position 1) may be, "
                                     "with lang_to_id listing the languages to detect")  # fmt: skip
                forced.append(None if tok is None else FieldReader({"id": tok}, f"{source}: forced_decoder_ids").token_id("id", vocab_size))
        if language is not None:  # a token of lang_to_id, a code or a name, in any case, as transformers reads it
            name = language.lower()
            code = LANGUAGE_CODES.get(name, name if name in LANGUAGE_CODES.values() else None)
            key = name if name in lang_to_id.config else None if code is None else f"<|{code}|>"
            if key not in lang_to_id.config:
                raise ModelError(f"{source}: language {language!r} is not in lang_to_id" + ("" if code else " (nor a Whisper language's name or code)"))
            forced[:1] = [lang_to_id.token_id(key, vocab_size)]
        if task is not None:
            if task not in task_to_id.config:
                raise ModelError(f"{source}: task {task!r} is not in task_to_id {sorted(task_to_id.config)}")
            forced.append(task_to_id.token_id(task, vocab_size))
        elif language is not None and task_to_id.config and not set(forced) & set(task_to_id.config.values()):
            forced.append(task_to_id.token_id("transcribe", vocab_size))
        if self.lang_ids and (not forced or forced[0] is None) and language is None:
            forced[:1] = [None]  # detected at generate time
        self.forced = forced

    def decoder_prompt(self, hidden, *, timestamps: bool = False) -> list:  # (1, 1500, E) -> token ids
        """The start token, then what :meth:`read_generation` found forced: a language to be detected is the
        language token with the highest logit after the start token alone; then ``<|notimestamps|>``,
        unless ``timestamps``."""
        prompt = [self.config.decoder_start_token_id, *self.forced]
        if None in prompt and self.lang_ids:
            logits = self.decode([prompt[:1]], self.new_cache(hidden))[0, -1]
            ids = sorted(self.lang_ids)  # the first of equal logits by id, as an argmax over the masked vocabulary picks
            prompt[1] = ids[int(np.argmax(logits[ids]))]
        prompt = [t for t in prompt if t is not None]
        if timestamps:  # (an English-only checkpoint forces <|notimestamps|> itself: taken off, as transformers does)
            return prompt[:-1] if len(prompt) > 1 and prompt[-1] == self.no_timestamps else prompt
        if self.no_timestamps is not None and prompt[-1] != self.no_timestamps:
            prompt.append(self.no_timestamps)
        return prompt

    def _timestamps(self, return_timestamps) -> bool:
        if return_timestamps is not None and not isinstance(return_timestamps, (bool, np.bool_)):
            raise TypeError(f"return_timestamps should be True, False or None (the generation config's), got {return_timestamps!r}")
        on = bool(self.timestamps if return_timestamps is None else return_timestamps)
        if on and self.no_timestamps is None:
            raise ValueError("return_timestamps needs the generation config's no_timestamps_token_id (the timestamp tokens follow it), and this model's has none")
        return on

    def _constrain(self, scores, prompt, news, max_new_tokens, source_ids, timestamps=False):  # (k, V) -> (k, V)
        """The general rules, then with ``timestamps`` Whisper's, as transformers'
        ``WhisperTimeStampLogitsProcessor`` (after OpenAI's decoder) applies them: a timestamp first (at most
        ``max_initial_timestamp_index`` in); then timestamps in pairs, a pair's closing one followed by text
        or EOS, an opening one by no text; none smaller than the last (a pair may close where it opened);
        never ``<|notimestamps|>``; and a timestamp wherever all timestamps together are likelier than any
        one text token."""
        scores = super()._constrain(scores, prompt, news, max_new_tokens, source_ids, timestamps)
        if not timestamps:
            return scores
        begin = self.no_timestamps + 1  # <|0.00|>
        eos = self.config.eos_token_id
        scores[:, self.no_timestamps] = -np.inf
        for row, new in enumerate(news):
            last = len(new) >= 1 and new[-1] >= begin
            penultimate = len(new) < 2 or new[-2] >= begin
            if last and penultimate:
                scores[row, begin:] = -np.inf  # a pair just closed: text or EOS now
            elif last:
                scores[row, :eos] = -np.inf  # a pair just opened: no text (Whisper's text tokens all come before EOS)
            stamps = [t for t in new if t >= begin]
            floor = begin if not stamps else stamps[-1] if last and not penultimate else stamps[-1] + 1
            scores[row, begin:floor] = -np.inf
        if not news[0]:
            scores[:, :begin] = -np.inf
            if self.max_initial_timestamp is not None:
                scores[:, begin + self.max_initial_timestamp + 1 :] = -np.inf
        logp = scores - logsumexp(scores, keepdims=True)
        stamp = logsumexp(logp[:, begin:]) > logp[:, :begin].max(axis=-1)  # all timestamps together likelier than the likeliest text
        scores[np.flatnonzero(stamp), :begin] = -np.inf
        return scores

    def _default_length(self, prompt_length: int) -> int:
        """The most new tokens when the caller gives none, as transformers' Whisper ``generate`` sets them
        (``_set_max_new_tokens_and_length``): the generation config's ``max_new_tokens``, or its
        ``max_length`` counting the new tokens only (the prompt's come on top) and cut to the decoder's
        positions (Whisper's configs say 448: the whole of a 30 s transcript)."""
        c = self.config
        room = c.max_positions - prompt_length
        if c.max_new_tokens is not None:
            if c.max_new_tokens > room:  # transformers refuses it too
                raise ValueError(f"the generation config's max_new_tokens ({c.max_new_tokens}) and the decoder's {prompt_length} prompt tokens pass this model's "
                                 f"{c.max_positions} positions: pass max_new_tokens")  # fmt: skip
            return c.max_new_tokens
        if c.max_length is not None:
            return min(c.max_length + min(c.max_positions // 2 - 1, prompt_length), c.max_positions) - prompt_length
        return min(DEFAULT_MAX_NEW_TOKENS, room)

    def features(self, audio, *, sampling_rate: int) -> np.ndarray:
        """The model's input for ``audio``: (1, n_mels, 3000), or (1, n_mels, frames) past 30 s."""
        return log_mel_spectrogram(audio, sampling_rate=sampling_rate, n_mels=self.conv1_w.shape[1])[None]

    def encode(self, input_features, *, attention_mask=None, output_attentions: bool = False):
        """The encoder's output (B, 1500, E) for log-mel features (B, n_mels, 3000) (or (n_mels, 3000))."""
        x = np.asarray(input_features, np.float32)
        if x.ndim == 2:
            x = x[None]
        n_mels = self.conv1_w.shape[1]
        if x.ndim != 3 or x.shape[1] != n_mels or x.shape[2] != FRAMES:
            raise ValueError(f"input_features shape should be (B, {n_mels}, {FRAMES}) (log_mel_spectrogram of 30 s), got {np.shape(input_features)}")
        gelu = ACTIVATIONS["gelu"]
        h = _conv1d(x, self.conv1_w, self.conv1_b, 1)  # (B, E, 3000)
        h = gelu(h, [np.empty_like(h) for _ in range(3)])
        h = _conv1d(h, self.conv2_w, self.conv2_b, 2)  # (B, E, 1500): half the frames
        h = gelu(h, [np.empty_like(h) for _ in range(3)])
        h = np.ascontiguousarray(h.swapaxes(1, 2))  # (B, 1500, E)
        h += self.encoder_positions[: h.shape[1]]
        return self._encoder_stack(h, None, output_attentions)

    def generate(self, source, max_new_tokens: int | None = None, *, sampling_rate: int | None = None, return_timestamps: bool | None = None,
                 num_beams: int | None = None, length_penalty: float | None = None, early_stopping: bool | str | None = None):  # fmt: skip
        """The transcript of audio (with ``sampling_rate``) or of log-mel features (n_mels, frames): the
        tokens after the decoder's prompt, by greedy or beam search (as :meth:`Seq2SeqLM.generate`).

        With ``return_timestamps`` (default: the generation config's), and always for audio past 30 s,
        Whisper writes timestamp tokens (:meth:`_constrain`), and the audio is transcribed as transformers'
        Whisper ``generate`` does it: a 30 s window from ``seek`` (0 to start) is decoded; its text is cut
        into segments at each pair of timestamps; the window then moves to the last timestamp the model
        wrote (past the window where it wrote a single closing one, or none), and so on to the end. The
        output's ``token_ids`` are the segments' tokens one after another and ``segments`` time them
        (seconds into the audio). A timestamp token is 0.02 s after the one before it.
        """
        feats = self.features(source, sampling_rate=sampling_rate) if sampling_rate is not None else self._source(source)
        long = feats.shape[-1] > FRAMES
        asked = self.timestamps if return_timestamps is None else return_timestamps
        if long and asked is False:  # transformers refuses it too: past 30 s, the windows move by the timestamps
            raise ValueError(f"the features are {feats.shape[-1]} frames, past Whisper's {FRAMES} (30 s): transcribing them needs timestamps; "
                             "leave return_timestamps unset (or True)")  # fmt: skip
        if not (long or self._timestamps(return_timestamps)):
            return super().generate(feats, max_new_tokens, num_beams=num_beams, length_penalty=length_penalty, early_stopping=early_stopping)
        return self._transcribe(feats, max_new_tokens, num_beams, length_penalty, early_stopping)

    def _transcribe(self, feats, max_new_tokens, num_beams, length_penalty, early_stopping):  # (1, n_mels, frames) -> Seq2SeqGenerateOutput
        """Window after window, with timestamps (:meth:`generate`; transformers' ``WhisperGenerationMixin.generate``
        with its defaults: no temperature fallback, no conditioning on the previous window's text)."""
        self._timestamps(True)
        max_new_tokens, search = self._options(max_new_tokens, num_beams, length_penalty, early_stopping)
        c, total = self.config, feats.shape[-1]
        t0 = time.perf_counter()
        seek, prompt, tokens, segments, windows = 0, None, [], [], 0
        while seek < total:
            windows += 1
            n = min(total - seek, FRAMES)
            window = np.zeros((1, feats.shape[1], FRAMES), np.float32)  # the last one zero-padded, as transformers pads the features
            window[..., :n] = feats[..., seek : seek + n]
            hidden = self.encode(window)
            if prompt is None:  # a language to detect: from the first window, once
                prompt = self.decoder_prompt(hidden, timestamps=True)
                if max_new_tokens is not None and max_new_tokens + len(prompt) > c.max_positions:
                    raise ValueError(f"max_new_tokens ({max_new_tokens}) and the decoder's {len(prompt)} prompt tokens pass this model's {c.max_positions} positions")
            new, _, _ = self._search(hidden, prompt, None, max_new_tokens, *search, True)
            pieces, advance = self._cut(self._trimmed(new), seek, n)
            segments += pieces
            seek += advance
        for piece in segments:
            tokens += piece["token_ids"]
        text = self.tokenizer.decode(tokens) if self.tokenizer is not None else ""
        return Seq2SeqGenerateOutput(text, tokens, [], "eos", None, {"seconds": time.perf_counter() - t0, "new_tokens": len(tokens), "windows": windows}, prompt, segments)

    def _trimmed(self, new: list) -> list:
        """A window's tokens without their end, as transformers' ``generate_with_fallback`` trims them: as many
        tokens off the end as the padding token occurs (one fewer where it is EOS), then an EOS."""
        c, seq = self.config, list(new)
        if seq and seq[-1] == c.pad_token_id:
            pads = seq.count(c.pad_token_id) - (c.pad_token_id == c.eos_token_id)
            seq = seq[:-pads] if pads else seq
        return seq[:-1] if seq and seq[-1] == c.eos_token_id else seq

    def _cut(self, seq: list, seek: int, n: int):  # -> (segments, frames to move on)
        """A window's segments and how far the next window starts, as transformers' ``_retrieve_segment``:
        at each pair of timestamps a segment ends; after a single closing timestamp (no speech after it),
        or no pair at all, the next window starts past this one; otherwise at the last pair, and what
        follows it is left for the next window to hear whole."""
        begin = self.no_timestamps + 1
        offset = seek * TIME_PRECISION / 2  # seconds: the encoder's frames are 2 feature frames, 0.02 s
        is_stamp = [t >= begin for t in seq]
        single_ending = is_stamp[-2:] == [False, True]
        cuts = [i + 1 for i in range(len(is_stamp) - 1) if is_stamp[i] and is_stamp[i + 1]]

        def piece(tokens, start, end):
            return {"start": offset + start * TIME_PRECISION, "end": offset + end * TIME_PRECISION, "text": self.tokenizer.decode([t for t in tokens if t < begin]) if self.tokenizer is not None else "",
                    "token_ids": list(tokens)}  # fmt: skip

        if not cuts:  # one segment: to its last timestamp, or to the window's end (a feature frame is 0.01 s)
            stamps = [t for t in seq if t >= begin]
            return [piece(seq, 0, stamps[-1] - begin if stamps and stamps[-1] != begin else int(n * 0.01 / TIME_PRECISION))], n
        if single_ending:
            cuts.append(len(seq))
        else:
            cuts[-1] += 1  # the last pair's second timestamp stays in its segment
        out, last = [], 0
        for i, cut in enumerate(cuts):
            part = seq[last:cut]
            end_at = -1 if i < len(cuts) - 1 or single_ending else -2
            out.append(piece(part, part[0] - begin, part[end_at] - begin))
            last = cut
        return out, n if single_ending else (seq[last - 2] - begin) * 2

    def _source(self, source):  # log-mel features go to the encoder as they are: (1, n_mels, 3000)
        x = np.asarray(source, np.float32)
        return x[None] if x.ndim == 2 else x


def config_from_hf(c: dict, source: str, get) -> Seq2SeqConfig:
    common = bart.common_fields(source, get)  # Whisper's config is BART's, with audio
    E = common["hidden_size"]
    return Seq2SeqConfig(
        family="whisper",
        **common,
        position="learned",
        decoder_start_token_id=get.token_id("decoder_start_token_id", get("vocab_size", int), 50258),
        eos_token_id=get.token_id("eos_token_id", get("vocab_size", int), 50257),
        pad_token_id=get.token_id("pad_token_id", get("vocab_size", int), 50257),
        pre_norm=True,
        embed_scale=float(np.sqrt(E)) if get("scale_embedding", bool, False) else 1.0,
        max_positions=get("max_target_positions", int, 448),
    )


def weights_from_hf(t, cfg: Seq2SeqConfig, c: dict, get):
    """``(conv, embed, encoder, encoder_norm, decoder, decoder_norm, encoder_positions, decoder_positions)``."""
    E, F = cfg.hidden_size, cfg.ffn_size
    n_mels = get("num_mel_bins", int, 80)
    src_pos = get("max_source_positions", int, 1500)
    if src_pos * 2 != FRAMES:
        raise ModelError(f"max_source_positions should be {FRAMES // 2} (30 s of audio), got {src_pos}")

    def norm(name):
        return t(name + ".weight", (E,)), t(name + ".bias", (E,))

    layer = bart.layer_reader(t, E, F, key_bias=False)  # BART's layers, keys without bias
    m = "model."
    conv = (t(m + "encoder.conv1.weight", (E, n_mels, 3)), t(m + "encoder.conv1.bias", (E,)), t(m + "encoder.conv2.weight", (E, E, 3)), t(m + "encoder.conv2.bias", (E,)))
    encoder = [layer(f"{m}encoder.layers.{i}.", False) for i in range(cfg.encoder_layers)]
    decoder = [layer(f"{m}decoder.layers.{i}.", True) for i in range(cfg.decoder_layers)]
    embed = t(m + "decoder.embed_tokens.weight", (cfg.vocab_size, E))
    enc_pos = t(m + "encoder.embed_positions.weight", (src_pos, E))
    dec_pos = t(m + "decoder.embed_positions.weight", (cfg.max_positions, E))
    return conv, embed, encoder, norm(m + "encoder.layer_norm"), decoder, norm(m + "decoder.layer_norm"), enc_pos, dec_pos


def from_hf(c: dict, source: str, get, t):
    """``(Seq2SeqConfig, Seq2SeqWeights)`` of a Hugging Face directory: a :class:`WhisperLM`, its LM head the embeddings."""
    cfg = config_from_hf(c, source, get)
    conv, embed, encoder, enc_norm, decoder, dec_norm, enc_pos, dec_pos = weights_from_hf(t, cfg, c, get)
    return cfg, Seq2SeqWeights(embed, encoder, enc_norm, decoder, dec_norm, model=WhisperLM, extra=(conv,), parts=dict(encoder_positions=enc_pos, decoder_positions=dec_pos))
