"""Write src/shardtune/model/tiny_corpus.txt: the text the tiny demo tokenizer is trained on.

It is every string of the bundled demo data, so the tokenizer covers what the demos train on.
Rerun after regenerating data/ (python scripts/make_tiny_corpus.py).
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "src" / "shardtune" / "model" / "tiny_corpus.txt"


def strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return []


def records(path: Path) -> list:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)


def main() -> None:
    lines: list[str] = []
    for path in sorted((REPO / "data").glob("demo_*.json*")):
        for record in records(path):
            lines += [s.replace("\n", " ").strip() for s in strings(record) if s.strip()]
    OUT.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(lines)} lines)")


if __name__ == "__main__":
    main()
