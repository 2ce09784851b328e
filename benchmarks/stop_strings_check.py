"""The host cost of the stop-string check a request with stop strings pays per applied token:
`StopStrings.match` next to decoding its whole window each time (what it does without the
one-token pre-check), for stop strings of 1 to 30 characters, on the tiny model's byte-level
tokenizer, over an output of printable ASCII that never completes the stop string.

  python benchmarks/stop_strings_check.py [--out stop_strings_check.json]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from tokenizers import Tokenizer

from rollout.stop_strings import StopStrings
from rollout.tiny_model import TinyModelSpec, make_tiny_model


def per_call_us(fn, calls: int = 5000) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    path = make_tiny_model(Path(tempfile.mkdtemp()) / "m", TinyModelSpec())
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    output = [32 + i % 94 for i in range(2000)]  # never a "\x7f"
    rows = []
    for length in (1, 5, 12, 30):
        stops = StopStrings(tok, ["\x7f" * length])
        window = lambda: any(s in tok.decode(output[-stops.window:]) for s in stops.stops)  # noqa: E731
        rows.append({"stop_chars": length, "window_tokens": stops.window,
                     "match_us": per_call_us(lambda: stops.match(output)),
                     "window_decode_us": per_call_us(window)})
        print(json.dumps(rows[-1]))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
