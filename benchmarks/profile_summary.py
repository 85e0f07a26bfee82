"""Text summary of a py-spy speedscope profile: per thread, the functions where its samples
were (self) and under which they ran (total), as shares of that thread's samples.

    python -m benchmarks.profile_summary worker-profile.json [--top 25] [--by total]
                                         [--under FUNCTION]

`--by total` ranks by the share of samples a function is anywhere on the stack: with
`py-spy --native`, where a library's own work goes (plan searches, graph instantiation,
kernel compilation) under the Python call that asked for it. `--under` keeps only the
samples with a function of that name on the stack (shares are then of those samples).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any


def summarize(
    doc: dict[str, Any], top: int = 25, by: str = "self", under: str | None = None
) -> str:
    frames = doc["shared"]["frames"]
    kept = {i for i, f in enumerate(frames) if f["name"] == under}

    def name(i: int) -> str:
        frame = frames[i]
        where = Path(frame.get("file") or "?").name
        return f"{frame['name']} ({where}:{frame.get('line')})"

    lines: list[str] = []
    for profile in doc["profiles"]:
        stacks: list[list[int]] = profile.get("samples", [])
        if under is not None:
            stacks = [stack for stack in stacks if kept.intersection(stack)]
        if not stacks:
            continue
        self_count: Counter[int] = Counter(stack[-1] for stack in stacks if stack)
        total: Counter[int] = Counter(i for stack in stacks for i in set(stack))
        n = len(stacks)
        lines.append(f"== {profile['name']}: {n} samples")
        lines.append("   self %  total %  function")
        ranked = self_count if by == "self" else total
        for i, _ in ranked.most_common(top):
            lines.append(f"   {100 * self_count[i] / n:6.1f}  {100 * total[i] / n:7.1f}  {name(i)}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_summary", description=__doc__)
    p.add_argument("profile", type=Path)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--by", choices=("self", "total"), default="self", help="the ranking")
    p.add_argument("--under", help="only samples with this function on the stack")
    args = p.parse_args(argv)
    print(summarize(json.loads(args.profile.read_text()), args.top, args.by, args.under))
    return 0


if __name__ == "__main__":
    sys.exit(main())
