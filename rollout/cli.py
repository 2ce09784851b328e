"""The `rollout` console script: `demo`, `generate` (JSONL in/out) and `bench`."""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import tempfile
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args) or 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollout", description="RL rollout engine: sample with logprobs, "
                                "sync weights, measure.")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(title="commands")
    _demo_parser(sub)
    _generate_parser(sub)
    _plugin_parsers(sub)
    return p


def _demo_parser(sub) -> None:
    d = sub.add_parser("demo", help="GRPO-style sampling on the embedded tiny model (no downloads)")
    d.add_argument("--model", default=None, help="HF model directory (default: the embedded tiny model)")
    d.add_argument("--n", type=int, default=4, help="samples per prompt (default 4)")
    d.add_argument("--max-new-tokens", type=int, default=24, help="tokens per sample (default 24)")
    d.add_argument("--seed", type=int, default=0, help="seed of the sampling streams (default 0)")
    d.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    d.set_defaults(func=lambda a: _demo(a))


def _demo(a) -> int:
    from rollout.demo import run_demo
    run_demo(a.model, a.n, a.max_new_tokens, a.seed, a.device)
    return 0


def _generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate for a JSONL file of prompts",
                       description="Each input line is a JSON object with either 'prompt' (a string; "
                       "needs tokenizer.json in the model dir) or 'prompt_token_ids' (a list of ints), "
                       "and optionally 'sampling_params' (an object of SamplingParams fields) that "
                       "overrides the command-line defaults. Each output line holds the prompt index, "
                       "sample index, token ids, logprobs, finish reason, weight version and text.")
    g.add_argument("--model", required=True, help="Hugging Face model directory (safetensors)")
    g.add_argument("--input", required=True, help="JSONL file of prompts")
    g.add_argument("--output", required=True, help="JSONL file to write, one line per sample")
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    g.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default float32)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="default max_new_tokens (128)")
    g.add_argument("--temperature", type=float, default=1.0, help="default temperature; 0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="default top_p (1.0 = off)")
    g.add_argument("--top-k", type=int, default=-1, help="default top_k (-1 = off)")
    g.add_argument("--n", type=int, default=1, help="default samples per prompt")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="default stop string, repeatable: a sample ends at the first token whose "
                        "text contains one (needs the model's tokenizer.json)")
    g.add_argument("--seed", type=int, default=0, help="engine seed for prompts without their own")
    g.add_argument("--kv-cache-tokens", type=int, default=None, help="KV budget in tokens (CPU)")
    g.add_argument("--progress", action="store_true", help="show a progress bar")
    g.set_defaults(func=lambda a: _generate(a))


def _generate(a) -> int:
    """Every input line is read and checked, and the output's directory too, before the model
    loads; the output appears whole (written beside it, then renamed) or not at all."""
    from rollout import Engine, EngineConfig, InvalidRequestError, KVCacheBudgetError
    defaults = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
                    top_k=a.top_k, n=a.n, stop=tuple(a.stop))
    prompts, params, lines = [], [], []
    with open(a.input) as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                prompt, sp = _parse_line(line, line_no, defaults)
                prompts.append(prompt)
                params.append(sp)
                lines.append(line_no)
    _check_writable(a.output)
    engine = Engine(EngineConfig(model_path=a.model, device=a.device, dtype=a.dtype, seed=a.seed,
                                 kv_cache_tokens=a.kv_cache_tokens))
    try:
        outs = engine.generate(prompts, params, progress=a.progress)
    except (InvalidRequestError, KVCacheBudgetError) as e:
        raise SystemExit(_with_line(str(e), lines))
    _write_lines(a.output, [json.dumps(_output_record(o)) for o in outs])
    print(f"wrote {len(outs)} samples to {a.output}", file=sys.stderr)
    return 0


def _parse_line(line: str, line_no: int, defaults: dict):
    from rollout import InvalidRequestError, SamplingParams
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise SystemExit(f"input line {line_no} is not JSON: {e}")
    if not isinstance(rec, dict):
        raise SystemExit(f"input line {line_no} must be a JSON object, got {type(rec).__name__}")
    prompt = rec.get("prompt", rec.get("prompt_token_ids"))
    if prompt is None:
        raise SystemExit(f"input line {line_no} has neither 'prompt' nor 'prompt_token_ids'")
    overrides = rec.get("sampling_params", {})
    if not isinstance(overrides, dict):
        raise SystemExit(f"input line {line_no}: 'sampling_params' must be an object, got "
                         f"{type(overrides).__name__}")
    try:
        return prompt, SamplingParams(**{**defaults, **overrides})
    except InvalidRequestError as e:
        raise SystemExit(f"input line {line_no}: {e}")


def _check_writable(output: str) -> None:
    """Before the run: the output opens for writing (nothing of it changed; a file this made is
    removed again)."""
    existed = os.path.lexists(output)
    try:
        with open(output, "a"):
            pass
    except OSError as e:
        raise SystemExit(f"cannot write the output {output}: {e}")
    if not existed:
        os.unlink(output)


def _write_lines(output: str, lines: list[str]) -> None:
    """A regular file appears whole or not at all (written beside it with its mode, then renamed
    into place); anything else — a symlink, a device, a directory that takes no new file — is
    written as it is."""
    directory = os.path.dirname(os.path.abspath(output))
    plain = not os.path.lexists(output) or (os.path.isfile(output) and not os.path.islink(output))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(output)}.", dir=directory) if plain \
            else (None, None)
    except OSError:  # no new file there (a directory without write permission): in place
        fd, tmp = None, None
    if tmp is None:
        with open(output, "w") as f:
            f.write("".join(line + "\n" for line in lines))
        return
    try:
        with os.fdopen(fd, "w") as f:
            f.write("".join(line + "\n" for line in lines))
        os.chmod(tmp, os.stat(output).st_mode & 0o7777 if os.path.exists(output) else _default_mode())
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _default_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _with_line(message: str, lines: list[int]) -> str:
    """The engine names prompts by index among the non-blank lines: say which input line."""
    found = re.match(r"prompt (\d+) ", message)
    if found and int(found.group(1)) < len(lines):
        return f"input line {lines[int(found.group(1))]}: {message}"
    return message


def _output_record(o) -> dict:
    return {"prompt_index": o.prompt_index, "sample_index": o.sample_index,
            "prompt_token_ids": o.prompt_token_ids, "token_ids": o.token_ids, "logprobs": o.logprobs,
            "finish_reason": o.finish_reason, "weight_version": o.weight_version,
            "token_weight_versions": o.token_weight_versions, "text": o.text,
            "matched_stop": o.matched_stop}


def _plugin_parsers(sub) -> None:
    """Commands of other packages (`bench` comes from actors) through the `rollout.cli`
    entry-point group, so rollout never imports them."""
    from importlib.metadata import entry_points
    for ep in entry_points(group="rollout.cli"):
        ep.load()(sub)


if __name__ == "__main__":
    sys.exit(main())
