"""Spec: stop strings (`SamplingParams.stop`). A sample ends at the first token whose decoded
output contains one of its stop strings, with finish_reason "stop": its tokens and logprobs are
the same seeded sample's without stop strings cut right after that token (the oracle: the
first prefix of that sample whose decode contains a stop string, found by brute force), and its
text is those tokens decoded. Overlap scheduling on and off, several prompts and samples in one
call, single- and multi-character stops; bad stop values and a model without a tokenizer are
refused before any work, and the engine keeps serving."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from rollout import Engine, EngineConfig, InvalidRequestError, SamplingParams
from rollout.stop_strings import StopStrings
from rollout.tiny_model import TinyModelSpec, make_tiny_model
from tests.helpers import gpu

ARCH = "Qwen2ForCausalLM"
PROMPTS = [[5, 6, 7], [9, 10], [11, 12, 13, 14], [20, 21]]
NEW = 64


def _engine(path: str, overlap: bool = False, **cfg) -> Engine:
    return Engine(EngineConfig(model_path=path, kv_cache_tokens=1024, overlap_schedule=overlap, **cfg))


def _params(stop=(), n: int = 1) -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=11, ignore_eos=True, n=n,
                          stop=stop)


def _first_stop(tok: Tokenizer, ids: list[int], stops) -> int:
    """Tokens up to the first prefix whose decode contains a stop string (all if none does)."""
    for t in range(1, len(ids) + 1):
        text = tok.decode(ids[:t])
        if any(s in text for s in stops):
            return t
    return len(ids)


def _stops_from(text: str) -> tuple[str, ...]:
    """A two-character stop string from the middle of a sample's text when it has one of
    printable ASCII, else a single character from there; a string that never occurs too."""
    middle = text[len(text) // 3:]
    pairs = [middle[i:i + 2] for i in range(len(middle) - 1)
             if middle[i:i + 2].isascii() and middle[i:i + 2].isprintable()]
    singles = [c for c in middle if c.isascii() and c.isprintable()]
    return ((pairs[0],) if pairs else (singles[0],)) + ("\x00never\x00",)


@pytest.fixture(scope="module")
def tokenizer(tiny_dirs) -> Tokenizer:
    return Tokenizer.from_file(f"{tiny_dirs[ARCH]}/tokenizer.json")


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_samples_end_at_the_first_token_that_completes_a_stop_string(tiny_dirs, tokenizer,
                                                                     overlap):
    _check_stops(_engine(tiny_dirs[ARCH], overlap), tokenizer, atol=1e-5)


@gpu
def test_gpu_samples_end_at_the_first_token_that_completes_a_stop_string(tiny_dirs, tokenizer):
    """The GPU path (graphs, overlap, the fused sampler) in float32: the same cut."""
    _check_stops(_engine(tiny_dirs[ARCH], None, device="cuda", dtype="float32"), tokenizer,
                 atol=1e-3)


def _check_stops(engine: Engine, tokenizer: Tokenizer, atol: float) -> None:
    reference = engine.generate(PROMPTS, _params())
    stops = [_stops_from(o.text) for o in reference]
    assert any(len(s[0]) == 2 for s in stops)  # a stop spanning two tokens is in the case
    outs = engine.generate(PROMPTS, [_params(s) for s in stops])
    for ref, out, s in zip(reference, outs, stops):
        end = _first_stop(tokenizer, ref.token_ids, s)
        assert 0 < end < NEW, "the case must stop early"
        assert out.token_ids == ref.token_ids[:end]
        # the batch shrinks differently, so GEMMs may round the last fp32 bits otherwise
        assert out.logprobs == pytest.approx(ref.logprobs[:end], abs=atol)
        assert out.finish_reason == "stop" and out.matched_stop == s[0]
        assert out.text == tokenizer.decode(out.token_ids) and s[0] in out.text
    # the engine goes on as before: the same call without stops gives the reference again
    again = engine.generate(PROMPTS, _params())
    assert [o.token_ids for o in again] == [o.token_ids for o in reference]


def test_each_of_n_samples_stops_on_its_own(tiny_dirs, tokenizer):
    engine = _engine(tiny_dirs[ARCH])
    reference = engine.generate(PROMPTS[:2], _params(n=3))
    chars = "".join(c for o in reference for c in o.text if c.isascii() and c.isprintable())
    stop = (chars[len(chars) // 2],)  # a character some samples have and maybe not all
    outs = engine.generate(PROMPTS[:2], _params(stop, n=3))
    ends = []
    for ref, out in zip(reference, outs):
        end = _first_stop(tokenizer, ref.token_ids, stop)
        ends.append(end)
        assert out.token_ids == ref.token_ids[:end]
        assert out.finish_reason == ("stop" if stop[0] in out.text else "length")
        assert out.matched_stop == (stop[0] if out.finish_reason == "stop" else None)
    assert len(set(ends)) > 1  # the samples end at different tokens


def test_a_character_of_several_byte_tokens_stops_at_its_last_byte():
    tok = Tokenizer.from_file(str(make_tiny_model(_tmp() / "m", TinyModelSpec()) / "tokenizer.json"))
    stops = StopStrings(tok, ["é"])  # two UTF-8 bytes: two byte tokens
    e1, e2 = "é".encode()
    assert stops.match([ord("a"), e1]) is None
    assert stops.match([ord("a"), e1, e2]) == "é"
    long_output = [ord("x")] * 500 + [e1, e2]  # the window reaches it at the end of a long output
    assert stops.match(long_output) == "é"
    four_bytes = list("😀".encode())
    emoji = StopStrings(tok, ["a😀"])
    assert emoji.window >= 2 * 4  # two characters of up to four byte tokens each
    assert emoji.match([ord("a")] + four_bytes[:3]) is None
    assert emoji.match([ord("b")] * 50 + [ord("a")] + four_bytes) == "a😀"


def test_the_check_after_each_token_finds_the_first_prefix_with_a_stop_string():
    """Random byte outputs (multi-byte characters, cut ones, special tokens) and stop strings
    cut out of their texts, some ending in a space: checking token after token stops exactly at
    the first prefix whose whole decode contains a stop string."""
    import random
    tok = Tokenizer.from_file(str(make_tiny_model(_tmp() / "m", TinyModelSpec()) / "tokenizer.json"))
    rng = random.Random(0)
    alphabet = list(range(32, 127)) * 4 + list("é😀ж".encode()) * 3 + [10, 200, 256, 257]
    checked = 0
    for case in range(300):
        ids = [rng.choice(alphabet) for _ in range(rng.randint(5, 60))]
        text = tok.decode(ids)
        start = rng.randrange(len(text))
        stop = text[start:start + rng.randint(1, 4)]
        stops = (stop, stop + " ") if case % 3 == 0 else (stop,)
        if "\ufffd" in stop or not stop.strip():
            continue
        checker = StopStrings(tok, stops)
        found = next((t for t in range(1, len(ids) + 1) if checker.match(ids[:t])), None)
        assert found == _first_stop(tok, ids, stops), (ids, stops)
        checked += 1
    assert checked > 200


def _tmp():
    import tempfile
    from pathlib import Path
    return Path(tempfile.mkdtemp())


def test_matched_stop_names_the_stop_token_or_the_eos(tiny_dirs):
    """`matched_stop` is the stop token id that ended a sample, an EOS id, or None (length)."""
    engine = _engine(tiny_dirs[ARCH])
    reference = engine.generate(PROMPTS[:1], _params())[0]
    token = reference.token_ids[NEW // 2]
    first = reference.token_ids.index(token)
    out = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=NEW, temperature=1.0,
                                                       seed=11, ignore_eos=True,
                                                       stop_token_ids=[token]))[0]
    assert (out.finish_reason, out.matched_stop, len(out.token_ids)) == ("stop", token, first + 1)
    assert reference.matched_stop is None and reference.finish_reason == "length"
    eos = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=NEW, temperature=1.0,
                                                       seed=11, stop_token_ids=[token]))[0]
    end = next(i for i, t in enumerate(reference.token_ids) if t in (token, 257))  # 257: EOS
    assert (eos.finish_reason, eos.matched_stop) == ("stop", reference.token_ids[end])
    assert eos.token_ids == reference.token_ids[:end + 1]


def test_stop_values_are_checked():
    assert SamplingParams(stop="</answer>").stop == ("</answer>",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=None).stop == ()
    for bad in ("", ["a", ""], [1], 3, [None]):
        with pytest.raises(InvalidRequestError):
            SamplingParams(stop=bad)


def test_a_model_without_a_tokenizer_refuses_stop_strings_and_keeps_serving(tmp_path):
    path = str(make_tiny_model(tmp_path / "m", TinyModelSpec(), with_tokenizer=False))
    engine = _engine(path)
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        engine.generate(PROMPTS, [_params(), _params("a"), _params(), _params()])
    outs = engine.generate(PROMPTS, _params())
    assert all(len(o.token_ids) == NEW for o in outs)
