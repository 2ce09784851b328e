"""Probes whose variants each run in a child process of the probe's own script, with a time
limit: a kernel that deadlocks or faults takes its child down, not the sweep. The child prints
one JSON line; the parent adds it to the variant's row, writes all rows after each variant."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Callable, Sequence


def run_in_children(script: str, variants: Sequence, describe: Callable[[list], dict],
                    out: str, timeout_s: float) -> list[dict]:
    """Each variant through `script --child VARIANT`: its row is describe(variant) plus the
    child's JSON line, or the error (stderr's tail, a hang, no result)."""
    rows = []
    for v in variants:
        row = describe(list(v))
        try:
            proc = subprocess.run([sys.executable, script, "--child", json.dumps(list(v))],
                                  env=dict(os.environ), capture_output=True, text=True,
                                  timeout=timeout_s)
            lines = proc.stdout.strip().splitlines()
            if proc.returncode == 0 and lines:
                row.update(json.loads(lines[-1]))
            else:
                row["error"] = proc.stderr[-2500:]
        except subprocess.TimeoutExpired:
            row["error"] = f"no return in {timeout_s} s (hang)"
        except json.JSONDecodeError:
            row["error"] = f"no result: {proc.stdout[-300:]} {proc.stderr[-600:]}"
        rows.append(row)
        print(json.dumps(row)[:600], flush=True)
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def probe_main(script: str, description: str, variants: Sequence,
               describe: Callable[[list], dict], child: Callable[[list], None],
               timeout_s: float) -> None:
    """The command line of such a probe: `--out` for the sweep, `--child VARIANT` for one."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out")
    p.add_argument("--timeout-s", type=float, default=timeout_s)
    p.add_argument("--child", default=None, help="run this one variant (JSON) here")
    args = p.parse_args()
    if args.child:
        child(json.loads(args.child))
    elif not args.out:
        p.error("--out is required")
    else:
        run_in_children(script, variants, describe, args.out, args.timeout_s)
