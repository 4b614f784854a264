"""Writes ``arith.jsonl`` beside this script: 50 one-digit additions (``"3+4"`` -> ``"7"``).

    python examples/data/make_arith.py

The pairs are drawn without replacement from a fixed seed, so the file is reproducible. Each line
is ``{"question": "3+4", "answer": "7"}``; ``configs/dataset.yaml`` turns the question into the
prompt ``"3+4="`` with ``template: "{question}="``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ROWS = 50
OUT = Path(__file__).with_name("arith.jsonl")


def main() -> None:
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(0).shuffle(pairs)
    lines = [json.dumps({"question": f"{a}+{b}", "answer": str(a + b)}) for a, b in pairs[:ROWS]]
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} rows to {OUT}")


if __name__ == "__main__":
    main()
